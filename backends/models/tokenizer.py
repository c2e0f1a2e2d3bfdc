"""Tokenizers: a character-level tokenizer built locally for the tiny model, or a model's own.

The character tokenizer is a ``tokenizers`` BPE model without merges (so every character of the
alphabet is one token) wrapped as a ``PreTrainedTokenizerFast`` with a chat template, so it saves
and loads like any HF tokenizer (transformers and vLLM read the same files).

Chat format of the char template (one token per marker)::

    <bos><|user|>007+123=<|assistant|>130<eos>

The assistant turn ends with ``<eos>``: that is where greedy generation stops.

With tools (``apply_chat_template(..., tools=...)``) a system line lists their signatures, a tool
call is written in the pythonic format vLLM's ``pythonic`` tool parser reads, and a tool's answer
follows its own marker (appended to the vocabulary after the characters, so the ids above stay)::

    <bos><|system|>lookup(key)<|user|>kqz?<|assistant|>[lookup(key="kqz")]<eos><|tool|>417<|assistant|>417<eos>
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_MARKERS)

TOOL_MARKER = "<|tool|>"  # after the alphabet in the vocabulary: earlier ids do not move

CHAR_CHAT_TEMPLATE = (
    "{# PYTHONIC_TOOL_CALLS #}"
    "{{ bos_token }}"
    "{% if tools %}{{ '<|system|>' }}{% for tool in tools %}"
    "{% set f = tool['function'] if tool['function'] is defined else tool %}"
    "{% set params = f['parameters']['properties'] if f['parameters'] is defined "
    "and f['parameters']['properties'] is defined else {} %}"
    "{{ f['name'] + '(' + (params | list | join(',')) + ')' }}"
    "{% if not loop.last %}{{ ';' }}{% endif %}{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + (message['content'] or '') }}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}{{ '[' }}"
    "{% for call in message['tool_calls'] %}{% set c = call['function'] if call['function'] is defined else call %}"
    "{{ c['name'] + '(' }}{% if c['arguments'] is mapping %}"
    "{% for key, value in c['arguments'].items() %}{{ key + '=' }}{{ value | tojson }}"
    "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{% else %}{{ c['arguments'] }}{% endif %}{{ ')' }}"
    "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ ']' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_char_tokenizer(alphabet: Iterable[str], vocab_size: int | None = None):
    """A ``PreTrainedTokenizerFast`` with one token per character of ``alphabet`` plus the special
    tokens (ids 0..6: pad, bos, eos, unk, system, user, assistant markers). ``vocab_size``: filler
    tokens (``<|fill<i>|>``) up to that size, which no text encodes to but every id decodes from: a
    model of a real model's vocabulary (Qwen2.5's 151936) served with this tokenizer."""
    # lazy: tokenizers/transformers (imports torch); the orchestrator imports this module before its tokenizer lap
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(alphabet) - {""})
    if any(len(c) != 1 for c in chars):
        raise ValueError("a character alphabet holds single characters")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    vocab[TOOL_MARKER] = len(vocab)
    for i in range(len(vocab), vocab_size or 0):
        vocab[f"<|fill{i}|>"] = i
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()  # join characters without separators
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, TOOL_MARKER)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[*ROLE_MARKERS, TOOL_MARKER],
        chat_template=CHAR_CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
    return tokenizer


# What build_char_tokenizer's directories record as their class (transformers 5 writes its generic
# fast class's name). They load without AutoTokenizer, whose model registry imports torch: 4 s on a
# quiet machine, 15-25 s on a loaded 2-core one, paid by the RL orchestrator before its first rollout.
GENERIC_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def saved_tokenizer_class(path: str) -> str | None:
    try:
        return json.loads((Path(path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def load_tokenizer(path: str, require_chat_template: bool = True):
    """A local HF tokenizer; a missing pad token falls back to eos (needed for batched generation).
    ``require_chat_template``: refuse one without (skyrl formats every row it trains on as a chat;
    a judge reads plain text when it has none)."""
    if saved_tokenizer_class(path) in GENERIC_FAST_CLASSES and (Path(path) / "tokenizer.json").is_file():
        # lazy: transformers (imports torch); the orchestrator imports this module before its tokenizer lap
        from transformers import PreTrainedTokenizerFast as loader
    else:
        # lazy: transformers (imports torch); the orchestrator imports this module before its tokenizer lap
        from transformers import AutoTokenizer as loader

    tokenizer = loader.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None and require_chat_template:
        raise ValueError(f"tokenizer at {path} has no chat template; skyrl formats every row as a chat")
    return tokenizer
