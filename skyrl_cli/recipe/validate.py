"""Checks beyond the schema: knobs accepted but not implemented yet, files that must exist, user
code that must be findable, loss and data settings that cannot act. What a machine must offer
(devices, batches over ranks, what vLLM serves) is ``skyrl_cli.plan.feasibility``; lengths that
follow the model are ``skyrl_cli.recipe.lengths``.

Each check returns ``Problem``s (a key path and a message); ``skyrl_cli.recipe.loader`` adds the
file and line. ``NOT_YET_IMPLEMENTED`` is THE list of accepted-but-unimplemented values: when a
feature lands, delete its entry here (and its broken-recipe test, if any) in the same change.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from dataclasses import dataclass
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any, Callable

from skyrl_cli.recipe.registry import builtin_recipes
from skyrl_cli.recipe.tokenizers import vocabulary_difference
from skyrl_contracts.episodes import TASKS_WITH_TOOLS, episode_kind, turn_problems
from skyrl_contracts.losses import RATIO_BOUNDS, inert_loss_keys
from skyrl_contracts.rundir import RUNS_ROOT, sft_output_dir
from skyrl_contracts.schema import Recipe, environment_library


@dataclass(frozen=True)
class Problem:
    path: tuple[str | int, ...]
    message: str


@dataclass(frozen=True)
class NotYetImplemented:
    path: str  # dotted TOML key the message points at
    applies: Callable[[Recipe], bool]
    what: str
    example: str  # a --set that triggers it (the tests use it)


# Empty today: every key the schema accepts acts. A knob that lands before its code goes here.
NOT_YET_IMPLEMENTED: tuple[NotYetImplemented, ...] = ()


def not_yet_implemented(recipe: Recipe) -> list[Problem]:
    return [
        Problem(tuple(entry.path.split(".")), f"{entry.what} is not implemented yet; remove this setting")
        for entry in NOT_YET_IMPLEMENTED
        if entry.applies(recipe)
    ]


# ----------------------------------------------------------------------------------------- files

# Keys whose string value names a local file or directory (relative to the recipe's directory),
# with the values that are keywords instead of paths.
PATH_KEYS: dict[tuple[str, ...], frozenset[str]] = {
    ("model", "path"): frozenset(),
    ("model", "tokenizer"): frozenset({"auto", "char"}),
    ("data", "train"): frozenset(),
    ("data", "eval"): frozenset(),
    ("rl", "init_from"): frozenset({"sft"}),
    ("quantization", "init_from"): frozenset({"sft"}),
    ("inference", "speculative", "model"): frozenset(),
    ("rl", "distillation", "teacher"): frozenset(),
    ("rl", "judge", "model"): frozenset(),
}


# Keys naming a directory skyrl writes: resolved like PATH_KEYS, but they need not exist yet.
OUTPUT_PATH_KEYS: dict[tuple[str, ...], frozenset[str]] = {("tinker", "storage_dir"): frozenset()}


def _get(data: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


RUN_OUTPUT_PREFIX = "run:"


def resolve_path(value: str, base_dir: Path) -> Path:
    """``value`` against ``base_dir``; a value no file can have (a NUL byte, ``~user`` of no such
    user) comes back unresolved, and ``missing_files`` reports it.

    ``run:<run>/<stage>`` is that run's final model where skyrl writes it, ``runs/<run>/<stage>/final``
    under the directory skyrl runs in, wherever the recipe file is (a built-in recipe installed from
    a wheel, or copied elsewhere, still finds the quickstart's SFT output)."""
    if value.startswith(RUN_OUTPUT_PREFIX):
        return (RUNS_ROOT / value[len(RUN_OUTPUT_PREFIX) :].strip("/") / "final").resolve()
    try:
        path = Path(value).expanduser()
    except RuntimeError:
        path = Path(value)
    try:
        return (base_dir / path).resolve()
    except (OSError, ValueError):
        return base_dir / path


# The stages whose command writes a run's model to runs/<run>/<stage>/final (skyrl_contracts.rundir).
STAGES_WITH_A_FINAL_MODEL = ("sft", "rl")


def run_output_hint(path: Path) -> str:
    """How to make a missing run output: ``path`` is ``<dir>/runs/<run>/<stage>/final``, which
    ``skyrl <stage>`` on the recipe named ``<run>``, run in ``<dir>``, writes. Else ``""``."""
    parts = path.parts
    if len(parts) < 5 or parts[-1] != "final" or parts[-2] not in STAGES_WITH_A_FINAL_MODEL:
        return ""
    if parts[-4] != RUNS_ROOT.name:
        return ""
    run, stage, home = parts[-3], parts[-2], Path(*parts[:-4])
    builtin = run in {r.name for r in builtin_recipes()}
    command = f"`skyrl {stage} {run}`" if builtin else f"`skyrl {stage}` on the recipe named {run!r}"
    written = f"{RUNS_ROOT.name}/{run}/{stage}/final"
    try:
        here = home == Path.cwd().resolve()
    except OSError:  # the working directory is gone
        here = False
    if here:
        return f"; run {command} first (it writes {written})"
    return f"; run {command} in {home} first (it writes {written} there)"


def _path_problem(value: str, base_dir: Path) -> str | None:
    path = resolve_path(value, base_dir)
    try:
        found = path.exists()
    except (OSError, ValueError) as err:  # a name too long, a NUL byte
        return f"not a usable path: {value!r} ({getattr(err, 'strerror', None) or err})"
    return None if found else f"file not found: {value}{run_output_hint(path)}"


def missing_files(data: dict[str, Any], base_dir: Path) -> list[Problem]:
    """Path-valued keys of the raw recipe data that name nothing on disk."""
    problems = []
    for path, keywords in PATH_KEYS.items():
        value = _get(data, path)
        problem = _path_problem(value, base_dir) if isinstance(value, str) and value not in keywords else None
        if problem is None and path in DATA_KEYS and isinstance(value, str):
            problem = _data_file_problem(resolve_path(value, base_dir))
        if problem and path in AUXILIARY_MODEL_KEYS and written_by_own_sft(resolve_path(value, base_dir), data):
            problem = None  # skyrl_cli.stages.local.ensure_auxiliary_models checks it when RL starts
        if problem:
            problems.append(Problem(path, problem))
    return problems


DATA_KEYS = (("data", "train"), ("data", "eval"))
AUXILIARY_MODEL_KEYS = (("rl", "distillation", "teacher"), ("rl", "judge", "model"))


def written_by_own_sft(path: Path, data: dict[str, Any]) -> bool:
    """``path`` is the final model of this recipe's own SFT stage (``run:<name>/sft``): missing
    before that stage has run, there when the RL stage after it starts. (A teacher or a judge
    trained by the recipe's SFT stage, for a student that starts elsewhere.)"""
    name = data.get("name")
    if not isinstance(data.get("sft"), dict) or not isinstance(name, str):
        return False
    return path == resolve_path(f"{RUN_OUTPUT_PREFIX}{name}/sft", Path.cwd())


def _data_file_problem(path: Path) -> str | None:
    """A data file of a format the data layer does not read (a .csv passed validation and failed
    when the stage started, after an SFT stage may have run)."""
    if path.is_dir() or path.suffix.lower() in DATA_FILE_SUFFIXES:
        return None
    return f"unsupported data file {path.name!r} (use .jsonl, .parquet or an HF dataset directory)"


def with_absolute_paths(recipe: Recipe, base_dir: Path) -> Recipe:
    """The recipe with every path-valued key resolved against ``base_dir``."""
    data = recipe.model_dump(mode="json", by_alias=True, exclude_unset=False)
    for path, keywords in {**PATH_KEYS, **OUTPUT_PATH_KEYS}.items():
        value = _get(data, path)
        if isinstance(value, str) and value not in keywords:
            _get(data, path[:-1])[path[-1]] = str(resolve_path(value, base_dir))
    return Recipe.model_validate(data)


# ------------------------------------------------------------------------------------- user code

# Keys naming user code as ``module:name``. The RL orchestrator imports the module with the
# recipe's directory first on its path, then the directory skyrl runs in, then the installed
# packages (skyrl_cli.plan.rl.orchestrator_spec); here it is only looked up, never imported (user
# code may be heavy, and validation stays light).
USER_CODE_KEYS = (("rl", "reward"), ("rl", "environment"), ("rl", "agent"))


def module_findable(name: str, first: list[Path]) -> bool:
    """Whether ``import name`` would find something, searching ``first`` before the installed packages."""
    parts = name.split(".")
    spec = PathFinder.find_spec(parts[0], [str(p) for p in first])
    if spec is None:
        try:
            spec = importlib.util.find_spec(parts[0])
        except (ImportError, ValueError):
            spec = None
    for i in range(1, len(parts)):  # submodules: found in their package's folders, nothing run
        if spec is None or not spec.submodule_search_locations:
            return False
        spec = PathFinder.find_spec(".".join(parts[: i + 1]), list(spec.submodule_search_locations))
    return spec is not None


def user_code_problems(recipe: Recipe, base_dir: Path) -> list[Problem]:
    problems = []
    first = [base_dir, Path.cwd()]
    for path in USER_CODE_KEYS:
        ref = _get(recipe.model_dump(by_alias=True), path)
        if not isinstance(ref, str) or (path == ("rl", "environment") and environment_library(ref)):
            continue  # a library's environments: environment_problems
        if not module_findable(ref.partition(":")[0], first):
            problems.append(Problem(path, f"cannot find module {ref.partition(':')[0]!r} ({LOOKED})"))
    if recipe.rl is not None:
        for i, module in enumerate(recipe.rl.environment_modules):
            if not module_findable(module, first):
                problems.append(Problem(("rl", "environment_modules", i), f"cannot find module {module!r} ({LOOKED})"))
    return problems


LOOKED = "looked next to the recipe, in the current directory and in the installed packages"
# The package each library's environments need, and its install command.
LIBRARY_PACKAGES = {
    "skyrl_gym": ("skyrl_gym", 'pip install "skyrl-gym>=0.4,<0.5"'),
    "verifiers": ("verifiers", 'pip install "skyrl-cli[verifiers]"'),
}
# Keys of our own tool loop, which a skyrl-gym episode does not use.
SKYRL_GYM_INERT = ("tool_parser", "tool_timeout_s", "tool_errors")
CLASS_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def environment_problems(recipe: Recipe) -> list[Problem]:
    """rl.environment's form, its library installed, and the keys only one library reads."""
    rl = recipe.rl
    if rl is None:
        return []
    library = environment_library(rl.environment)
    problems = []
    if rl.environment and library is None and not CLASS_REF.match(rl.environment):
        problems.append(
            Problem(
                ("rl", "environment"),
                f"{rl.environment!r} is neither a class 'module:Class' nor a library environment "
                "('skyrl_gym:<id>', 'skyrl_gym', 'verifiers:<environment>')",
            )
        )
    if library is not None:
        module, install = LIBRARY_PACKAGES[library[0]]
        if not module_findable(module, []):
            problems.append(Problem(("rl", "environment"), f"needs the {module} package: {install}"))
        if library[0] == "verifiers" and not library[1] and not (rl.env_args.get("taskset") or {}).get("id"):
            problems.append(
                Problem(
                    ("rl", "environment"),
                    "name the verifiers taskset: 'verifiers:<taskset id>' (or rl.env_args.taskset.id)",
                )
            )
    kind = library[0] if library else None
    if kind == "skyrl_gym":  # its tool groups run inside the environment's step
        why = "a skyrl-gym environment runs its tool groups itself, inside step(); remove this key"
        problems += [Problem(("rl", key), why) for key in SKYRL_GYM_INERT if key in rl.model_fields_set]
    for key, wanted in (("env_config", "skyrl_gym"), ("environment_modules", "skyrl_gym"), ("env_args", "verifiers")):
        if getattr(rl, key) and kind != wanted:
            problems.append(Problem(("rl", key), f'applies to rl.environment = "{wanted}:..." only; remove this key'))
    return problems


# ---------------------------------------------------------------------------------------- losses


def loss_problems(recipe: Recipe) -> list[Problem]:
    """Loss settings the recipe states explicitly that cannot act in its combination (the
    defaults are not reported: they are the values a loss kind ignores silently by design)."""
    rl = recipe.rl
    if rl is None:
        return []
    loss, stated = rl.loss, rl.loss.model_fields_set
    problems: list[Problem] = []

    def refuse(key: str, why: str) -> None:
        if key in stated:
            problems.append(Problem(("rl", "loss", key), why))

    if rl.mini_batches * rl.epochs == 1 and loss.ratio == "proximal":
        why = (
            "clipping cannot act: with one update per step (rl.mini_batches = rl.epochs = 1) the ratio to the "
            'proximal policy is exactly 1; set rl.mini_batches > 1 or rl.loss.ratio = "rollout", or remove this key'
        )
        for key in RATIO_BOUNDS:
            refuse(key, why)
    for key, why in inert_loss_keys(loss.kind).items():
        refuse(key, why)
    off_policy = rl.async_.off_policy
    if loss.ratio == "rollout":
        for key in sorted({"token_is_cap", "seq_is_cap"} & off_policy.model_fields_set):
            problems.append(
                Problem(
                    ("rl", "async", "off_policy", key),
                    'with rl.loss.ratio = "rollout" the ratio to the sampler carries the behaviour correction; no separate IS weight applies',
                )
            )
    return problems


# ---------------------------------------------------------------------------------- distillation


def student_tokenizer_dir(recipe: Recipe, base_dir: Path) -> Path | None:
    """The directory whose tokenizer the RL stage's policy uses: ``rl.init_from``, else the SFT
    stage's (its output once written, ``model.tokenizer`` when it is a path, else ``model.path``);
    None where it is not on disk yet (a char tokenizer is built by the SFT stage)."""
    rl, model = recipe.rl, recipe.model
    if rl.init_from != "sft":
        return resolve_path(rl.init_from, base_dir)
    written = sft_output_dir(recipe)
    if (written / "config.json").is_file():
        return written
    if model.tokenizer not in ("auto", "char"):
        return resolve_path(model.tokenizer, base_dir)
    return resolve_path(model.path, base_dir) if model.path is not None else None


def distillation_problems(recipe: Recipe, base_dir: Path) -> list[Problem]:
    """``rl.distillation`` in a combination where it, or a key beside it, cannot act; a teacher
    whose vocabulary is not the policy's."""
    rl = recipe.rl
    if rl is None or rl.distillation is None:
        return []
    distill, problems = rl.distillation, []
    if recipe.cluster is not None:
        why = "a teacher is served on one machine: distillation does not run across nodes ([cluster]) yet"
        problems.append(Problem(("rl", "distillation"), why))
    if not distill.task_reward:
        if rl.dynamic_sampling.enabled:
            why = "drops groups by their task reward, which pure distillation (rl.distillation.task_reward = false) does not train on"
            problems.append(Problem(("rl", "dynamic_sampling", "enabled"), why))
        if "advantage" in rl.model_fields_set:
            why = "the task reward's advantage; with rl.distillation.task_reward = false it does not act: remove it"
            problems.append(Problem(("rl", "advantage"), why))
    student = student_tokenizer_dir(recipe, base_dir)
    if student is not None:
        why = vocabulary_difference(student, resolve_path(distill.teacher, base_dir))
        if why:
            problems.append(Problem(("rl", "distillation", "teacher"), f"not the policy's tokenizer: {why}"))
    return problems


def judge_problems(recipe: Recipe) -> list[Problem]:
    """``rl.judge`` where it cannot be the reward: beside another reward, with episodes that score
    themselves, across nodes, or in a pure distillation that trains on no reward."""
    rl = recipe.rl
    if rl is None or rl.judge is None:
        return []
    problems = []
    if rl.reward is not None:
        problems.append(
            Problem(("rl", "reward"), "set rl.reward or [rl.judge], not both: the judge's verdict is the reward")
        )
    kind = episode_kind(recipe)
    if kind != "single_turn" and rl.reward is None:
        scorer = {"agent": "rl.agent", "environment": "the environment"}.get(kind, f"the {kind} environment")
        why = f"the judge scores single-turn answers; these episodes are scored by {scorer} (remove [rl.judge])"
        problems.append(Problem(("rl", "judge"), why))
    if rl.judge.verdict == "number" and "labels" in rl.judge.model_fields_set:
        why = 'labels act only with verdict = "label" or "regex" (verdict is "number"): remove them'
        problems.append(Problem(("rl", "judge", "labels"), why))
    if recipe.cluster is not None:
        problems.append(
            Problem(("rl", "judge"), "a judge is served on one machine: it does not run across nodes ([cluster]) yet")
        )
    if rl.distillation is not None and not rl.distillation.task_reward:
        why = "pure distillation (rl.distillation.task_reward = false) trains on no reward: the judge would not act"
        problems.append(Problem(("rl", "judge"), why))
    return problems


# ------------------------------------------------------------------------------------------ data

# Built-in tasks whose demonstrations can be flawed (backends.data.tasks: Task.flawed_answer);
# light on purpose: the CLI does not import the data layer.
TASKS_WITH_A_FLAW = frozenset({"addition", "lookup"})
DATA_FILE_SUFFIXES = frozenset({".jsonl", ".json", ".parquet"})  # backends.data.files.load_rows reads these


_REGISTERS = re.compile(r"""register_dataset\(\s*(?:(["'])(\w+)\1|(\w+))""")


def reasoning_gym_names() -> list[str] | None:
    """The dataset names the installed reasoning-gym registers, read from its source (importing it
    takes seconds): ``register_dataset("name", ...)`` or ``register_dataset(NAME, ...)`` with
    ``NAME = "name"`` in the same file. None when the package is not installed."""
    spec = importlib.util.find_spec("reasoning_gym")
    if spec is None:
        return None
    names = set()
    for root in spec.submodule_search_locations or ():
        for path in Path(root).rglob("*.py"):
            text = path.read_text(encoding="utf-8", errors="replace")
            for match in _REGISTERS.finditer(text) if "register_dataset(" in text else ():
                if match.group(2):
                    names.add(match.group(2))
                elif constant := re.search(rf"""^{match.group(3)}\s*=\s*(["'])(\w+)\1""", text, re.M):
                    names.add(constant.group(2))
    return sorted(names)


def reasoning_gym_problems(data) -> list[Problem]:
    """``data.task = "reasoning_gym:<name>"``: the package is installed and every name is one of its
    datasets (a did-you-mean otherwise). Generator options are checked when the rows are drawn."""
    names = reasoning_gym_names()
    if names is None:
        return [Problem(("data", "task"), 'needs the reasoning-gym package: pip install "reasoning-gym>=0.1.25,<0.2"')]
    if not names:  # a layout this scan does not know: the backend's check still runs
        return []
    wanted = [(("data", "task"), data.task.removeprefix("reasoning_gym:"))]
    if data.reasoning_gym is not None:
        wanted += [(("data", "reasoning_gym", "datasets", name), name) for name in data.reasoning_gym.datasets]
    problems = []
    for path, name in wanted:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(close)}?" if close else f"it has {len(names)}: {', '.join(names[:8])}, ..."
            problems.append(Problem(path, f"{name!r} is not a reasoning-gym dataset; {hint}"))
    return problems


def data_problems(recipe: Recipe) -> list[Problem]:
    data = recipe.data
    problems = []
    reasoning_gym = data.task is not None and data.task.startswith("reasoning_gym:")
    if reasoning_gym:
        problems += reasoning_gym_problems(data)
    if data.flawed_demos and data.task not in TASKS_WITH_A_FLAW and not reasoning_gym:
        what = f'task = "{data.task}"' if data.task else "data files"
        problems.append(
            Problem(
                ("data", "flawed_demos"),
                f"flawed demonstrations exist for the built-in tasks {', '.join(sorted(TASKS_WITH_A_FLAW))} "
                "and reasoning-gym tasks only, "
                f"not for {what}",
            )
        )
    rl = recipe.rl
    problems += [Problem(key, message) for key, message in turn_problems(recipe)]
    if rl is not None and rl.environment and rl.reward:
        problems.append(
            Problem(
                ("rl", "reward"), "set rl.environment or rl.reward, not both (an environment computes its own reward)"
            )
        )
    if data.task in TASKS_WITH_TOOLS and recipe.sft is not None and recipe.sft.stop_at_accuracy is not None:
        problems.append(
            Problem(
                ("sft", "stop_at_accuracy"),
                f'task = "{data.task}" is solved with a tool; the SFT stage measures eval loss only '
                "(the RL stage's first evaluation is the SFT policy's accuracy); remove this key",
            )
        )
    return problems


def agent_problems(recipe: Recipe) -> list[Problem]:
    """A black-box agent (``rl.agent``) runs its own episode: the environment keys cannot act."""
    rl = recipe.rl
    if rl is None or (rl.agent is None and "agent_timeout_s" not in rl.model_fields_set):
        return []
    stated = rl.model_fields_set
    why = "rl.agent runs its own episodes and tools (its calls to the endpoint are the turns); remove this key"
    keys = ("environment", "reward", "tool_errors", "tool_timeout_s")  # max_turns caps an agent's calls
    problems = [Problem(("rl", key), why) for key in keys if key in stated and rl.agent is not None]
    if "agent_timeout_s" in stated and rl.agent is None:
        problems.append(Problem(("rl", "agent_timeout_s"), "applies to rl.agent only"))
    return problems
