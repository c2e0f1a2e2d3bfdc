"""Whether two model directories share one vocabulary, read from their tokenizer files with the json
module (validation stays light: no transformers).

On-policy distillation (``rl.distillation``) scores the policy's sampled token ids with the
teacher's model, so both must map every id to the same text. ``vocabulary`` reads what a directory
says: ``tokenizer.json`` (the model's vocabulary and the added tokens), else ``vocab.json`` (and
``added_tokens.json``), else the bytes of a SentencePiece ``tokenizer.model``. None where a
directory holds none of them (it cannot be compared here; the orchestrator compares the loaded
tokenizers at its start).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def vocabulary(model_dir: Path) -> tuple | None:
    """A comparable form of the directory's vocabulary (token -> id, plus added tokens); None if unknown."""
    fast = _read_json(model_dir / "tokenizer.json")
    if isinstance(fast, dict) and isinstance(fast.get("model"), dict):
        vocab = fast["model"].get("vocab")
        pieces = sorted(vocab.items()) if isinstance(vocab, dict) else [tuple(v) for v in vocab or ()]
        added = sorted((t.get("id"), t.get("content")) for t in fast.get("added_tokens") or () if isinstance(t, dict))
        return ("tokenizer.json", tuple(map(tuple, pieces)), tuple(added))
    vocab = _read_json(model_dir / "vocab.json")
    if isinstance(vocab, dict):
        added = _read_json(model_dir / "added_tokens.json")
        return ("vocab.json", tuple(sorted(vocab.items())), tuple(sorted((added or {}).items())))
    try:
        return ("tokenizer.model", hashlib.sha256((model_dir / "tokenizer.model").read_bytes()).hexdigest())
    except OSError:
        return None


def vocabulary_difference(student: Path, teacher: Path) -> str | None:
    """Why ``teacher``'s tokenizer is not ``student``'s (a short phrase), or None when they match
    or either cannot be read here."""
    mine, theirs = vocabulary(student), vocabulary(teacher)
    if mine is None or theirs is None or mine == theirs:
        return None
    if mine[0] != theirs[0]:
        return f"tokenizer files differ ({mine[0]} in {student}, {theirs[0]} in {teacher})"
    sizes = (len(mine[1]), len(theirs[1]))
    if sizes[0] != sizes[1]:
        return f"vocabularies differ: {sizes[0]} tokens in {student}, {sizes[1]} in {teacher}"
    return f"vocabularies differ: the same size ({sizes[0]}), other tokens or ids, in {student} and {teacher}"
