"""What the SFT trainer and the RL learner processes share: the resolved recipe, rank-0 output
(events and printed lines) and exporting the trained model as an HF directory. Both take the
module dtype from ``backends.models.loading.torch_dtype``."""

from __future__ import annotations

import logging
from pathlib import Path

from backends.models.loading import save_hf
from backends.models.lora import ADAPTER_DIR, is_peft, merged_copy, save_adapter
from backends.models.tied import engine_state, save_engine_state, save_for_engines
from backends.quant.export import export_version
from skyrl_contracts.events import EventWriter
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.schema import Recipe

PROCESS_NAME = "trainer"


def load_recipe(run_dir: Path) -> Recipe:
    return RunDir(run_dir).read_recipe()


def open_events(run_dir: Path, dist) -> EventWriter | None:
    """The run's event log on rank 0; None on the other ranks."""
    return EventWriter(RunDir(run_dir).events, PROCESS_NAME) if dist.is_main else None


def say(dist, msg: str) -> None:
    """Log on rank 0 only (one line each in ``logs/trainer.log``, which the tests read too)."""
    if dist.is_main:
        logging.getLogger("skyrl.trainer").info("%s", msg)


class HFExporter:
    """Writes the trained model (+ tokenizer) as an HF directory; collective under ZeRO-3.

    A LoRA model is written as its adapter in ``adapter/`` plus, with ``merge`` (always in SFT; in
    RL with ``model.lora.merge_final``), the merged model as the HF directory itself, so a merged
    export loads like any other model. Without ``merge`` the directory holds the tokenizer and
    ``adapter/`` only (the adapter's config names its base model)."""

    def __init__(self, engine, tokenizer, dist, zero_stage: int, merge: bool = True, engine_dtype: str | None = None):
        self.engine, self.tokenizer, self.dist, self.zero_stage = engine, tokenizer, dist, zero_stage
        self.merge = merge
        self.engine_dtype = engine_dtype  # versions for the engines are written in it (RL)

    def _gathered(self):
        """ZeRO-3's full state dict (a collective every rank joins), None below ZeRO-3."""
        return self.engine._zero3_consolidated_16bit_state_dict() if self.zero_stage == 3 else None

    def __call__(self, out_dir: Path) -> None:
        state_dict = self._gathered()
        if not self.dist.is_main:
            return
        module = self.engine.module
        if not is_peft(module):
            save_hf(module, self.tokenizer, out_dir, state_dict=state_dict)
            return
        if self.merge:
            save_hf(merged_copy(module), self.tokenizer, out_dir)
        else:
            self.tokenizer.save_pretrained(out_dir)
        save_adapter(module, out_dir / ADAPTER_DIR)

    def for_engines(self, out_dir: Path) -> None:
        """One policy version for the engines to reload: the HF model with a tied head written out
        (``backends.models.tied``: the engines serve tied models untied), in the engines' dtype.
        Collective under ZeRO-3."""
        state_dict = self._gathered()
        if self.dist.is_main:
            save_for_engines(
                self.engine.module, self.tokenizer, out_dir, state_dict=state_dict, dtype=self.engine_dtype
            )

    def engine_tensors(self) -> dict | None:
        """One policy version for the engines held in memory (``backends.models.tied.engine_state``)
        on rank 0, None on the other ranks. Collective under ZeRO-3."""
        state_dict = self._gathered()
        if not self.dist.is_main:
            return None
        return engine_state(self.engine.module, state_dict, self.engine_dtype)

    def write_engine_tensors(self, out_dir: Path, tensors: dict) -> None:
        """``engine_tensors``' version as a full HF directory the engines reload (rank 0)."""
        save_engine_state(self.engine.module, self.tokenizer, out_dir, tensors)

    def int4_for_engines(self, out_dir: Path | None, cfg) -> None:
        """One policy version for INT4 rollouts: the W4A16 export of the model, rounded in memory
        on rank 0 (``backends.quant.export.export_version``). Collective under ZeRO-3: the other
        ranks join the gather (``out_dir`` None there)."""
        state_dict = self._gathered()
        if self.dist.is_main:
            export_version(self.engine.module, self.tokenizer, out_dir, cfg, state_dict=state_dict)

    def adapter(self, out_dir: Path) -> None:
        """The PEFT adapter alone (adapter_config.json + adapter_model.safetensors), rank 0."""
        if self.dist.is_main:
            save_adapter(self.engine.module, out_dir)
