"""An agent program for the own_task data (`rl.agent = "own_task.agent:solve"`): it asks the model to
sort the letters and, when the answer is wrong, asks once more in a new user turn (the letters
again: the character tokenizer of this recipe knows only the data's letters). Two chat calls at most,
written with the `openai` package against the run's endpoint, as an agent written for any
OpenAI-compatible server is.

The reward is the last answer's (the same check as reward.py). Both calls of a trajectory train:
the second call's prompt extends the first call's conversation, so the two are one sample, and
the feedback between them carries no loss. `rl.max_turns` is left unset, so the calls are not
capped; `rl.max_turns = 1` would refuse every second call with a 400.
"""

from __future__ import annotations

from typing import Any, Mapping

from own_task.reward import score


async def solve(row: Mapping[str, Any], endpoint) -> tuple[float, dict]:
    client = endpoint.client()  # cheap: built on the endpoint's shared connection
    messages = [{"role": "user", "content": row["prompt"]}]
    reward, calls = 0.0, 0
    for _ in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        calls += 1
        answer = reply.choices[0].message.content or ""
        reward = score(answer, row)
        if reward == 1.0:
            break
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": row["prompt"]}]
    return reward, {"retried": float(calls > 1)}
