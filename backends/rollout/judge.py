"""A judge model as the reward (``rl.judge``): each response is shown to a model served on engines of
its own, in the recipe's template with the row's question and reference answer, and its greedy
reply becomes the reward through the recipe's verdict parser.

Requests go to the judge engine with the fewest in flight, as soon as a trajectory's response is
sampled: the groups still generating and the responses being judged share the time, and vLLM batches
the judge's requests on its engines. A reply that cannot be parsed raises ``UnparsedVerdict``; a
judge request that still fails after retries raises ``JudgeUnavailable``: either way the episode's
step fails, so the response scores 0 with a record in ``sample_errors.jsonl`` (the run goes on), and
the judge counts it (``judge/unparsed``, ``judge/errors``). Every verdict, parsed or not, is
appended to ``judge_verdicts.jsonl`` in the run directory with the prompt the judge read and its reply.

Where the row has a programmatic check too (a built-in task, or a reference answer that math-verify
reads), the judged environment also scores the response with it, and ``judge/agreement`` is the
share of responses where the judge's verdict (at least 0.5 counts as correct) and the check agree.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from backends.rollout.auxiliary import AuxiliaryEngines, shorten
from backends.rollout.environments import Environment, Messages, SingleTurnEnvironment, StepResult, prompt_and_answer
from skyrl_contracts.auxiliary import JUDGE
from skyrl_contracts.schema import JudgeConfig

NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


class UnparsedVerdict(ValueError):
    """The judge's reply holds no verdict the recipe's parser reads."""


# A plain-text judge's template that renders nothing (a template of "{response}" alone, and a
# response that is empty): nothing to read, so no verdict, and no request.
EMPTY_PROMPT = "the judge's prompt is empty (rl.judge.template rendered nothing for this response): not asked"


class JudgeUnavailable(RuntimeError):
    """The judge's engines did not answer (after retries, or a request they refused)."""


def judge_prompt(template: str, question: str, response: str, answer: str | None) -> str:
    return template.format(question=question, response=response, answer="" if answer is None else answer)


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _first_label(text: str, labels: Mapping[str, float]) -> float | None:
    """The reward of the label said first in ``text`` (whole words, any case); None if none is."""
    found = [
        (match.start(), -len(label), value)
        for label, value in labels.items()
        if (match := re.search(rf"(?<!\w){re.escape(label)}(?!\w)", text, re.IGNORECASE))
    ]
    return min(found)[2] if found else None


def parse_verdict(reply: str, config: JudgeConfig) -> float:
    """The reward the reply states, by ``config.verdict``; ``UnparsedVerdict`` when it states none."""
    if config.verdict == "number":
        match = NUMBER.search(reply)
        value = _number(match.group()) if match else None
        if value is None:
            raise UnparsedVerdict(f"no number in the judge's reply {shorten(reply)!r}")
        return value
    if config.verdict == "label":
        value = _first_label(reply, config.labels)
        if value is None:
            raise UnparsedVerdict(f"none of the labels {sorted(config.labels)} in the judge's reply {shorten(reply)!r}")
        return value
    match = re.search(config.pattern, reply)
    if match is None or match.group(1) is None:
        raise UnparsedVerdict(f"pattern {config.pattern!r} does not match the judge's reply {shorten(reply)!r}")
    text = match.group(1).strip()
    value = _number(text)
    if value is None:
        value = next((v for label, v in config.labels.items() if label.lower() == text.lower()), None)
    if value is None:
        raise UnparsedVerdict(
            f"the pattern's group {text!r} is neither a number nor a label in {sorted(config.labels)}"
        )
    return value


class Judge:
    """The judge's engines (``urls``), asked through ``verdict``. ``chat``: the judge has a chat
    template (its prompt is one user message), else the prompt is sent as plain text."""

    def __init__(self, urls: Sequence[str], config: JudgeConfig, verdicts_file: Path, *, chat: bool = True, **settings):
        """``settings``: ``AuxiliaryEngines``' (timeout, retries, backoff, concurrency)."""
        self.engines = AuxiliaryEngines(JUDGE, urls, JudgeUnavailable, **settings)
        self.config, self.verdicts_file, self.chat = config, verdicts_file, chat
        # The run's totals (as rollout/errors), and the agreement with a programmatic check since the last figures().
        self.verdicts = self.unparsed = self.errors = 0
        self.agreed = self.compared = 0

    @classmethod
    def from_recipe(cls, urls: Sequence[str], recipe, verdicts_file: Path, chat: bool) -> "Judge":
        return cls(urls, recipe.rl.judge, verdicts_file, chat=chat, **AuxiliaryEngines.settings(recipe))

    async def aclose(self) -> None:
        await self.engines.aclose()

    def request(self, prompt: str) -> tuple[str, dict]:
        """(path, body) of the request that asks the judge about ``prompt``: greedy, ``max_tokens``."""
        body: dict[str, Any] = {"model": JUDGE, "max_tokens": self.config.max_tokens, "temperature": 0.0}
        if self.chat:
            return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", body | {"prompt": prompt}

    async def verdict(self, question: str, response: str, answer: str | None, reference: float | None = None) -> float:
        """The judge's reward for ``response``; ``reference``: the programmatic check's reward, when
        the row has one (counted into ``judge/agreement``). Raises ``UnparsedVerdict`` or
        ``JudgeUnavailable`` (the episode's step fails: reward 0, a record)."""
        prompt = judge_prompt(self.config.template, question, response, answer)
        record: dict[str, Any] = {"time": time.time(), "prompt": prompt, "reply": None, "verdict": None}
        if reference is not None:
            record["reference_reward"] = reference
        try:
            if not prompt and not self.chat:  # an engine refuses an empty prompt (HTTP 400)
                raise UnparsedVerdict(EMPTY_PROMPT)
            reply = await self.ask(prompt)
            record["reply"] = reply
            value = record["verdict"] = parse_verdict(reply, self.config)
        except UnparsedVerdict as exc:
            self.unparsed += 1
            record["error"] = str(exc)
            self.append(record)
            raise
        except JudgeUnavailable as exc:
            self.errors += 1
            record["error"] = str(exc)
            self.append(record)
            raise
        # (cancelled: the run ended before the judge answered; the sample is never trained on, so
        # there is no verdict to count or keep)
        self.append(record)
        self.verdicts += 1
        if reference is not None:
            self.compared += 1
            self.agreed += (value >= 0.5) == (reference >= 0.5)
        return value

    def append(self, record: dict) -> None:
        with open(self.verdicts_file, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")

    def figures(self) -> dict[str, float]:
        """``judge/verdicts``, ``judge/unparsed``, ``judge/errors``: the run's totals (held-out
        responses included); ``judge/agreement`` since the last call, where a check was compared."""
        figures = {"judge/verdicts": self.verdicts, "judge/unparsed": self.unparsed, "judge/errors": self.errors}
        if self.compared:
            figures["judge/agreement"] = self.agreed / self.compared
        self.agreed = self.compared = 0
        return figures

    async def ask(self, prompt: str) -> str:
        """The judge's reply text."""
        path, body = self.request(prompt)
        choice = (await self.engines.post(path, body))["choices"][0]
        return (choice["message"]["content"] or "") if self.chat else choice["text"]


class JudgedEnvironment(Environment):
    """One model turn scored by the judge. ``base``: the environment the run would score with
    without a judge (a built-in task's, or the math default), whose prompt the model answers and
    whose check, where the row has a reference answer, is the judge's ``reference``."""

    def __init__(self, judge: Judge, base: SingleTurnEnvironment):
        self.judge, self.base = judge, base
        self.step_name = "the judge (rl.judge)"  # what a timeout message names
        self._row: Mapping[str, Any] | None = None
        self._question = ""
        self._reference: float | None = None

    def reset(self, row: Mapping[str, Any]) -> Messages:
        self._row = row
        messages = self.base.reset(row)
        users = [m.get("content") for m in messages if m.get("role") == "user"]
        self._question = str(users[-1] if users else messages[-1].get("content", ""))
        return messages

    async def step(self, response: str) -> StepResult:
        assert self._row is not None, "step() before reset()"
        answer = reference_answer(self._row)
        reference = await asyncio.to_thread(self.reference, response) if answer is not None else None
        self._reference = reference
        value = await self.judge.verdict(self._question, response, answer, reference)
        return StepResult(reward=value, done=True)

    def metrics(self) -> dict[str, float]:
        """``reference_reward``: the programmatic check's reward of the response, where the row has
        one (``rollout/env/reference_reward`` in training, ``eval/reference_accuracy`` held out)."""
        return {} if self._reference is None else {"reference_reward": self._reference}

    def reference(self, response: str) -> float | None:
        """The programmatic check's reward, or None where it cannot score this row."""
        try:
            reward = float(self.base.step(response).reward)
        except Exception:  # noqa: BLE001 - a check that cannot score the row compares nothing
            return None
        return reward if math.isfinite(reward) else None


def reference_answer(row: Mapping[str, Any]) -> str | None:
    try:
        return prompt_and_answer(row)[1]
    except (ValueError, KeyError, TypeError):
        return None
