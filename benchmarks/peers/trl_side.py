"""The TRL scripts' shared parts (run in ``.venv-peers``, the repository on PYTHONPATH, read-only):
the model and tokenizer from the one HF directory, the held-out evaluation by skyrl's own code
(``backends.train.evaluate.eval_accuracy``, scored by the task's checker), the skyrl optimizer and
schedule, and a callback that times evaluations and writes the result file."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from backends.data.sft import SourceRows, build_sft_data
from backends.data.tasks import get_task
from backends.models.tokenizer import load_tokenizer
from backends.train.engine import Dist
from backends.train.evaluate import eval_accuracy
from backends.train.schedule import schedule


def read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def load_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model, load_tokenizer(model_dir)


class HeldOut:
    """Greedy accuracy on the task's held-out rows, exactly as the skyrl SFT trainer scores it."""

    def __init__(self, paths: dict, tokenizer):
        from skyrl_contracts.schema import DataConfig

        task = get_task(paths["task"], paths["digits"])
        rows = read_jsonl(paths["eval_jsonl"])
        chats = [task.prompt(r) + [{"role": "assistant", "content": r["answer"]}] for r in rows]
        data = build_sft_data(
            SourceRows(chats[:1], chats, task, rows), tokenizer, DataConfig(task=paths["task"], digits=paths["digits"])
        )
        self.items, self.scorer, self.max_new_tokens = data.eval_items, data.scorer, data.max_new_tokens
        self.tokenizer = tokenizer
        self.dist = Dist(0, 1, 0, torch.device("cpu"))

    def __call__(self, model) -> float:
        return eval_accuracy(model, self.tokenizer, self.items, self.scorer, self.max_new_tokens, self.dist)


def optimizer_and_schedule(model, lr: float, weight_decay: float, warmup: int, total: int, kind: str, min_ratio: float):
    """skyrl's optimizer (torch AdamW, betas 0.9/0.999) and its LambdaLR schedule, so the learning
    rate of every optimizer step is the same on both sides."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule(warmup, total, kind, min_ratio))


class Timeline(TrainerCallback):
    """Evaluates when ``due(step)`` (and before the first step), keeps (seconds since the launch,
    step, accuracy) and the time spent evaluating, so training throughput excludes it."""

    def __init__(self, held_out: HeldOut, due, launched: float):
        self.held_out, self.due, self.launched = held_out, due, launched
        self.curve: list[tuple[float, int, float]] = []
        self.eval_s = 0.0
        self.train_started, self.eval_before = 0.0, 0.0

    def _evaluate(self, model, step: int) -> None:
        t0 = time.perf_counter()
        acc = self.held_out(model)
        self.eval_s += time.perf_counter() - t0
        self.curve.append((time.time() - self.launched, step, acc))
        print(f"step {step}: held-out accuracy {acc:.4f} at {self.curve[-1][0]:.1f} s", flush=True)

    def on_train_begin(self, args, state, control, model=None, **kw):
        self._evaluate(model, 0)
        self.train_started, self.eval_before = time.perf_counter(), self.eval_s

    def on_step_end(self, args, state, control, model=None, **kw):
        if self.due(state.global_step):
            self._evaluate(model, state.global_step)

    def train_seconds(self) -> float:
        return time.perf_counter() - self.train_started - (self.eval_s - self.eval_before)

    def result(self, **extra) -> dict:
        return {"curve": self.curve, "eval_s": self.eval_s, **extra}


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
