"""The official tinker SDK (from the package registry) drives `skyrl tinker serve`'s stack end to
end on the tiny model: one vLLM engine with runtime LoRA behind vllm-router, and the API server
with the multi-LoRA trainer, started once for this module from the same plan as the command."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from tests.integration.conftest import free_ports, wait_groups_gone

pytestmark = pytest.mark.integration
tinker = pytest.importorskip("tinker")
from tinker import types

KEY_A, KEY_B = "tml-alice", "tml-bob"
SEQ_A = [7, 20, 11, 33, 9, 25, 14, 30, 8, 19, 27, 12, 35, 10, 22, 16]
SEQ_B = [40, 12, 31, 8, 26, 17, 36, 9, 21, 14, 38, 11, 29, 18, 33, 13]
PROMPT_LEN = 4
STEPS, LR = 30, 5e-3


class Stack:
    def __init__(self, supervisor, server_spec, base_url: str, base_model: str, stack):
        self.supervisor, self.server_spec, self.base_url, self.base_model, self.stack = (
            supervisor,
            server_spec,
            base_url,
            base_model,
            stack,
        )

    def restart_server_with_sigkill(self) -> None:
        proc = self.supervisor.processes[self.server_spec.name]
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(timeout=30)
        self.supervisor.start(self.server_spec)
        self.supervisor.wait_ready([self.server_spec.name])


@pytest.fixture(scope="module")
def tinker_stack(tmp_path_factory, tiny_model_dir):
    from skyrl_cli.engines.stack import launch_inference
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.machine import detect_machine
    from skyrl_cli.plan.tinker import SERVER_NAME, plan_tinker
    from skyrl_cli.recipe.lengths import with_model_lengths
    from skyrl_contracts.atomic import write_json
    from skyrl_contracts.schema import Recipe

    (port,) = free_ports(1)
    recipe = with_model_lengths(
        Recipe.model_validate(
            {
                "name": "tinker-itest",
                "model": {"path": str(tiny_model_dir)},
                "inference": {"engines": 1},
                "tinker": {
                    "port": port,
                    "api_keys": [KEY_A, KEY_B],
                    "base_model": "tiny-llama",
                    "max_lora_rank": 16,
                    "max_live_adapters": 8,
                    "long_poll_s": 5,
                },
            }
        )
    )
    run_dir = tmp_path_factory.mktemp("tinker-run")
    plan, config = plan_tinker(recipe, run_dir, detect_machine())
    write_json(run_dir / "server.json", config)
    engines = [p for p in plan.processes if p.role == "engine"]
    (router,) = [p for p in plan.processes if p.role == "router"]
    (server,) = [p for p in plan.processes if p.name == SERVER_NAME]
    with Supervisor(run_dir) as sup:
        stack = launch_inference(
            sup, engines, router, plan.engine_urls, plan.router_url, run_dir, metrics_period_s=None
        )
        try:
            sup.start(server)
            sup.wait_ready([server.name])
            yield Stack(sup, server, f"http://127.0.0.1:{port}", "tiny-llama", stack)
        finally:
            stack.stop()
            groups = [p.popen.pid for p in sup.processes.values()]
    assert not wait_groups_gone(groups), "processes left behind"


def ce_datum(seq):
    return types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )


def train(tc, seq, steps=STEPS, lr=LR) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward([ce_datum(seq)], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def greedy(sampler, seq) -> list[int]:
    params = types.SamplingParams(max_tokens=len(seq) - PROMPT_LEN, temperature=0.0)
    out = sampler.sample(types.ModelInput.from_ints(seq[:PROMPT_LEN]), 1, params).result()
    return list(out.sequences[0].tokens)


def test_sdk_end_to_end(tinker_stack):
    with tinker.ServiceClient(base_url=tinker_stack.base_url, api_key=KEY_A) as sc:
        tc = sc.create_lora_training_client(base_model=tinker_stack.base_model, rank=8).result()
        assert tc.get_tokenizer() is not None  # tokenizer_id is the local model directory
        losses = train(tc, SEQ_A)
        assert losses[-1] < 0.1 * losses[0], losses

        # forward-only: no gradient, same logprobs twice; the loss is the sum of -logprobs
        fw1 = tc.forward([ce_datum(SEQ_A)], "cross_entropy").result()
        fw2 = tc.forward([ce_datum(SEQ_A)], "cross_entropy").result()
        lp = fw1.loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(lp, fw2.loss_fn_outputs[0]["logprobs"].to_numpy())
        assert fw1.metrics["loss:sum"] == pytest.approx(-lp.sum(), rel=1e-5, abs=1e-6)

        # cross_entropy with negative weights: plain sum semantics
        weights = np.linspace(-1.0, 1.0, len(SEQ_A) - 1).astype(np.float32)
        neg = types.Datum(
            model_input=types.ModelInput.from_ints(SEQ_A[:-1]),
            loss_fn_inputs={"target_tokens": SEQ_A[1:], "weights": weights.tolist()},
        )
        out = tc.forward([neg], "cross_entropy").result()
        assert out.metrics["loss:sum"] == pytest.approx(float(-(weights * lp).sum()), rel=1e-4, abs=1e-5)

        # ppo with thresholds from loss_fn_config, hand-checked against the returned logprobs
        n = len(SEQ_A) - 1
        sampler_lp = (lp - 0.3).astype(np.float32)
        adv = np.where(np.arange(n) % 2 == 0, 1.0, -1.0).astype(np.float32)
        ppo_datum = types.Datum(
            model_input=types.ModelInput.from_ints(SEQ_A[:-1]),
            loss_fn_inputs={"target_tokens": SEQ_A[1:], "logprobs": sampler_lp.tolist(), "advantages": adv.tolist()},
        )
        ppo = tc.forward_backward(
            [ppo_datum], "ppo", loss_fn_config={"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
        ).result()
        ratio = np.exp(ppo.loss_fn_outputs[0]["logprobs"].to_numpy() - sampler_lp)
        expected = -np.minimum(ratio * adv, np.clip(ratio, 0.9, 1.1) * adv).sum()
        assert ppo.metrics["loss:sum"] == pytest.approx(float(expected), rel=1e-4)
        tc.optim_step(types.AdamParams(learning_rate=1e-6)).result()  # spend the ppo gradient, barely move

        # ephemeral sampler: greedy sampling reproduces the trained sequence
        sampler = tc.save_weights_and_get_sampling_client().result()
        assert greedy(sampler, SEQ_A) == SEQ_A[PROMPT_LEN:]
        # compute_logprobs: the engine's prompt logprobs match the trainer's (bf16 engine)
        plp = sampler.compute_logprobs(types.ModelInput.from_ints(SEQ_A)).result()
        assert plp[0] is None
        train_lp = tc.forward([ce_datum(SEQ_A)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        assert np.allclose(np.array(plp[1:], dtype=np.float32), train_lp, atol=0.15)
        # several samples at temperature 1 (n > 1), each with its sequence id
        many = sampler.sample(
            types.ModelInput.from_ints(SEQ_A[:PROMPT_LEN]),
            3,
            types.SamplingParams(max_tokens=5, temperature=1.0, seed=1),
        ).result()
        assert len(many.sequences) == 3 and all(len(s.tokens) <= 5 for s in many.sequences)

        # named sampler checkpoint, used through a sampling client made from its path
        named = tc.save_weights_for_sampler("named-1").result().path
        assert named.endswith("/sampler_weights/named-1") and named.count("/") == 4
        assert greedy(sc.create_sampling_client(model_path=named).result(), SEQ_A) == SEQ_A[PROMPT_LEN:]

        # save_state, then a new training client from it (create-via-load) with the optimizer
        state = tc.save_state("state-1").result().path
        tc2 = sc.create_training_client_from_state_with_optimizer(state).result()
        again = tc2.forward([ce_datum(SEQ_A)], "cross_entropy").result().metrics["loss:sum"]
        assert again == pytest.approx(-float(train_lp.sum()), rel=1e-4, abs=1e-5)
        more = train(tc2, SEQ_A, steps=2)
        assert all(math.isfinite(x) for x in more)

        # forward_backward_custom: the SDK sends -dL/dlogp as cross_entropy weights (negative too)
        def custom_loss(data, logprobs_list):
            loss = sum((lp * lp).sum() for lp in logprobs_list)  # the SDK sends weights -dL/dlogp = -2 logp
            return loss, {"custom:sum": float(loss.detach())}

        custom = tc2.forward_backward_custom([ce_datum(SEQ_A)], custom_loss).result()
        assert custom.metrics["custom:sum"] > 0
        tc2.optim_step(types.AdamParams(learning_rate=1e-4)).result()

        rest = tinker.RestClient(base_url=tinker_stack.base_url, api_key=KEY_A)
        runs = rest.list_training_runs().result()
        assert {r.training_run_id for r in runs.training_runs} >= {tc.model_id.replace(":", "_")}
        ckpts = rest.list_checkpoints(tc.model_id.replace(":", "_")).result()
        assert {c.tinker_path for c in ckpts.checkpoints} >= {named, state}
        model_a = tc.model_id

    # isolation: another key does not see or use alice's model and checkpoints
    headers = {"X-API-Key": KEY_B}
    with httpx.Client(base_url=tinker_stack.base_url, timeout=30) as http:
        r = http.post("/api/v1/get_info", json={"model_id": model_a}, headers=headers)
        assert r.status_code == 404
        r = http.post(
            "/api/v1/optim_step", json={"model_id": model_a, "seq_id": 99, "adam_params": {}}, headers=headers
        )
        assert r.status_code == 404
        r = http.get(f"/api/v1/training_runs/{model_a.replace(':', '_')}/checkpoints", headers=headers)
        assert r.status_code == 404
        r = http.post("/api/v1/get_info", json={"model_id": model_a}, headers={"X-API-Key": "tml-wrong"})
        assert r.status_code == 401
    with (
        tinker.ServiceClient(base_url=tinker_stack.base_url, api_key=KEY_B) as sc_b,
        pytest.raises(tinker.NotFoundError),
    ):
        sc_b.create_sampling_client(model_path=named).result().sample(
            types.ModelInput.from_ints(SEQ_A[:PROMPT_LEN]), 1, types.SamplingParams(max_tokens=2)
        ).result()
    # a wrong key is refused at the first request
    with (
        pytest.raises(tinker.AuthenticationError),
        tinker.ServiceClient(base_url=tinker_stack.base_url, api_key="tml-wrong") as bad,
    ):
        bad.create_lora_training_client(base_model=tinker_stack.base_model, rank=8).result()


def test_two_clients_train_concurrently_without_interference(tinker_stack):
    results: dict[str, object] = {}

    def client(key, seq):
        try:
            with tinker.ServiceClient(base_url=tinker_stack.base_url, api_key=key) as sc:
                tc = sc.create_lora_training_client(base_model=tinker_stack.base_model, rank=8, seed=3).result()
                losses = train(tc, seq)
                results[key] = (losses, greedy(tc.save_weights_and_get_sampling_client().result(), seq))
        except Exception as err:  # noqa: BLE001 - reported below
            results[key] = err

    threads = [threading.Thread(target=client, args=a) for a in ((KEY_A, SEQ_A), (KEY_B, SEQ_B))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for key, seq in ((KEY_A, SEQ_A), (KEY_B, SEQ_B)):
        assert not isinstance(results[key], Exception), results[key]
        losses, sampled = results[key]
        assert losses[-1] < 0.1 * losses[0]
        assert sampled == seq[PROMPT_LEN:], key


def test_restart_keeps_checkpoints_and_finished_futures(tinker_stack):
    with tinker.ServiceClient(base_url=tinker_stack.base_url, api_key=KEY_A) as sc:
        tc = sc.create_lora_training_client(base_model=tinker_stack.base_model, rank=8).result()
        train(tc, SEQ_B, steps=STEPS)
        state = tc.save_state("before-kill").result().path
        sampler_path = tc.save_weights_for_sampler("before-kill").result().path
        headers = {"X-API-Key": KEY_A}
        with httpx.Client(base_url=tinker_stack.base_url, timeout=60) as http:
            # a future finished before the kill (the model is live until the session finishes)
            r = http.post(
                "/api/v1/optim_step",
                json={"model_id": tc.model_id, "seq_id": 1000, "adam_params": {"learning_rate": 0.0}},
                headers=headers,
            )
            rid = r.json()["request_id"]
            done = http.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=headers).json()
            deadline = time.monotonic() + 60
            while done.get("type") == "try_again" and time.monotonic() < deadline:
                done = http.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=headers).json()
            assert "metrics" in done, done

    tinker_stack.restart_server_with_sigkill()

    with httpx.Client(base_url=tinker_stack.base_url, timeout=60) as http:
        again = http.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=headers).json()
        assert again == done
        r = http.post(
            "/api/v1/forward_backward", content=b"", headers={**headers, "Content-Type": "application/x-protobuf"}
        )
        assert r.status_code == 400
    with tinker.ServiceClient(base_url=tinker_stack.base_url, api_key=KEY_A) as sc:
        assert greedy(sc.create_sampling_client(model_path=sampler_path).result(), SEQ_B) == SEQ_B[PROMPT_LEN:]
        tc2 = sc.create_training_client_from_state_with_optimizer(state).result()
        loss = tc2.forward([ce_datum(SEQ_B)], "cross_entropy").result().metrics["loss:sum"]
        assert loss < 1.0
