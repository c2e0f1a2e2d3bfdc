"""The run directory: the one home of its layout, its readers and the files written before a start.

Layout (the machine-readable contract of a run, documented in README.md)::

    recipe.resolved.json          the validated recipe (aliases as TOML keys, absolute paths)
    plan.json                     the LaunchPlan
    logs/<process>.log            stdout+stderr of each process
    events.jsonl                  MetricEvents (skyrl_contracts.events)
    summary.json                  final figures (skyrl_cli.metrics.summary)
    sample_errors.jsonl           RL: one record per sample whose reward or environment failed (reward 0)
    judge_verdicts.jsonl          RL with rl.judge: every judge verdict (the prompt it read, its reply, the reward)
    checkpoints/step-<n>/         complete once trainer_state.json is in it (backends.train.checkpoint)
    final/                        the stage's model, built at .tmp-final and published whole
    int4/                         INT4 W4A16 export (compressed-tensors; skyrl quantize, int4_qat; RL with
                                  int4_rollouts: the initial policy, then the last version served), via .tmp-int4
    engine-model/                 RL: what the engines start from, rebuilt at each launch: links to the
                                  initial policy's files; a tied model untied (backends.models.tied)
    eval_initial.json             held-out accuracy of the RL stage's initial policy
    batches/step-<k>.json         RL: the k-th training batch (orchestrator -> learner)
    weights/v<k>/, weights/LATEST RL: policy versions (learner -> engines) and the newest one's number
    weights/current.json          RL: the version the engines serve (engine recovery reloads it)
    control/stop                  RL: either side asks the other to stop
    weights/v<k>/transfer.json    RL, NCCL weight sync: v<k> comes over NCCL, not as files in v<k>/
    control/transfer-v<k>.ready   RL, NCCL: the engines are paused for v<k> (orchestrator -> learner)
    control/transfer-v<k>.done    RL, NCCL: v<k> is in the engines, or why not (learner -> orchestrator)
    orchestrator_state/step-<k>.json   RL: the rollout buffer's state at each checkpoint
    report/report.png, report.html     skyrl runs report (default place; written on request)
    nodes/node-<k>.json           across nodes ([cluster]): node k's marker and heartbeat (launch id,
                                  recipe hash, phase, its engines' URLs), rewritten every second
    logs/node-<k>/<process>.log   across nodes: the processes of node k > 0 (node 0's are in logs/)
    slurm/<stage>.sbatch          the script skyrl sft|rl --slurm wrote and submitted

Every process of a run (the CLI driver and the launched backends) reaches these paths only through
``RunDir``: a new file of the contract is added here, once. Every JSON file is written atomically
(``skyrl_contracts.atomic``: temporary file, fsync, rename), so a reader never sees half of one;
directories (checkpoints, final/, weight versions) are published whole the same way.

Light (pydantic and the standard library), so the CLI and every backend can import it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from skyrl_contracts.atomic import write_json
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe

RUNS_ROOT = Path("runs")
# A checkpoint directory is complete once its trainer state is in it: the trainer writes it last
# and renames the directory into place (backends.train.checkpoint).
CHECKPOINT_STATE_FILE = "trainer_state.json"
CHECKPOINT_MODEL = "model"  # the HF model inside a checkpoint (what final/ is copied from)
_STEP_DIR = re.compile(r"^step-(\d+)$")
_VERSION_DIR = re.compile(r"^v(\d+)$")


@dataclass(frozen=True)
class RunDir:
    """Paths and readers of one run directory; ``RunDir(path)`` is cheap and touches nothing."""

    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root))

    # ------------------------------------------------------------------ written before the start
    @property
    def resolved_recipe(self) -> Path:
        return self.root / "recipe.resolved.json"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    def node_logs(self, node: int) -> Path:
        """Where node ``node``'s processes log: ``logs/`` on node 0, ``logs/node-<k>/`` on the others."""
        return self.logs if node == 0 else self.logs / f"node-{node}"

    # ------------------------------------------------------------------ across nodes
    @property
    def nodes(self) -> Path:
        return self.root / "nodes"

    def node_marker(self, node: int) -> Path:
        return self.nodes / f"node-{node}.json"

    def slurm_script(self, stage: str) -> Path:
        return self.root / "slurm" / f"{stage}.sbatch"

    # ------------------------------------------------------------------ figures
    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def sample_errors(self) -> Path:
        """RL: JSON lines ``{"time", "version", "sample", "turns", "error"}``, one per failed sample."""
        return self.root / "sample_errors.jsonl"

    @property
    def judge_verdicts(self) -> Path:
        return self.root / "judge_verdicts.jsonl"

    @property
    def eval_initial(self) -> Path:
        return self.root / "eval_initial.json"

    @property
    def report(self) -> Path:
        """Where ``skyrl runs report`` writes report.png and report.html unless told otherwise."""
        return self.root / "report"

    # ------------------------------------------------------------------ models
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step}"

    @property
    def final(self) -> Path:
        return self.root / "final"

    @property
    def final_tmp(self) -> Path:
        """Where ``final/`` is built before it is published whole (``skyrl_contracts.atomic.publish_dir``)."""
        return self.root / ".tmp-final"

    @property
    def int4(self) -> Path:
        """The INT4 W4A16 export that vLLM serves (``backends.quant.export``)."""
        return self.root / "int4"

    @property
    def int4_tmp(self) -> Path:
        return self.root / ".tmp-int4"

    @property
    def engine_model(self) -> Path:
        """RL: the initial policy as the engines serve it (``backends.models.tied.write_untied_copy``)."""
        return self.root / "engine-model"

    # ------------------------------------------------------------------ the RL exchange
    @property
    def batches(self) -> Path:
        return self.root / "batches"

    def batch(self, step: int) -> Path:
        return self.batches / f"step-{step}.json"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    def weights_version(self, version: int) -> Path:
        return self.weights / f"v{version}"

    def weight_versions(self) -> list[tuple[int, Path]]:
        """``(version, path)`` of every published ``weights/v<k>/``, oldest first."""
        if not self.weights.is_dir():
            return []
        found = ((_VERSION_DIR.match(p.name), p) for p in self.weights.iterdir())
        return sorted((int(m.group(1)), p) for m, p in found if m and p.is_dir())

    @property
    def latest_weights(self) -> Path:
        return self.weights / "LATEST"

    @property
    def current_weights(self) -> Path:
        return self.weights / "current.json"

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def stop_request(self) -> Path:
        return self.control / "stop"

    def full_weights_request(self) -> Path:
        return self.control / "full-weights.request"

    def full_weights(self, version: int) -> Path:
        """A full copy of a delta-synced version, written on request (``weights/full-v<k>/``)."""
        return self.weights / f"full-v{version}"

    def transfer_marker(self, version: int) -> Path:
        return self.weights_version(version) / "transfer.json"

    def transfer_ready(self, version: int) -> Path:
        return self.control / f"transfer-v{version}.ready"

    def transfer_done(self, version: int) -> Path:
        return self.control / f"transfer-v{version}.done"

    @property
    def orchestrator_state(self) -> Path:
        return self.root / "orchestrator_state"

    def orchestrator_state_at(self, step: int) -> Path:
        return self.orchestrator_state / f"step-{step}.json"

    def prune_orchestrator_states(self, keep: int) -> list[Path]:
        """Remove all but the newest ``keep`` buffer states (one is written per checkpoint; a
        400-step run kept all 20 while the learner kept its ``keep_last`` checkpoints). Returns
        what was removed."""

        def step_of(path: Path) -> int:
            try:
                return int(path.stem.split("-", 1)[1])
            except (IndexError, ValueError):
                return -1

        states = sorted((p for p in self.orchestrator_state.glob("step-*.json") if step_of(p) >= 0), key=step_of)
        gone = states[:-keep] if keep > 0 else states
        for path in gone:
            path.unlink(missing_ok=True)
        return gone

    # ------------------------------------------------------------------ readers
    def read_recipe(self) -> Recipe:
        return Recipe.model_validate_json(self.resolved_recipe.read_text())

    def latest_weights_version(self) -> int | None:
        """The number in ``weights/LATEST``, or ``None`` before the first publish."""
        try:
            return int(self.latest_weights.read_text().strip())
        except (OSError, ValueError):
            return None

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every complete ``checkpoints/step-<n>/``, oldest first (numeric order)."""
        found = []
        if self.checkpoints.is_dir():
            for child in self.checkpoints.iterdir():
                match = _STEP_DIR.match(child.name)
                if match and (child / CHECKPOINT_STATE_FILE).is_file():
                    found.append((int(match.group(1)), child))
        return sorted(found)

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint, or ``None``."""
        found = self.complete_checkpoints()
        return found[-1][1] if found else None

    def latest_rl_checkpoint(self) -> Path | None:
        """The newest complete checkpoint an RL run resumes from: one whose orchestrator state (the
        prompt order at that version) was written too. The orchestrator writes it after the learner
        published the version, so a run killed in between has a newer checkpoint without one:
        resuming from that would draw prompts from the start again."""
        found = [p for step, p in self.complete_checkpoints() if self.orchestrator_state_at(step).is_file()]
        return found[-1] if found else None

    def initial_accuracy(self) -> float | None:
        try:
            return float(json.loads(self.eval_initial.read_text())["accuracy"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write_initial_accuracy(self, version: int, accuracy: float) -> None:
        write_json(self.eval_initial, {"version": version, "accuracy": accuracy}, indent=None)

    # ------------------------------------------------------------------ before a start
    def _previous_run(self) -> list[Path]:
        """What a previous run left behind (deleted by --overwrite), the RL exchange included."""
        marks = (
            self.events,
            self.checkpoints,
            self.final,
            self.summary,
            self.batches,
            self.weights,
            self.control,
            self.orchestrator_state,
            self.eval_initial,
            self.int4,
        )
        return [p for p in marks if p.exists()]

    def prepare(
        self,
        recipe: Recipe,
        plan: BaseModel | dict[str, Any] | None = None,
        *,
        resume: bool = False,
        overwrite: bool = False,
    ) -> "RunDir":
        """Create the directory (and ``logs/``) and write ``recipe.resolved.json`` and ``plan.json``.

        A directory that already holds a run is refused unless ``resume`` (continue it) or
        ``overwrite`` (start again: the old events, summary, checkpoints and final model are deleted)."""
        used = self._previous_run()
        if used and not (resume or overwrite):
            raise UsageError(
                f"run directory {self.root} already holds a run; pass --resume to continue it, "
                "--overwrite to start again, or --run-dir to use another directory"
            )
        try:
            if used and overwrite and not resume:
                for target in used:
                    shutil.rmtree(target) if target.is_dir() else target.unlink()
            self.logs.mkdir(parents=True, exist_ok=True)
            write_json(self.resolved_recipe, recipe_json(recipe))
            if plan is not None:
                write_json(self.plan, plan.model_dump(mode="json") if isinstance(plan, BaseModel) else plan)
        except OSError as err:  # read-only, full, or a path through a file: before anything starts
            where = err.filename or self.root
            raise UsageError(f"run directory {self.root} is not writable: {where}: {err.strerror or err}") from None
        return self


def default_run_dir(recipe: Recipe, stage: str, root: Path = RUNS_ROOT) -> Path:
    return root / recipe.name / stage


def resolve_run_dir(recipe: Recipe, stage: str, run_dir: str | os.PathLike | None, root: Path = RUNS_ROOT) -> Path:
    """``--run-dir`` if given, else ``runs/<name>/<stage>``."""
    return Path(run_dir) if run_dir is not None else default_run_dir(recipe, stage, root)


def sft_output_dir(recipe: Recipe, root: Path = RUNS_ROOT) -> Path:
    """Where ``rl.init_from = "sft"`` points: the final model of this recipe's SFT stage."""
    return RunDir(default_run_dir(recipe, "sft", root)).final


def recipe_hash(recipe: Recipe) -> str:
    """What every node of a run must agree on: the SHA-256 of the resolved recipe (canonical JSON)
    without ``trainer.node_rank``, the one key that legitimately differs between the nodes of a
    ``trainer.nnodes`` run (first 16 hex digits)."""
    data = recipe_json(recipe)
    data["trainer"] = {k: v for k, v in data["trainer"].items() if k != "node_rank"}
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def recipe_json(recipe: Recipe) -> dict[str, Any]:
    """The form of ``recipe.resolved.json``: ``Recipe.model_validate_json`` reads it back."""
    return recipe.model_dump(mode="json", by_alias=True)
