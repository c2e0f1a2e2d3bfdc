"""Chat rows -> token ids and loss masks, through the tokenizer's own chat template.

``encode_prompt`` is the ONE function that turns prompt messages into token ids: SFT evaluation and
the RL stage both call it, so a task's prompt is byte-identical everywhere. ``encode_conversation``
renders the same template for training rows, so the trained tokens line up with what generation sees.

Loss masks come from character spans: each assistant turn is the text between the rendering of the
conversation before it (with the generation prompt) and the rendering including it; a token is a
target when its first character falls in such a span. This works with any template whose renderings
of prefixes are string prefixes of the whole conversation, which is true of common templates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

Messages = Sequence[dict]
Tools = Sequence[dict] | None  # JSON schemas of tools (backends.rollout.tools)
LossOn = Literal["assistant", "last_assistant", "all"]


def render(tokenizer, messages: Messages, add_generation_prompt: bool = False, tools: Tools = None) -> str:
    """The chat template's text; ``tools``: JSON schemas the template shows the model (``tools=``)."""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools or None
    )


def encode_text(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt(tokenizer, messages: Messages, tools: Tools = None) -> list[int]:
    """Token ids of a prompt, ending with the assistant's generation prompt."""
    return encode_text(tokenizer, render(tokenizer, messages, add_generation_prompt=True, tools=tools))


def continuation_text(tokenizer, history: Messages, new_messages: Messages, tools: Tools = None) -> str | None:
    """What the template writes after the model's last turn of ``history`` when ``new_messages``
    (an environment's observation, tool results) follow it, through the next generation prompt; None
    when the template renders ``history`` differently once more messages follow (history rewriting).

    The cut is just after the end-of-turn token the model generated (the tokenizer's eos): what a
    template adds after it (Qwen's newline after ``<|im_end|>``) belongs to the observation, so the
    trajectory's tokens are the template's rendering of the whole conversation."""
    before = render(tokenizer, history, tools=tools)
    after = render(tokenizer, [*history, *new_messages], add_generation_prompt=True, tools=tools)
    eos = tokenizer.eos_token or ""
    cut = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
    if not after.startswith(before[:cut]):
        return None
    return after[cut:]


@dataclass(frozen=True)
class Example:
    """One training sequence: ``loss_mask[k] == 1`` when token k is a target of the loss."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)


def assistant_spans(
    tokenizer, messages: Messages, loss_on: LossOn, tools: Tools = None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans that carry loss."""
    full = render(tokenizer, messages, tools=tools)
    if loss_on == "all":
        return full, [(0, len(full))]
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools) if i else ""
        through = full if i == len(messages) - 1 else render(tokenizer, messages[: i + 1], tools=tools)
        if not (full.startswith(before) and full.startswith(through)):
            raise ValueError(
                "the chat template renders a conversation prefix differently from the whole conversation; "
                'use data.loss_on = "all" or a template without history rewriting'
            )
        spans.append((len(before), len(through)))
    if loss_on == "last_assistant":
        spans = spans[-1:]
    return full, spans


def encode_conversation(
    tokenizer, messages: Messages, loss_on: LossOn = "assistant", max_length: int | None = None
) -> Example:
    """Token ids of a whole conversation and its loss mask, truncated to ``max_length`` tokens."""
    return encode_conversations(tokenizer, [messages], loss_on, max_length)[0]


def encode_conversations(
    tokenizer,
    conversations: Sequence[Messages],
    loss_on: LossOn = "assistant",
    max_length: int | None = None,
    tools: Tools = None,
) -> list[Example]:
    """``encode_conversation`` for many conversations (one batched tokenizer call); ``tools``: the
    tools every conversation's template shows (a tool task's demonstrations)."""
    rendered = [assistant_spans(tokenizer, conv, loss_on, tools) for conv in conversations]
    if not rendered:
        return []
    texts = [text for text, _ in rendered]
    backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizers: skip the Python wrapping
    if backend is not None:
        encodings = backend.encode_batch(texts, add_special_tokens=False)
        pairs = [(e.ids, e.offsets) for e in encodings]
    else:
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        pairs = list(zip(enc["input_ids"], enc["offset_mapping"]))
    out = []
    for (text, spans), (ids, offsets) in zip(rendered, pairs):
        in_loss = bytearray(len(text) + 1)
        for lo, hi in spans:
            in_loss[lo:hi] = b"\x01" * (hi - lo)
        mask = [in_loss[start] for start, _ in offsets]
        if mask:
            mask[0] = 0  # the first token has no prediction
        out.append(Example(tuple(ids[:max_length]), tuple(mask[:max_length])))
    return out


def to_messages(row: dict, fmt: Literal["auto", "messages", "prompt_completion"] = "auto") -> list[dict]:
    """A row in ``messages`` form or ``prompt``/``completion`` form (strings or message lists)."""
    if fmt == "messages" or (fmt == "auto" and "messages" in row):
        if "messages" not in row:
            raise ValueError("row has no 'messages' field")
        return [dict(m) for m in row["messages"]]
    if "prompt" not in row or "completion" not in row:
        raise ValueError("row needs 'messages', or 'prompt' and 'completion'")
    prompt, completion = row["prompt"], row["completion"]
    head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    tail = (
        [{"role": "assistant", "content": completion}] if isinstance(completion, str) else [dict(m) for m in completion]
    )
    return head + tail


def split_reference(messages: Messages) -> tuple[list[dict], str]:
    """(prompt messages, reference answer): everything before the last assistant turn, and its text."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return list(messages[:i]), str(messages[i].get("content", ""))
    raise ValueError("conversation has no assistant message")
