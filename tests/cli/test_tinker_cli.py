"""`skyrl tinker serve`: recipe checks and the launch plan (nothing is started here)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def recipe(tmp_path):
    model = tmp_path / "my-model"
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

    def write(tinker: str = 'api_keys = ["tml-x"]', model_table: str = 'path = "my-model"') -> str:
        path = tmp_path / "t.toml"
        path.write_text(
            f'name = "t"\n[model]\n{model_table}\n[inference]\nengines = 1\n[tinker]\nport = 18123\n{tinker}\n'
        )
        return str(path)

    return write


def test_dry_run_plans_lora_engines_router_and_server(skyrl, recipe, tmp_path):
    result = skyrl(
        "tinker",
        "serve",
        recipe('api_keys = ["tml-x"]\nmax_live_adapters = 5\nmax_lora_rank = 12'),
        "--dry-run",
        "--json",
        "--run-dir",
        tmp_path / "run",
    )
    assert result.code == 0, result.err
    plan = json.loads(result.out)
    assert plan["stage"] == "tinker"
    roles = [p["role"] for p in plan["processes"]]
    assert roles == ["engine", "router", "server"]
    engine = plan["processes"][0]["argv"]
    assert engine[engine.index("--max-loras") + 1] == "5"
    assert engine[engine.index("--max-lora-rank") + 1] == "16"  # the smallest vLLM rank holding 12
    assert plan["processes"][0]["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    server = plan["processes"][2]
    assert server["argv"][1:4] == ["-m", "backends.tinker.server", "--config"]
    assert server["ready"]["url"] == "http://127.0.0.1:18123/api/v1/healthz"


def test_no_engines(skyrl, recipe, tmp_path):
    result = skyrl("tinker", "serve", recipe(), "--dry-run", "--json", "--no-engines", "--run-dir", tmp_path / "run")
    assert result.code == 0, result.err
    assert [p["role"] for p in json.loads(result.out)["processes"]] == ["server"]


def test_refusals(skyrl, recipe, tmp_path, monkeypatch):
    monkeypatch.delenv("SKYRL_TINKER_API_KEYS", raising=False)
    bad_key = skyrl("tinker", "serve", recipe('api_keys = ["secret"]'), "--dry-run")
    assert bad_key.code == 2 and "tinker.api_keys" in bad_key.err
    no_keys = skyrl("tinker", "serve", recipe(""), "--run-dir", tmp_path / "run")
    assert no_keys.code != 0 and "no API keys" in no_keys.err and "tml-" in no_keys.err
    monkeypatch.setenv("SKYRL_TINKER_API_KEYS", "nope")
    wrong_env = skyrl("tinker", "serve", recipe(""), "--run-dir", tmp_path / "run")
    assert wrong_env.code != 0 and "must start with tml-" in wrong_env.err
    tiny = skyrl("tinker", "serve", recipe(model_table='init = { hidden_size = 128 }\ntokenizer = "char"'), "--dry-run")
    assert tiny.code != 0 and "model.path" in tiny.err
    unknown = skyrl("tinker", "serve", recipe('api_keys = ["tml-x"]\nmax_rank = 3'), "--dry-run")
    assert unknown.code == 2 and "max_rank" in unknown.err
