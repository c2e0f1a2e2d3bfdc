"""Built-in verifiable tasks for the CPU quickstart: rows, prompts and an exact-match reward.

The SFT stage (targets and held-out accuracy) and the RL stage (prompts and reward) both use these::

    task = get_task("addition", digits=3)
    rows = task.make_rows(seed=0, n=500, split="eval")   # [{"prompt": "007+123=", "answer": "130"}, ...]
    messages = task.prompt(rows[0])                       # [{"role": "user", "content": "007+123="}]
    task.reward("130", rows[0])                           # 1.0

``"reasoning_gym:<name>"`` is any reasoning-gym dataset (``backends.data.reasoning_gym``).

Splits never overlap: every problem belongs to exactly one split by a hash of (seed, task, problem),
so train and eval can be generated independently (and by different processes) with the same result.
Rows are plain JSON-able dicts (a reasoning-gym row also carries its entry as the dataset made it).
"""

from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass, field
from typing import Literal

from backends.data.reasoning_gym import ReasoningGymSource
from skyrl_contracts.schema import DataConfig, ReasoningGymConfig

Split = Literal["train", "eval"]
EVAL_PERMILLE = 100  # 10% of the problem space is held out


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response equals the answer (surrounding whitespace ignored), else 0.0."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def in_split(seed: int, task: str, problem: str, split: Split) -> bool:
    digest = hashlib.blake2b(f"{seed}:{task}:{problem}".encode(), digest_size=8).digest()
    is_eval = int.from_bytes(digest, "little") % 1000 < EVAL_PERMILLE
    return is_eval == (split == "eval")


@dataclass(frozen=True)
class Task:
    """A generated task: ``problem(rng)`` draws one (prompt, answer); the rest is shared."""

    name: str
    digits: int

    @property
    def alphabet(self) -> str:
        """Every character that can appear in a prompt or an answer (the char tokenizer's vocab)."""
        raise NotImplementedError

    @property
    def space_size(self) -> int:
        raise NotImplementedError

    def draw(self, rng: random.Random) -> tuple[str, str]:
        raise NotImplementedError

    def make_rows(self, seed: int, n: int, split: Split) -> list[dict[str, str]]:
        """``n`` rows of ``split``. Eval rows are distinct problems (capped by the split's size);
        train rows are i.i.d. draws from the train split, so they may repeat."""
        rng = random.Random(f"{seed}:{self.name}:{self.digits}:{split}")
        distinct = split == "eval"
        cap = self.space_size * (EVAL_PERMILLE if distinct else 1000 - EVAL_PERMILLE) // 1000
        target = min(n, max(cap, 1)) if distinct else n
        rows: list[dict[str, str]] = []
        seen: set[str] = set()
        attempts = 0
        while len(rows) < target and attempts < 50 * n + 1000:
            attempts += 1
            prompt, answer = self.draw(rng)
            if not in_split(seed, self.name, prompt, split) or (distinct and prompt in seen):
                continue
            seen.add(prompt)
            rows.append({"prompt": prompt, "answer": answer})
        return rows

    def prompt(self, row: dict) -> list[dict[str, str]]:
        """The chat messages of a row's prompt (tokenized by ``backends.data.chat.encode_prompt``)."""
        return [{"role": "user", "content": row["prompt"]}]

    def reward(self, response: str, row: dict) -> float:
        return exact_match(response, row["answer"])

    def max_answer_chars(self) -> int:
        raise NotImplementedError

    def flawed_answer(self, row: dict) -> str | None:
        """The answer a sloppy demonstrator writes for this row, or None where it makes no
        mistake (see ``flawed_demonstrations``). Tasks without a defined flaw return None."""
        return None

    def has_flaw(self) -> bool:
        return type(self).flawed_answer is not Task.flawed_answer

    def demonstration(self, row: dict) -> list[dict]:
        """The SFT conversation of a row: its prompt and the demonstrator's answer."""
        return self.prompt(row) + [{"role": "assistant", "content": row["answer"]}]

    @property
    def environment(self):
        """The RL environment class of a task with its own (tools), or None for the exact-match one."""
        return None

    @property
    def tools(self) -> list[dict]:
        """JSON schemas of the tools the task's prompts show (none for single-turn tasks)."""
        return []


def flawed_demonstrations(task: Task, rows: list[dict], rate: float, seed: int) -> list[dict]:
    """SFT rows whose answers come from a sloppy demonstrator: on each row where the task defines a
    flaw, the flawed answer replaces the right one with probability ``rate`` (seeded per row).

    Why: with ``rate`` > 1/2 the flawed answer is the demonstrations' majority on those rows, so
    SFT learns to reproduce it under greedy decoding however long it trains, and its held-out
    accuracy plateaus near the share of rows without a flaw, on every seed and machine; the right
    answer keeps probability ~(1 - rate) under sampling, so an RL stage with the exact-match reward
    sees it in most groups and has a job with a known size: unlearning the flaw."""
    rng = random.Random(f"{seed}:{task.name}:flawed")
    out = []
    for row in rows:
        flawed = task.flawed_answer(row)
        draw = rng.random()  # one draw per row, so the choice of a row does not depend on the others
        out.append({**row, "answer": flawed} if flawed is not None and draw < rate else row)
    return out


@dataclass(frozen=True)
class Addition(Task):
    """``"007+123="`` -> ``"130"``: fixed-width operands, answer without leading zeros."""

    @property
    def alphabet(self) -> str:
        return string.digits + "+="

    @property
    def space_size(self) -> int:
        return (10**self.digits) ** 2

    def draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randrange(10**self.digits), rng.randrange(10**self.digits)
        return f"{a:0{self.digits}d}+{b:0{self.digits}d}=", str(a + b)

    def max_answer_chars(self) -> int:
        return self.digits + 1

    def flawed_answer(self, row: dict) -> str | None:
        """Sums with a carry out of the top digit (one digit longer than the operands) lose their
        last digit: ``"99+01="`` -> ``"10"`` instead of ``"100"``."""
        answer = row["answer"]
        return answer[:-1] if len(answer) > self.digits else None


@dataclass(frozen=True)
class Reversal(Task):
    """``"abcde"`` -> ``"edcba"``: lowercase strings of length ``digits``."""

    @property
    def alphabet(self) -> str:
        return string.ascii_lowercase

    @property
    def space_size(self) -> int:
        return 26**self.digits

    def draw(self, rng: random.Random) -> tuple[str, str]:
        text = "".join(rng.choice(string.ascii_lowercase) for _ in range(self.digits))
        return text, text[::-1]

    def max_answer_chars(self) -> int:
        return self.digits


UNKNOWN = "unknown"


@dataclass(frozen=True)
class Lookup(Task):
    """``"kqz?"`` -> ``"417"``: the value stored under a key of ``digits`` letters, which only the
    episode's ``lookup`` tool knows. Values are drawn per row, so a key seen in training has another
    value elsewhere: nothing to memorise, the model must call the tool and copy its answer::

        <|system|>lookup(key)<|user|>kqz?<|assistant|>[lookup(key="kqz")]<eos><|tool|>417<|assistant|>417<eos>

    Its flaw: a demonstrator who gives up (``"unknown"``) instead of calling the tool."""

    @property
    def alphabet(self) -> str:
        return string.ascii_lowercase + string.digits + '?[]()=",; '

    @property
    def space_size(self) -> int:
        return 26**self.digits

    def draw(self, rng: random.Random) -> tuple[str, str]:
        key = "".join(rng.choice(string.ascii_lowercase) for _ in range(self.digits))
        return f"{key}?", f"{rng.randrange(1000):03d}"

    def max_answer_chars(self) -> int:
        return 3

    def flawed_answer(self, row: dict) -> str | None:
        return UNKNOWN

    def demonstration(self, row: dict) -> list[dict]:
        if row["answer"] == UNKNOWN:
            return super().demonstration(row)
        call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": row["prompt"][:-1]}}}
        return self.prompt(row) + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": row["answer"], "name": "lookup"},
            {"role": "assistant", "content": row["answer"]},
        ]

    @property
    def environment(self):
        from backends.rollout.environments import LookupEnvironment  # lazy: the data layer sits below rollout

        return LookupEnvironment

    @property
    def tools(self) -> list[dict]:
        from backends.rollout.environments import LookupEnvironment  # lazy: the data layer sits below rollout

        return LookupEnvironment.tool_schemas()


@dataclass(frozen=True)
class ReasoningGym(Task):
    """``"reasoning_gym:<name>"``: a reasoning-gym dataset or mixture (``backends.data.reasoning_gym``:
    the adapter, its rows and answer format). ``digits`` does not apply; the generator's options
    are ``options`` (the recipe's ``[data.reasoning_gym]``)."""

    options: ReasoningGymConfig = field(default_factory=ReasoningGymConfig, compare=False)

    @property
    def source(self):
        return ReasoningGymSource(self.name, self.options)

    @property
    def alphabet(self) -> str:
        """Unknown before rows are drawn: ``backends.data.sft.SourceRows.alphabet`` collects the
        characters of the generated conversations (questions, tagged answers, system prompt)."""
        return ""

    def make_rows(self, seed: int, n: int, split: Split) -> list[dict]:
        return self.source.make_rows(seed, n, split, lambda question: in_split(seed, self.name, question, split))

    def prompt(self, row: dict) -> list[dict[str, str]]:
        return self.source.prompt(row)

    def reward(self, response: str, row: dict) -> float:
        return self.source.reward(response, row)

    def flawed_answer(self, row: dict) -> str | None:
        return self.source.flawed_answer(row)


TASKS: dict[str, type[Task]] = {"addition": Addition, "reversal": Reversal, "lookup": Lookup}


def get_task(name: str, digits: int = 3, reasoning_gym: ReasoningGymConfig | None = None) -> Task:
    """A built-in task, or a reasoning-gym dataset (``"reasoning_gym:<name>"``) with the recipe's
    ``[data.reasoning_gym]`` options (needed to draw rows; scoring a row needs none)."""
    if name.startswith("reasoning_gym:"):
        return ReasoningGym(name=name, digits=digits, options=reasoning_gym or ReasoningGymConfig())
    try:
        return TASKS[name](name=name, digits=digits)
    except KeyError:
        raise ValueError(
            f"unknown task {name!r}; built-in tasks: {', '.join(TASKS)}, or reasoning_gym:<dataset name>"
        ) from None


def task_for(data: DataConfig) -> Task:
    """The task of a recipe's ``[data]`` table (``data.task`` must be set)."""
    return get_task(data.task, data.digits, data.reasoning_gym)


def score(task: Task | str, response: str, answer: str) -> float:
    """Score of a response against a reference answer with the task's reward (exact match for the
    built-in tasks); the RL stage's reward."""
    task = get_task(task) if isinstance(task, str) else task
    return task.reward(response, {"answer": answer})
