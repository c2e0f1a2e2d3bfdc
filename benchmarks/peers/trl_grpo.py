"""TRL's GRPOTrainer (transformers generation) on the workload of ``spec.json`` (run by ``bench_grpo.py``
in ``.venv-peers``): the same SFT checkpoint, prompts, group size, reward, learning rate and samples.

    .venv-peers/bin/python benchmarks/peers/trl_grpo.py --spec WORK/spec.json --out r.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from common import spec_from_json, trl_eval_due, trl_grpo_kwargs  # noqa: E402


def task_reward(task):
    """The skyrl task's own reward (exact match against the right answer) as a TRL reward function."""

    def exact_match(completions, answer, **_):
        return [
            task.reward(c[0]["content"] if isinstance(c, list) else c, {"answer": a})
            for c, a in zip(completions, answer)
        ]

    return exact_match


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--launched", type=float, default=None)
    args = p.parse_args(argv)
    launched = args.launched or time.time()

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl_side import HeldOut, Timeline, load_model, optimizer_and_schedule, peak_rss_bytes, read_jsonl

    from backends.data.tasks import get_task

    _, spec, paths = spec_from_json(args.spec)
    model, tokenizer = load_model(paths["sft_model_dir"])
    train = Dataset.from_list(read_jsonl(paths["rl_train_jsonl"]))
    held_out = HeldOut(paths, tokenizer)
    held_out.max_new_tokens = spec.max_new_tokens  # skyrl's RL eval decodes up to rl.max_new_tokens
    timeline = Timeline(held_out, lambda step: trl_eval_due(step, spec), launched)
    total = spec.steps * spec.mini_batches
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[task_reward(get_task(paths["task"], paths["digits"]))],
        args=GRPOConfig(**trl_grpo_kwargs(spec, str(args.out.parent / "trl-grpo"))),
        train_dataset=train,
        processing_class=tokenizer,
        optimizers=optimizer_and_schedule(model, spec.learning_rate, 0.0, spec.warmup_steps, total, "constant", 1.0),
        callbacks=[timeline],
    )
    trainer.train()
    train_s = timeline.train_seconds()
    samples = spec.steps * spec.samples_per_step
    result = timeline.result(
        side="trl-grpo",
        optimizer_steps=trainer.state.global_step,
        samples=samples,
        train_s=train_s,
        samples_per_s=samples / train_s,
        wall_s=time.time() - launched,
        peak_rss_bytes=peak_rss_bytes(),
    )
    args.out.write_text(json.dumps(result))
    print(
        f"trl-grpo: {result['samples_per_s']:.1f} samples/s, accuracy {timeline.curve[0][2]:.3f} -> {timeline.curve[-1][2]:.3f}, {result['wall_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
