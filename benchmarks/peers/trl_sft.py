"""TRL's SFTTrainer on the workload of ``spec.json`` (run by ``bench_sft.py`` in ``.venv-peers``).

.venv-peers/bin/python benchmarks/peers/trl_sft.py --spec WORK/spec.json --variant default --out r.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from common import spec_from_json, trl_sft_kwargs  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, required=True)
    p.add_argument("--variant", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--launched", type=float, default=None, help="unix time the driver started this process")
    args = p.parse_args(argv)
    launched = args.launched or time.time()

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    from trl_side import HeldOut, Timeline, load_model, optimizer_and_schedule, peak_rss_bytes, read_jsonl

    spec, _, paths = spec_from_json(args.spec)
    model, tokenizer = load_model(paths["model_dir"])
    train = Dataset.from_list(read_jsonl(paths["sft_train_jsonl"]))
    config = SFTConfig(
        **trl_sft_kwargs(spec, args.variant, str(args.out.parent / f"trl-{args.variant}"), paths["mean_length"])
    )
    timeline = Timeline(
        HeldOut(paths, tokenizer), lambda step: step == spec.steps or step % spec.eval_every == 0, launched
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
        optimizers=optimizer_and_schedule(
            model,
            spec.learning_rate,
            spec.weight_decay,
            spec.warmup_steps,
            spec.steps,
            spec.schedule,
            spec.min_lr_ratio,
        ),
        callbacks=[timeline],
    )
    first = trainer.train_dataset[0]
    trainer.train()
    train_s = timeline.train_seconds()
    tokens = int(trainer._total_train_tokens)
    result = timeline.result(
        side=f"trl-{args.variant}",
        steps=trainer.state.global_step,
        train_s=train_s,
        tokens=tokens,
        tokens_per_s=tokens / train_s,
        wall_s=time.time() - launched,
        peak_rss_bytes=peak_rss_bytes(),
        first_row_ids=list(first["input_ids"]),
        first_row_mask=list(first.get("completion_mask", [])),
    )
    args.out.write_text(json.dumps(result))
    print(
        f"trl-{args.variant}: {result['tokens_per_s']:,.0f} tokens/s, final accuracy {timeline.curve[-1][2]:.3f}, {result['wall_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
