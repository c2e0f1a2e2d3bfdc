"""The episode runner's own checks of a recipe, run by the driver in a child process before anything
starts (``skyrl recipes validate``, ``skyrl rl``): a library environment that is not installed, not
registered, or cannot run beside a trainer is refused in one line then, not after the engines are up.

    python -m backends.rollout.episodes.preflight [--import-path DIR] < recipe.json

Reads the resolved recipe (JSON) on stdin; exits 0 when the runner's ``preflight`` passes, 2 with
the reason as the last line of stderr when it refuses, 1 on anything else (its traceback on stderr).
"""

from __future__ import annotations

import argparse
import sys

from skyrl_contracts.episodes import episode_kind
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe

from . import runner_class


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.rollout.episodes.preflight")
    parser.add_argument("--import-path", action="append", default=[], help="searched first for the recipe's modules")
    args = parser.parse_args(argv)
    sys.path[:0] = [p for p in args.import_path if p not in sys.path]
    recipe = Recipe.model_validate_json(sys.stdin.read())
    try:
        runner_class(episode_kind(recipe)).preflight(recipe)
    except UsageError as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
