"""The Tinker server's launch plan: ports and paths from the recipe (nothing is started here)."""

from __future__ import annotations

import json

from skyrl_cli.plan.feasibility import load_feasible_recipe
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.tinker import plan_tinker

CPU2 = MachineFacts(
    cpu_cores=(0, 1), python="py", torch_extensions_dir="/ext", port_finder=lambda n: [29500 + i for i in range(n)]
)


def recipe_file(tmp_path, extra: str = "") -> str:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 128,
                "num_attention_heads": 4,
                "num_hidden_layers": 2,
                "max_position_embeddings": 512,
                "vocab_size": 64,
            }
        )
    )
    path = tmp_path / "conf" / "t.toml"
    path.parent.mkdir()
    path.write_text(
        f'name = "t"\n[model]\npath = "../m"\n[inference]\nengines = 1\n[tinker]\napi_keys = ["tml-x"]\n{extra}\n'
    )
    return str(path)


def test_the_recipes_router_port_is_the_routers_port(tmp_path):
    recipe = load_feasible_recipe(recipe_file(tmp_path, "[inference.router]\nport = 18555"), gpu_count=0)
    plan, config = plan_tinker(recipe, tmp_path / "run", CPU2)
    router = next(p for p in plan.processes if p.role == "router")
    assert router.argv[router.argv.index("--port") + 1] == "18555"
    assert plan.router_url == config["sample_url"] == "http://127.0.0.1:18555"


def test_a_relative_storage_dir_is_relative_to_the_recipe_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path / "..")
    recipe = load_feasible_recipe(recipe_file(tmp_path, 'storage_dir = "store"'), gpu_count=0)
    _, config = plan_tinker(recipe, tmp_path / "run", CPU2)
    assert config["storage_dir"] == str(tmp_path / "conf" / "store")


def test_without_storage_dir_the_storage_is_in_the_run_directory(tmp_path):
    recipe = load_feasible_recipe(recipe_file(tmp_path), gpu_count=0)
    assert plan_tinker(recipe, tmp_path / "run", CPU2)[1]["storage_dir"] == str(tmp_path / "run" / "storage")
