"""A random-init model with exactly a real model's config (its vocabulary, tied head and all), and the
character tokenizer of a built-in task padded to that vocabulary: the real size of a recipe, run
here with no download (``benchmarks/model_configs/`` holds the configs).

    python benchmarks/make_shape_model.py --config benchmarks/model_configs/qwen2.5-0.5b-instruct.json \\
        --task addition --out /tmp/qwen0.5b-shape
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from backends.data.tasks import get_task
    from backends.models.tokenizer import build_char_tokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--task", default="addition")
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    raw = json.loads(args.config.read_text())
    tokenizer = build_char_tokenizer(get_task(args.task, args.digits).alphabet, vocab_size=raw["vocab_size"])
    raw.update(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    config = AutoConfig.for_model(**raw)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {type(model).__name__}, {params / 1e6:.1f}M parameters, vocabulary {len(tokenizer)}")


if __name__ == "__main__":
    main()
