"""The drivers' side (project ``.venv``): one work folder with the model directory both sides load,
the data exported to JSONL for TRL, the resolved recipe and ``spec.json``; running one side as a
subprocess under the memory / load sampler; reading a skyrl run's accuracy curve from its events."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from common import PEERS_VENV, RECIPE, REPO, TreeSampler, derived_recipe_text, first_reaching

SKYRL = str(Path(sys.executable).with_name("skyrl"))


def build_initial_model(recipe_path: Path, out_dir: Path, sets: list[str]) -> Path:
    """The quickstart's tiny model (its ``model.init``, seeded like ``skyrl sft`` seeds it) and its
    char tokenizer, saved as one HF directory."""
    from backends.data.sft import load_source
    from backends.models.loading import load_model, load_tokenizer_for, save_hf
    from skyrl_cli.recipe.loader import load_recipe

    recipe = load_recipe(recipe_path, sets)
    tokenizer = load_tokenizer_for(recipe.model, load_source(recipe.data, recipe.seed).alphabet())
    return save_hf(load_model(recipe.model, tokenizer, recipe.seed), tokenizer, out_dir)


def export_rows(recipe, work: Path) -> dict:
    """The SFT demonstrations (prompt/completion chat rows) and the held-out task rows as JSONL, the
    same rows ``skyrl sft`` builds from the recipe; plus the mean token length of a training row."""
    from backends.data.chat import encode_conversations
    from backends.data.sft import load_source
    from backends.models.tokenizer import load_tokenizer

    source = load_source(recipe.data, recipe.seed)
    train = work / "sft_train.jsonl"
    with train.open("w") as f:
        for conv in source.train:
            f.write(json.dumps({"prompt": conv[:-1], "completion": conv[-1:]}) + "\n")
    evals = work / "eval.jsonl"
    evals.write_text("".join(json.dumps(r) + "\n" for r in source.task_rows))
    sample = encode_conversations(load_tokenizer(recipe.model.path), source.train[:2000], recipe.data.loss_on)
    return {
        "sft_train_jsonl": str(train),
        "eval_jsonl": str(evals),
        "task": recipe.data.task,
        "digits": recipe.data.digits,
        "mean_length": sum(len(ex) for ex in sample) / len(sample),
        "first_row_ids": list(sample[0].input_ids),
        "first_row_mask": list(sample[0].loss_mask),
    }


def prepare(work: Path, sets: list[str], init_sets: Sequence[str] = ()) -> tuple[object, Path, dict]:
    """(resolved recipe, recipe file, paths) of the work folder, built once and reused.
    ``init_sets``: ``model.init.*`` overrides of the initial model's shape (only the model is built
    with them: the derived recipe loads it by ``model.path``)."""
    from skyrl_cli.recipe.loader import load_recipe

    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model-init"
    if not (model_dir / "config.json").exists():
        build_initial_model(RECIPE, model_dir, [*sets, *init_sets])
    recipe_file = work / "recipe.toml"
    recipe_file.write_text(derived_recipe_text(RECIPE.read_text(), str(model_dir)))
    recipe = load_recipe(recipe_file, sets)
    paths_file = work / "paths.json"
    if paths_file.exists():
        paths = json.loads(paths_file.read_text())
    else:
        paths = {"model_dir": str(model_dir), **export_rows(recipe, work)}
        paths_file.write_text(json.dumps(paths))
    return recipe, recipe_file, paths


def run_measured(argv: list[str], log: Path, env: dict | None = None) -> dict:
    """Run one side; its wall time from the launch, peak tree RSS and the load average meanwhile."""
    launched = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=REPO)
        with TreeSampler(proc.pid) as sampler:
            rc = proc.wait()
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-8:])
        raise SystemExit(f"{' '.join(argv)} failed (exit {rc}), log {log}:\n{tail}")
    return {
        "launched": launched,
        "wall_s": time.time() - launched,
        "peak_rss_bytes": sampler.peak_sum,
        "peak_rss_one_bytes": sampler.peak_one,
        "load": sampler.load,
    }


def peers_python() -> str:
    python = PEERS_VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} not found: run `bash benchmarks/peers/setup.sh` first")
    return str(python)


def peers_env(threads: int | None = None) -> dict:
    return {
        "PYTHONPATH": str(REPO),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        **({"OMP_NUM_THREADS": str(threads)} if threads else {}),
    }


def skyrl_events(run_dir: Path) -> dict[str, list[tuple[float, int, float]]]:
    """name -> [(unix time, step, value)] from a run's events.jsonl."""
    out: dict[str, list] = {}
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        if line.strip():
            e = json.loads(line)
            out.setdefault(e["name"], []).append((e["time"], e["step"], e["value"]))
    return out


def accuracy_curve(events: dict, launched: float) -> list[tuple[float, int, float]]:
    """(seconds since the launch, step, held-out accuracy) of a skyrl run."""
    return [(t - launched, step, v) for t, step, v in events.get("eval/accuracy", [])]


def time_to(curve, target: float) -> float | None:
    return first_reaching([(t, acc) for t, _, acc in curve], target)


def med(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def generation_seconds(raw: list[dict]) -> list[float]:
    """Sync mode: generation for version k runs from the engines' sync to version k (and its
    evaluation, if due) until the orchestrator writes batch k (its event at step k + 1)."""
    orch = [e for e in raw if e["process"] == "orchestrator"]
    opened: dict[int, float] = {}
    for e in orch:
        if e["name"] in ("timing/sync_weights_s", "eval/accuracy"):
            opened[e["step"]] = max(opened.get(e["step"], 0.0), e["time"])
    written = {e["step"]: e["time"] for e in orch if e["name"] == "timing/take_batch_s"}
    return [written[k + 1] - t for k, t in sorted(opened.items()) if k + 1 in written]


def phases(run_dir: Path, launched: float, samples_per_step: int = 256) -> dict:
    """Per-step medians from a sync run's events: step interval (between learner steps), generation,
    training, weight publish (learner) and sync (engines), evaluation, the rest (exchange and
    scheduling gaps), response length, generation tokens/s, start-up (launch -> first evaluation)."""
    raw = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    events = skyrl_events(run_dir)
    learner_steps = sorted(t for t, _, _ in events.get("train/policy_loss", []))
    value = lambda name: med(v for _, _, v in events.get(name, []))  # noqa: E731
    gen = generation_seconds(raw)
    row = {
        "interval_s": med(b - a for a, b in zip(learner_steps, learner_steps[1:])),
        "generate_s": med(gen),
        "train_s": value("timing/train_s"),
        "publish_s": value("timing/publish_weights_s"),
        "sync_s": value("timing/sync_weights_s"),
        "eval_s": value("timing/eval_s"),
        "response_len": value("rollout/response_len"),
        "start_s": min(t for t, _, _ in events["eval/accuracy"]) - launched,
    }
    known = [row[k] for k in ("generate_s", "train_s", "publish_s", "sync_s")]
    row["rest_s"] = row["interval_s"] - sum(known) if row["interval_s"] is not None and None not in known else None
    row["rollout_tok_s"] = (
        samples_per_step * row["response_len"] / row["generate_s"]
        if row["generate_s"] and row["response_len"]
        else None
    )
    return row
