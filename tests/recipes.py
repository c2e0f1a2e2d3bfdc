"""The tiny-model recipe of the end-to-end tests, written once: each test states only what makes
its recipe its own.

    tiny_recipe(SMALL, SFT, RL, name="rltest", rl={"steps": 3})  # the base, then layers, then keys
    write_recipe(path, recipe)

Layers and keyword overrides are deep-merged in order; a key set to None is left out (TOML has no
null), so a recipe can keep a key at the schema's default rather than the base's value.
"""

from __future__ import annotations

import copy
from pathlib import Path

# The model tests/integration/conftest.py builds (``build_tiny_model``): a recipe whose
# ``rl.init_from`` is that model describes the same architecture.
TINY_INIT = {"hidden_size": 128, "layers": 2, "heads": 4}

BASE = {
    "name": "itest",
    "seed": 1,
    "model": {"init": TINY_INIT, "tokenizer": "char"},
    "data": {"task": "addition", "digits": 2},
    "trainer": {"ranks": 2, "zero_stage": 2},
}
# Half the width, for the runs that train from scratch: an SFT stage of a few seconds.
SMALL = {"model": {"init": {"hidden_size": 64, "heads": 2, "intermediate_size": 128}}}
# A short SFT stage, long enough for the RL after it to earn rewards on 2-digit addition.
SFT = {
    "sft": {"steps": 30, "batch_size": 32, "learning_rate": 3e-3, "warmup_steps": 5, "eval_every": 0, "save_every": 0}
}
# A few small sync RL steps on one engine; ``rl.init_from`` and ``rl.steps`` are the test's.
RL = {
    "rl": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 4, "eval_every": 0, "save_every": 0},
    "inference": {"engines": 1, "max_num_seqs": 32},
}


def merged(recipe: dict, *layers: dict, **overrides) -> dict:
    """``recipe`` with each layer, then ``overrides``, deep-merged in (None: the key is left out)."""
    out = copy.deepcopy(recipe)
    for layer in (*layers, overrides):
        _merge_into(out, layer)
    return out


def _merge_into(into: dict, layer: dict) -> None:
    for key, value in layer.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict):
            if not isinstance(into.get(key), dict):
                into[key] = {}
            _merge_into(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def tiny_recipe(*layers: dict, **overrides) -> dict:
    return merged(BASE, *layers, **overrides)


def write_recipe(path: Path, recipe: dict) -> Path:
    import tomli_w

    path.write_text(tomli_w.dumps(recipe))
    return path
