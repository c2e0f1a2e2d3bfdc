"""Run tinker-cookbook's own supervised-learning loop (``tinker_cookbook.supervised.train``) on
its shipped example conversations against a `skyrl tinker serve` server, unmodified.

Runs inside the cookbook's virtual environment (see scripts/tinker_cookbook_check.sh):

    python scripts/tinker_cookbook_sl.py BASE_URL TOKENIZER_DIR LOG_DIR STEPS
"""

import asyncio
import json
import os
import sys
from pathlib import Path

import tinker_cookbook
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig


def main() -> int:
    base_url, tokenizer_dir, log_dir, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=tokenizer_dir,
        renderer_name="role_colon",
        max_length=512,
        batch_size=16,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    config = train.Config(
        log_path=log_dir,
        model_name=tokenizer_dir,  # the server accepts its model directory as base_model
        recipe_name="skyrl_cookbook_check",
        renderer_name="role_colon",
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(conversations)),
        learning_rate=5e-3,
        lora_rank=16,
        num_epochs=100,
        max_steps=steps,
        base_url=base_url,
        save_every=0,
        eval_every=0,
    )
    asyncio.run(train.main(config))
    with open(os.path.join(log_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    print(f"cookbook supervised loop: {len(nll)} steps, train_mean_nll {nll[0]:.3f} -> {nll[-1]:.3f}")
    return 0 if len(nll) >= 2 and min(nll[-3:]) < nll[0] else 1


if __name__ == "__main__":
    sys.exit(main())
