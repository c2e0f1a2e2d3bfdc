"""What the peer comparisons share, imported by the drivers (project ``.venv``) and by the TRL
scripts (``.venv-peers``): the workload read from one recipe, the TRL configs derived from it, the
summaries, and the measurements (peak resident memory of a process tree, load average).

Nothing here imports torch, transformers or trl: the unit tests run it in the project's venv.

The single source of both sides' settings is the recipe the driver resolves (the quickstart with
``model.path`` swapped in for ``model.init``, so that both sides load the same HF directory): the
driver writes ``spec.json`` from it, the TRL scripts build their ``SFTConfig`` / ``GRPOConfig``
only from that file (``trl_sft_kwargs``, ``trl_grpo_kwargs``).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "quickstart.toml"
PEERS_VENV = Path(os.environ.get("PEERS_VENV", REPO / ".venv-peers"))
SFT_VARIANTS = ("default", "padding_free", "packing")


@dataclass(frozen=True)
class SftSpec:
    seed: int
    steps: int
    batch_size: int
    learning_rate: float
    warmup_steps: int
    schedule: str
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float
    eval_every: int
    target_accuracy: float


@dataclass(frozen=True)
class RlSpec:
    seed: int
    steps: int
    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    learning_rate: float
    warmup_steps: int
    grad_clip: float
    mini_batches: int
    eps_low: float
    eps_high: float
    kl_coef: float
    eval_every: int

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


def sft_spec(recipe, target_accuracy: float) -> SftSpec:
    s = recipe.sft
    return SftSpec(
        recipe.seed,
        s.steps,
        s.batch_size,
        s.learning_rate,
        s.warmup_steps,
        s.schedule,
        s.min_lr_ratio,
        s.weight_decay,
        s.grad_clip,
        s.eval_every,
        target_accuracy,
    )


def rl_spec(recipe) -> RlSpec:
    r = recipe.rl
    if r.advantage.kind != "grpo" or not r.advantage.std_normalize or r.loss.kind != "ppo_clip":
        raise ValueError("the TRL comparison maps GRPO advantages (std-normalized) and the ppo_clip loss only")
    if r.loss.reduction != "token_mean" or r.dynamic_sampling.enabled or r.epochs != 1:
        raise ValueError("the TRL comparison needs rl.loss.reduction = token_mean, no dynamic sampling, rl.epochs = 1")
    return RlSpec(
        recipe.seed,
        r.steps,
        r.prompts_per_step,
        r.samples_per_prompt,
        r.max_new_tokens,
        r.temperature,
        r.learning_rate,
        r.warmup_steps,
        r.grad_clip,
        r.mini_batches,
        r.loss.eps_low,
        r.loss.eps_high,
        r.kl.coef,
        r.eval_every,
    )


def spec_from_json(path: Path) -> tuple[SftSpec | None, RlSpec | None, dict]:
    raw = json.loads(Path(path).read_text())
    sft = SftSpec(**raw["sft"]) if raw.get("sft") else None
    rl = RlSpec(**raw["rl"]) if raw.get("rl") else None
    return sft, rl, raw.get("paths", {})


def write_spec(path: Path, sft: SftSpec | None, rl: RlSpec | None, paths: dict) -> None:
    data = {"sft": asdict(sft) if sft else None, "rl": asdict(rl) if rl else None, "paths": paths}
    Path(path).write_text(json.dumps(data, indent=1))


# ------------------------------------------------------------------------------------ TRL configs
def trl_common_kwargs(out_dir: str, seed: int, grad_clip: float, steps: int) -> dict:
    """What both TRL trainers get: one process on the CPU, no checkpoints, no reports, fp32 (the
    skyrl trainer's dtype on CPU). The optimizer and schedule are passed in (``trl_optimizer``)."""
    return {
        "output_dir": out_dir,
        "max_steps": steps,
        "seed": seed,
        "data_seed": seed,
        "max_grad_norm": grad_clip,
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "save_strategy": "no",
        "report_to": [],
        "logging_steps": 10,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }


def trl_sft_kwargs(spec: SftSpec, variant: str, out_dir: str, mean_length: float) -> dict:
    """``SFTConfig`` keyword arguments equivalent to the skyrl SFT stage of ``spec``.

    ``variant``: TRL's default (padded batches), ``padding_free`` (the batch as one row, position
    ids restarting per sequence) or ``packing`` (best-fit-decreasing packing into rows, which implies
    padding-free). Packing fixes tokens per row, not sequences per batch: one row of
    ``batch_size * mean_length`` tokens keeps the tokens per optimizer step of the other variants."""
    if variant not in SFT_VARIANTS:
        raise ValueError(f"unknown TRL SFT variant {variant!r}; one of {', '.join(SFT_VARIANTS)}")
    kwargs = trl_common_kwargs(out_dir, spec.seed, spec.grad_clip, spec.steps)
    kwargs.update(
        per_device_train_batch_size=spec.batch_size,
        gradient_accumulation_steps=1,
        learning_rate=spec.learning_rate,
        weight_decay=spec.weight_decay,
        completion_only_loss=True,
        padding_free=variant == "padding_free",
        packing=variant == "packing",
        max_length=1024,
    )
    if variant == "padding_free":  # TRL refuses a max_length it would not enforce; rows are short anyway
        kwargs["max_length"] = None
    if variant == "packing":
        kwargs.update(per_device_train_batch_size=1, max_length=round(spec.batch_size * mean_length))
    return kwargs


def trl_grpo_kwargs(spec: RlSpec, out_dir: str) -> dict:
    """``GRPOConfig`` keyword arguments equivalent to the skyrl RL stage of ``spec``.

    One skyrl step = ``prompts_per_step * samples_per_prompt`` samples from one policy, then
    ``mini_batches`` optimizer updates on equal slices. TRL's unit is the optimizer step: one
    generation of ``generation_batch_size`` samples serves ``steps_per_generation`` updates of
    ``per_device_train_batch_size`` samples each, so TRL runs ``steps * mini_batches`` optimizer steps.
    ``loss_type = "dapo"`` normalises by the tokens of the whole batch (skyrl's ``token_mean``),
    ``scale_rewards = "group"`` is GRPO's std normalisation, ``beta`` the KL weight (0: no reference)."""
    per_update = spec.samples_per_step // spec.mini_batches
    if per_update * spec.mini_batches != spec.samples_per_step or per_update % spec.samples_per_prompt:
        raise ValueError("rl.mini_batches must split the step's samples into whole groups")
    kwargs = trl_common_kwargs(out_dir, spec.seed, spec.grad_clip, spec.steps * spec.mini_batches)
    kwargs.update(
        learning_rate=spec.learning_rate,
        weight_decay=0.0,
        per_device_train_batch_size=per_update,
        gradient_accumulation_steps=1,
        steps_per_generation=spec.mini_batches,
        num_generations=spec.samples_per_prompt,
        num_iterations=1,
        max_completion_length=spec.max_new_tokens,
        temperature=spec.temperature,
        top_p=1.0,
        top_k=0,
        epsilon=spec.eps_low,
        epsilon_high=spec.eps_high,
        beta=spec.kl_coef,
        loss_type="dapo",
        scale_rewards="group",
        mask_truncated_completions=False,
        logging_steps=spec.mini_batches,
    )
    return kwargs


def trl_eval_due(optimizer_step: int, spec: RlSpec) -> bool:
    """Whether TRL's optimizer step ``optimizer_step`` ends a skyrl step that skyrl evaluates after."""
    if optimizer_step % spec.mini_batches:
        return False
    step = optimizer_step // spec.mini_batches
    return step == spec.steps or bool(spec.eval_every and step % spec.eval_every == 0)


# ------------------------------------------------------------------------------------ the recipe
def derived_recipe_text(source: str, model_dir: str) -> str:
    """The quickstart recipe with ``model.path`` (an HF directory both sides load) in place of
    ``model.init``, and the model's own tokenizer (saved there) in place of building one."""
    out, n_init = re.subn(r"(?m)^init = \{[^}\n]*\}.*$", f"path = {json.dumps(model_dir)}", source)
    out, n_tok = re.subn(r'(?m)^tokenizer = "char".*$', 'tokenizer = "auto"', out)
    if (n_init, n_tok) != (1, 1):
        raise ValueError(
            'the recipe\'s [model] table no longer has one `init = {...}` and one `tokenizer = "char"` line'
        )
    return out


# ------------------------------------------------------------------------------------ summaries
def first_reaching(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first time of a (time, accuracy) curve at which accuracy >= target, or None."""
    for t, acc in curve:
        if acc >= target - 1e-9:
            return t
    return None


def spread(values: Sequence[float | None]) -> dict:
    """Median, min and max of the measured values (None: not reached; counted, not averaged)."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0, "missing": len(values)}
    return {
        "median": statistics.median(got),
        "min": min(got),
        "max": max(got),
        "n": len(got),
        "missing": len(values) - len(got),
    }


def ratio(subject: float | None, baseline: float | None) -> float | None:
    if subject is None or baseline is None or baseline == 0:
        return None
    return subject / baseline


def fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def table(rows: Sequence[dict], columns: Sequence[tuple[str, str, int]]) -> str:
    """A plain text table: ``columns`` are (key, header, digits)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([row[k] if isinstance(row.get(k), str) else fmt(row.get(k), d) for k, _, d in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells
    )


def machine() -> dict:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


# ------------------------------------------------------------------------------------ measurements
def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        out += [int(c) for c in _read(str(task / "children")).split()]
    return out


def tree_rss_bytes(root: int) -> tuple[int, int]:
    """(sum, largest) resident set size of ``root`` and all its descendants, from /proc."""
    total = largest = 0
    stack, seen = [root], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        m = re.search(r"VmRSS:\s+(\d+) kB", _read(f"/proc/{pid}/status"))
        if m:
            rss = int(m.group(1)) * 1024
            total, largest = total + rss, max(largest, rss)
        stack += _children(pid)
    return total, largest


class TreeSampler:
    """Samples a process tree's resident memory and the load average while a command runs."""

    def __init__(self, pid: int, period_s: float = 0.25):
        self.pid, self.period_s = pid, period_s
        self.peak_sum = self.peak_one = 0
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            total, one = tree_rss_bytes(self.pid)
            self.peak_sum, self.peak_one = max(self.peak_sum, total), max(self.peak_one, one)
            self.loads.append(os.getloadavg()[0])
            self._stop.wait(self.period_s)

    @property
    def load(self) -> dict:
        return spread(self.loads)
