"""GSM8K rows for the real-model recipes (``recipes/gsm8k_*.toml``), from the dataset's
``question`` / ``answer`` fields (``openai/gsm8k``, config ``main``).

A GSM8K answer is a worked solution with calculator annotations (``<<48/2=24>>``) ending in
``#### 72``. A row here is ``{"prompt", "completion", "answer"}``: the question with the instruction
to box the result (what Qwen2.5-Instruct models are trained to do, and what math-verify extracts
first), the solution rewritten to end in ``\\boxed{72}`` (the SFT target), and the final number
alone (what the RL reward compares with, ``backends.rollout.rewards.math_reward``).
"""

from __future__ import annotations

import re

INSTRUCTION = "Solve the problem step by step. Put your final answer within \\boxed{}."
_CALCULATOR = re.compile(r"<<[^>]*>>")


def final_answer(solution: str) -> str:
    """The number after ``####`` (thousands separators dropped: math-verify compares values)."""
    head, sep, tail = solution.rpartition("####")
    if not sep:
        raise ValueError("a GSM8K solution ends in '#### <answer>'")
    return tail.strip().replace(",", "")


def gsm8k_row(question: str, solution: str) -> dict[str, str]:
    answer = final_answer(solution)
    steps = _CALCULATOR.sub("", solution.rpartition("####")[0]).strip()
    return {
        "prompt": f"{question.strip()}\n{INSTRUCTION}",
        "completion": f"{steps}\nThe final answer is \\boxed{{{answer}}}.",
        "answer": answer,
    }
