"""Property-based broken recipes (hypothesis) against the validator and the planner.

Each example takes a built-in recipe (or a richer variant of the quickstart), breaks it one way and
runs ``skyrl recipes validate`` and ``skyrl <stage> --dry-run`` (the planner) in-process through the
real entry point. Whatever the break: never a traceback, never an internal error, exit 0 or 2, the
two commands agree, and every error line is ``file:line: ...`` pointing at the key it names. Breaks
that cannot be valid (an unknown key, a wrong type, a negative number, TOML syntax) must exit 2.

    .venv/bin/python -m pytest -q tests/faults/test_recipe_fuzz.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyrl_cli.recipe.registry import builtin_recipes

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = int(os.environ.get("SKYRL_FUZZ_EXAMPLES", "400"))
RANDOM = os.environ.get("SKYRL_FUZZ_RANDOM", "") not in ("", "0")  # new examples each run (CI: the same ones)
GENERATED: list[tuple[str, int]] = []  # (kind, validate's exit code) of each example, counted at the end

# Tables the built-in recipes leave at their defaults, so that their keys get broken too.
RICH_EXTRA = {
    "model": {"lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}},
    "rl": {
        "kl": {"coef": 0.01, "estimator": "k2"},
        "dynamic_sampling": {"enabled": True, "max_extra_batches": 2},
        "advantage": {"kind": "rloo"},
        "async": {"max_staleness": 1, "off_policy": {"token_is_cap": 2.0, "mask_low": 0.1}},
    },
    "inference": {
        "router": {"policy": "round_robin", "retries": 2, "retry_backoff_ms": 50, "circuit_breaker_failures": 5},
        "max_retries": 2,
        "request_timeout_s": 30.0,
    },
    "trainer": {"threads_per_rank": 1},
    "logging": {"wandb": {"mode": "disabled"}, "log_every": 5},
}


def _merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


# Local stand-ins for the files a built-in recipe names outside the checkout (a downloaded model,
# a data set, another run's output under runs/): so that its breaks reach the checks after the
# file checks.
LOCAL_FILES = {
    ("model", "path"): "model",
    ("rl", "init_from"): "model",
    ("data", "train"): "own_task/train.jsonl",
    ("data", "eval"): "own_task/eval.jsonl",
    ("inference", "speculative", "model"): "model",
    ("rl", "distillation", "teacher"): "model",
}


def _localized(data: dict) -> dict:
    for path, local in LOCAL_FILES.items():
        table = data
        for key in path[:-1]:
            table = table.get(key) if isinstance(table, dict) else None
        value = str(table.get(path[-1], "")) if isinstance(table, dict) else ""
        if value.startswith(("~", "run:")) or "runs/" in value:
            data = _set(data, path, local)
    return data


def _bases() -> dict[str, dict]:
    bases = {r.name: _localized(tomllib.loads(r.path.read_text())) for r in builtin_recipes()}
    quickstart = dict(bases["quickstart"])
    quickstart.pop("quantization", None)  # LoRA and quantization exclude each other
    bases["rich"] = _merged(quickstart, RICH_EXTRA)
    # A model directory (written per example, with a fuzzed config.json) for the checks that read it.
    from_path = {**quickstart, "model": {"path": "model"}, "data": {"task": "addition"}}
    bases["path_lora"] = _merged(from_path, {"model": {"lora": {"rank": 4}}})
    bases["path_quant"] = {**from_path, "quantization": {"group_size": 32}}
    return bases


def _leaves(data: dict, prefix: tuple = ()) -> list[tuple[tuple, object]]:
    """(key path, value) of every scalar or array in ``data``; tables are walked into."""
    out = []
    for key, value in data.items():
        if isinstance(value, dict):
            out += _leaves(value, (*prefix, key))
        else:
            out.append(((*prefix, key), value))
    return out


def _free_form(table: tuple) -> bool:
    """Tables whose keys are another library's options, not skyrl's: a reasoning-gym generator's
    config (checked when its rows are drawn: validation does not import reasoning-gym), a
    skyrl-gym environment's env_config, a verifiers environment's env_args."""
    return (
        table[-1:] == ("config",)
        and "reasoning_gym" in table
        or table[:2] in (("rl", "env_config"), ("rl", "env_args"))
    )


def _tables(data: dict, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    for key, value in data.items():
        if isinstance(value, dict):
            out += _tables(value, (*prefix, key))
    return out


def _set(data: dict, path: tuple, value: object) -> dict:
    """A copy of ``data`` with ``path`` set to ``value`` (``_DELETE``: removed)."""
    out = dict(data)
    if len(path) == 1:
        if value is _DELETE:
            out.pop(path[0], None)
        else:
            out[path[0]] = value
        return out
    out[path[0]] = _set(out.get(path[0], {}), path[1:], value)
    return out


_DELETE = object()
BASES = _bases()


@dataclass
class Broken:
    kind: str
    source: str
    must_fail: bool
    key: tuple = ()  # the key a must-fail break is reported at


# Values of every TOML type, odd ones included (NaN, inf, huge, empty, unicode).
ANY_VALUE = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=12),
    st.lists(st.integers(-3, 3) | st.text(max_size=4), max_size=3),
    st.dictionaries(st.sampled_from(["x", "rank", "steps", "kind"]), st.integers(-2, 2), max_size=2),
)
UNKNOWN_KEY = st.from_regex(r"\A[a-z][a-z_]{0,10}\Z").map(lambda k: f"zz_{k}")
LETTERS = st.from_regex(r"\A[a-z]{1,8}\Z")


def _wrong_type(value: object):
    """A value of a type no key holding ``value`` accepts."""
    if isinstance(value, bool):
        return LETTERS
    if isinstance(value, (int, float)):
        return LETTERS | st.just([1, 2]) | st.just({"x": 1})
    if isinstance(value, str):
        return st.integers(-5, 5) | st.just({"x": 1}) | st.just(True)
    return st.just({"x": 1})  # arrays: a table is never an array


@st.composite
def data_break(draw, base: dict) -> Broken:
    """One break of the recipe's data, written back as TOML (so every key has its own line)."""
    leaves = [(p, v) for p, v in _leaves(base) if not _free_form(p[:-1])]  # skyrl's keys, not a library's options
    kind = draw(
        st.sampled_from(
            [
                "delete",
                "wrong_type",
                "negative",
                "huge",
                "any_value",
                "unknown_key",
                "unknown_table",
                "delete_table",
                "layout",
                "table_to_scalar",
                "odd_path",
            ]
        )
    )
    if kind in ("delete", "wrong_type", "negative", "any_value"):
        candidates = leaves if kind != "negative" else [(p, v) for p, v in leaves if _is_number(v)]
        path, value = draw(st.sampled_from(candidates))
        if kind == "negative":
            new = st.just(-abs(value) - 1 if isinstance(value, int) else -abs(value) - 0.5)
        else:
            new = {"delete": st.just(_DELETE), "wrong_type": _wrong_type(value), "any_value": ANY_VALUE}[kind]
        data = _set(base, path, draw(new))
        must_fail = kind in ("wrong_type", "negative")
        return Broken(kind, tomli_w.dumps(data), must_fail, path if must_fail else ())
    if kind == "huge":
        path, _ = draw(st.sampled_from([(p, v) for p, v in leaves if _is_number(v)]))
        data = _set(base, path, draw(st.sampled_from([2**31, 10**12, 2**63 - 1, 1e30, float("inf")])))
        return Broken(kind, tomli_w.dumps(data), False)
    if kind == "unknown_key":
        table = draw(st.sampled_from([t for t in _tables(base) if not _free_form(t)]))
        key = draw(UNKNOWN_KEY)
        return Broken(kind, tomli_w.dumps(_set(base, (*table, key), draw(ANY_VALUE))), True, (*table, key))
    if kind == "unknown_table":
        key = draw(UNKNOWN_KEY)
        return Broken(kind, tomli_w.dumps({**base, key: {"x": 1}}), True, (key,))
    if kind == "table_to_scalar":
        table = draw(st.sampled_from([t for t in _tables(base) if t]))
        return Broken(
            kind,
            tomli_w.dumps(_set(base, table, draw(ANY_VALUE.filter(lambda v: not isinstance(v, dict))))),
            True,
            table,
        )
    if kind == "odd_path":
        data = _set(base, draw(st.sampled_from(PATH_KEYS)), draw(ODD_PATH))
        return Broken(kind, tomli_w.dumps(data), False)
    if kind == "delete_table":
        table = draw(st.sampled_from([t for t in _tables(base) if t]))
        return Broken(kind, tomli_w.dumps(_set(base, table, _DELETE)), False)
    return Broken(kind, tomli_w.dumps(_merged(base, draw(ABSURD_LAYOUT))), False)


# A plausible config.json of the stand-in model directory (Qwen2.5-1.5B's shape) for the recipes
# that name a downloaded model.
MODEL_JSON = json.dumps(
    {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "num_attention_heads": 12,
        "num_hidden_layers": 28,
        "intermediate_size": 8960,
        "max_position_embeddings": 32768,
    }
)
PATH_KEYS = [("model", "tokenizer"), ("data", "eval"), ("rl", "init_from"), ("quantization", "init_from")]
# Paths no file has or that name the wrong thing: a NUL byte, a name too long, an unknown user's
# home, a file for a directory, the model directory (config.json fuzzed), the directory itself.
ODD_PATH = st.sampled_from(
    [
        "a\x00b",
        "x" * 300,
        "~no_such_user_skyrl/m",
        "own_task/train.jsonl",
        "model",
        ".",
        "",
        "own_task",
        "model/config.json",
        "/",
        "//x",
    ]
) | st.text(max_size=8)
JSON_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 4096),
    st.floats(),
    st.text(max_size=6),
    st.lists(st.integers(0, 4), max_size=2),
)
MODEL_CONFIG = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            key: JSON_VALUE | st.sampled_from(["llama", "qwen2", "gpt2"]) if key == "model_type" else JSON_VALUE
            for key in (
                "model_type",
                "num_attention_heads",
                "hidden_size",
                "head_dim",
                "intermediate_size",
                "num_hidden_layers",
                "max_position_embeddings",
            )
        },
    ).map(json.dumps),
    st.sampled_from(["", "{", "[1, 2]", "null", '"llama"', "\ufeff{}", '{"model_type": "llama"}']),
    st.none(),  # no config.json at all
)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


ABSURD_LAYOUT = st.fixed_dictionaries(
    {},
    optional={
        "trainer": st.fixed_dictionaries(
            {},
            optional={
                "ranks": st.integers(1, 4096),
                "nnodes": st.integers(1, 64),
                "node_rank": st.integers(0, 64),
                "device": st.sampled_from(["auto", "cpu", "cuda"]),
                "gpus": st.lists(st.integers(0, 16), max_size=5),
                "zero_stage": st.integers(0, 3),
                "rdzv_endpoint": st.sampled_from(["h:1", "host:29500"]),
                "threads_per_rank": st.integers(1, 512),
            },
        ),
        "inference": st.fixed_dictionaries(
            {},
            optional={
                "engines": st.integers(0, 512),
                "tensor_parallel": st.integers(1, 64),
                "urls": st.lists(st.sampled_from(["http://10.0.0.1:8000", "not a url", ""]), max_size=2),
                "max_model_len": st.integers(1, 2**20),
                "kv_cache_bytes": st.integers(1, 2**40),
                "max_num_seqs": st.integers(1, 10**6),
                "gpu_memory_utilization": st.floats(0.01, 1.0),
            },
        ),
        "rl": st.fixed_dictionaries(
            {},
            optional={
                "prompts_per_step": st.integers(1, 10**6),
                "samples_per_prompt": st.integers(1, 4096),
                "max_new_tokens": st.integers(1, 10**6),
                "mini_batches": st.integers(1, 4096),
                "max_turns": st.integers(1, 10**4),
                "max_tokens_per_microbatch": st.integers(1, 10**7),
            },
        ),
        "sft": st.fixed_dictionaries(
            {},
            optional={
                "batch_size": st.integers(1, 10**6),
                "micro_batching": st.sampled_from(["dynamic", "fixed"]),
                "micro_batch_size": st.integers(1, 10**6),
                "max_tokens_per_microbatch": st.integers(1, 10**7),
            },
        ),
        "data": st.fixed_dictionaries({}, optional={"max_length": st.integers(1, 2**20), "digits": st.integers(1, 12)}),
    },
)


@st.composite
def text_break(draw, base_text: str) -> Broken:
    """A break of the TOML text itself; each one is a syntax error."""
    lines = base_text.splitlines()
    body = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
    i = draw(st.sampled_from(body))
    line = lines[i] = lines[i].split("#", 1)[0].rstrip()  # a break after a comment would be comment
    how = draw(st.sampled_from(["dup_key", "open_string", "no_value", "open_header", "stray", "dup_table"]))
    if how == "dup_key" and "=" in line and not line.startswith("["):
        lines.insert(i + 1, line)  # the same key twice in one table
    elif how == "dup_table" and line.startswith("["):
        lines.append(line)
    elif how == "open_header" and line.startswith("["):
        lines[i] = line.replace("]", "", 1)
    elif how == "no_value" and "=" in line:
        lines[i] = line.split("=", 1)[0] + "="
    elif how == "open_string":
        lines[i] = line + ' x = "unterminated'
    else:
        lines[i] = line + " " + draw(st.sampled_from(["= =", "}", "]]", '"', "[x"]))
    return Broken(f"syntax_{how}", "\n".join(lines) + "\n", True)


@st.composite
def broken_recipe(draw) -> tuple[str, Broken, str | None]:
    """(base name, the break, the model directory's config.json text or None for no file)."""
    name = draw(st.sampled_from(sorted(BASES)))
    config = draw(MODEL_CONFIG) if name.startswith("path_") else MODEL_JSON
    roll = draw(st.integers(0, 9))
    builtin = REPO / "recipes" / f"{name}.toml"
    if roll < 2:  # TOML syntax breaks of the file as written
        text = builtin.read_text() if builtin.is_file() else tomli_w.dumps(BASES[name])
        return name, draw(text_break(text)), config
    if roll == 2:  # not UTF-8: one byte of a Latin-1 editor in a comment or a string
        text = tomli_w.dumps(BASES[name]).replace('"', '"\udce9', 1)
        return name, Broken("not_utf8", text, True), config
    return name, draw(data_break(BASES[name])), config


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory with the built-in recipes' own files (own_task/: data, reward module), where the
    broken recipes are written and the commands run."""
    root = tmp_path_factory.mktemp("fuzz")
    for recipe in builtin_recipes():  # each one's own folder (data, reward or environment code)
        if recipe.path.with_suffix("").is_dir():
            shutil.copytree(
                recipe.path.with_suffix(""), root / recipe.name, ignore=shutil.ignore_patterns("__pycache__")
            )
    (root / "model").mkdir()
    old = os.getcwd()
    os.chdir(root)
    yield root
    os.chdir(old)
    refused = sum(code == 2 for _, code in GENERATED)
    kinds = sorted({kind for kind, _ in GENERATED})
    print(
        f"\n{len(GENERATED)} broken recipes generated, {refused} refused with exit 2: "
        + ", ".join(f"{k} {sum(kind == k for kind, _ in GENERATED)}" for k in kinds)
    )


def _skyrl(*args: str, gpus: int) -> tuple[int, str]:
    """``skyrl ARGS`` through the real entry point with ``gpus`` visible GPUs: (exit code, stderr + stdout)."""
    from skyrl_cli.app import main

    out, err = io.StringIO(), io.StringIO()
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(gpus)))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
                code = 0
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else 1
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
    return code, err.getvalue() + out.getvalue()


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def _check_lines(file: str, broken: Broken, errors: list[str]) -> None:
    """Every error line is ``file:line: ...`` at a real line; a must-fail break names its key there."""
    lines = broken.source.splitlines()
    pattern = re.compile(rf"^error: {re.escape(file)}:(\d+): (\S.*)$")
    located = []
    for text in errors:
        match = pattern.match(text)
        assert match, f"not a file:line: message: {text!r}"
        number = int(match.group(1))
        assert 1 <= number <= max(1, len(lines)), text
        located.append((number, match.group(2)))
    if broken.key:
        dotted = ".".join(map(str, broken.key))
        named = [(n, m) for n, m in located if m.startswith(f"{dotted}: ") or m.startswith(f"{dotted}[")]
        assert named, f"no line names {dotted}: {errors}"
        number, _ = named[0]
        assert re.search(rf"\b{re.escape(str(broken.key[-1]))}\b", lines[number - 1]), (lines[number - 1], named[0])


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, suppress_health_check=[HealthCheck.too_slow])
@given(case=broken_recipe(), gpus=st.sampled_from([0, 8]))
def test_a_broken_recipe_gets_exit_2_and_file_line_messages(workdir, case, gpus):
    name, broken, config = case
    path = workdir / f"{name}.toml"
    path.write_bytes(broken.source.encode("utf-8", "surrogateescape"))
    (workdir / "model" / "config.json").unlink(missing_ok=True)
    if config is not None:
        (workdir / "model" / "config.json").write_text(config)
    validated = _skyrl("recipes", "validate", path.name, "--gpus", str(gpus), gpus=gpus)
    stages = [s for s in ("sft", "rl", "tinker") if re.search(rf"^\[{s}[.\]]", broken.source, re.MULTILINE)] or ["sft"]
    commands = {"tinker": ("tinker", "serve")}
    planned = [_skyrl(*commands.get(stage, (stage,)), path.name, "--dry-run", gpus=gpus) for stage in stages]
    GENERATED.append((broken.kind, validated[0]))
    for code, output in [validated, *planned]:
        assert "Traceback" not in output and "internal error" not in output, output
        assert code in (0, 2), output
    if broken.must_fail:
        assert validated[0] == 2, f"{broken.kind} at {broken.key} was accepted:\n{broken.source}"
    if validated[0] == 2:
        errors = _error_lines(validated[1])
        assert errors, validated[1]
        _check_lines(path.name, broken, errors)
        for code, output in planned:  # the planner refuses what validate refuses, line for line
            assert (code, _error_lines(output)) == (2, errors)
    else:
        assert [code for code, _ in planned] == [0] * len(planned), planned


# ``--set`` overrides: a key path (real, misspelt or nonsense) and a value (TOML or not).
SET_KEY = st.one_of(
    st.sampled_from(
        [".".join(map(str, p)) for p, _ in _leaves(BASES["rich"])] + ["rl.async", "model.init", "inference.router"]
    ),
    st.from_regex(r"\A[a-z_.\[\]0-9]{1,20}\Z"),
)
SET_VALUE = st.one_of(
    st.sampled_from(["-1", "0", "1e400", "nan", "inf", "true", "[1,", "{x=1}", '"', "''", "[]", "{}", "null", "1_000"]),
    st.text(max_size=10),
)


@settings(
    max_examples=max(50, EXAMPLES // 3),
    deadline=None,
    derandomize=not RANDOM,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(key=SET_KEY, value=SET_VALUE, stage=st.sampled_from(["sft", "rl"]))
def test_a_broken_override_gets_exit_2_and_a_set_message(workdir, key, value, stage):
    path = workdir / "rich.toml"
    path.write_text(tomli_w.dumps(BASES["rich"]))
    validated = _skyrl("recipes", "validate", path.name, "--set", f"{key}={value}", gpus=0)
    planned = _skyrl(stage, path.name, "--dry-run", "--set", f"{key}={value}", gpus=0)
    GENERATED.append(("set_override", validated[0]))
    assert planned[0] == validated[0], (validated, planned)
    for code, output in (validated, planned):
        assert "Traceback" not in output and "internal error" not in output, output
        assert code in (0, 2), output
    if validated[0] == 2:
        errors = _error_lines(validated[1])
        assert errors and all(re.match(rf"^error: (--set: |{re.escape(path.name)}:\d+: )\S", e) for e in errors), errors
        assert planned == (2, "\n".join(errors) + "\n")


@pytest.mark.parametrize("name", sorted(BASES))
def test_every_base_recipe_is_valid_before_it_is_broken(workdir, name):
    """A break is only a break of a recipe that was valid: each base validates (on 8 GPUs: some
    built-in recipes need them), its model directory holding a plausible config.json."""
    (workdir / f"{name}.toml").write_text(tomli_w.dumps(BASES[name]))
    (workdir / "model" / "config.json").write_text(MODEL_JSON)
    code, output = _skyrl("recipes", "validate", f"{name}.toml", "--gpus", "8", gpus=8)
    assert code == 0, output
