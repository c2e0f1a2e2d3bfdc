"""SFT data from the recipe's ``[data]`` table: tokenized training sequences, a held-out split for
eval loss and accuracy, and the data order.

The data order is a pure function of ``(seed, step)``: the training stream is the concatenation of
per-epoch permutations seeded by ``(seed, epoch)``, and step ``s`` takes positions
``[s * B, (s + 1) * B)`` of it. Resuming at step ``s`` therefore needs nothing but ``s``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from backends.data.chat import Example, encode_conversations, encode_prompt, split_reference, to_messages
from backends.data.files import hold_out, load_rows
from backends.data.tasks import Task, exact_match, flawed_demonstrations, task_for
from skyrl_contracts.schema import DataConfig


@dataclass(frozen=True)
class EvalItem:
    """A held-out prompt for accuracy: its token ids, the reference answer, and the source row."""

    prompt_ids: tuple[int, ...]
    reference: str
    row: dict = field(hash=False, compare=False)


@dataclass
class SourceRows:
    """Rows before tokenization: chat messages for training and evaluation, plus the task if built-in."""

    train: list[list[dict]]
    eval: list[list[dict]]
    task: Task | None
    task_rows: list[dict] | None = None  # eval rows of a built-in task (for its reward)
    tools: list[dict] = field(default_factory=list)  # schemas every conversation's template shows

    def alphabet(self) -> str:
        """The characters a character tokenizer needs."""
        if self.task is not None and self.task.alphabet:  # a reasoning-gym task's is its rows'
            return self.task.alphabet
        chars: set[str] = set()
        for conv in (*self.train, *self.eval):
            for message in conv:
                chars.update(str(message.get("content", "")))
        return "".join(sorted(chars))


@dataclass
class SftData:
    train: list[Example]
    eval: list[Example]
    eval_items: list[EvalItem]
    max_new_tokens: int
    scorer: Callable[[str, EvalItem], float]
    dropped: int = 0  # training rows without any loss token after truncation


def load_source(data: DataConfig, seed: int) -> SourceRows:
    if data.task is not None:
        task = task_for(data)
        train = task.make_rows(seed, data.train_size, "train")
        if data.flawed_demos:
            train = flawed_demonstrations(task, train, data.flawed_demos, seed)
        evals = task.make_rows(seed, data.eval_size, "eval")
        return SourceRows(
            [task.demonstration(r) for r in train], [task.demonstration(r) for r in evals], task, evals, task.tools
        )
    train = [to_messages(r, data.format) for r in load_rows(data.train)]
    if data.eval is not None:
        evals = [to_messages(r, data.format) for r in load_rows(data.eval, limit=data.eval_size)]
    else:  # hold out a seeded subset of the training rows (at most 10%), as the RL stage does
        train, evals = hold_out(train, data.eval_size, seed)
    if not train:
        raise ValueError(f"no training rows in {data.train}")
    return SourceRows(train, evals, None)


def build_sft_data(
    source: SourceRows,
    tokenizer,
    data: DataConfig,
    shard: tuple[int, int] = (0, 1),
    gather: Callable[[list], list] | None = None,
) -> SftData:
    """Tokenize the rows. With ``shard=(rank, world_size)`` and ``gather`` (concatenates every
    rank's list in rank order), each rank encodes one contiguous block of the training rows."""
    rank, world = shard
    block = -(-len(source.train) // world)
    mine = encode_conversations(
        tokenizer, source.train[rank * block : (rank + 1) * block], data.loss_on, data.max_length, source.tools
    )
    train = gather(mine) if gather is not None else mine
    kept = [ex for ex in train if ex.loss_tokens > 0]
    if not kept:
        raise ValueError(
            f"no training sequence keeps a loss token (data.loss_on = {data.loss_on!r}, "
            f"data.max_length = {data.max_length}); raise data.max_length"
        )
    evals = [
        ex
        for ex in encode_conversations(tokenizer, source.eval, data.loss_on, data.max_length, source.tools)
        if ex.loss_tokens > 0
    ]
    items = []
    # A tool task's accuracy needs the tool loop: the RL stage measures it (its first evaluation).
    for i, conv in enumerate(source.eval if not source.tools else ()):
        prompt, reference = split_reference(conv)
        row = source.task_rows[i] if source.task_rows is not None else {"answer": reference}
        items.append(EvalItem(tuple(encode_prompt(tokenizer, prompt)), reference, row))
    longest = max((len(tokenizer(it.reference, add_special_tokens=False)["input_ids"]) for it in items), default=1)
    task = source.task
    if task is not None:
        scorer = lambda response, item: task.reward(response, item.row)  # noqa: E731
    else:
        scorer = lambda response, item: exact_match(response, item.reference)  # noqa: E731
    return SftData(kept, evals, items, max_new_tokens=longest + 2, scorer=scorer, dropped=len(train) - len(kept))


@lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(f"{seed}:order:{epoch}").shuffle(order)
    return tuple(order)


def batch_indices(seed: int, step: int, batch_size: int, n: int) -> list[int]:
    """Indices (into the training examples) of the global batch of optimizer step ``step``."""
    out = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, n)
        out.append(_epoch_order(seed, epoch, n)[offset])
    return out
