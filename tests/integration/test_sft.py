"""The SFT stage on the real stack: torchrun, 2 CPU ranks, DeepSpeed, the tiny model.

- one optimizer step with dynamic micro-batching (2 ranks, ZeRO-2, uneven micro-batch counts
  padded with zero-weight ones) equals one plain-torch step on the whole batch in one process;
- a run killed mid-way and resumed ends exactly like an uninterrupted one (same seed);
- ``skyrl sft`` end to end: summary, checkpoints, an HF model that transformers loads;
- each trainer rank's peak resident memory in that run within 10% of the estimate on CPU
  (``skyrl_cli.plan.memory``; larger models: ``benchmarks/bench_memory_estimates.py``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.run_watch import ProcessMemory
from tests.integration.cli_runs import ENV, events, run_skyrl
from tests.recipes import merged, tiny_recipe, write_recipe

pytestmark = pytest.mark.integration


def skyrl(*args, check: bool = True):
    return run_skyrl(*args, check=check)


# ------------------------------------------------------------------------------- one step, 2 ranks

# ``data.train``: the test's JSONL file (``one_step_recipe``)
ONE_STEP = tiny_recipe(
    seed=3,
    model={"init": {"hidden_size": 64, "intermediate_size": 128}},
    data={"task": None, "digits": None, "eval_size": 4},
    sft={
        "steps": 1,
        "batch_size": 16,
        "learning_rate": 1e-3,
        "warmup_steps": 0,
        "weight_decay": 0.01,
        "grad_clip": 0.5,
        "max_tokens_per_microbatch": 64,
        "eval_every": 0,
        "save_every": 0,
    },
    logging={"log_every": 1},
)


def one_step_recipe(folder: Path, train: Path) -> Path:
    return write_recipe(folder / "one_step.toml", merged(ONE_STEP, data={"train": str(train)}))


def long_tailed_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text = "".join(rng.choice("abcdefgh") for _ in range(min(40, int(rng.paretovariate(1.2) * 3))))
        rows.append({"prompt": text, "completion": text[::-1]})
    return rows


def reference_step(recipe) -> dict:
    """One AdamW step on the whole global batch, in this process, in plain torch."""
    import torch

    from backends.data.sft import batch_indices, build_sft_data, load_source
    from backends.models.loading import load_model, load_tokenizer_for
    from backends.train.microbatch import collate, token_nll_sum
    from backends.train.schedule import lr_factor

    sft = recipe.sft
    source = load_source(recipe.data, recipe.seed)
    tokenizer = load_tokenizer_for(recipe.model, source.alphabet())
    data = build_sft_data(source, tokenizer, recipe.data)
    model = load_model(recipe.model, tokenizer, recipe.seed)
    batch = [data.train[i] for i in batch_indices(recipe.seed, 0, sft.batch_size, len(data.train))]
    loss = token_nll_sum(model, collate(batch, "padded", tokenizer.pad_token_id)) / sum(ex.loss_tokens for ex in batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), sft.grad_clip)
    lr = sft.learning_rate * lr_factor(
        0, warmup=sft.warmup_steps, total=sft.steps, kind=sft.schedule, min_ratio=sft.min_lr_ratio
    )
    torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=sft.weight_decay).step()
    return {k: v.detach() for k, v in model.state_dict().items()}, [len(ex) for ex in batch]


def test_two_rank_dynamic_step_equals_single_process_step(tmp_path):
    from safetensors.torch import load_file

    from backends.train.packing import dynamic_layout
    from skyrl_contracts.schema import Recipe

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in long_tailed_rows(200)))
    recipe_path = one_step_recipe(tmp_path, train)
    run_dir = tmp_path / "run"
    skyrl("sft", recipe_path, "--run-dir", run_dir, "--quiet")

    recipe = Recipe.model_validate_json((run_dir / "recipe.resolved.json").read_text())
    expected, lengths = reference_step(recipe)
    # the step really was split unevenly: several micro-batches, padding ones on one rank
    layout = dynamic_layout(lengths, 2, recipe.sft.max_tokens_per_microbatch)
    assert layout.num_microbatches >= 2 and layout.padding_microbatches() >= 1, layout
    assert events(run_dir, "train/padding_microbatches") == [(1, layout.padding_microbatches())]

    trained = load_file(run_dir / "final" / "model.safetensors")
    assert set(trained) == set(expected)
    worst = max(float((trained[k] - expected[k]).abs().max()) for k in expected)
    moved = max(float((trained[k] - load_initial(recipe)[k]).abs().max()) for k in expected)
    assert moved > 1e-4  # the step did change the weights
    assert worst < 1e-5, f"parameters differ by up to {worst}"


def load_initial(recipe) -> dict:
    from backends.data.sft import load_source
    from backends.models.loading import load_model, load_tokenizer_for

    tokenizer = load_tokenizer_for(recipe.model, load_source(recipe.data, recipe.seed).alphabet())
    return load_model(recipe.model, tokenizer, recipe.seed).state_dict()


# ----------------------------------------------------------------------------------- kill + resume

RESUMABLE = tiny_recipe(
    seed=3,
    model={"init": {"intermediate_size": 256}},
    data={"digits": None, "train_size": 2000, "eval_size": 50},
    sft={
        "steps": 16,
        "batch_size": 64,
        "learning_rate": 3e-3,
        "warmup_steps": 2,
        "eval_every": 0,
        "save_every": 4,
        "keep_last": 2,
        # a budget each rank's share of the batch (32 sums) fills: the largest micro-batch is the
        # one the memory estimate assumes
        "max_tokens_per_microbatch": 256,
    },
    logging={"log_every": 1},
)


def run_until_checkpoint_then_kill(recipe_path: Path, run_dir: Path, step: int) -> None:
    """Start the trainer of the plan directly and SIGKILL its process group once checkpoint
    ``step`` is complete (the trainer is then mid-run)."""
    from skyrl_cli.commands.common import load_for_run
    from skyrl_cli.plan.build import build_plan
    from skyrl_contracts.rundir import RunDir

    recipe = load_for_run(str(recipe_path), None, "sft", gpu_count=0)
    plan = build_plan(recipe, "sft", run_dir)
    RunDir(run_dir).prepare(recipe, plan)
    (spec,) = plan.processes
    with open(run_dir / "logs" / "trainer.log", "ab") as log:
        proc = subprocess.Popen(
            spec.argv, env={**ENV, **spec.env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "checkpoints" / f"step-{step}" / "trainer_state.json").exists():
            assert proc.poll() is None, (run_dir / "logs" / "trainer.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """An uninterrupted ``skyrl sft --json`` run of RESUMABLE: (recipe path, run dir, CLI output,
    the peak resident memory of each process it started)."""
    root = tmp_path_factory.mktemp("straight")
    recipe_path = write_recipe(root / "resumable.toml", RESUMABLE)
    with ProcessMemory(os.getpid()) as memory:  # this test process's children: the run
        proc = skyrl("sft", recipe_path, "--run-dir", root / "run", "--json")
    return recipe_path, root / "run", proc.stdout, memory


def test_killed_run_resumes_to_the_same_final_loss(tmp_path, straight_run):
    recipe_path, straight, _, _ = straight_run
    interrupted = tmp_path / "interrupted"
    run_until_checkpoint_then_kill(recipe_path, interrupted, step=4)
    assert not (interrupted / "final").exists(), "the run finished before it was killed"
    stopped_at = max(s for s, _ in events(interrupted, "train/loss"))
    assert stopped_at < 16

    skyrl("sft", recipe_path, "--run-dir", interrupted, "--resume", "--quiet")
    log = (interrupted / "logs" / "trainer.log").read_text()
    assert "resumed from" in log

    final_straight = events(straight, "train/loss")[-1]
    final_resumed = events(interrupted, "train/loss")[-1]
    assert final_straight[0] == final_resumed[0] == 16
    assert final_resumed[1] == pytest.approx(final_straight[1], abs=1e-6)
    # the same losses at every step after the resume point (the data order continued)
    straight_losses = dict(events(straight, "train/loss"))
    resumed_losses = {s: v for s, v in events(interrupted, "train/loss")}
    for step in range(5, 17):
        assert resumed_losses[step] == pytest.approx(straight_losses[step], abs=1e-6), step
    # keep_last = 2 complete checkpoints, no partial ones left behind
    names = sorted(p.name for p in (interrupted / "checkpoints").iterdir())
    assert names == ["step-12", "step-16"]


# ------------------------------------------------------------------------------------ CLI summary


def test_cli_run_writes_summary_and_a_loadable_model(straight_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run_dir, stdout, _ = straight_run
    last = json.loads(stdout.strip().splitlines()[-1])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert last["summary"]["metrics"] == summary["metrics"]
    assert summary["completed"] is True and summary["steps"] == 16
    for name in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/num_microbatches",
        "train/packing_efficiency",
        "train/padding_microbatches",
        "eval/loss",
        "eval/accuracy",
        "progress/total_steps",
    ):
        assert name in summary["metrics"], name
    assert summary["throughput"]["train/tokens_per_s"]["mean"] > 0

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "001+002="}], add_generation_prompt=True, return_dict=False
    )
    out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)
    assert out.shape[1] > len(ids)


def test_trainer_ranks_resident_memory_is_the_estimate_within_10_percent(straight_run):
    """What ``skyrl sft --dry-run`` estimates for a CPU rank of this run (its resolved recipe) against
    each rank's resident high-water mark: at this size mostly the process and its data
    (``TRAINER_CPU_RUNTIME_BYTES``, ``CPU_BYTES_PER_EXAMPLE``)."""
    from skyrl_cli.plan.fit import Hardware, estimate
    from skyrl_cli.plan.shape import trained_shape
    from skyrl_contracts.schema import Recipe

    _, run_dir, _, memory = straight_run
    recipe = Recipe.model_validate_json((run_dir / "recipe.resolved.json").read_text())
    cpu = Hardware(gpus=0, gpu_bytes=None, gpu=None, device="cpu")
    expected = estimate(recipe, trained_shape(recipe, run_dir), cpu).trainer("sft").memory.peak
    ranks = [rss for role, _, rss in memory.peaks() if role == "trainer rank"]
    assert len(ranks) == 2, memory.peaks()
    for rss in ranks:
        assert abs(rss / expected - 1) < 0.10, f"measured {rss / 1e9:.3f} GB, estimated {expected / 1e9:.3f} GB"


def test_trainer_failure_reports_the_log(tmp_path):
    recipe_path = write_recipe(tmp_path / "bad.toml", merged(RESUMABLE, data={"max_length": 8}))
    proc = skyrl("sft", recipe_path, "--run-dir", tmp_path / "run", "--quiet", check=False)
    assert proc.returncode == 1
    assert "the trainer failed" in proc.stderr and "trainer.log" in proc.stderr


def test_stop_at_accuracy_ends_early_and_a_resume_keeps_it_ended(tmp_path):
    recipe = merged(RESUMABLE, sft={"eval_every": 4, "stop_at_accuracy": 0.0})
    recipe_path = write_recipe(tmp_path / "stop.toml", recipe)
    run_dir = tmp_path / "run"
    proc = skyrl("sft", recipe_path, "--run-dir", run_dir, "--quiet")
    assert "stopped early at step 4 (sft.stop_at_accuracy)" in proc.stdout
    assert max(s for s, _ in events(run_dir, "train/loss")) == 4
    assert (run_dir / "final" / "config.json").exists()
    assert json.loads((run_dir / "checkpoints" / "step-4" / "trainer_state.json").read_text())["stopped_early"] is True

    skyrl("sft", recipe_path, "--run-dir", run_dir, "--resume", "--quiet")
    assert max(s for s, _ in events(run_dir, "train/loss")) == 4  # no step after the stop
