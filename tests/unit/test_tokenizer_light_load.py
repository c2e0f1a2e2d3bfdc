"""Tokenizers other than the saved char tokenizer go through AutoTokenizer (the char tokenizer's
load without torch: tests/integration/test_tokenizer_light_load_processes.py)."""

from __future__ import annotations

import json

from backends.models.tokenizer import saved_tokenizer_class


def test_other_tokenizer_classes_are_left_to_autotokenizer(tmp_path):
    assert saved_tokenizer_class(str(tmp_path)) is None  # no config: AutoTokenizer decides
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    assert saved_tokenizer_class(str(tmp_path)) == "Qwen2Tokenizer"
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert saved_tokenizer_class(str(tmp_path)) is None
