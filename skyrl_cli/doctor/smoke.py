"""``skyrl doctor --smoke``: start one real vLLM engine as the recipe's plan starts it, on the
recipe's model (a tiny random-init one is built for ``model.init``), and generate a few tokens."""

from __future__ import annotations

import string
import sys
import tempfile
import time
from pathlib import Path

from skyrl_cli.doctor.checks import Check, failed, passed, run_child
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.recipe.schema import Recipe

ALPHABET = string.digits + string.ascii_lowercase + " +-*=?.,"

BUILD_TINY_MODEL = """
import sys
from backends.models.loading import save_hf
from backends.models.tiny import build_tiny_llama
from backends.models.tokenizer import build_char_tokenizer
from skyrl_cli.recipe.schema import TinyModelInit
tokenizer = build_char_tokenizer(sys.argv[2])
save_hf(build_tiny_llama(TinyModelInit.model_validate_json(sys.argv[1]), tokenizer, 0), tokenizer, sys.argv[3])
print(sys.argv[3])
"""


def _model_dir(recipe: Recipe, base_dir: Path, scratch: Path, timeout_s: float) -> tuple[Path | None, str]:
    from skyrl_cli.recipe.validate import resolve_path

    if recipe.model.init is None:
        return resolve_path(recipe.model.path, base_dir), ""
    out = scratch / "model"
    argv = [sys.executable, "-c", BUILD_TINY_MODEL, recipe.model.init.model_dump_json(), ALPHABET, str(out)]
    built = run_child(argv, timeout_s)
    return (out, "") if built.ok else (None, f"building the tiny model failed: {built.output}")


def _generate(url: str) -> str:
    import httpx

    from skyrl_cli.plan.inference import ENGINE_MODEL_NAME

    body = {"model": ENGINE_MODEL_NAME, "prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30.0)
    answer.raise_for_status()
    return repr(answer.json()["choices"][0]["text"])


def check_engine_smoke(recipe: Recipe, machine: MachineFacts, base_dir: Path, timeout_s: float) -> Check:
    import httpx

    from skyrl_cli.errors import SkyrlError
    from skyrl_cli.launch.supervisor import Supervisor, log_tail
    from skyrl_cli.plan.inference import engine_specs, engine_url
    from skyrl_cli.plan.rl import inference_machine
    from skyrl_cli.plan.trainer import trainer_device
    from skyrl_cli.ports import find_free_ports
    from skyrl_cli.rundir import RunDir

    started = time.monotonic()
    one_engine = recipe.model_copy(update={"inference": recipe.inference.model_copy(update={"engines": 1})})
    engines_on = inference_machine(one_engine, machine, trainer_device(one_engine, machine))
    with tempfile.TemporaryDirectory(prefix="skyrl-doctor-smoke-") as scratch:
        model_dir, why = _model_dir(one_engine, base_dir, Path(scratch), timeout_s)
        if model_dir is None:
            return failed("engine smoke test", why, "see skyrl doctor's package lines; scripts/setup.sh installs the tested set")
        (port,) = find_free_ports(1)
        (spec,) = engine_specs(one_engine, engines_on, [port], str(model_dir))
        try:
            with Supervisor(scratch) as supervisor:
                supervisor.start(spec)
                supervisor.wait_ready([spec.name], timeout_s=max(timeout_s - (time.monotonic() - started), 1.0))
                text = _generate(engine_url(engines_on, port))
        except (SkyrlError, OSError, ValueError, KeyError, httpx.HTTPError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0].split("; see ")[0]
            last = log_tail(RunDir(scratch).log(spec.name), 1).strip()[-300:] or "(empty)"  # the scratch folder goes next
            fix = (f"on a busy machine give it longer (--smoke-timeout {2 * timeout_s:.0f}); else start it by hand "
                   f"to see the whole log: {' '.join(spec.argv[:4])} ...")  # fmt: skip
            return failed("engine smoke test", f"{first}; its log ends: {last}", fix)
    elapsed = time.monotonic() - started
    return passed("engine smoke test", f"a vLLM engine on {engines_on.device} started and generated {text} in {elapsed:.0f} s")
