"""Chat templates, loss masks, file formats and the data order."""

from __future__ import annotations

import json

import pytest

from backends.data.chat import encode_conversation, encode_prompt, split_reference, to_messages
from backends.data.files import load_rows
from backends.data.sft import batch_indices, build_sft_data, load_source
from backends.models.tokenizer import build_char_tokenizer
from skyrl_contracts.schema import DataConfig

CONV = [
    {"role": "user", "content": "ab"},
    {"role": "assistant", "content": "ba"},
    {"role": "user", "content": "cd"},
    {"role": "assistant", "content": "dc"},
]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("abcd0123456789+=")


def _targets(tok, example):
    return tok.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m])


def test_prompt_ids_are_the_prefix_of_the_training_sequence(tok):
    messages = [{"role": "user", "content": "007+123="}]
    prompt = encode_prompt(tok, messages)
    assert tok.decode(prompt) == "<bos><|user|>007+123=<|assistant|>"
    full = encode_conversation(tok, messages + [{"role": "assistant", "content": "130"}])
    assert list(full.input_ids[: len(prompt)]) == prompt
    assert _targets(tok, full) == "130<eos>"  # the answer and the end of turn, nothing else


def test_loss_on_every_assistant_turn(tok):
    assert _targets(tok, encode_conversation(tok, CONV, "assistant")) == "ba<eos>dc<eos>"


def test_loss_on_last_assistant_turn(tok):
    assert _targets(tok, encode_conversation(tok, CONV, "last_assistant")) == "dc<eos>"


def test_loss_on_all_tokens_but_the_first(tok):
    ex = encode_conversation(tok, CONV, "all")
    assert ex.loss_mask[0] == 0 and all(ex.loss_mask[1:])


def test_truncation(tok):
    ex = encode_conversation(tok, CONV, "assistant", max_length=6)
    assert len(ex.input_ids) == len(ex.loss_mask) == 6


def test_prompt_completion_rows_become_messages():
    assert to_messages({"prompt": "q", "completion": "a"}) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    conv = to_messages(
        {
            "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
            "completion": [{"role": "assistant", "content": "a"}],
        }
    )
    assert [m["role"] for m in conv] == ["system", "user", "assistant"]
    assert split_reference(conv) == (conv[:2], "a")
    with pytest.raises(ValueError):
        to_messages({"text": "x"})


def _write_all_formats(tmp_path, rows):
    import datasets

    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    hf_dir = tmp_path / "hf"
    datasets.Dataset.from_list(rows).save_to_disk(str(hf_dir))
    return jsonl, parquet, hf_dir


def test_jsonl_parquet_and_hf_dataset_dirs_give_the_same_rows(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(5)
    ]
    for path in _write_all_formats(tmp_path, rows):
        assert load_rows(path) == rows, path
        assert load_rows(path, limit=2) == rows[:2], path


def test_unsupported_file(tmp_path):
    with pytest.raises(ValueError, match="unsupported data file"):
        load_rows(tmp_path / "x.csv")


def test_file_data_builds_examples_with_a_held_out_split(tmp_path, tok):
    rows = [{"prompt": f"{i:02d}+1=", "completion": str(i + 1)} for i in range(40)]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data_cfg = DataConfig(train=str(jsonl), eval_size=4)
    source = load_source(data_cfg, seed=0)
    assert len(source.train) == 36 and len(source.eval) == 4
    assert set(source.alphabet()) == set("0123456789+=")
    data = build_sft_data(source, tok, data_cfg)
    item = data.eval_items[0]
    assert data.scorer(item.reference, item) == 1.0 and data.scorer("x", item) == 0.0


def test_data_order_is_a_function_of_seed_and_step():
    n = 10
    first_epoch = [i for step in range(5) for i in batch_indices(0, step, 2, n)]
    assert sorted(first_epoch) == list(range(n))  # one epoch = a permutation
    assert batch_indices(0, 7, 2, n) == batch_indices(0, 7, 2, n)
    assert first_epoch != [i for step in range(5) for i in batch_indices(1, step, 2, n)]
    second_epoch = [i for step in range(5, 10) for i in batch_indices(0, step, 2, n)]
    assert sorted(second_epoch) == list(range(n)) and second_epoch != first_epoch
