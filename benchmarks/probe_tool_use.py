"""What a ``lookup`` model does with its tool, turn by turn, in transformers (no engines).

For held-out rows of the ``lookup`` task: does the first turn call the tool, with the right key, and
does the answer after the tool's result equal the value? Greedy and sampled (temperature 1) episodes,
the tool parsed by the recipe's parser (vLLM's ``pythonic``), observations as the RL stage renders them.

    .venv/bin/python benchmarks/probe_tool_use.py runs/tool_use/sft/final [--rows 100] [--digits 3]
"""

from __future__ import annotations

import argparse


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from backends.data.chat import continuation_text, encode_prompt, encode_text
    from backends.data.tasks import get_task
    from backends.models.tokenizer import load_tokenizer
    from backends.rollout.tools import ToolCallParser

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--digits", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the rows' seed (the task's eval split)")
    args = parser.parse_args()
    torch.manual_seed(0)
    tok = load_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    task = get_task("lookup", args.digits)
    tools, calls = task.tools, ToolCallParser("pythonic", tok)
    rows = task.make_rows(args.seed, args.rows, "eval")

    def turn(ids: list[int], sample: bool) -> list[int]:
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=sample, temperature=1.0, top_k=None,
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        )  # fmt: skip
        return out[0, len(ids) :].tolist()

    for sample in (False, True):
        called = right_key = correct = 0
        for row in rows:
            prompt = task.prompt(row)
            ids = encode_prompt(tok, prompt, tools)
            first = turn(ids, sample)
            raw = tok.decode(first, skip_special_tokens=True)
            parsed = calls.parse(raw)
            if not parsed.calls:
                continue
            called += 1
            key_ok = (parsed.calls[0].arguments or {}).get("key") == row["prompt"][:-1]
            right_key += key_ok
            history = [*prompt, {"role": "assistant", "content": raw}]
            result = [{"role": "tool", "content": row["answer"] if key_ok else "not found"}]
            context = ids + first + encode_text(tok, continuation_text(tok, history, result, tools))
            correct += tok.decode(turn(context, sample), skip_special_tokens=True).strip() == row["answer"]
        mode = "sampled" if sample else "greedy"
        print(f"{mode:8s} of {len(rows)}: called the tool {called}, right key {right_key}, right answer {correct}")


if __name__ == "__main__":
    main()
