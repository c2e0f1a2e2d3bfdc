"""The weight transports of an RL run: how each policy version the learner makes reaches the vLLM
engines. What the driver plans with and the workers check, stated once per transport, without
importing a worker (``skyrl --help`` stays light).

``skyrl_cli.plan.weight_sync.select_weight_sync`` picks one name per run; the plan records it
(``LaunchPlan.weight_sync``) and hands it to both workers as ``--weight-sync NAME``. Each looks it
up once and acts on the spec's facts, never on the name; the two sides of a transport live in its
module, ``backends.inference.transports.<name>`` (``publisher``: the learner's; ``engine_loader``:
the orchestrator's).

A new transport is one module there and one entry in ``TRANSPORTS`` below (``TransportName`` and
the workers' ``--weight-sync`` choices are read off the table); ``select_weight_sync`` says when a
run takes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

# vLLM's worker extension on every engine this tool starts (pools and restarts included): what
# applies a delta version inside the engine (``backends.inference.delta_worker``).
WORKER_EXTENSION = "backends.inference.delta_worker.PolicyVersions"
# A ``weights/v<k>/`` holding this file is a delta against the version before (``backends.inference.deltas``).
DELTA_MANIFEST = "delta.json"

# Where it works everywhere: a worker started without --weight-sync, a pool recorded without one.
DEFAULT_TRANSPORT: TransportName = "disk"
TRANSPORTS_PACKAGE = "backends.inference.transports"

# The model the engines boot from (``skyrl_cli.plan.rl.engine_model_setup`` adds the setup job):
# "untied": ``engine-model/``, the initial policy with a tied head written out, because vLLM's
# in-place reload keeps a tied head at its first weights; "init_from": the initial policy itself,
# never reloaded; "int4_export": its W4A16 export in ``int4/``.
EngineModel = Literal["untied", "init_from", "int4_export"]


@dataclass(frozen=True)
class Transport:
    name: TransportName
    engine_model: EngineModel = "untied"
    engine_flags: tuple[str, ...] = ()  # added to every engine's vLLM flags: the receiving side's setup
    # False: the learner meets the engines at its start-up, so it must wait until they are ready
    # instead of overlapping its own start-up (torch, DeepSpeed, the model) with theirs.
    start_with_engines: bool = True
    # Rank 0 opens an NCCL group with every engine worker: the plan gives it a rendezvous port and
    # the engines' URLs.
    nccl_group: bool = False
    # Versions are adapters over a base the engines never reload: a pool must serve the run's own
    # base, and a run attaching to one only drops the previous run's adapters.
    adapters: bool = False
    # Engines sample from a quantized copy of the policy the trainer holds in full precision: the
    # gap between them is the quantization's, not a sync fault (``skyrl_contracts.health``).
    quantized_versions: bool = False
    pool_refusal: str | None = None  # why an engine pool (skyrl engines up) cannot serve it; None: it can

    @property
    def module(self) -> str:
        """The worker module holding both sides of this transport."""
        return f"{TRANSPORTS_PACKAGE}.{self.name}"


TRANSPORTS: dict[str, Transport] = {
    t.name: t
    for t in (
        Transport(
            "nccl",
            engine_flags=("--weight-transfer-config", json.dumps({"backend": "nccl"})),
            start_with_engines=False,
            nccl_group=True,
            pool_refusal=(
                "the NCCL weight sync opens its group with the trainer when the engines start; "
                'set inference.weight_sync = "disk" to use a pool'
            ),
        ),
        Transport("disk"),
        Transport("delta"),
        Transport("lora", engine_model="init_from", adapters=True),
        Transport(
            "int4",
            engine_model="int4_export",
            quantized_versions=True,
            pool_refusal=(
                "quantization.int4_rollouts: the engines serve the INT4 export from start-up; this run starts its own"
            ),
        ),
    )
}
TRANSPORT_NAMES: tuple[str, ...] = tuple(TRANSPORTS)
# The plan's and the workers' type, read off the table: a new entry is a new name everywhere.
TransportName = Literal[TRANSPORT_NAMES]
