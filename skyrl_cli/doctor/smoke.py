"""``skyrl doctor --smoke``: start one real vLLM engine as the recipe's plan starts it, on the
recipe's model (a tiny random-init one is built for ``model.init``), generate a few tokens, and, where
the RL stage reloads full weights, make one weight-sync round trip: a moved copy of the model
published as the learner publishes it, reloaded, and the engine's logprobs compared with
transformers' (``backends.inference.sync_check``; a tied head left behind shows here)."""

from __future__ import annotations

import json
import string
import sys
import tempfile
import time
from pathlib import Path

import httpx

from skyrl_cli.doctor.checks import Check, failed, passed, run_child
from skyrl_cli.launch.supervisor import Supervisor, log_tail
from skyrl_cli.launch.tiny_model import build_tiny_model_dir
from skyrl_cli.plan.inference import engine_dtype, engine_specs, engine_url
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.rl import inference_machine, untied_engine_model
from skyrl_cli.plan.trainer import trainer_device
from skyrl_cli.plan.weight_sync import select_weight_sync
from skyrl_cli.recipe.validate import resolve_path
from skyrl_contracts.engine_api import SERVED_MODEL_NAME
from skyrl_contracts.errors import LaunchError, SkyrlError
from skyrl_contracts.health import sync_gap_floor
from skyrl_contracts.ports import find_free_ports
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.schema import Recipe
from skyrl_contracts.transports import TRANSPORTS

ALPHABET = string.digits + string.ascii_lowercase + " +-*=?.,"


def _model_dir(recipe: Recipe, base_dir: Path, scratch: Path, timeout_s: float) -> tuple[Path | None, str]:
    if recipe.model.init is None:
        return resolve_path(recipe.model.path, base_dir), ""
    try:
        build_tiny_model_dir(recipe.model.init, ALPHABET, scratch / "model", timeout_s)
    except LaunchError as err:
        return None, str(err)
    return scratch / "model", ""


def _reloads_full_weights(recipe: Recipe, device: str) -> bool:
    """The plan's transport has the engines reload full weights into ``engine-model/`` (LoRA adapters
    and INT4 exports are other paths; NCCL needs a trainer, so the smoke test checks its disk fallback)."""
    return TRANSPORTS[select_weight_sync(recipe, device, transfer_available=False)].engine_model == "untied"


def _served_model(
    recipe: Recipe, device: str, model_dir: Path, scratch: Path, machine: MachineFacts, timeout_s: float
) -> tuple[Path | None, str]:
    """What the RL stage's engines start from: the plan's setup job's ``engine-model/`` (a tied model untied)."""
    if not _reloads_full_weights(recipe, device):
        return model_dir, ""
    (setup,), served = untied_engine_model(scratch, model_dir, machine)
    made = run_child(setup.argv, timeout_s)
    return (served, "") if made.ok else (None, f"preparing the engines' model failed: {made.output}")


def _sync_round_trip(
    recipe: Recipe, device: str, dtype: str, url: str, model_dir: Path, scratch: Path, timeout_s: float
) -> tuple[bool, str] | None:
    """(within the bound, what was measured), or None where the RL stage reloads no full weights."""
    if not _reloads_full_weights(recipe, device):
        return None
    argv = [
        sys.executable,
        "-m",
        "backends.inference.sync_check",
        "--engine-url",
        url,
        "--model",
        str(model_dir),
        "--scratch",
        str(scratch),
        "--engine-dtype",
        dtype,
    ]
    done = run_child(argv, timeout_s)
    if not done.ok:
        return False, f"the weight-sync round trip failed: {done.output}"
    result, bound = json.loads(done.output), sync_gap_floor(dtype)
    what = (
        f"a weight-sync round trip ({'tied' if result['tied'] else 'untied'} head) gave logprobs "
        f"{result['mean_abs_diff']:.1e} from transformers' (mean; max {result['max_abs_diff']:.1e}; bound {bound:.0e}, {dtype})"
    )
    return result["mean_abs_diff"] <= bound, what


def _generate(url: str) -> str:
    body = {"model": SERVED_MODEL_NAME, "prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30.0)
    answer.raise_for_status()
    return repr(answer.json()["choices"][0]["text"])


def check_engine_smoke(recipe: Recipe, machine: MachineFacts, base_dir: Path, timeout_s: float) -> Check:
    started = time.monotonic()
    one_engine = recipe.model_copy(update={"inference": recipe.inference.model_copy(update={"engines": 1})})
    device = trainer_device(one_engine, machine)
    engines_on = inference_machine(one_engine, machine, device)
    no_model_fix = "see skyrl doctor's package lines; scripts/setup.sh installs the tested set"
    with tempfile.TemporaryDirectory(prefix="skyrl-doctor-smoke-") as scratch:
        model_dir, why = _model_dir(one_engine, base_dir, Path(scratch), timeout_s)
        if model_dir is None:
            return failed("engine smoke test", why, no_model_fix)
        served, why = _served_model(one_engine, device, model_dir, Path(scratch), machine, timeout_s)
        if served is None:
            return failed("engine smoke test", why, no_model_fix)
        (port,) = find_free_ports(1)
        (spec,) = engine_specs(one_engine, engines_on, [port], str(served))
        url = engine_url(engines_on, port)
        try:
            with Supervisor(scratch) as supervisor:
                supervisor.start(spec)
                supervisor.wait_ready([spec.name], timeout_s=max(timeout_s - (time.monotonic() - started), 1.0))
                text = _generate(url)
                remaining = max(timeout_s - (time.monotonic() - started), 30.0)
                dtype = engine_dtype(one_engine, engines_on)
                sync = _sync_round_trip(one_engine, device, dtype, url, model_dir, Path(scratch), remaining)
        except (SkyrlError, OSError, ValueError, KeyError, httpx.HTTPError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0].split("; see ")[0]
            last = (
                log_tail(RunDir(scratch).log(spec.name), 1).strip()[-300:] or "(empty)"
            )  # the scratch folder goes next
            fix = (
                f"on a busy machine give it longer (--smoke-timeout {2 * timeout_s:.0f}); else start it by hand "
                f"to see the whole log: {' '.join(spec.argv[:4])} ..."
            )
            return failed("engine smoke test", f"{first}; its log ends: {last}", fix)
    elapsed = time.monotonic() - started
    if sync is not None and not sync[0]:
        return failed(
            "engine smoke test",
            f"{sync[1]}: the engine does not serve the weights it was given",
            "report it with this line and the versions from skyrl doctor; RL on this model would not learn",
        )
    said = f"; {sync[1]}" if sync is not None else ""
    return passed(
        "engine smoke test",
        f"a vLLM engine on {engines_on.device} started and generated {text} in {elapsed:.0f} s{said}",
    )
