"""docs/will-it-fit.md shows what `skyrl recipes validate RECIPE --gpus N --gpu-type T` prints for
the GSM8K recipes: this test runs every command the page's tables and blocks come from and compares
them with the page. ``SKYRL_WRITE_DOCS=1`` writes the page's generated parts instead."""

from __future__ import annotations

import os
import re

import pytest

from tests.docs_blocks import DOCS, REPO

from .test_recipes_cli import fetched_assets  # noqa: F401  (the fixture: the models' config.json under HOME)

PAGE = DOCS / "will-it-fit.md"
RECIPES = ("gsm8k_qwen0.5b", "gsm8k_qwen1.5b", "gsm8k_multiturn", "gsm8k_lora")
GPU_COUNTS = (1, 4, 8)
GPU_TYPES = (("4090", 24), ("h100", 80), ("h200", 141))  # each type's memory is its --gpu-memory default
SHOWN = ("gsm8k_qwen1.5b", 8, "h100")  # the one whole output on the page
BEGIN, END = "<!-- generated: tests/cli/test_docs_will_it_fit.py -->", "<!-- end of generated -->"


def _validate(skyrl, recipe: str, gpus: int, kind: str):
    return skyrl("recipes", "validate", f"recipes/{recipe}.toml", "--gpus", gpus, "--gpu-type", kind)


def _row(skyrl, recipe: str, gpus: int, kind: str, memory: int) -> str:
    result = _validate(skyrl, recipe, gpus, kind)
    assert "Traceback" not in result.err
    keys = [line.split(": ")[2] for line in result.err.splitlines() if line.startswith("error: ")]
    written = "fits" if result.code == 0 else "no: " + ", ".join(f"`{k}`" for k in dict.fromkeys(keys))
    lines = result.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("splits of "))
    if "none fits" in lines[header]:
        return f"| {gpus} x {memory} GiB ({kind}) | {written} | none fits | | |"
    best = re.split(r"\s{2,}", lines[header + 2].strip())
    trainer, engines, zero, micro, checkpointing, rank, _, step, overlapped = best
    count, _, tp = engines.partition(" x ")
    engines = f" + {count} engine{'s' if count != '1' else ''} x TP {tp}" if engines != "-" else ""
    split = f"{trainer} trainer GPU{'s' if trainer != '1' else ''}{engines}"
    micro += ", gradient checkpointing" if checkpointing == "yes" else ""
    return f"| {gpus} x {memory} GiB ({kind}) | {written} | {split}, ZeRO-{zero}, micro-batch {micro} | {rank} | {step} / {overlapped} |"


def generated(skyrl) -> str:
    parts = []
    for recipe in RECIPES:
        parts += [
            f"### {recipe}",
            "",
            "| GPUs | as written | fastest split that fits | GiB a trainer rank | step s (sync / --async) |",
            "|---|---|---|---|---|",
        ]
        parts += [_row(skyrl, recipe, n, kind, memory) for kind, memory in GPU_TYPES for n in GPU_COUNTS]
        parts.append("")
    recipe, gpus, kind = SHOWN
    result = _validate(skyrl, recipe, gpus, kind)
    command = f"skyrl recipes validate recipes/{recipe}.toml --gpus {gpus} --gpu-type {kind}"
    errors = [line for line in result.err.splitlines() if line.startswith("error: ")]
    parts += [
        f"### The whole output: {recipe} on {gpus} x {kind}",
        "",
        "```text",
        f"$ {command}",
        *result.out.splitlines(),
        *errors,
        "```",
    ]
    return "\n".join(parts)


@pytest.mark.timeout(300)
def test_the_page_shows_what_the_command_prints(skyrl, fetched_assets, monkeypatch):  # noqa: F811
    monkeypatch.chdir(REPO)
    text = PAGE.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    fresh = "\n" + generated(skyrl) + "\n"
    if os.environ.get("SKYRL_WRITE_DOCS") == "1":
        PAGE.write_text(text[:start] + fresh + text[end:])
        return
    assert text[start:end] == fresh, "docs/will-it-fit.md is stale: SKYRL_WRITE_DOCS=1 pytest " + __file__


def test_a_layout_that_does_not_fit_is_one_line_a_problem_with_exit_2(skyrl, fetched_assets, monkeypatch):  # noqa: F811
    monkeypatch.chdir(REPO)
    result = _validate(skyrl, "gsm8k_qwen1.5b", 8, "4090")
    assert result.code == 2 and "Traceback" not in result.err
    errors = result.err.splitlines()
    assert errors and all(line.startswith("error: recipes/gsm8k_qwen1.5b.toml:") for line in errors)
    assert any("rl.max_tokens_per_microbatch: a trainer rank of the RL stage needs" in line for line in errors)
    assert "splits of 8 GPUs of 24 GiB" in result.out


def test_gpu_memory_overrides_the_type_and_unknown_types_are_refused(skyrl, fetched_assets, monkeypatch):  # noqa: F811
    monkeypatch.chdir(REPO)
    roomy = skyrl("recipes", "validate", "recipes/gsm8k_lora.toml", "--gpus", "8", "--gpu-memory", "1000")
    assert roomy.code == 0 and "on 8 GPUs of 1000 GiB (roofline: H100 SXM" in roomy.out
    assert roomy.out.rstrip().endswith("ok: recipes/gsm8k_lora.toml")
    unknown = skyrl("recipes", "validate", "recipes/gsm8k_lora.toml", "--gpus", "8", "--gpu-type", "v100")
    assert unknown.code == 2 and "--gpu-type v100: not a GPU type of the roofline" in unknown.err
    no_gpus = skyrl("recipes", "validate", "recipes/gsm8k_lora.toml", "--gpus", "0", "--gpu-memory", "80")
    assert no_gpus.code == 2 and "give --gpus N" in no_gpus.err
