"""The agent path's cost: one task trained through ``rl.reward`` and through an agent program.

A user's task (the ``own_task`` recipe: sort 5 letters, the user's own JSONL files) is trained from
one SFT model twice, as a user runs it (``skyrl rl`` from the command line, sync): once with its
reward function (``rl.reward``, the baseline), once through an agent program (``rl.agent``) that
makes one chat-completions call per trajectory with the ``openai`` package over the run's
endpoint and scores the answer with the same function. Same seed, steps, batch and engines; the only
difference is the path a trajectory takes. Printed per side: wall time of ``skyrl rl`` (start-up
included), the time from the first to the last training step, mean rollout tokens/s, and held-out
accuracy first -> last; then the ratio agent / reward of each time (means over the seeds).

    python benchmarks/bench_agent_path.py                 # SFT once, then 20 RL steps each side, seed 0
    python benchmarks/bench_agent_path.py --steps 20 --seeds 0 1 --sft-dir runs/own_task/sft/final
    python benchmarks/bench_agent_path.py --agent new-client   # the agent builds its own AsyncOpenAI per trajectory
    python benchmarks/bench_agent_path.py --agent retry --steps 60   # own_task/agent.py: a second call when wrong
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import tomli_w

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "own_task.toml"
SKYRL = Path(sys.executable).with_name("skyrl")

# One call per trajectory, scored by the recipe's own reward function. "endpoint": the client the
# endpoint hands out (what docs/agents.md shows); "new-client": an AsyncOpenAI built per trajectory
# from base_url, as a user's program that knows nothing of skyrl does; "retry": the recipe folder's
# own agent (own_task/agent.py), which asks again after a wrong answer (two calls at most).
AGENTS = {
    "retry": """
from own_task.agent import solve
""",
    "endpoint": """
from own_task.reward import score


async def solve(row, endpoint):
    reply = await endpoint.client().chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}]
    )
    return score(reply.choices[0].message.content or "", row)
""",
    "new-client": """
from openai import AsyncOpenAI

from own_task.reward import score


async def solve(row, endpoint):
    client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}]
    )
    return score(reply.choices[0].message.content or "", row)
""",
}


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]


def skyrl(workdir: Path, *args: str) -> float:
    """Runs ``skyrl ARGS`` in ``workdir``; its wall time in seconds."""
    started = time.perf_counter()
    proc = subprocess.run([str(SKYRL), *args], cwd=workdir, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"skyrl {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def side_recipe(workdir: Path, base: dict, side: str, steps: int, sft_dir: Path, seed: int) -> str:
    recipe = json.loads(json.dumps(base))
    recipe.pop("sft", None)
    recipe["seed"] = seed
    rl = recipe["rl"]
    rl.update(init_from=str(sft_dir), steps=steps, save_every=0, eval_every=max(1, steps // 2))
    if side != "reward":
        rl.pop("reward")
        rl.pop("reward_timeout_s", None)
        rl["agent"] = "sort_agent:solve"
    name = f"{side}.toml"
    (workdir / name).write_text(tomli_w.dumps(recipe))
    return name


def measure(workdir: Path, recipe: str, run: Path) -> dict:
    wall = skyrl(workdir, "rl", recipe, "--run-dir", str(run), "--quiet")
    evs = events(run)
    losses = [e["time"] for e in evs if e["name"] == "train/policy_loss"]
    rates = [e["value"] for e in evs if e["name"] == "rollout/tokens_per_s"]
    accuracy = [e["value"] for e in evs if e["name"] == "eval/accuracy"]
    calls = [e["value"] for e in evs if e["name"] == "rollout/agent_calls_mean"]
    errors = sum(e["value"] for e in evs if e["name"] == "rollout/errors")
    return {
        "wall_s": wall,
        "steps_s": losses[-1] - losses[0] if len(losses) > 1 else float("nan"),
        "tokens_per_s": statistics.mean(rates) if rates else float("nan"),
        "accuracy": (accuracy[0], accuracy[-1]) if accuracy else (float("nan"),) * 2,
        "agent_calls": statistics.mean(calls) if calls else None,
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="RL seeds; one run of each side per seed")
    parser.add_argument("--agent", choices=sorted(AGENTS), default="endpoint")
    parser.add_argument("--sft-dir", type=Path, help="an SFT model of the own_task recipe (default: train one)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    shutil.copytree(RECIPE.with_suffix(""), workdir / "own_task", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(RECIPE, workdir / "own_task.toml")
    (workdir / "sort_agent.py").write_text(AGENTS[args.agent])
    base = tomllib.loads(RECIPE.read_text())
    sft_dir = args.sft_dir.resolve() if args.sft_dir else None
    if sft_dir is None:
        print("SFT (own_task recipe) ...", flush=True)
        skyrl(workdir, "sft", "own_task.toml", "--quiet")
        sft_dir = workdir / "runs/own_task/sft/final"
    results: dict[str, list[dict]] = {"reward": [], "agent": []}
    for seed in args.seeds:
        for side in results:
            recipe = side_recipe(workdir, base, side, args.steps, sft_dir, seed)
            result = measure(workdir, recipe, workdir / f"runs/{side}-{seed}")
            results[side].append(result)
            print(
                f"{side:>6} seed {seed}: wall {result['wall_s']:6.1f} s, steps {result['steps_s']:6.1f} s, "
                f"rollout {result['tokens_per_s']:7.0f} tokens/s, accuracy {result['accuracy'][0]:.3f} -> "
                f"{result['accuracy'][1]:.3f}, agent calls {result['agent_calls']}, errors {result['errors']:.0f}",
                flush=True,
            )
    print(f"\nown_task, {args.steps} RL steps, agent {args.agent!r}, seeds {args.seeds}, means:")
    for key, label in (("wall_s", "wall time"), ("steps_s", "first to last step")):
        reward = statistics.mean(r[key] for r in results["reward"])
        agent = statistics.mean(r[key] for r in results["agent"])
        print(f"  {label:<18} reward {reward:6.1f} s   agent {agent:6.1f} s   agent/reward {agent / reward:.2f}x")
    reward = statistics.mean(r["tokens_per_s"] for r in results["reward"])
    agent = statistics.mean(r["tokens_per_s"] for r in results["agent"])
    print(
        f"  {'rollout tokens/s':<18} reward {reward:6.0f}     agent {agent:6.0f}     agent/reward {agent / reward:.2f}x"
    )
    if args.keep:
        print(f"work directory: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
