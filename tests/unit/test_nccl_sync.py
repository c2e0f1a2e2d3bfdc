"""The NCCL weight sync on CPU: which path a run takes (plan layer), the rank layout the engines
are told, the learner/orchestrator handshake and its version bookkeeping, and the fallback.

NCCL itself cannot run here (no CUDA), so the engines' HTTP routes are an ``httpx.MockTransport``
that records what each engine was asked, and the learner's send is a callable that checks the
engines' state at the moment of the broadcast: a protocol test, not a transfer test (that one is
tests/integration/test_inference_gpu.py and scripts/gpu-check.sh, on GPUs).
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import pytest

from backends.inference.nccl_sync import (
    NcclEngineWeights,
    NcclPublisher,
    _FanOutClient,
    make_weight_syncer,
    open_weight_syncer,
)
from backends.inference.weight_sync import WeightSyncError, read_current_weights
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.rl import plan_rl
from skyrl_cli.plan.weight_sync import nccl_obstacles, select_weight_sync, weight_sync_problems
from skyrl_contracts.exchange import RunExchange
from skyrl_contracts.schema import Recipe

URLS = ["http://e0:1", "http://e1:1"]
GPU8 = MachineFacts(
    cpu_cores=tuple(range(16)),
    gpus=tuple(range(8)),
    python="py",
    torch_extensions_dir="/ext",
    port_finder=lambda n: [30000 + i for i in range(n)],
)
CPU2 = MachineFacts(
    cpu_cores=(0, 1), python="py", torch_extensions_dir="/ext", port_finder=lambda n: [30000 + i for i in range(n)]
)


def recipe(
    weight_sync: str = "auto", lora: bool = False, zero_stage: int = 2, urls: tuple = (), device: str = "auto"
) -> Recipe:
    model = {"path": "/models/m", **({"lora": {"rank": 8}} if lora else {})}
    return Recipe.model_validate(
        {
            "name": "t",
            "model": model,
            "data": {"task": "addition"},
            "rl": {"init_from": "/models/m"},
            "inference": {"engines": 2, "weight_sync": weight_sync, "urls": list(urls)},
            "trainer": {"ranks": 4, "zero_stage": zero_stage, "device": device},
        }
    )


# ------------------------------------------------------------------------------ selection


@pytest.mark.parametrize(
    ("kwargs", "device", "available", "expected"),
    [
        ({}, "cuda", True, "nccl"),
        ({}, "cpu", True, "disk"),
        ({}, "cuda", False, "disk"),
        ({"zero_stage": 3}, "cuda", True, "disk"),
        ({"urls": ("http://far:8000",)}, "cuda", True, "disk"),
        ({"weight_sync": "disk"}, "cuda", True, "disk"),
        ({"lora": True}, "cuda", True, "lora"),
        ({"lora": True, "weight_sync": "disk"}, "cpu", True, "lora"),
    ],
)
def test_auto_takes_nccl_only_where_all_of_its_conditions_hold(kwargs, device, available, expected):
    assert select_weight_sync(recipe(**kwargs), device, available) == expected


def test_an_explicit_nccl_that_cannot_run_is_a_recipe_error_naming_the_reason():
    assert weight_sync_problems(recipe("nccl"), GPU8, transfer_available=True) == []
    (cpu,) = weight_sync_problems(recipe("nccl"), CPU2, transfer_available=True)
    assert cpu.path == ("inference", "weight_sync")
    assert cpu.message == '"nccl": the trainer runs on CPU; the NCCL weight sync needs CUDA'
    (forced_cpu,) = weight_sync_problems(recipe("nccl", device="cpu"), GPU8, transfer_available=True)
    assert forced_cpu.message == cpu.message
    assert "ZeRO-3" in weight_sync_problems(recipe("nccl", zero_stage=3), GPU8, transfer_available=True)[0].message
    assert "LoRA" in weight_sync_problems(recipe("nccl", lora=True), GPU8, transfer_available=True)[0].message
    assert "no NCCL weight transfer" in weight_sync_problems(recipe("nccl"), GPU8, transfer_available=False)[0].message
    # "auto" and "disk" are never errors: they fall back
    assert weight_sync_problems(recipe("auto"), CPU2) == weight_sync_problems(recipe("disk"), CPU2) == []
    assert len(nccl_obstacles(recipe(zero_stage=3, urls=("http://far:1",)), "cpu", False)) == 4


def test_an_explicit_delta_runs_on_any_device_where_the_weights_are_full_and_the_engines_ours():
    assert (
        select_weight_sync(recipe("delta"), "cpu", True) == select_weight_sync(recipe("delta"), "cuda", True) == "delta"
    )
    assert weight_sync_problems(recipe("delta", zero_stage=3), CPU2) == []  # ZeRO-3 gathers for every version anyway
    assert "LoRA" in weight_sync_problems(recipe("delta", lora=True), CPU2)[0].message
    (remote,) = weight_sync_problems(recipe("delta", urls=("http://far:8000",)), CPU2)
    assert (
        remote.message == '"delta": remote engines (inference.urls) do not run the worker extension that applies deltas'
    )


def test_full_version_every_acts_only_with_deltas():
    data = recipe("disk").model_dump(mode="json")
    assert weight_sync_problems(Recipe.model_validate(data), CPU2) == []  # a resolved dump states the default
    data["inference"]["full_version_every"] = 5
    (problem,) = weight_sync_problems(Recipe.model_validate(data), CPU2)
    assert problem.path == ("inference", "full_version_every") and "delta" in problem.message
    data["inference"]["weight_sync"] = "delta"
    assert weight_sync_problems(Recipe.model_validate(data), CPU2) == []


def _proc(plan, role):
    return next(p for p in plan.processes if p.role == role)


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_the_gpu_plan_records_nccl_and_wires_both_sides(monkeypatch, tmp_path):
    monkeypatch.setattr("skyrl_cli.plan.rl.vllm_weight_transfer_available", lambda: True)
    plan = plan_rl(recipe(), tmp_path, resume=False, async_mode=True, machine=GPU8)
    assert plan.weight_sync == "nccl" and plan.device == "cuda"
    engines = [p for p in plan.processes if p.role == "engine"]
    assert all(json.loads(_flag(e.argv, "--weight-transfer-config")) == {"backend": "nccl"} for e in engines)
    trainer, orchestrator = _proc(plan, "trainer"), _proc(plan, "orchestrator")
    assert _flag(trainer.argv, "--weight-sync") == _flag(orchestrator.argv, "--weight-sync") == "nccl"
    assert _flag(trainer.argv, "--engine-urls") == ",".join(plan.engine_urls)
    assert _flag(trainer.argv, "--tensor-parallel") == "1"
    host, port = _flag(trainer.argv, "--nccl-address").rsplit(":", 1)
    used = {p for proc in plan.processes for p in proc.ports} | {
        int(_flag(trainer.argv, "--rdzv-endpoint").rsplit(":")[1])
    }
    assert host == "127.0.0.1" and int(port) not in used  # its own free port
    # The group's members sit on disjoint GPUs: NCCL refuses two ranks on one device.
    assert set(trainer.devices).isdisjoint({d for e in engines for d in e.devices})
    # It opens its NCCL group with the engines at start-up, so it starts once they are ready.
    assert not trainer.start_with_engines


def test_the_cpu_plan_records_disk_and_passes_no_nccl_flags(tmp_path):
    plan = plan_rl(recipe(), tmp_path, resume=False, async_mode=False, machine=CPU2)
    assert plan.weight_sync == "disk"
    assert all("--weight-transfer-config" not in p.argv and "--nccl-address" not in p.argv for p in plan.processes)
    assert _flag(_proc(plan, "orchestrator").argv, "--weight-sync") == "disk"
    lora = plan_rl(recipe(lora=True), tmp_path, resume=False, async_mode=False, machine=CPU2)
    assert lora.weight_sync == "lora"
    # On the file paths the learner needs no engine until it gets a batch: it starts beside them.
    assert _proc(plan, "trainer").start_with_engines and _proc(lora, "trainer").start_with_engines
    assert not _proc(plan, "orchestrator").start_with_engines


# ------------------------------------------------------------------------------ fake engines


class Engines:
    """Each engine's routes answer 200 (or ``fail`` for one path) and record the calls in order."""

    def __init__(self, fail: str | None = None):
        self.calls: list[tuple[str, str, object]] = []
        self.urls: list[str] = []
        self.paused: dict[str, bool] = {}
        self.versions: dict[str, str] = {}
        self.fail = fail
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        engine, path = f"{request.url.scheme}://{request.url.host}:{request.url.port}", request.url.path
        body = json.loads(request.content) if request.content else None
        with self.lock:
            self.calls.append((engine, path, body))
            self.urls.append(str(request.url))
            if path == self.fail:
                return httpx.Response(500, text="refused")
            if path == "/pause":
                self.paused[engine] = True
            elif path == "/resume":
                self.paused[engine] = False
            elif path == "/update_weight_version":
                self.versions[engine] = body["new_version"]
        return httpx.Response(200, json={})

    def paths(self, engine: str) -> list[str]:
        return [p for e, p, _ in self.calls if e == engine]


def test_engines_are_told_their_ranks_after_the_sender():
    engines = Engines()
    client = _FanOutClient(URLS, tensor_parallel=2, transport=httpx.MockTransport(engines))
    client.init_weight_transfer_engine(
        {"master_address": "10.0.0.1", "master_port": 5, "rank_offset": 1, "world_size": 5}
    )
    offsets = {e: body["init_info"]["rank_offset"] for e, _, body in engines.calls}
    assert offsets == {URLS[0]: 1, URLS[1]: 3}  # engine i's tp workers: 1 + i*tp .. (i+1)*tp
    assert {body["init_info"]["world_size"] for _, _, body in engines.calls} == {5}
    client.update_weights({"names": ["w"]})
    assert [body for _, p, body in engines.calls if p == "/update_weights"] == [{"update_info": {"names": ["w"]}}] * 2
    refusing = _FanOutClient(URLS, 1, transport=httpx.MockTransport(Engines(fail="/start_weight_update")))
    with pytest.raises(WeightSyncError, match="start_weight_update: HTTP 500"):
        refusing.start_weight_update()


# ------------------------------------------------------------------------------ handshake


class Sender:
    """The learner's broadcast: records that every engine was paused when it ran."""

    def __init__(self, engines: Engines, error: Exception | None = None):
        self.engines, self.error, self.sent_while_paused = engines, error, []

    def send(self) -> float:
        with self.engines.lock:
            self.sent_while_paused.append(all(self.engines.paused.get(u) for u in URLS))
        if self.error is not None:
            raise self.error
        return 0.25


def _sync(run_dir: Path, engines: Engines, sender: Sender, version: int):
    """The learner's publish (a thread, as in its process) against the orchestrator's load."""
    exchange = RunExchange(run_dir)
    publisher = NcclPublisher(exchange, sender, timeout_s=30)
    outcome: dict = {}

    def learner() -> None:
        try:
            outcome["seconds"] = publisher.publish(version)
        except Exception as err:  # noqa: BLE001 - recorded for the test
            outcome["error"] = err

    thread = threading.Thread(target=learner)
    thread.start()
    exchange.wait_version(version, timeout_s=30)

    async def orchestrator():
        async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as http:
            loader = NcclEngineWeights(URLS, run_dir, exchange, http=http, timeout_s=30)
            try:
                return loader, await loader.load(version, exchange.weights_dir(version))
            except WeightSyncError as err:
                return loader, err

    loader, result = asyncio.run(orchestrator())
    thread.join(timeout=30)
    return loader, result, outcome


def test_a_version_goes_pause_send_label_resume_on_every_engine(tmp_path):
    engines = Engines()
    sender = Sender(engines)
    loader, result, outcome = _sync(tmp_path, engines, sender, 3)
    assert sender.sent_while_paused == [True]
    assert outcome == {"seconds": 0.25} and loader.last_transfer_s == 0.25
    for url in URLS:
        assert engines.paths(url) == ["/pause", "/update_weight_version", "/resume"]
    assert engines.versions == {u: "3" for u in URLS} and not any(engines.paused.values())
    assert ("http://e0:1", "/update_weight_version", {"new_version": "3"}) in engines.calls
    assert result.version == "3" and result.synced == tuple(URLS)
    paths = RunExchange(tmp_path).paths
    assert paths.latest_weights_version() == 3 and paths.transfer_marker(3).exists()
    assert not paths.transfer_ready(3).exists() and not paths.transfer_done(3).exists()  # handshake cleaned up
    assert read_current_weights(tmp_path) is None  # a restarted engine cannot load an NCCL version


def test_the_pause_is_keep_mode_as_on_the_disk_path(tmp_path):
    engines = Engines()
    _sync(tmp_path, engines, Sender(engines), 1)
    assert {u for u in engines.urls if "/pause" in u} == {f"{u}/pause?mode=keep" for u in URLS}


def test_a_failed_send_fails_both_sides_and_still_resumes_the_engines(tmp_path):
    engines = Engines()
    loader, result, outcome = _sync(tmp_path, engines, Sender(engines, RuntimeError("NCCL error: unhandled")), 2)
    assert isinstance(outcome["error"], RuntimeError)
    assert isinstance(result, WeightSyncError) and "RuntimeError: NCCL error: unhandled" in str(result)
    for url in URLS:
        assert engines.paths(url) == ["/pause", "/resume"]  # never labelled with a version it did not get
    assert engines.versions == {}


def test_a_version_published_as_files_is_reloaded_from_disk(tmp_path):
    """The starting version, and every version once the learner fell back: the disk path, whole."""
    engines = Engines()
    exchange = RunExchange(tmp_path)
    with exchange.publish_weights(4) as out:
        (out / "model.safetensors").write_bytes(b"")

    real = httpx.AsyncClient  # the disk path opens its own client: route it to the fake engines
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(engines), **kw))
        loader = NcclEngineWeights(URLS, tmp_path, exchange, timeout_s=30)
        result = asyncio.run(loader.load(4, exchange.weights_dir(4)))
    assert result.version == "4"
    for url in URLS:
        assert engines.paths(url) == ["/pause", "/collective_rpc", "/update_weight_version", "/resume"]
    assert read_current_weights(tmp_path).version == "4"


# ------------------------------------------------------------------------------ fallback


def test_no_nccl_syncer_on_cpu_and_the_engines_are_never_asked_to_join(caplog):
    engines = Engines()
    transport = httpx.MockTransport(engines)
    assert make_weight_syncer("cpu", URLS, 1, None, "127.0.0.1", 1, transport) is None
    assert open_weight_syncer("cpu", URLS, 1, None, "127.0.0.1", 1, transport) == (None, "the trainer runs on cpu")
    with caplog.at_level("WARNING", logger="backends.inference.nccl_sync"):
        assert make_weight_syncer("cuda", URLS, 1, None, "127.0.0.1", 1, transport) is None
    (line,) = [r.getMessage() for r in caplog.records if r.name == "backends.inference.nccl_sync"]
    assert (
        line
        == "NCCL weight transfer unavailable (CUDA is not available to the trainer); weights go through the disk path"
    )
    assert engines.calls == []


def test_a_group_that_fails_to_form_falls_back_with_one_line(monkeypatch, caplog):
    """Past the pre-check, vLLM's own trainer_init runs: it asks the engines to join (with its real
    payload, at rank offsets after the sender) and then fails to open its end without CUDA."""
    import torch

    from skyrl_contracts.ports import find_free_ports

    monkeypatch.setattr("backends.inference.nccl_sync.nccl_missing", lambda: None)
    engines = Engines()
    (port,) = find_free_ports(1)
    with caplog.at_level("WARNING", logger="backends.inference.nccl_sync"):
        syncer = make_weight_syncer(
            "cuda", URLS, 1, torch.nn.Linear(2, 2), "127.0.0.1", port, httpx.MockTransport(engines)
        )
    assert syncer is None
    (line,) = [r.getMessage() for r in caplog.records if r.name == "backends.inference.nccl_sync"]
    assert line.startswith("NCCL weight transfer unavailable (") and line.endswith("; weights go through the disk path")
    joined = {e: body["init_info"] for e, p, body in engines.calls if p == "/init_weight_transfer_engine"}
    assert {e: (i["rank_offset"], i["world_size"], i["master_port"]) for e, i in joined.items()} == {
        URLS[0]: (1, 3, port),
        URLS[1]: (2, 3, port),
    }
