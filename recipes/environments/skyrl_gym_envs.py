"""A skyrl-gym environment as a SkyRL user writes it, unchanged: registered when this module is
imported (the recipe lists it in rl.environment_modules). A wrong answer is told so and gets one
more try; the second try earns half."""

import re

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class RetryArithmetic(BaseTextEnv):
    def __init__(self, env_config=None, extras={}):
        super().__init__()
        self.answer = str(extras["reward_spec"]["ground_truth"])
        self.max_turns = extras["max_turns"]
        self.second_try = env_config.get("second_try", 0.5)

    def step(self, action):
        self.turns += 1
        numbers = re.findall(r"-?\d+", action)
        right = bool(numbers) and numbers[-1] == self.answer
        if right or self.turns >= self.max_turns:
            weight = 1.0 if self.turns == 1 else self.second_try
            return BaseTextEnvStepOutput(observations=[], reward=weight * right, done=True, metadata={})
        retry = [{"role": "user", "content": "not quite, try again"}]
        return BaseTextEnvStepOutput(observations=retry, reward=0.0, done=False, metadata={})

    def get_metrics(self):
        return {"tries": self.turns}


skyrl_gym.register(id="retry_arithmetic", entry_point="skyrl_gym_envs:RetryArithmetic")
