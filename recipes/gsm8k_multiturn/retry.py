"""The environment of the gsm8k_multiturn recipe (``rl.environment = "gsm8k_multiturn.retry:RetryMath"``).

A GSM8K problem with one second chance: turn 1 is the problem; a right answer (math-verify against
the row's ``answer``) scores 1 and ends the episode; a wrong one is told so and the model answers
again (up to ``rl.max_turns``). The second turn's right answer also scores 1, so the reward is
"solved within the turns"; the feedback message is an observation (rendered with the model's chat
template, no loss on it). The orchestrator makes one instance per trajectory, so state is on self.
"""

from __future__ import annotations

from typing import Any, Mapping

from backends.rollout.environments import Environment, StepResult, prompt_and_answer
from backends.rollout.rewards import math_reward

FEEDBACK = "That answer is not correct. Check your work and give the final answer again within \\boxed{}."


class RetryMath(Environment):
    def reset(self, row: Mapping[str, Any]) -> list[dict]:
        messages, self.answer = prompt_and_answer(row)
        if self.answer is None:
            raise ValueError("row has no 'answer' to check against")
        return messages

    def step(self, response: str) -> StepResult:
        if math_reward(response, self.answer):
            return StepResult(reward=1.0, done=True)
        return StepResult(observation=[{"role": "user", "content": FEEDBACK}], reward=0.0, done=False)
