"""The peer comparisons' pure parts (benchmarks/peers): the TRL configs say what the skyrl recipe
says, the recipe swap, the summaries and ratios, the argument defaults. No timings here."""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import bench_grpo  # noqa: E402
import bench_sft  # noqa: E402
import common  # noqa: E402

from skyrl_cli.recipe.loader import load_recipe  # noqa: E402


@pytest.fixture(scope="module")
def quickstart():
    return load_recipe(common.RECIPE)


def test_sft_config_matches_the_recipe(quickstart):
    spec = common.sft_spec(quickstart, 0.4)
    for variant in ("default", "padding_free"):
        kw = common.trl_sft_kwargs(spec, variant, "/tmp/x", mean_length=12.0)
        assert kw["learning_rate"] == quickstart.sft.learning_rate == 3e-3
        assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == quickstart.sft.batch_size
        assert kw["max_steps"] == quickstart.sft.steps and kw["max_grad_norm"] == quickstart.sft.grad_clip
        assert kw["weight_decay"] == quickstart.sft.weight_decay and kw["seed"] == quickstart.seed
        assert kw["completion_only_loss"] and not kw["bf16"] and kw["use_cpu"]
        assert kw["padding_free"] == (variant == "padding_free") and not kw["packing"]
        assert kw["max_length"] == (None if variant == "padding_free" else 1024)
    packed = common.trl_sft_kwargs(spec, "packing", "/tmp/x", mean_length=12.0)
    assert packed["packing"] and packed["per_device_train_batch_size"] == 1
    assert packed["max_length"] == 128 * 12  # the tokens of one padded batch in one packed row
    with pytest.raises(ValueError, match="unknown TRL SFT variant"):
        common.trl_sft_kwargs(spec, "wrapped", "/tmp/x", 12.0)


def test_grpo_config_matches_the_recipe(quickstart):
    spec = common.rl_spec(quickstart)
    kw = common.trl_grpo_kwargs(spec, "/tmp/x")
    rl = quickstart.rl
    # one skyrl step: 32 prompts x 8 samples from one policy, then 4 updates on 64-sample slices
    assert kw["per_device_train_batch_size"] * kw["steps_per_generation"] == rl.prompts_per_step * rl.samples_per_prompt
    assert kw["steps_per_generation"] == rl.mini_batches == 4 and kw["per_device_train_batch_size"] == 64
    assert kw["num_generations"] == rl.samples_per_prompt and kw["num_iterations"] == 1
    assert kw["max_steps"] == rl.steps * rl.mini_batches
    assert kw["learning_rate"] == rl.learning_rate and kw["max_grad_norm"] == rl.grad_clip
    assert (kw["epsilon"], kw["epsilon_high"], kw["beta"]) == (rl.loss.eps_low, rl.loss.eps_high, rl.kl.coef)
    assert kw["max_completion_length"] == rl.max_new_tokens and kw["temperature"] == rl.temperature
    assert kw["loss_type"] == "dapo" and kw["scale_rewards"] == "group" and kw["top_k"] == 0


def test_grpo_spec_refuses_what_trl_cannot_mirror():
    with pytest.raises(ValueError, match="GRPO advantages"):
        common.rl_spec(load_recipe(common.RECIPE, ["rl.advantage.kind=rloo"]))
    with pytest.raises(ValueError, match="dynamic sampling"):
        common.rl_spec(load_recipe(common.RECIPE, ["rl.dynamic_sampling.enabled=true"]))
    with pytest.raises(ValueError, match="whole groups"):
        common.trl_grpo_kwargs(common.rl_spec(load_recipe(common.RECIPE, ["rl.mini_batches=3"])), "/tmp/x")


def test_trl_evaluates_after_the_same_rl_steps(quickstart):
    spec = common.rl_spec(load_recipe(common.RECIPE, ["rl.eval_every=2", "rl.steps=5"]))
    due = [s for s in range(1, 5 * spec.mini_batches + 1) if common.trl_eval_due(s, spec)]
    assert due == [8, 16, 20]  # after RL steps 2, 4 and the last (5), each = 4 optimizer steps


def test_derived_recipe_swaps_the_model_source():
    text = common.derived_recipe_text(common.RECIPE.read_text(), "/tmp/model dir")
    model = tomllib.loads(text)["model"]
    assert model["path"] == "/tmp/model dir" and "init" not in model and model["tokenizer"] == "auto"
    with pytest.raises(ValueError, match="no longer has"):
        common.derived_recipe_text(text, "/tmp/again")


def test_summaries_and_ratios():
    curve = [(10.0, 0, 0.5), (20.0, 2, 0.58), (30.0, 4, 0.61), (40.0, 6, 0.9)]
    assert common.first_reaching([(t, a) for t, _, a in curve], 0.6) == 30.0
    assert common.first_reaching([(1.0, 0.1)], 0.6) is None
    assert common.spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3, "missing": 1}
    assert common.ratio(None, 2.0) is None and common.ratio(3.0, 2.0) == 1.5
    run = {"curve": curve, "wall_s": 50.0, "peak_rss_bytes": 2**30, "load": {"median": 2.0}}
    trl = {"curve": [(5.0, 0, 0.5), (60.0, 2, 0.7)], "wall_s": 100.0, "peak_rss_bytes": 2**29, "load": {"median": 2.0}}
    rows = bench_grpo.summarise({"skyrl-sync": [run], "trl": [trl]}, gain=0.10, samples=1000)
    by = {r["side"]: r for r in rows}
    assert by["skyrl-sync"]["to_gain_s"] == 30.0 and by["trl"]["to_gain_s"] == 60.0
    assert by["skyrl-sync"]["samples_per_s"] == 20.0 and by["trl"]["start_s"] == 5.0
    line = bench_grpo.ratio_lines(rows, 0.10)[0]
    assert "wall time to +10 points 0.50x" in line and "samples/s 2.00x" in line and "start-up 2.00x" in line


def test_sft_summary_and_arguments():
    runs = {
        "skyrl": [
            {
                "curve": [(5.0, 0, 0.0), (50.0, 100, 0.45)],
                "tokens_per_s": 9000.0,
                "wall_s": 60.0,
                "peak_rss_bytes": 2**31,
                "load": {"median": 1.0},
            }
        ],
        "trl-default": [
            {
                "curve": [(9.0, 0, 0.0), (90.0, 100, 0.41)],
                "tokens_per_s": 3000.0,
                "wall_s": 99.0,
                "peak_rss_bytes": 2**30,
                "load": {"median": 1.0},
            }
        ],
    }
    rows = bench_sft.summarise(runs, target=0.4)
    assert [r["to_target_s"] for r in rows] == [50.0, 90.0]
    assert bench_sft.ratio_lines(rows) == [
        "skyrl / trl-default: training tokens/s 3.00x, wall time to target 0.56x (lower is faster), peak memory 2.00x"
    ]
    quick = bench_sft.parse_args(["--quick"])
    assert (quick.reps, quick.steps) == (1, 60) and bench_grpo.parse_args(["--quick"]).steps == 6
    assert bench_sft.parse_args([]).sides == ["skyrl", "trl-default", "trl-padding_free", "trl-packing"]


def test_tree_rss_counts_this_process():
    total, largest = common.tree_rss_bytes(os.getpid())
    assert total >= largest > 10 * 2**20


def test_generation_window_from_orchestrator_events():
    import skyrl_side

    def ev(t, step, name, process="orchestrator"):
        return {"time": t, "step": step, "name": name, "process": process, "value": 0.0}

    raw = [
        ev(10.0, 0, "eval/accuracy"),  # v0 evaluated: generation of batch 0 opens
        ev(12.5, 1, "timing/take_batch_s"),  # batch 0 written
        ev(14.0, 1, "timing/sync_weights_s"),  # engines on v1
        ev(14.1, 1, "timing/wait_for_batch_s", "trainer"),  # the learner's own wait: not generation
        ev(15.0, 2, "timing/take_batch_s"),  # batch 1 written
        ev(16.0, 2, "timing/sync_weights_s"),  # v2 synced, the run ended before batch 2
    ]
    assert skyrl_side.generation_seconds(raw) == [2.5, 1.0]
