"""What every engine this tool starts adds to vLLM's workers (``--worker-extension-cls``), for the
delta weight sync (``backends.inference.deltas``): the worker holds the tensors of the policy
version it serves and turns the next version's delta into that version's tensors itself.

The orchestrator calls it through vLLM's ``/collective_rpc`` (``load_policy_version``), on every
worker of the engine. It answers with what it did rather than raising, so that the orchestrator can
tell a delta it could not use (ask the learner for the version whole) from an engine failure:

- ``{"ok": true, "version": k, "how": "delta"}``: applied to the version held (with the deltas in
  between, where ``--async`` skipped versions);
- ``"how": "rebuilt"``: the worker held no version on the delta's chain (a restarted engine, a pool
  engine, the run's first delta), so it read the chain's whole version and every delta after it;
- ``"how": "full"``: a full version (a directory of safetensors);
- ``{"ok": false, "error": ...}``: no version ``k`` to be had from these files (a file missing or not
  checking out). The engine keeps serving the version it had.

A version is checked (CRC-32 per tensor) before vLLM loads any of it: never a wrong model. The
held tensors are one copy of the model in host memory per worker, in the engines' dtype.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("skyrl.delta")


class PolicyVersions:
    # (the run's weights directory, the version, its tensors): a pool engine's version numbers from
    # the run before mean other tensors, so a version is on a chain only within its own run
    _skyrl_held: tuple[str, int, dict] | None = None

    def load_policy_version(self, path: str, version: str) -> dict:
        # lazy: vLLM imports the extension class in every worker; torch is loaded there already
        from backends.inference.deltas import DeltaError, chain, is_delta, read_full, rebuild

        target = int(version)
        weights = str(Path(path).resolve().parent)
        held = self._skyrl_held
        try:
            if not is_delta(path):
                tensors, how = read_full(path), "full"
            else:
                on_chain = held is not None and held[0] == weights and held[1] in chain(path)
                rebuilt, tensors = rebuild(path, held[1:] if on_chain else None)
                how = "delta" if on_chain else "rebuilt"
                if rebuilt != target:
                    raise DeltaError(f"{path} holds v{rebuilt}, not v{target}")
        except DeltaError as err:
            log.warning("v%d: %s", target, err)
            return {"ok": False, "error": str(err)}
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        self._skyrl_held = (weights, target, tensors)
        return {"ok": True, "version": target, "how": how}

    def policy_checksums(self) -> dict:
        """CRC-32 of every parameter the worker serves with (the tests compare engines with it)."""
        from backends.inference.deltas import crc32  # lazy: as above

        return {name: crc32(param.detach().cpu()) for name, param in self.model_runner.model.named_parameters()}
