"""skyrl-gym environments on the real stack (vLLM engine + router + orchestrator + DeepSpeed learner):
one RL step on a SkyRL-format parquet dataset whose rows name their environment (``env_class``):
SkyRL's built-in ``gsm8k`` and a user-registered two-turn environment, with ``rl.environment =
"skyrl_gym"``. The learner's batch itself is checked (``rl.keep_batches``): turns, loss masks,
observation tokens and rewards as the environments gave them.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.cli_runs import events, run_skyrl
from tests.recipes import RL, tiny_recipe, write_recipe

pytestmark = pytest.mark.integration
pytest.importorskip("skyrl_gym")

USER_ENV = '''
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class TwoTurns(BaseTextEnv):
    """Turn 1 earns env_config.bonus and asks again; turn 2 earns 1 for an answer of even length."""

    def __init__(self, env_config=None, extras={}):
        super().__init__()
        self.max_turns = extras["max_turns"]
        self.bonus = env_config.bonus

    def step(self, action):
        self.turns += 1
        if self.turns < self.max_turns:
            obs = [{"role": "user", "content": "again?"}]
            return BaseTextEnvStepOutput(observations=obs, reward=self.bonus, done=False, metadata={})
        return BaseTextEnvStepOutput(observations=[], reward=float(len(action) % 2 == 0), done=True, metadata={})

    def get_metrics(self):
        return {"turns_taken": self.turns}


skyrl_gym.register(id="two_turns", entry_point="my_envs:TwoTurns")
'''
BONUS = 0.25


def skyrl_rows(n: int) -> list[dict]:
    """SkyRL's dataset format (examples/gsm8k/gsm8k_dataset.py there), half for each environment."""
    rows = []
    for i in range(n):
        a, b = 10 + i, 3 * i
        rows.append(
            {
                "data_source": "itest",
                "prompt": [{"role": "user", "content": f"what is {a}+{b}?"}],
                "env_class": "gsm8k" if i % 2 == 0 else "two_turns",
                "reward_spec": {"method": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i},
            }
        )
    return rows


def test_builtin_and_user_registered_environments_train_from_a_skyrl_dataset(tmp_path, tiny_model_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(skyrl_rows(40)), tmp_path / "train.parquet")
    (tmp_path / "my_envs.py").write_text(USER_ENV)
    recipe = tiny_recipe(
        RL,
        name="gymtest",
        model={"path": str(tiny_model_dir), "init": None, "tokenizer": None},
        data={"task": None, "digits": None, "train": "train.parquet", "eval_size": 4},
        trainer={"ranks": 1},
        rl={
            "init_from": str(tiny_model_dir),
            "steps": 1,
            "prompts_per_step": 8,
            "max_new_tokens": 6,
            "max_turns": 2,
            "keep_batches": True,
            "environment": "skyrl_gym",
            "environment_modules": ["my_envs"],
            "env_config": {"two_turns": {"bonus": BONUS}},
        },
    )
    write_recipe(tmp_path / "recipe.toml", recipe)
    run = tmp_path / "runs/gym"
    run_skyrl("rl", "recipe.toml", "--run-dir", run, "--quiet", cwd=tmp_path, timeout=900)

    from skyrl_gym.envs.gsm8k.utils import compute_score

    from backends.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    truth = {r["prompt"][0]["content"]: r for r in skyrl_rows(40)}
    samples = json.loads((run / "batches/step-0.json").read_text())["samples"]
    kinds = {"gsm8k": 0, "two_turns": 0}
    for s in samples:
        prompt = tokenizer.decode(s["prompt_ids"], skip_special_tokens=True)
        row = next(r for text, r in truth.items() if text in prompt)
        kinds[row["env_class"]] += 1
        mask, ids = s["loss_mask"], s["response_ids"]
        if row["env_class"] == "gsm8k":  # one turn, scored by gsm8k's own rule
            assert s["num_turns"] == 1 and set(mask) == {1}
            answer = tokenizer.decode(ids, skip_special_tokens=True)
            assert s["reward"] == compute_score(answer, row["reward_spec"]["ground_truth"])
            continue
        # two turns: the model's, the environment's observation (no loss, no logprob), the model's
        assert s["num_turns"] == 2, s
        a = mask.index(0)
        b = a + mask[a:].index(1)
        assert set(mask[:a]) == {1} and set(mask[b:]) == {1}
        assert all(lp == 0 for lp in s["rollout_logprobs"][a:b])
        assert "again?" in tokenizer.decode(ids[a:b], skip_special_tokens=False)
        answer = tokenizer.decode(ids[b:], skip_special_tokens=True)
        assert s["reward"] == pytest.approx(BONUS + float(len(answer) % 2 == 0)), (answer, s["reward"])
    assert kinds["gsm8k"] and kinds["two_turns"], kinds
    assert [v for _, v in events(run, "rollout/errors")] == [0.0]
    turns = events(run, "rollout/env/turns_taken")
    assert turns and 1.0 <= turns[0][1] <= 2.0  # gsm8k reports none; two_turns always 2
