"""The reward of the own_task recipe (`rl.reward = "own_task.reward:score"`).

The RL orchestrator imports this module with the recipe's directory (here: recipes/) first on the
import path, and calls ``score(response, row)`` once per sampled response, in a worker thread with
a timeout (`rl.reward_timeout_s`). ``row`` is the JSONL row as read from the data file, every field
included. An exception, a timeout or a value that is not a finite number scores 0 and is counted
in the `rollout/errors` metric; the run goes on.
"""

from __future__ import annotations

from typing import Any, Mapping


def score(response: str, row: Mapping[str, Any]) -> float:
    """1.0 when the response is the prompt's letters in sorted order, else 0.0.

    Checked against the prompt itself rather than the row's completion, to show that a reward can
    verify an answer with any field of its row."""
    return 1.0 if response.strip() == "".join(sorted(row["prompt"])) else 0.0
