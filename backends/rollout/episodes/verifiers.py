"""verifiers episodes: an environment written for the ``verifiers`` library (0.4, ``verifiers.v1``),
rolled out by verifiers itself against the run's OpenAI-compatible endpoint and scored by its own
reward functions; the endpoint records the calls, which become samples exactly as an agent's do
(``backends.rollout.agents.samples_from_calls``).

``rl.environment = "verifiers:<taskset id>"`` names what verifiers' own loader resolves
(``vf.load_environment``): a built-in taskset (``verifiers.v1.tasksets.<id>``) or an importable
module (a file next to the recipe, an installed package; hub ids ``owner/name@version`` import as
``name``) exporting one ``vf.Taskset`` subclass in ``__all__``, and optionally its own ``vf.Env``.
``rl.env_args`` is verifiers' ``[env]`` table (``EnvConfig``): ``taskset`` knobs, the roles
(``agent.harness``, ``agent.sampling``, ...), ``id`` for a reusable env such as ``best-of-n``.

One trajectory is one verifiers episode (``Env.run_episode``) of the task made from one dataset
row (``Task(TaskData(**row), taskset.config.task)``). Its reward is the mean over the episode's
trainable traces of each trace's weighted reward sum (``Trace.reward``); a failed episode is an
error record with reward 0. verifiers 0.4 has no group-level reward: the rollouts of one task are
independent episodes (``Env.slots``), and cross-attempt judgement lives inside one episode
(``Env.finalize``, as ``best-of-n`` does), which runs here unchanged.

verifiers' interception server relays each harness call to ``ModelContext.client``; every
trajectory's calls go to one base URL here, and the endpoint finds the trajectory from the
``X-Session-ID`` header (the trace id) that verifiers sends on every call. Calls of a trace whose
agent the env marks untrainable (a judge seat on the policy) are answered and not trained on.

What cannot run beside a trainer is refused when the runner is built, naming ``rl.environment``, and
before that by the driver's preflight (``VerifiersEpisodes.preflight``, ``skyrl_cli.plan.preflight``):
a harness in a sandbox or container runtime (prime, docker, modal, ...), a harness that runs the
model's commands with no runtime chosen, a task that needs a container, tool servers behind a
tunnel, a seat on another model or endpoint, judges (they call an external model), and seat
retries. verifiers' episode-level retries (``rl.env_args.retries``) do not run: a failed episode is
an error record with reward 0, as a failed agent run is.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from fastapi import Request  # at module level: FastAPI resolves the handler's annotations in these globals
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from backends.rollout.agents import AgentServer, samples_from_calls
from backends.rollout.environments import Episode
from skyrl_contracts.episodes import turn_limit
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe, environment_library

from .agent import AgentEpisodes
from .tools import tool_use

INSTALL = 'pip install "verifiers>=0.4,<0.5"'
SESSION_HEADER = "x-session-id"  # verifiers.v1.clients.client.SESSION_ID_HEADER, as HTTP reads it
ROUTE = "/vf/v1"  # every trajectory's base URL: the trajectory comes from the session header
# The only runtime this trainer offers a harness: processes on this host.
LOCAL_RUNTIME = "subprocess"
API_KEY_VAR = "SKYRL_VERIFIERS_API_KEY"  # unset: verifiers sends "EMPTY", which the endpoint accepts


def import_verifiers():
    try:
        import verifiers.v1 as vf  # lazy: an optional extra; the error below names how to install it
    except ImportError as exc:
        raise UsageError(f"rl.environment = verifiers:... needs the verifiers package ({INSTALL}): {exc}") from exc
    return vf


# ------------------------------------------------------------------------------ the environment


def env_table(recipe: Recipe) -> dict[str, Any]:
    """verifiers' ``[env]`` table for this recipe: ``rl.env_args`` with the taskset id of
    ``rl.environment``."""
    rl = recipe.rl
    _, name = environment_library(rl.environment)
    table = copy.deepcopy(dict(rl.env_args))
    taskset = dict(table.get("taskset") or {})
    stated = taskset.get("id")
    if name and stated and stated != name:
        raise UsageError(
            f"rl.environment {rl.environment!r} and rl.env_args.taskset.id {stated!r} name two tasksets; keep one"
        )
    if not (name or stated):
        raise UsageError(
            f"rl.environment {rl.environment!r} names no taskset: write 'verifiers:<taskset id>' "
            "(a module next to the recipe or an installed package exporting a vf.Taskset)"
        )
    table["taskset"] = {**taskset, "id": name or stated}
    return table


def resolved_config(table: Mapping[str, Any], ref: str):
    """verifiers' ``EnvConfig`` for the table, every failure a one-line ``UsageError``."""
    vf = import_verifiers()

    try:
        return vf.resolve_env_config(copy.deepcopy(dict(table)))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(env)'}: {e['msg']}" for e in exc.errors())
        raise UsageError(f"rl.env_args (rl.environment {ref!r}): {problems}") from None
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise UsageError(f"rl.environment {ref!r}: {type(exc).__name__}: {exc}") from None


def local_harness(harness) -> bool:
    """A harness that needs no sandbox: it runs no model-written code and no third-party program."""
    return not harness.EXECUTES_CODE and not harness.NEEDS_CONTAINER


def role_defaults(config, table: Mapping[str, Any], max_turns: int | None) -> dict[str, dict[str, Any]]:
    """What this trainer fills into each seat the recipe leaves unset: the subprocess runtime for
    a harness that needs no sandbox (verifiers' own default is a remote Prime sandbox), and
    ``rl.max_turns`` as the seat's turn limit, which verifiers ends gracefully and still scores
    (the endpoint's cap would fail the episode instead)."""
    # lazy: verifiers is an optional extra; import_verifiers (at load_env) names how to install it
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import harness_class

    harnesses = config.agent_harnesses()
    updates: dict[str, dict[str, Any]] = {}
    for role, spec in agent_config_fields(config).items():
        stated = table.get(role) or {}
        update: dict[str, Any] = {}
        if "runtime" not in stated and spec.runtime.type == "prime":
            if local_harness(harness_class(harnesses[role].id)):
                update["runtime"] = {"type": LOCAL_RUNTIME}
        if max_turns is not None and spec.max_turns is None and "max_turns" not in stated:
            update["max_turns"] = max_turns
        if update:
            updates[role] = update
    return updates


def with_role_defaults(table: Mapping[str, Any], updates: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    out = copy.deepcopy(dict(table))
    for role, update in updates.items():
        out[role] = {**(out.get(role) or {}), **update}
    return out


def refusals(config, env) -> list[str]:
    """Why this environment cannot run beside the trainer (empty: it can)."""
    # lazy: verifiers is an optional extra; import_verifiers (at load_env) names how to install it
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.interception import requires_tunnel
    from verifiers.v1.utils.loaders import harness_class

    reasons = []
    harnesses = config.agent_harnesses()
    for role, spec in agent_config_fields(config).items():
        harness = harness_class(harnesses[role].id)
        reasons += seat_refusals(role, spec, harnesses[role].id, harness)
    task_cls = type(env.taskset).task_type()
    if task_cls.NEEDS_CONTAINER:
        reasons.append(f"its tasks ({task_cls.__name__}) need a container")
    servers = [*env.taskset.toolsets(env.taskset.config), *task_cls.toolsets(env.taskset.config.task)]
    if requires_tunnel(True, [server.config for server in servers]):
        reasons.append("its tool servers run in a remote runtime (a tunnel back to this host)")
    if env.taskset.config.task.judges:
        reasons.append("its judges call an external model (taskset.task.judges)")
    return reasons


def seat_refusals(role: str, spec, harness_id: str, harness) -> list[str]:
    reasons = []
    runtime = spec.runtime.type
    if runtime != LOCAL_RUNTIME:
        hint = (
            f'; for a chat-only seat set rl.env_args.{role}.harness = {{ id = "null" }}, or to run its '
            f'commands on this host, rl.env_args.{role}.runtime = {{ type = "subprocess" }}'
            if not local_harness(harness) and not harness.NEEDS_CONTAINER
            else ""
        )
        reasons.append(f"seat {role!r} runs harness {harness_id!r} in a {runtime} runtime (a sandbox){hint}")
    elif harness.NEEDS_CONTAINER:
        reasons.append(f"seat {role!r}: harness {harness_id!r} needs a container runtime")
    if spec.client is not None:
        reasons.append(f"seat {role!r} calls its own endpoint ({spec.client.base_url})")
    if spec.model is not None:
        reasons.append(f"seat {role!r} plays model {spec.model!r}, not the policy")
    if retries(spec.retries):
        # an abandoned attempt's calls are recorded already, and would train on the retry's reward
        reasons.append(f"seat {role!r} retries failed runs, whose calls would train on the retry's reward")
    return reasons


def retries(config) -> bool:
    return config.max_retries > 0 or any(rule.max_retries > 0 for rule in config.rules)


def load_env(recipe: Recipe):
    """(the verifiers ``Env``, its ``EnvConfig``), with this trainer's seat defaults; a
    ``UsageError`` naming ``rl.environment`` for what cannot run here."""
    ref = recipe.rl.environment
    table = env_table(recipe)
    config = resolved_config(table, ref)
    config = resolved_config(with_role_defaults(table, role_defaults(config, table, turn_limit(recipe))), ref)
    vf = import_verifiers()
    try:
        env = vf.load_environment(config)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise UsageError(f"rl.environment {ref!r}: {type(exc).__name__}: {exc}") from None
    reasons = refusals(config, env)
    if reasons:
        raise UsageError(f"rl.environment {ref!r} cannot run beside the trainer: {'; '.join(reasons)}")
    return env, config


def ensure_uv() -> None:
    """verifiers runs a harness's program as a uv script, and installs uv with pip --user (or
    curl) when none is on PATH: point it at the one installed beside this interpreter instead."""
    if shutil.which("uv"):
        return
    here = Path(sys.executable).parent
    if (here / "uv").exists():
        os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"
        return
    raise UsageError("rl.environment = verifiers:... runs its harness's program with uv; install it (pip install uv)")


# ------------------------------------------------------------------------------ rows and tasks


def task_maker(env):
    """``row -> Task`` for the env's taskset: the row is the task's data (``TaskData`` fields and the
    taskset's own), the taskset's task config and system-prompt override applied."""
    taskset = env.taskset
    task_cls = type(taskset).task_type()
    data_cls = task_cls.data_type()

    def make(row: Mapping[str, Any]):
        data = data_cls.model_validate(dict(row))
        if taskset.system_prompt is not None:
            data = data.model_copy(update={"system_prompt": taskset.system_prompt})
        return task_cls(data, taskset.config.task)

    return make


def taskset_rows(recipe: Recipe, limit: int | None = None) -> list[dict[str, Any]]:
    """The environment's own tasks as dataset rows (for a recipe without ``data.train``): each
    task's data as JSON, which ``task_maker`` turns back into the task."""
    env, _ = load_env(recipe)
    taskset = env.taskset if limit is None else env.taskset.take(limit)
    if not taskset.bounded:
        raise UsageError(f"rl.environment {recipe.rl.environment!r}: its taskset is infinite; set data.train")
    return [task.data.model_dump(mode="json", exclude_none=True) for task in taskset]


# ------------------------------------------------------------------------------ the endpoint


class VerifiersEndpoint(AgentServer):
    """The agent endpoint, plus ``/vf/v1/chat/completions``: verifiers' calls, routed by their
    session header to the trajectory that runs the trace, streamed where asked."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.routes: dict[str, str] = {}  # verifiers trace id -> our session id

    def app(self):
        app = super().app()

        @app.post(f"{ROUTE}/chat/completions")
        async def verifiers_chat(request: Request):
            session_id = self.routes.get(request.headers.get(SESSION_HEADER, ""))
            if session_id is None:
                message = "no trajectory runs this trace (the X-Session-ID header names none)"
                return JSONResponse({"error": {"message": message, "type": "not_found"}}, status_code=404)
            try:
                body = await request.json()
            except ValueError:
                body = None
            streaming = isinstance(body, dict) and bool(body.pop("stream", False))
            if streaming:
                body.pop("stream_options", None)
            # in process, through the trajectory's own route: its checks, its caps, its records
            reply = await self.http_client.post(f"http://in-process/t/{session_id}/v1/chat/completions", json=body)
            if not streaming or reply.status_code != 200:
                return Response(reply.content, status_code=reply.status_code, media_type="application/json")
            return Response(b"".join(sse_events(reply.json())), media_type="text/event-stream")

        return app


def sse_events(completion: Mapping[str, Any]) -> list[bytes]:
    """A whole chat completion as the stream verifiers' chat dialect parses (its own framing)."""
    from verifiers.v1.dialects.chat import ChatDialect  # lazy: verifiers is an optional extra

    return ChatDialect().stream_events(dict(completion))


# ------------------------------------------------------------------------------ episodes


def model_context(port: int):
    """The policy on the endpoint, as every seat without a model of its own plays it. No sampling
    knobs: the run's (rl.temperature, rl.max_new_tokens) apply unless the env's seats set theirs.
    A key variable of our own, so verifiers reads no Prime credentials for a local endpoint."""
    vf = import_verifiers()
    client = vf.EvalClientConfig(base_url=f"http://127.0.0.1:{port}{ROUTE}", api_key_var=API_KEY_VAR)
    return vf.ModelContext(model="policy", client=client)


@dataclass
class Outcome:
    reward: float = 0.0
    error: str | None = None
    info: dict[str, float] = field(default_factory=dict)  # the traces' named rewards and metrics


def one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def episode_error(episode) -> str | None:
    """The failure that ends a verifiers episode, one line; None where it completed."""
    if episode.ok:
        return None
    errors = [*episode.errors, *(e for trace in episode.traces for e in trace.errors)]
    if not errors:
        return "verifiers: the episode did not complete"
    last = errors[-1]
    return one_line(f"verifiers: {last.type}: {last.message}")


def trace_signals(trace) -> dict[str, float]:
    """A trace's named rewards and metrics, each a number (``rollout/env/<name>`` of the step)."""
    out = {name: r.score for name, r in trace.rewards.items() if r is not None}
    out |= {name: float(v) for name, v in trace.metrics.items() if isinstance(v, (int, float))}
    return out


def outcome_of(episode) -> Outcome:
    """Reward: the mean of the trainable traces' rewards (one trace per episode for most envs)."""
    error = episode_error(episode)
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable] or list(episode.traces)
    if error or not traces:
        return Outcome(error=error or "verifiers: the episode ran no agent")
    signals: dict[str, list[float]] = {}
    for trace in traces:
        for name, value in trace_signals(trace).items():
            signals.setdefault(name, []).append(value)
    info = {name: sum(values) / len(values) for name, values in signals.items()}
    return Outcome(reward=sum(t.reward for t in traces) / len(traces), info=info)


class VerifiersEpisodes(AgentEpisodes):
    """``EpisodeRunner`` for verifiers environments: an agent run whose program is verifiers'
    rollout of the row's task; the env serves (interception, shared tool servers) from ``start``
    to ``stop``."""

    server_class = VerifiersEndpoint

    @classmethod
    def preflight(cls, recipe: Recipe) -> None:
        """The environment loaded by verifiers' loader, and refused if it cannot run beside a trainer."""
        load_env(recipe)
        ensure_uv()

    def __init__(self, recipe: Recipe, tokenizer):
        self.recipe, self.rl, self.tokenizer = recipe, recipe.rl, tokenizer
        self.server = None
        self.env, self.config = load_env(recipe)
        ensure_uv()
        self.make_task = task_maker(self.env)
        self.tool_use = tool_use(recipe, tokenizer)
        self.serving: contextlib.AsyncExitStack | None = None
        self.context = None  # verifiers' ModelContext: the policy on the endpoint

    async def start(self, client, stop_ids: Sequence[int]) -> None:
        await super().start(client, stop_ids)
        self.context = model_context(self.server.port)
        self.serving = contextlib.AsyncExitStack()
        await self.serving.enter_async_context(self.env.serving())

    async def stop(self) -> None:
        if self.serving is not None:
            await self.serving.aclose()
        await super().stop()

    def check_rows(self, rows: Sequence[Mapping[str, Any]], source: str) -> None:
        """Every row is its task's data, before any engine work."""
        for index, row in enumerate(rows):
            try:
                self.make_task(row)
            except ValidationError as exc:
                problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
                raise UsageError(f"{source} row {index}: not a task of {self.rl.environment!r}: {problems}") from None

    async def trajectory(self, row: Mapping[str, Any], session_id: str, temperature: float, first_turn=None, index=0):
        """(the samples built from the trainable traces' calls, episode). Evaluation (temperature 0)
        samples every call greedily, whatever the env's sampling asks."""
        greedy = temperature if temperature == 0.0 else None
        trajectory, _ = self.server.open(session_id, greedy, first_turn, index)
        untrained = f"{session_id}-untrained"  # opened for the first untrainable trace
        traces: list[str] = []

        def route(trace) -> None:
            trainable = trace.agent is None or trace.agent.trainable
            if not trainable and untrained not in self.server.trajectories:
                self.server.open(untrained, greedy)
            self.server.routes[trace.id] = session_id if trainable else untrained
            traces.append(trace.id)

        try:
            outcome = await self.rollout(row, route)
        finally:
            for trace_id in traces:
                self.server.routes.pop(trace_id, None)
            await self.server.close(untrained)
            await self.server.close(session_id)
        parts = samples_from_calls(trajectory.calls)
        error = outcome.error or (None if parts else "verifiers: the episode made no call to the endpoint")
        episode = Episode(reward=0.0 if error else outcome.reward, turns=len(trajectory.calls), done=True, error=error)
        episode.env_metrics = outcome.info
        return parts, episode

    async def rollout(self, row: Mapping[str, Any], on_trace) -> Outcome:
        """verifiers' episode of the row's task under ``rl.agent_timeout_s``; every failure an
        outcome, never an exception."""
        try:
            task = self.make_task(row)
            async with asyncio.timeout(self.rl.agent_timeout_s):
                episode = await self.env.run_episode(task, self.context, on_trace=on_trace)
        except TimeoutError:
            return Outcome(error=f"verifiers: timeout after {self.rl.agent_timeout_s:g}s (rl.agent_timeout_s)")
        except Exception as exc:  # noqa: BLE001 - a row the task cannot take fails its own episode
            return Outcome(error=one_line(f"verifiers: {type(exc).__name__}: {exc}"))
        return outcome_of(episode)
