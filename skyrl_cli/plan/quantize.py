"""The quantize stage's plan: one job that writes ``<run dir>/int4/``, a W4A16 checkpoint vLLM serves.

- ``--int4-qat``: the SFT trainer (``torchrun -m backends.train.sft``), fine-tuning the source model
  under INT4 fake-quant for the recipe's ``[sft]`` steps; it exports ``int4/`` after ``final/``.
- ``--ptq``: ``python -m backends.quant.export``, round-to-nearest of the source model, no training.

The source is ``quantization.init_from``: this recipe's SFT output, or a checkpoint directory. The
processes read the stage's recipe (``stage_recipe``): the user's, with the source as ``model.path``
and ``quantization.int4_qat`` saying which of the two runs, so the trainer needs no flag of its own.
"""

from __future__ import annotations

from pathlib import Path

from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.model import LaunchPlan, ProcessSpec
from skyrl_cli.plan.trainer import trainer_resources, trainer_spec, world_size
from skyrl_contracts.errors import UsageError
from skyrl_contracts.rundir import RUNS_ROOT, sft_output_dir
from skyrl_contracts.schema import ModelConfig, Recipe

QUANTIZER_NAME = "quantizer"
PTQ_MODULE = "backends.quant.export"
QAT_MODULE = "backends.train.sft"


def quantize_source(recipe: Recipe, runs_root: Path | None = None) -> Path:
    """The model to quantize: this recipe's SFT output for ``init_from = "sft"``, else the path
    given (already absolute: the recipe loader resolved it)."""
    if recipe.quantization is None:
        raise UsageError("the recipe has no [quantization] section")
    if recipe.quantization.init_from == "sft":
        return sft_output_dir(recipe, runs_root or RUNS_ROOT).resolve()
    return Path(recipe.quantization.init_from).resolve()


def stage_recipe(recipe: Recipe, source: Path, qat: bool) -> Recipe:
    """What the quantize stage's process reads: the source checkpoint (with its own tokenizer) as
    the model, and ``int4_qat`` on for QAT, off for PTQ."""
    model = ModelConfig(path=str(source), tokenizer="auto", dtype=recipe.model.dtype)
    quantization = recipe.quantization.model_copy(update={"int4_qat": qat, "init_from": str(source)})
    return recipe.model_copy(update={"model": model, "quantization": quantization})


def ptq_spec(run_dir: Path, source: str, machine: MachineFacts) -> ProcessSpec:
    argv = (machine.python, "-m", PTQ_MODULE, "--run-dir", str(run_dir), "--model", source)
    env = {
        "OMP_NUM_THREADS": str(max(1, machine.cores)),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    return ProcessSpec(
        name=QUANTIZER_NAME,
        role="quantizer",
        argv=argv,
        env=env,
        devices=tuple(f"cpu:{c}" for c in machine.cpu_cores),
        kind="job",
    )


def plan_quantize(recipe: Recipe, run_dir: Path, resume: bool, machine: MachineFacts) -> LaunchPlan:
    """``recipe``: the stage's (``stage_recipe``)."""
    quant = recipe.quantization
    if quant is None or recipe.model.path is None:
        raise UsageError("the quantize stage plans a stage recipe (skyrl_cli.plan.quantize.stage_recipe)")
    if not quant.int4_qat:
        if resume:
            raise UsageError("--resume continues an --int4-qat run; --ptq has nothing to resume")
        spec = ptq_spec(run_dir, recipe.model.path, machine)
        return LaunchPlan(stage="quantize", run_dir=str(run_dir), device="cpu", processes=(spec,))
    if recipe.sft is None:
        raise UsageError("--int4-qat fine-tunes for the recipe's sft.steps, but the recipe has no [sft] section")
    resources = trainer_resources(recipe, machine)
    trainer = trainer_spec(recipe, run_dir, machine, module=QAT_MODULE, resume=resume, resources=resources)
    return LaunchPlan(
        stage="quantize",
        run_dir=str(run_dir),
        device=resources.device,
        resume=resume,
        world_size=world_size(recipe),
        processes=(trainer,),
    )
