"""A saved char tokenizer loads without importing torch, seen from a fresh interpreter (the RL
orchestrator's start-up), and behaves exactly as AutoTokenizer's load of the same directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from backends.data.tasks import get_task
from backends.models.tokenizer import build_char_tokenizer, load_tokenizer

pytestmark = pytest.mark.integration


def test_char_tokenizer_loads_without_torch_and_matches_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    build_char_tokenizer(get_task("addition", 2).alphabet).save_pretrained(tmp_path)
    probe = (
        "import sys, json; from backends.models.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(tmp_path)!r}); "
        "ids = t.apply_chat_template([{'role': 'user', 'content': '12+34='}], add_generation_prompt=True, tokenize=False); "
        "print(json.dumps({'torch': 'torch' in sys.modules, 'text': ids, 'enc': t('12+34=46')['input_ids']}))"
    )
    out = json.loads(
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.splitlines()[
            -1
        ]
    )
    assert out["torch"] is False
    auto = AutoTokenizer.from_pretrained(tmp_path)
    light = load_tokenizer(str(tmp_path))
    messages = [{"role": "user", "content": "12+34="}]
    assert out["text"] == auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out["enc"] == auto("12+34=46")["input_ids"] == light("12+34=46")["input_ids"]
    assert (light.eos_token_id, light.pad_token_id, light.bos_token_id) == (
        auto.eos_token_id,
        auto.pad_token_id,
        auto.bos_token_id,
    )
    assert light.decode([5, 9, 2], skip_special_tokens=True) == auto.decode([5, 9, 2], skip_special_tokens=True)
