"""On-policy distillation through `skyrl tinker serve` with the official tinker SDK, the way
tinker-cookbook's recipe (``tinker_cookbook.distillation.train_on_policy``, 0.5.8) drives it: the
teacher is a sampling client of the base model itself, the student a LoRA training client on it.

The base model is the tiny Llama trained on the cyclic pattern (sharp next-token distributions,
unlike a random init), served by one vLLM engine in float32, so that the teacher's logprobs can be
held to transformers' to fp32 precision: an off-by-one position or a wrong token fails the test."""

from __future__ import annotations

import asyncio
import math
import shutil
from contextlib import contextmanager

import numpy as np
import pytest

from tests.docs_blocks import DOCS, blocks
from tests.integration.conftest import free_ports, load_and_train_pattern_policy, wait_groups_gone

pytestmark = pytest.mark.integration
tinker = pytest.importorskip("tinker")
from tinker import types

KEY = "tml-distill"
BASE = "teacher"
# atol of the fp32 engine's prompt logprobs against transformers' (measured: 1.9e-6 at most)
TOLERANCE = 1e-4


@contextmanager
def tinker_server(model_dir, run_dir, dtype: str):
    """`skyrl tinker serve`'s stack from its own plan: one vLLM engine (runtime LoRA) behind
    vllm-router, and the API server; yields its base_url."""
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
                "name": "tinker-distill",
                "model": {"path": str(model_dir), "dtype": dtype},
                "inference": {"engines": 1},
                "tinker": {"port": port, "api_keys": [KEY], "base_model": BASE, "max_lora_rank": 16, "long_poll_s": 5},
            }
        )
    )
    plan, config = plan_tinker(recipe, run_dir, detect_machine())
    write_json(run_dir / "server.json", config)
    engines = [p for p in plan.processes if p.role == "engine"]
    (router,) = [p for p in plan.processes if p.role == "router"]
    (server,) = [p for p in plan.processes if p.name == SERVER_NAME]
    assert all(s.argv[s.argv.index("--dtype") + 1] == dtype for s in engines)
    with Supervisor(run_dir) as sup:
        stack = launch_inference(
            sup, engines, router, plan.engine_urls, plan.router_url, run_dir, metrics_period_s=None
        )
        try:
            sup.start(server)
            sup.wait_ready([server.name])
            yield f"http://127.0.0.1:{port}"
        finally:
            stack.stop()
            groups = [p.popen.pid for p in sup.processes.values()]
    assert not wait_groups_gone(groups), "processes left behind"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_model_dir):
    """(the pattern-trained model in transformers, fp32; its directory, with the tokenizer)."""
    model = load_and_train_pattern_policy(tiny_model_dir)
    out = tmp_path_factory.mktemp("teacher") / "teacher"
    shutil.copytree(tiny_model_dir, out)
    model.save_pretrained(out)
    return model, out


@pytest.fixture(scope="module")
def served(tmp_path_factory, teacher):
    with tinker_server(teacher[1], tmp_path_factory.mktemp("tinker-distill-run"), "float32") as base_url:
        yield base_url


def hf_logprobs(model, tokens) -> np.ndarray:
    """transformers' next-token logprobs at every position but the last: [len - 1, vocab]."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(tokens)])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).numpy()


PATTERN = list(range(7, 23))  # the teacher continues consecutive ids (7..42, cyclic)
NOISE = [12, 40, 9, 33, 21, 8, 30, 17, 26, 11, 38, 15]  # not the pattern: broad, varied distributions


def test_teacher_logprobs_match_transformers(served, teacher):
    model, model_dir = teacher
    tol = TOLERANCE
    with tinker.ServiceClient(base_url=served, api_key=KEY) as sc:
        by_name = sc.create_sampling_client(base_model=BASE).result()
        by_path = sc.create_sampling_client(base_model=str(model_dir)).result()  # the directory names it too
        worst = 0.0
        for seq in (PATTERN, NOISE, PATTERN[:2]):
            expected = hf_logprobs(model, seq)
            want = expected[np.arange(len(seq) - 1), seq[1:]]
            for client in (by_name, by_path):
                got = client.compute_logprobs(types.ModelInput.from_ints(seq)).result()
                assert got[0] is None and len(got) == len(seq)
                np.testing.assert_allclose(np.array(got[1:], dtype=np.float64), want, atol=tol)
                worst = max(worst, float(np.abs(np.array(got[1:], dtype=np.float64) - want).max()))

            # sample(..., include_prompt_logprobs, topk_prompt_logprobs): the k best at every position
            k = 5
            out = by_name.sample(
                types.ModelInput.from_ints(seq),
                1,
                types.SamplingParams(max_tokens=1),
                include_prompt_logprobs=True,
                topk_prompt_logprobs=k,
            ).result()
            np.testing.assert_allclose(np.array(out.prompt_logprobs[1:], dtype=np.float64), want, atol=tol)
            topk = out.topk_prompt_logprobs
            assert topk[0] is None and len(topk) == len(seq)
            for position, row in enumerate(topk[1:]):
                ids = [t for t, _ in row]
                values = np.array([v for _, v in row])
                assert len(row) == k and np.all(np.diff(values) <= 1e-6)  # best first
                np.testing.assert_allclose(values, np.sort(expected[position])[::-1][:k], atol=tol)
                np.testing.assert_allclose(values, expected[position][ids], atol=tol)  # each id's own logprob

        # several samples and prompt logprobs at once; compute_logprobs calls and samples all in
        # flight together (vLLM 0.32 died on this before the prompts were scored alone)
        expected = hf_logprobs(model, NOISE)
        want = expected[np.arange(len(NOISE) - 1), NOISE[1:]]
        prompt = types.ModelInput.from_ints(NOISE)
        params = types.SamplingParams(max_tokens=3, temperature=1.0)
        both = by_name.sample(prompt, 2, params, include_prompt_logprobs=True, topk_prompt_logprobs=2)
        scores = [by_name.compute_logprobs(prompt) for _ in range(4)]
        samples = [by_path.sample(prompt, 2, params) for _ in range(4)]
        both = both.result()
        assert len(both.sequences) == 2 and all(len(s.tokens) == 3 for s in both.sequences)
        np.testing.assert_allclose(np.array(both.prompt_logprobs[1:], dtype=np.float64), want, atol=tol)
        for future in scores:
            np.testing.assert_allclose(np.array(future.result()[1:], dtype=np.float64), want, atol=tol)
        assert all(len(f.result().sequences) == 2 for f in samples)

        # the teacher's prompt logprobs of a pattern are sharp: it has learnt the pattern
        sharp = by_name.compute_logprobs(types.ModelInput.from_ints(PATTERN)).result()
        assert min(sharp[1:]) > -0.5, sharp
    print(f"compute_logprobs - transformers: at most {worst:.2e}")


def pattern_prompts(count: int, length: int = 4) -> list[list[int]]:
    return [[7 + (start + i) % 36 for i in range(length)] for start in range(0, 36, 36 // count)][:count]


def reversed_datum(start: int, length: int = 12) -> types.Datum:
    """A sequence counting down: what the student is first taught, the teacher never does."""
    seq = [7 + (start - i) % 36 for i in range(length)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (length - 1)},
    )


def floats(values) -> types.TensorData:
    return types.TensorData.from_numpy(np.asarray(values, dtype=np.float32))


async def distillation_step(student_sampler, teacher_client, training, prompts, group, max_tokens, lr):
    """One step of the cookbook's on-policy distillation: rollouts from the student, their datums
    (``assemble_training_data``), reverse-KL advantages from the teacher (``incorporate_kl_penalty``,
    kl_penalty_coef 1, no discount), then ``train_step``'s importance_sampling forward_backward and
    optim_step. Returns (the batch's teacher_kl, the datums trained on, the forward_backward output)."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    samples = await asyncio.gather(
        *[student_sampler.sample_async(types.ModelInput.from_ints(p), group, params) for p in prompts]
    )
    data = []
    for prompt, result in zip(prompts, samples):
        for seq in result.sequences:
            tokens, sampled_lp = list(seq.tokens), list(seq.logprobs)
            full = prompt + tokens
            ob = len(prompt) - 1
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": types.TensorData.from_numpy(np.array(full[1:], dtype=np.int64)),
                        "logprobs": floats([0.0] * ob + sampled_lp),
                        "advantages": floats([0.0] * (len(full) - 1)),
                        "mask": floats([0.0] * ob + [1.0] * len(tokens)),
                    },
                )
            )
    # incorporate_kl_penalty: the teacher scores each whole sequence (model_input + last target)
    full_inputs = [d.model_input.append_int(int(d.loss_fn_inputs["target_tokens"].data[-1])) for d in data]
    teacher_lps = await asyncio.gather(*[teacher_client.compute_logprobs_async(x) for x in full_inputs])
    kl_sum = mask_sum = 0.0
    train_data = []
    for datum, teacher_lp in zip(data, teacher_lps):
        assert teacher_lp[0] is None and len(teacher_lp) == datum.model_input.length + 1
        sampled = datum.loss_fn_inputs["logprobs"].to_numpy()
        mask = datum.loss_fn_inputs["mask"].to_numpy()
        reverse_kl = (sampled - np.array(teacher_lp[1:], dtype=np.float32)) * mask
        advantages = datum.loss_fn_inputs["advantages"].to_numpy() - mask * reverse_kl
        kl_sum, mask_sum = kl_sum + float(reverse_kl.sum()), mask_sum + float(mask.sum())
        inputs = {k: v for k, v in datum.loss_fn_inputs.items() if k not in ("mask", "advantages")}  # _remove_mask
        inputs["advantages"] = floats(advantages)
        train_data.append(types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    fwd_bwd = await training.forward_backward_async(train_data, "importance_sampling")
    optim = await training.optim_step_async(types.AdamParams(learning_rate=lr))
    out = await fwd_bwd
    await optim
    return kl_sum / mask_sum, train_data, out


def check_importance_sampling_loss(train_data, out) -> None:
    """loss:sum is -sum(exp(logp - sampler logp) * advantages) over every token of every datum,
    with logp the trainer's own (returned per datum)."""
    expected = 0.0
    for datum, output in zip(train_data, out.loss_fn_outputs):
        logp = output["logprobs"].to_numpy().astype(np.float64)
        ratio = np.exp(logp - datum.loss_fn_inputs["logprobs"].to_numpy())
        expected -= float((ratio * datum.loss_fn_inputs["advantages"].to_numpy()).sum())
    assert math.isfinite(out.metrics["loss:sum"])
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-3, abs=1e-3)


def test_the_pages_distillation_step_runs(served):
    """docs/tinker.md's step of on-policy distillation, as written (the page's base model renamed)."""
    marker = ("run", "tests/integration/test_tinker_distillation.py")
    (block,) = [b for b in blocks(DOCS / "tinker.md") if b.marker == marker and b.lang == "python"]
    assert '"quickstart"' in block.code
    with tinker.ServiceClient(base_url=served, api_key=KEY) as service:
        training = service.create_lora_training_client(base_model=BASE, rank=8).result()
        scope = {"service": service, "training": training, "prompt": types.ModelInput.from_ints(PATTERN[:4])}
        scope["types"] = types
        exec(compile(block.code.replace('"quickstart"', repr(BASE)), block.where, "exec"), scope)
    assert len(scope["data"]) == 4
    for datum in scope["data"]:  # a new student is its teacher: advantages 0
        np.testing.assert_allclose(datum.loss_fn_inputs["advantages"].to_numpy(), 0.0, atol=1e-4)
    assert math.isfinite(scope["fwd_bwd"].result().metrics["loss:sum"])


# the cookbook 0.5.8's calls (compute_logprobs_async, sample_async, ...), deprecated in the SDK 0.38
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_on_policy_distillation_loop(served):
    """The cookbook's loop, unmodified in what it sends. A new student (a LoRA adapter at zero) is
    its teacher: the reverse KL on its samples is 0, which holds only if the teacher's prompt
    logprobs line up token by token with the student's sampling logprobs. Taught to count down, it
    disagrees with its teacher, and the loop's steps train it on the teacher's verdicts."""

    async def run() -> list[float]:
        with tinker.ServiceClient(base_url=served, api_key=KEY) as sc:
            teacher_client = sc.create_sampling_client(base_model=BASE)  # as train_on_policy.main does
            training = await sc.create_lora_training_client_async(base_model=BASE, rank=8, seed=0)
            sampler = await training.save_weights_and_get_sampling_client_async()
            kls = []
            for step in range(STEPS):
                if step == 1:  # teach the student to count down: now it disagrees with its teacher
                    for _ in range(3):
                        fb = await training.forward_backward_async(
                            [reversed_datum(s) for s in (30, 12)], "cross_entropy"
                        )
                        opt = await training.optim_step_async(types.AdamParams(learning_rate=1e-2))
                        await fb
                        await opt
                    sampler = await training.save_weights_and_get_sampling_client_async()
                kl, train_data, out = await distillation_step(
                    sampler, teacher_client, training, pattern_prompts(4), group=4, max_tokens=6, lr=1e-3
                )
                check_importance_sampling_loss(train_data, out)
                kls.append(kl)
                sampler = await training.save_weights_and_get_sampling_client_async()
            return kls

    kls = asyncio.run(run())
    print("teacher_kl per step:", [round(x, 4) for x in kls])
    assert abs(kls[0]) < 1e-2, kls  # the student is its teacher: same logprobs, token by token
    assert kls[1] > 1.0, kls  # the student counting down: its teacher disagrees
    assert all(math.isfinite(x) for x in kls)


STEPS = 4
