"""The models a run serves beside the policy (``AuxiliaryEngines`` sections of the recipe): each has
engines of its own, started, health-checked and torn down with the policy's, never weight-synced.

One list, in placement order, for everything that lays them out or talks to them: the launch plan
(their engines after the policy's: the next CPU cores, the next GPUs), the feasibility checks, the
orchestrator's ``--auxiliary-urls``, ``skyrl doctor``. A further kind of auxiliary model is one more
entry in ``auxiliary_models``.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_contracts.schema import AuxiliaryEngines, Recipe


@dataclass(frozen=True)
class AuxiliaryModel:
    name: str  # the engines' --served-model-name and process names (<name>-<i>); the orchestrator's key
    key: tuple[str, ...]  # the recipe section, e.g. ("rl", "distillation")
    model_field: str  # the section's key holding the model directory
    model: str  # as the recipe states it (relative to the recipe, or run:<run>/<stage>)
    engines: AuxiliaryEngines

    @property
    def model_key(self) -> tuple[str, ...]:
        return (*self.key, self.model_field)

    @property
    def gpus(self) -> int:
        return self.engines.engines * self.engines.tensor_parallel

    def dotted(self, field: str | None = None) -> str:
        return ".".join((*self.key, field or self.model_field))


TEACHER = "teacher"
JUDGE = "judge"


def auxiliary_models(recipe: Recipe) -> tuple[AuxiliaryModel, ...]:
    """The recipe's auxiliary models, in placement order (teacher, then judge)."""
    rl = recipe.rl
    if rl is None:
        return ()
    found = []
    if rl.distillation is not None:
        found.append(
            AuxiliaryModel(TEACHER, ("rl", "distillation"), "teacher", rl.distillation.teacher, rl.distillation)
        )
    if rl.judge is not None:
        found.append(AuxiliaryModel(JUDGE, ("rl", "judge"), "model", rl.judge.model, rl.judge))
    return tuple(found)


def auxiliary_engine(model: str, index: int) -> str:
    """An auxiliary model's engine process: ``teacher-0``, ``teacher-1``, ``judge-0``."""
    return f"{model}-{index}"


def model_of(engine: str) -> str:
    """The auxiliary model an engine process (``auxiliary_engine``) serves: ``teacher-1`` -> ``teacher``."""
    return engine.rsplit("-", 1)[0]
