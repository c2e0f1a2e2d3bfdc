"""An auxiliary model's engines (a teacher, a judge) under engine recovery, with hand-made fakes: a dead
one is restarted with its spec and nothing else (no router, no weights), counted in the metrics;
the run gives up only when a model has no engine left; ``run_jobs`` no longer treats them as fatal
while recovery is on. And the orchestrator's client of them (``AuxiliaryEngines``) waits out a
restart instead of failing the requests made meanwhile, while a bad request still fails at once."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from backends.rollout.auxiliary import AuxiliaryEngines
from skyrl_cli.engines.recovery import EngineRecovery
from skyrl_cli.plan.build import build_plan
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.stages.local import run_jobs
from tests.unit.test_distillation import recipe as distillation_recipe


class FakeSupervisor:
    """``poll()``: name -> exit code (None while running); ``restart`` brings a process back
    unless it is in ``broken`` (it dies again at once)."""

    def __init__(self, tmp_path: Path, names):
        self.codes = {name: None for name in names}
        self.processes = {name: SimpleNamespace(log_path=tmp_path / f"logs/{name}.log") for name in names}
        self.restarted: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self.broken: set[str] = set()

    def poll(self):
        return dict(self.codes)

    def kill(self, name):
        self.codes[name] = -9

    def restart(self, name):
        self.restarted.append(name)
        self.calls.append(("restart", name))
        self.codes[name] = -9 if name in self.broken else None

    def wait_ready(self, names, timeout_s=None):
        for name in names:
            self.calls.append(("wait_ready", name))
            if self.codes[name] is not None:
                raise RuntimeError(f"{name} exited")


class FakeRouter:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


class FakeWriter:
    def __init__(self):
        self.logged = []

    def log(self, step, metrics):
        self.logged.append((step, dict(metrics)))


def recovery(tmp_path, supervisor, **kwargs) -> EngineRecovery:
    r = EngineRecovery(
        supervisor,
        {"engine-0": "http://e0"},
        "http://router",
        tmp_path,
        auxiliaries={"teacher-0": "http://t0", "teacher-1": "http://t1"},
        writer=FakeWriter(),
        step_fn=lambda: 7,
        **kwargs,
    )
    r._healthy = lambda url: True  # alive unless its process exited
    r.router.close()
    r.router = FakeRouter()

    r.loaded = []
    r._load_current_weights = r.loaded.append
    return r


def test_a_dead_teacher_engine_is_restarted_with_its_spec_alone_and_counted(tmp_path):
    sup = FakeSupervisor(tmp_path, ["engine-0", "teacher-0", "teacher-1"])
    r = recovery(tmp_path, sup)
    assert r.check_once() == []
    sup.kill("teacher-1")
    assert r.check_once() == ["teacher-1"]
    assert sup.restarted == ["teacher-1"] and sup.codes["teacher-1"] is None
    assert r.router.calls == [] and r.loaded == []  # behind no router, and no weights to load
    ((step, metrics),) = r.writer.logged
    assert step == 7 and metrics["engine/restarts"] == 1.0 and metrics["auxiliary/restarts"] == 1.0
    assert metrics["timing/engine_recovery_s"] >= 0
    assert r.gave_up() is None


def test_engines_that_die_together_are_restarted_together(tmp_path):
    sup = FakeSupervisor(tmp_path, ["engine-0", "teacher-0", "teacher-1"])
    r = recovery(tmp_path, sup)
    sup.kill("engine-0")
    sup.kill("teacher-0")
    assert r.check_once() == ["engine-0", "teacher-0"]
    assert sup.calls == [  # both start before either is waited for: their start-ups overlap
        ("restart", "engine-0"),
        ("restart", "teacher-0"),
        ("wait_ready", "engine-0"),
        ("wait_ready", "teacher-0"),
    ]
    # The policy's engine left the router, loaded the current weights and came back; the teacher's did neither.
    assert r.router.calls == [("remove_worker", "http://e0"), ("ensure_worker", "http://e0")]
    assert r.loaded == ["http://e0"]
    assert [m.get("auxiliary/restarts") for _, m in r.writer.logged] == [None, 1.0]
    assert [m["engine/restarts"] for _, m in r.writer.logged] == [2.0, 2.0]
    assert not r.recovering.is_set()


def test_the_run_gives_up_only_when_an_auxiliary_model_has_no_engine_left(tmp_path):
    sup = FakeSupervisor(tmp_path, ["engine-0", "teacher-0", "teacher-1"])
    sup.broken = {"teacher-0", "teacher-1"}
    r = recovery(tmp_path, sup, max_restarts=1)
    sup.kill("teacher-0")
    assert r.check_once() == []  # restarted, died again
    assert r.check_once() == []  # max_restarts reached: left down
    assert sup.restarted == ["teacher-0"]
    assert r.gave_up() is None  # teacher-1 still serves the teacher
    sup.kill("teacher-1")
    r.check_once()
    assert r.gave_up() == (
        f"teacher-0, teacher-1 died after 1 restarts; log: {tmp_path / 'logs/teacher-0.log'}, "
        f"{tmp_path / 'logs/teacher-1.log'}"
    )


def test_auxiliary_engines_end_the_run_when_they_die_only_without_recovery(tmp_path):
    plan = build_plan(distillation_recipe({}), "rl", tmp_path, machine=MachineFacts(cpu_cores=(0, 1, 2)))
    assert [p.name for p in plan.processes if p.role == "auxiliary"] == ["teacher-0"]
    for recovering, fatal in ((True, []), (False, ["router", "teacher-0"])):
        seen = {}
        supervisor = SimpleNamespace(start=lambda spec: None, wait_jobs=lambda jobs, **kw: seen.update(kw))
        stack = SimpleNamespace(recovery=object() if recovering else None)
        run_jobs(supervisor, plan, stack, run=None, progress=None)
        assert sorted(seen["fatal_services"]) == fatal


# ---------------------------------------------------------------------------- the client


def engines(handler, urls=("http://a",), **settings) -> AuxiliaryEngines:
    client = AuxiliaryEngines("teacher", urls, RuntimeError, **{"max_retries": 0, "backoff_s": 0.01, **settings})
    client.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return client


def post(client: AuxiliaryEngines) -> dict:
    async def run():
        try:
            return await client.post("/v1/completions", {"x": 1})
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_a_request_waits_out_an_engine_restart_beyond_its_retries():
    calls = []
    back_at = time.monotonic() + 0.5  # the engine refuses connections until then

    def handler(request):
        calls.append(time.monotonic())
        if calls[-1] < back_at:
            raise httpx.ConnectError("Connection refused", request=request)
        return httpx.Response(200, json={"ok": True})

    assert post(engines(handler, outage_s=10.0)) == {"ok": True}
    assert len(calls) > 2  # more tries than max_retries (0) allows: the outage does not count


def test_an_engine_lost_mid_request_counts_as_down_too():
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) < 3:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, json={"ok": True})

    assert post(engines(handler, outage_s=10.0)) == {"ok": True} and len(calls) == 3


def test_the_wait_for_a_restart_is_capped_by_the_outage_budget():
    calls = []

    def handler(request):
        calls.append(request)
        raise httpx.ConnectError("Connection refused", request=request)

    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"^teacher: no engine could be reached for 0\.[3-9] s \(last: http://a: ConnectError"
    ):
        post(engines(handler, outage_s=0.3))
    assert 0.3 <= time.monotonic() - started < 3.0 and len(calls) > 1


def test_a_bad_request_fails_at_once():
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(400, text="prompt too long")

    with pytest.raises(RuntimeError, match="teacher http://a: HTTP 400: prompt too long"):
        post(engines(handler, outage_s=10.0))
    assert len(calls) == 1


def test_requests_go_to_the_engine_that_answers_while_another_restarts():
    seen = []

    def handler(request):
        seen.append(request.url.host)
        if request.url.host == "a":
            raise httpx.ConnectError("Connection refused", request=request)
        return httpx.Response(200, json=json.loads(request.content))

    client = engines(handler, urls=("http://a", "http://b"), max_retries=1)

    async def run():
        try:
            return [await client.post("/v1/completions", {"i": i}) for i in range(4)]
        finally:
            await client.aclose()

    assert asyncio.run(run()) == [{"i": i} for i in range(4)]
    assert seen == ["a", "b", "b", "b", "b"]  # a is passed over once it refused a connection


def test_a_run_on_a_pool_adopts_its_auxiliary_engines_and_its_recovery_watches_them(tmp_path, monkeypatch):
    import os

    from skyrl_cli.engines import stack as stack_module
    from skyrl_cli.plan.pool import plan_pool
    from tests.unit.test_engine_pool import CPU2, pool_from, teacher_recipe, write_model

    model, teacher = write_model(tmp_path / "m"), write_model(tmp_path / "teacher")
    path = tmp_path / "pool"
    path.mkdir()
    pool = pool_from(plan_pool(teacher_recipe(model, teacher), path, CPU2, warm=False), path, model, os.getpid())
    adopted = []
    supervisor = SimpleNamespace(adopt=lambda spec, pid, log: adopted.append(spec.name), poll=dict, on_detached=None)
    monkeypatch.setattr(stack_module, "load_run_weights", lambda pool, run_dir: None)
    stack = stack_module.attach_inference(supervisor, pool, [], tmp_path / "run", metrics_period_s=None)
    try:
        assert adopted == ["engine-0", "teacher-0", "router"]
        assert stack.recovery.auxiliaries == {"teacher-0": pool.auxiliary_engine_urls[0]}
        assert stack.recovery.engines == {"engine-0": pool.engine_urls[0]}  # no weights go to the teacher
    finally:
        stack.stop()
