"""The RL learner's wiring of PPO mini-batches, the ratio modes and the losses, on a tiny model.

The learner's own step code (slices, micro-batches, old-logprob pass, losses, metrics) runs as in
the trainer process; only DeepSpeed is replaced by a plain torch AdamW behind the same three calls
(forward, ``backward(loss, scale_wrt_gas=False)``, ``step()``), so it runs in one process. Samples
are drawn from the model itself by torch sampling, with the sampled tokens' logprobs recorded as
the engines report them.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from backends.train.engine import Dist
from backends.train.rl.step import RLStep
from skyrl_contracts.samples import Sample
from skyrl_contracts.schema import Recipe

VOCAB, PROMPT_LEN, RESPONSE_LEN = 32, 4, 5
GROUPS, GROUP_SIZE = 8, 4


class TorchEngine:
    """The part of a DeepSpeed engine the learner calls."""

    def __init__(self, model, lr: float):
        self.module = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def __call__(self, **kw):
        return self.module(**kw)

    def backward(self, loss, scale_wrt_gas=False):
        loss.backward()

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def sampled_batch(model) -> list[Sample]:
    """GROUPS prompts x GROUP_SIZE samples, with the sampled tokens' logprobs and rewards that
    differ within each group (a reward for each token 7 in the response)."""
    gen = torch.Generator().manual_seed(1)
    samples = []
    for g in range(GROUPS):
        prompt = torch.randint(1, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
        for k in range(GROUP_SIZE):
            ids, lps = list(prompt), []
            for _ in range(RESPONSE_LEN):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
                lps.append(float(torch.log_softmax(logits, -1)[token]))
                ids.append(token)
            response = ids[PROMPT_LEN:]
            reward = float(sum(t % 4 == 0 for t in response)) + 0.1 * k  # never all equal
            samples.append(Sample(f"0-{g}", k, prompt, response, [1] * RESPONSE_LEN, lps, reward, (0,)))
    return samples


def learner_for(model, *, kind="ppo_clip", mini_batches=4, ratio="proximal", lr=0.02, **loss_keys) -> RLStep:
    loss = {"kind": kind, "ratio": ratio, **loss_keys}
    recipe = Recipe.model_validate(
        {
            "name": "t",
            "model": {"init": {"hidden_size": 32, "layers": 2, "heads": 2}, "tokenizer": "char"},
            "data": {"task": "addition"},
            "rl": {
                "prompts_per_step": GROUPS,
                "samples_per_prompt": GROUP_SIZE,
                "max_new_tokens": RESPONSE_LEN,
                "mini_batches": mini_batches,
                "loss": loss,
                "async": {"off_policy": {"token_is_cap": None}},
            },
        }
    )
    # no process group, no DeepSpeed: see TorchEngine
    return RLStep(recipe.rl, TorchEngine(model, lr), Dist(0, 1, 0, torch.device("cpu")), pad_id=0)


@pytest.fixture(scope="module")
def start():
    model = tiny_model()
    return model, sampled_batch(model)


def trained(start, **kw):
    model, samples = start
    model = copy.deepcopy(model)
    metrics = learner_for(model, **kw).train(samples)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), metrics


def test_trainer_logprobs_align_exactly_with_the_sampled_tokens(start):
    _, metrics = trained(start, mini_batches=1)
    assert metrics["train/logprob_diff"] < 1e-5
    assert metrics["train/logprob_diff_max"] < 1e-4


@pytest.mark.parametrize("kind", ["ppo_clip", "dual_clip", "gspo", "cispo"])
def test_clipping_engages_from_the_second_update_on(start, kind):
    _, metrics = trained(start, kind=kind)
    assert metrics["train/updates"] == 4
    assert metrics["train/update1/clip_frac"] == 0.0  # ratio exactly 1 before any update
    assert metrics["train/update1/ratio_max"] == pytest.approx(1.0, abs=1e-6)
    later = [metrics[f"train/update{k}/clip_frac"] for k in (2, 3, 4)]
    assert max(later) > 0.0
    assert metrics["train/update4/approx_kl"] > 0.0


def test_the_four_loss_kinds_give_different_updates_with_four_mini_batches(start):
    # dual_clip departs from ppo_clip only where a negative-advantage ratio passes c: a low c
    # makes that happen within four small updates
    extra = {"dual_clip": {"dual_clip_c": 1.05}}
    params = {
        kind: trained(start, kind=kind, **extra.get(kind, {}))[0] for kind in ("ppo_clip", "dual_clip", "gspo", "cispo")
    }
    kinds = list(params)
    for i, a in enumerate(kinds):
        for b in kinds[i + 1 :]:
            assert not torch.allclose(params[a], params[b], atol=1e-7), f"{a} and {b} gave the same update"


def test_with_one_update_ppo_clip_and_cispo_are_the_same_gradient(start):
    """What mini_batches = 1 means: the ratio is 1, so the clipped losses reduce to the plain
    policy gradient (README, "The RL losses")."""
    ppo, _ = trained(start, kind="ppo_clip", mini_batches=1)
    cispo, _ = trained(start, kind="cispo", mini_batches=1)
    assert torch.allclose(ppo, cispo, atol=1e-6)


def test_bypass_ratio_is_taken_against_the_rollout_logprobs(start):
    """ratio = "rollout": already the first update's ratio is pi / mu, which differs from 1 by the
    engine-vs-trainer gap (here: the sampler's logprobs shifted on purpose)."""
    model, samples = start
    shifted = [copy.deepcopy(s) for s in samples]
    for s in shifted:
        s.rollout_logprobs = [lp - 0.5 for lp in s.rollout_logprobs]  # the sampler was "less sure"
    metrics = learner_for(copy.deepcopy(model), ratio="rollout").train(shifted)
    assert metrics["train/update1/ratio_mean"] == pytest.approx(float(torch.exp(torch.tensor(0.5))), rel=1e-3)
    assert metrics["train/update1/clip_frac"] > 0.0


def test_the_step_reports_its_phases_and_they_add_up_to_its_time(start):
    model, samples = start
    learner = learner_for(copy.deepcopy(model), mini_batches=2)
    began = time.perf_counter()
    metrics = learner.train(samples)
    took = time.perf_counter() - began
    phases = [metrics[f"timing/{name}_s"] for name in ("prepare", "forward_backward", "optimizer")]
    assert all(p > 0 for p in phases), phases
    # the laps are consecutive: together they are the step, less only the metrics after the last one
    assert took * 0.5 < sum(phases) <= took, (phases, took)
