"""Shared, session-scoped fixtures for integration tests: a tiny model, and 2 real vLLM engines + the
vllm-router started once per test session.

    def test_something(engines_and_router):
        live = engines_and_router
        live.router_url, live.engine_urls, live.model_dir, live.tokenizer_dir ...

The stack is started on first use and torn down (and checked for leftover processes) at the end of
the session. Tests may change engine state (weights, version labels) but must put it back: other
tests share it (``live.restore()`` reloads the original weights with version "0").
"""

from __future__ import annotations

import json
import os
import string
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.recipes import TINY_INIT, tiny_recipe

TINY_ALPHABET = string.digits + string.ascii_lowercase + " +-*=?.,"


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now, chosen as the launch plan chooses them."""
    from skyrl_contracts.ports import find_free_ports

    return find_free_ports(n)


def build_tiny_model(out_dir: Path, seed: int = 0, layers: int = 2) -> Path:
    """A random-init tiny Llama with a character tokenizer, saved as an HF directory."""
    from backends.models.loading import save_hf
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import TinyModelInit

    tokenizer = build_char_tokenizer(TINY_ALPHABET)
    model = build_tiny_model(TinyModelInit(**{**TINY_INIT, "layers": layers}), tokenizer, seed)
    return save_hf(model, tokenizer, out_dir)


def inference_recipe(engines: int = 2, policy: str = "sticky_least_loaded", model: dict | None = None, **inference):
    """A recipe for the inference tests; ``model`` adds keys to ``[model]`` (e.g. ``lora``), with
    the lengths the loader gives a recipe (the clients read ``inference.max_model_len``)."""
    from skyrl_cli.recipe.lengths import with_model_lengths
    from skyrl_contracts.schema import Recipe

    recipe = tiny_recipe(
        seed=None,
        model=model or {},
        data={"digits": None},
        rl={},
        inference={
            "engines": engines,
            "router": {"policy": policy},
            "max_retries": 4,
            "request_timeout_s": 60,
            **inference,
        },
        trainer=None,
    )
    return with_model_lengths(Recipe.model_validate(recipe))


def cpu_machine():
    from skyrl_cli.plan.inference import Machine

    cores = tuple(sorted(os.sched_getaffinity(0)))
    return Machine(device="cpu", engine_cores=cores)


def process_group_alive(pgid: int) -> bool:
    """True while any non-zombie process of group ``pgid`` exists."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            return True
    return False


def wait_groups_gone(pgids, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = list(pgids)
    while alive and time.monotonic() < deadline:
        alive = [g for g in alive if process_group_alive(g)]
        if alive:
            time.sleep(0.2)
    return alive


PATTERN_LOW, PATTERN_SIZE = 7, 36  # token ids 7..42 (the char alphabet): next = previous + 1, cyclic


def train_pattern_policy(model, steps: int = 150, lr: float = 3e-3):
    """Train ``model`` (a causal LM, or a peft model) in place for a few seconds on a cyclic pattern
    (next token = previous + 1) and return it in eval mode.

    A stand-in for "the trainer's new policy" in engine tests: its next-token distributions are
    sharp like a trained model's (a random init is nearly uniform, where a bf16 engine and fp32
    transformers can break near-ties differently), and its greedy output differs from the initial
    model's. Prompts of consecutive ids in 7..42 continue the cycle."""
    import torch

    gen = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is as fast and does not collapse when the cores are busy
    try:
        for _ in range(steps):
            starts = torch.randint(0, PATTERN_SIZE, (16, 1), generator=gen)
            batch = PATTERN_LOW + (starts + torch.arange(48)) % PATTERN_SIZE
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def load_and_train_pattern_policy(model_dir, steps: int = 150):
    import torch
    from transformers import AutoModelForCausalLM

    return train_pattern_policy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), steps)


def hf_greedy(model, prompt, max_new_tokens: int) -> list[int]:
    """transformers greedy continuation of one prompt (stops at eos, like the engines)."""
    import torch

    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@dataclass
class LiveInference:
    recipe: object
    supervisor: object
    stack: object  # skyrl_cli.engines.stack.InferenceStack
    run_dir: Path
    model_dir: Path

    @property
    def router_url(self) -> str:
        return self.stack.router_url

    @property
    def engine_urls(self) -> list[str]:
        return self.stack.engine_urls

    @property
    def engine_names(self) -> list[str]:
        return self.stack.engine_names

    def client(self, **overrides):
        """A RolloutClient over the router with the recipe's limits (``overrides`` win)."""
        from backends.rollout.client import RolloutClient

        inf = self.recipe.inference
        options = dict(
            max_concurrency=inf.max_concurrency,
            timeout_s=inf.request_timeout_s,
            max_retries=inf.max_retries,
            max_model_len=inf.max_model_len,
        )
        return RolloutClient(self.router_url, **{**options, **overrides})

    def restore(self) -> None:
        """Original weights, version "0", on every engine (and recorded for recovery)."""
        from backends.inference.weight_sync import CurrentWeights, record_current_weights, run_blocking, sync_weights

        record_current_weights(self.run_dir, CurrentWeights(str(self.model_dir), "0"))
        run_blocking(sync_weights(self.engine_urls, self.model_dir, "0"))


@contextmanager
def single_engine(recipe, model_dir, run_dir, machine=None):
    """One engine of ``recipe`` (no router) under its own supervisor: yields its URL."""
    from backends.inference.weight_sync import run_blocking, set_weight_version
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import engine_specs, engine_url

    machine = machine or cpu_machine()
    (port,) = free_ports(1)
    (spec,) = engine_specs(recipe, machine, [port], str(model_dir))
    with Supervisor(run_dir) as sup:
        sup.start(spec)
        sup.wait_ready([spec.name])
        url = engine_url(machine, port)
        run_blocking(set_weight_version([url], "0"))
        yield url


QUICKSTART_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.toml"
# The shortened quickstart's SFT stage (500 steps: it learns the sums and copies the teacher's
# flaw), which the RL tests of the quickstart start from.
SHORTENED_QUICKSTART = [
    "--set",
    "data.eval_size=200",
    "--set",
    "sft.steps=500",
    "--set",
    "sft.eval_every=0",
    "--set",
    "sft.save_every=0",
]


def finished_run(run_dir: Path) -> bool:
    summary = run_dir / "summary.json"
    return summary.exists() and json.loads(summary.read_text()).get("completed") is True


def made_once(tmp_path_factory, name: str, make) -> Path:
    """``<root>/<name>/run``, made by ``make(run_dir)`` once per test session, also when pytest-xdist
    splits it over workers (the workers share the parent of their base temp dirs, and wait on a
    file lock for the one making it); tests read it, never write it."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None
    root = shared or tmp_path_factory.getbasetemp()
    run_dir = root / name / "run"
    with FileLock(root / f"{name}.lock"):
        if not finished_run(run_dir):
            make(run_dir)
    return run_dir


@pytest.fixture(scope="session")
def shortened_quickstart_sft(tmp_path_factory) -> Path:
    """The run directory of ``skyrl sft quickstart`` with ``SHORTENED_QUICKSTART``."""
    from tests.integration.cli_runs import run_skyrl

    def make(run_dir: Path) -> None:
        run_skyrl("sft", QUICKSTART_RECIPE, "--run-dir", run_dir, "--quiet", *SHORTENED_QUICKSTART, timeout=600)

    return made_once(tmp_path_factory, "quickstart-sft", make)


# Its RL stage: 10 sync steps (4 mini-batches each) from the shortened SFT, a held-out evaluation
# at step 5 for the curves of `skyrl runs report`.
SHORTENED_QUICKSTART_RL = ["--set", "rl.steps=10", "--set", "rl.eval_every=5", "--set", "rl.save_every=0"]
RL_STDOUT = "stdout.txt"


@pytest.fixture(scope="session")
def shortened_quickstart_rl(tmp_path_factory, shortened_quickstart_sft) -> Path:
    """The run directory of ``skyrl rl quickstart`` (``SHORTENED_QUICKSTART_RL``) from
    ``shortened_quickstart_sft``, run once per test session; what it printed is in its
    ``RL_STDOUT``. Shared by the quickstart test and ``skyrl runs``' tests."""
    from tests.integration.cli_runs import run_skyrl

    def make(run_dir: Path) -> None:
        init = f"rl.init_from={shortened_quickstart_sft / 'final'}"
        rl = [*SHORTENED_QUICKSTART, *SHORTENED_QUICKSTART_RL, "--set", init]
        proc = run_skyrl("rl", QUICKSTART_RECIPE, "--run-dir", run_dir, "--quiet", *rl, timeout=600)
        (run_dir / RL_STDOUT).write_text(proc.stdout)

    return made_once(tmp_path_factory, "quickstart-rl", make)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model")


@dataclass
class PatternPolicy:
    model: object  # the trained transformers model (fp32, eval mode)
    weights_dir: Path  # its save_pretrained directory: what a trainer step writes


@pytest.fixture(scope="session")
def pattern_policy(tmp_path_factory, tiny_model_dir) -> PatternPolicy:
    """The tiny model trained on the cyclic pattern (see ``train_pattern_policy``), trained once."""
    model = load_and_train_pattern_policy(tiny_model_dir)
    weights_dir = tmp_path_factory.mktemp("pattern-policy") / "step-1"
    model.save_pretrained(weights_dir)
    return PatternPolicy(model, weights_dir)


@pytest.fixture(scope="session")
def engines_and_router(tmp_path_factory, tiny_model_dir):
    from skyrl_cli.engines.stack import launch_inference
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import all_engine_urls, engine_specs, engine_url, router_spec

    recipe = inference_recipe()
    machine = cpu_machine()
    run_dir = tmp_path_factory.mktemp("inference-run")
    *engine_ports, router_port, prometheus_port = free_ports(recipe.inference.engines + 2)
    engines = engine_specs(recipe, machine, engine_ports, str(tiny_model_dir))
    urls = all_engine_urls(recipe, machine, engine_ports)
    router = router_spec(recipe, machine, urls, router_port, prometheus_port)
    with Supervisor(run_dir) as sup:
        stack = launch_inference(
            sup, engines, router, urls, engine_url(machine, router_port), run_dir, metrics_period_s=None
        )
        live = LiveInference(recipe, sup, stack, run_dir, tiny_model_dir)
        try:
            yield live
        finally:
            stack.stop()
            groups = [p.popen.pid for p in sup.processes.values()]
    leftover = wait_groups_gone(groups)
    assert not leftover, f"processes left behind by process groups {leftover}"
