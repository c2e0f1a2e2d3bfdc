"""The launch plan: what `skyrl <stage>` will start, fully resolved, before anything starts.

A plan is pure data (written to ``plan.json`` and printed by ``--dry-run``). Building it
(``skyrl_cli.plan.build``) is a pure function of the recipe, the stage, the CLI flags and the
machine's facts (cores, GPUs, free ports), which are passed in so the planner is testable.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from skyrl_contracts.transports import TransportName


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ReadinessCheck(Frozen):
    """How the supervisor knows a process is ready: an HTTP GET that answers 200, or nothing."""

    url: str | None = None
    timeout_s: float = 300.0


class ProcessSpec(Frozen):
    name: str = Field(description="Unique name; the log is logs/<name>.log.")
    # "auxiliary": an engine of a model served beside the policy (rl.distillation's teacher, rl.judge):
    # never weight-synced, no router in front (skyrl_contracts.auxiliary)
    role: Literal["engine", "auxiliary", "router", "trainer", "orchestrator", "server", "quantizer", "setup"]
    argv: tuple[str, ...]
    env: dict[str, str] = Field(default_factory=dict, description="Added to the driver's environment.")
    devices: tuple[str, ...] = Field((), description="Devices this process owns (cpu:N cores or cuda:N).")
    ports: tuple[int, ...] = ()
    ready: ReadinessCheck = Field(default_factory=ReadinessCheck)
    # Engines and the router are services (run until torn down); a trainer is a job (its exit ends the
    # stage); a setup job runs to its end before any service starts (e.g. the INT4 export engines serve).
    kind: Literal["setup", "service", "job"] = "service"
    # A job that does not talk to the engines until the orchestrator hands it work (the RL learner
    # on the disk or LoRA path) starts beside the engines instead of after them: its start-up
    # (torchrun, ranks importing torch and DeepSpeed, the model) then overlaps theirs.
    start_with_engines: bool = False


class StartOrder(Frozen):
    """The order a plan's processes start in, stated once (``LaunchPlan.start_order``)."""

    setup: tuple[ProcessSpec, ...]  # run to their end first, one after another
    engines: tuple[ProcessSpec, ...]  # started together, waited ready
    auxiliaries: tuple[ProcessSpec, ...] = ()  # auxiliary models' engines: started and waited ready with the engines
    beside_engines: tuple[ProcessSpec, ...]  # jobs started with the engines (their failure ends the wait)
    router: tuple[ProcessSpec, ...]  # once the engines are ready and labelled
    after_router: tuple[ProcessSpec, ...]  # everything else: the remaining jobs, other services (a server)


class LaunchPlan(Frozen):
    stage: Literal[
        "sft", "rl", "tinker", "quantize", "pool"
    ]  # a stage is listed here once it has a planner (plan.build.STAGE_PLANNERS); "pool": skyrl engines up
    run_dir: str
    device: Literal["cpu", "cuda"]
    resume: bool = False
    async_mode: bool = False
    world_size: int = 1
    engine_urls: tuple[str, ...] = ()
    router_url: str | None = None
    # RL with auxiliary models (a teacher, a judge): each one's engines, by its name.
    auxiliary_urls: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    processes: tuple[ProcessSpec, ...] = ()
    # RL: how policy versions reach the engines (skyrl_cli.plan.weight_sync); None for other stages.
    weight_sync: TransportName | None = None
    # RL on an engine pool's engines and router (skyrl engines up): its name; they are not in processes.
    pool: str | None = None
    # Across nodes ([cluster], skyrl_cli.plan.nodes): this plan is node ``node``'s of ``nodes``, with
    # its roles ("coordinator": node 0, the run directory, router and orchestrator; "trainer"; "inference").
    node: int = 0
    nodes: int = 1
    roles: tuple[str, ...] = ()

    def start_order(self) -> StartOrder:
        """Setup jobs to their end; the engines, with the jobs marked ``start_with_engines`` beside
        them; the router; then everything else. The launchers follow this and decide nothing."""
        setup = tuple(p for p in self.processes if p.kind == "setup")
        engines = tuple(p for p in self.processes if p.role == "engine")
        auxiliaries = tuple(p for p in self.processes if p.role == "auxiliary")
        beside = tuple(p for p in self.processes if p.kind == "job" and p.start_with_engines)
        router = tuple(p for p in self.processes if p.role == "router")
        placed = {p.name for p in (*setup, *engines, *auxiliaries, *beside, *router)}
        rest = tuple(p for p in self.processes if p.name not in placed)
        return StartOrder(
            setup=setup,
            engines=engines,
            auxiliaries=auxiliaries,
            beside_engines=beside,
            router=router,
            after_router=rest,
        )


class PoolAttachment(Frozen):
    """The running engine pool an RL plan uses instead of starting engines (``skyrl_cli.engines.pool``)."""

    name: str
    engine_urls: tuple[str, ...]
    router_url: str
    # The pool's auxiliary models' engines (a teacher, a judge), by model name: the run's orchestrator
    # talks to them; the run starts none of its own.
    auxiliary_urls: dict[str, tuple[str, ...]] = Field(default_factory=dict)
