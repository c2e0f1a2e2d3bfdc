"""reasoning-gym datasets as built-in tasks: ``data.task = "reasoning_gym:<name>"``.

Any dataset of the installed reasoning-gym (``reasoning_gym.create_dataset``) becomes a task like
the built-in ones (``backends.data.tasks.Task``): the recipe's ``[data.reasoning_gym]`` gives the
generator's options, and ``"reasoning_gym:composite"`` a weighted mixture (reasoning-gym's own
``CompositeDataset``)::

    [data]
    task = "reasoning_gym:basic_arithmetic"
    [data.reasoning_gym]
    config = { min_terms = 2, max_terms = 2, operators = ["+", "-"] }

The answer format is reasoning-gym's: the model writes its final answer as ``<answer>...</answer>``,
which ``reasoning_gym.utils.extract_answer`` reads back (the last such span); the dataset's own
``score_answer(answer, entry)`` scores it, and a response without the tags scores 0, as in
reasoning-gym's evaluations. SFT demonstrations are the entry's ``answer`` in those tags.

Prompts are the entry's question alone unless ``system_prompt`` names one of
``reasoning_gym.utils.SYSTEM_PROMPTS``: those prompts tell a pretrained model the format, while a
model that learns the format from demonstrations gains nothing from them, and a character model
pays for every character of the constant prefix on every row.

Splits: each question belongs to exactly one split by the same hash as the built-in tasks
(``backends.data.tasks.in_split``), and each split is drawn from its own generator seed derived from
the recipe seed, so train and eval never share a question and either can be generated alone (by
the SFT process, the RL orchestrator) with the same result. Eval rows are distinct questions;
train rows may repeat. Each row carries its entry and the options of the dataset that generated it,
so its reward needs nothing else (reasoning-gym scores a mixture's entry with its source dataset).

reasoning-gym is imported on first use only: it takes seconds, and the CLI never needs it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, Callable

from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import ReasoningGymConfig

PREFIX = "reasoning_gym:"
COMPOSITE = "composite"
INSTALL = 'pip install "reasoning-gym>=0.1.25,<0.2"'
OPEN_TAG, CLOSE_TAG = "<answer>", "</answer>"


def is_reasoning_gym(task: str | None) -> bool:
    return bool(task) and task.startswith(PREFIX)


def _package():
    try:
        import reasoning_gym  # lazy: seconds to import, paid by its tasks only
    except ImportError as exc:
        raise UsageError(f"data.task = reasoning_gym:... needs the reasoning-gym package: {INSTALL}") from exc
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset the installed reasoning-gym registers."""
    _package()
    from reasoning_gym.factory import DATASETS  # lazy: seconds to import, paid by its tasks only

    return sorted(DATASETS)


def check_name(name: str, where: str = "data.task") -> None:
    """A ``ValueError`` naming the closest dataset names when ``name`` is not one."""
    names = dataset_names()
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}?" if close else f"it has {len(names)}: {', '.join(names[:8])}, ..."
    raise ValueError(f"{where}: {name!r} is not a reasoning-gym dataset; {hint}")


def _config_class(name: str):
    from reasoning_gym.factory import DATASETS  # lazy: seconds to import, paid by its tasks only

    return DATASETS[name][1]


def _create(name: str, where: str, **kwargs: Any):
    """``reasoning_gym.create_dataset`` with its option errors said in recipe terms."""
    from reasoning_gym import create_dataset  # lazy: seconds to import, paid by its tasks only

    try:
        return create_dataset(name, **kwargs)
    except TypeError as exc:  # an option the config dataclass does not have
        options = ", ".join(f.name for f in fields(_config_class(name)) if f.name not in ("seed", "size"))
        raise ValueError(f"{where}: {exc}; {name}'s options: {options}") from None
    except (AssertionError, ValueError) as exc:  # the config's own validate()
        raise ValueError(f"{where}: {name}: {exc}") from None


@lru_cache(maxsize=64)
def _scorer(name: str, config_json: str):
    """The dataset whose ``score_answer`` scores entries generated with these options (a few
    datasets read their config when scoring; seed and size do not matter to it)."""
    return _create(name, "data.reasoning_gym", **json.loads(config_json), seed=0, size=1)


def _split_seed(seed: int, task: str, split: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{task}:{split}:generator".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def tagged(answer: str) -> str:
    return f"{OPEN_TAG}{answer}{CLOSE_TAG}"


@dataclass(frozen=True)
class ReasoningGymSource:
    """The adapter behind ``backends.data.tasks.ReasoningGym``: a dataset (or mixture) and its
    options. Rows::

        {"prompt": question, "answer": "<answer>A</answer>", "entry": the reasoning-gym entry,
         "dataset": the entry's source dataset, "config": that dataset's options, "system": text | None}

    ``answer`` is what a demonstrator writes; the reward scores the entry, never this field."""

    name: str  # "reasoning_gym:<dataset>"
    options: ReasoningGymConfig

    @property
    def dataset(self) -> str:
        return self.name.removeprefix(PREFIX)

    def sources(self) -> list[tuple[str, float, dict[str, Any]]]:
        """(name, weight, options) of each dataset rows come from."""
        if self.dataset == COMPOSITE:
            return [(name, spec.weight, dict(spec.config)) for name, spec in self.options.datasets.items()]
        return [(self.dataset, 1.0, dict(self.options.config))]

    def check(self) -> None:
        """Clear errors before any row is drawn: the package, the names, the system prompt."""
        _package()
        check_name(self.dataset)
        for name, _, _ in self.sources():
            if name != self.dataset:
                check_name(name, f"data.reasoning_gym.datasets.{name}")
        if self.options.system_prompt is not None:
            from reasoning_gym.utils import SYSTEM_PROMPTS  # lazy: seconds to import, paid by its tasks only

            if self.options.system_prompt not in SYSTEM_PROMPTS:
                raise ValueError(
                    f"data.reasoning_gym.system_prompt: {self.options.system_prompt!r} is not one of "
                    f"reasoning_gym.utils.SYSTEM_PROMPTS: {', '.join(SYSTEM_PROMPTS)}"
                )

    def _generator(self, seed: int, size: int):
        if self.dataset != COMPOSITE:
            return _create(self.dataset, "data.reasoning_gym.config", **self.options.config, seed=seed, size=size)
        from reasoning_gym.composite import DatasetSpec  # lazy: seconds to import, paid by its tasks only

        specs = [DatasetSpec(name, weight, config) for name, weight, config in self.sources()]
        for spec in specs:  # each dataset's own errors name its table, before the mixture hides them
            _create(spec.name, f"data.reasoning_gym.datasets.{spec.name}.config", **spec.config, seed=0, size=1)
        return _create(COMPOSITE, "data.reasoning_gym.datasets", seed=seed, size=size, datasets=specs)

    def make_rows(self, seed: int, n: int, split: str, belongs: Callable[[str], bool]) -> list[dict[str, Any]]:
        """``n`` rows whose question ``belongs`` to ``split`` (fewer eval rows when the dataset has
        fewer distinct questions in that split than asked within the draw budget)."""
        self.check()
        budget = 50 * n + 1000
        generator = self._generator(_split_seed(seed, self.name, split), budget)
        options = {name: config for name, _, config in self.sources()}
        system = None
        if self.options.system_prompt is not None:
            from reasoning_gym.utils import SYSTEM_PROMPTS  # lazy: seconds to import, paid by its tasks only

            system = SYSTEM_PROMPTS[self.options.system_prompt]
        rows: list[dict[str, Any]] = []
        seen: set[str] = set()
        for index in range(budget):
            if len(rows) >= n:
                break
            entry = generator[index]
            question = entry["question"]
            if not belongs(question) or (split == "eval" and question in seen):
                continue
            seen.add(question)
            source = entry.get("metadata", {}).get("source_dataset", self.dataset)
            rows.append(
                {
                    "prompt": question,
                    "answer": tagged(str(entry["answer"])),
                    "entry": entry,
                    "dataset": source,
                    "config": options.get(source, {}),
                    "system": system,
                }
            )
        return rows

    def prompt(self, row: dict) -> list[dict[str, str]]:
        system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
        return system + [{"role": "user", "content": row["prompt"]}]

    def reward(self, response: str, row: dict) -> float:
        """The dataset's ``score_answer`` on the answer in the response's last ``<answer>`` tags;
        0 without them."""
        from reasoning_gym.utils import extract_answer  # lazy: seconds to import, paid by its tasks only

        answer = extract_answer(response)
        if answer is None:
            return 0.0
        scorer = _scorer(row["dataset"], json.dumps(row["config"], sort_keys=True))
        try:
            return float(scorer.score_answer(answer, row["entry"]))
        except Exception:  # noqa: BLE001
            # Some datasets' scorers parse the answer and raise on text they cannot parse: a
            # malformed answer is a wrong one, not a reason to stop training.
            return 0.0

    def flawed_answer(self, row: dict) -> str | None:
        """The answer without its tags: right, but unreadable for the scorer (data.flawed_demos)."""
        return str(row["entry"]["answer"])
