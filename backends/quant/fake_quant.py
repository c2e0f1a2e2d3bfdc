"""INT4 weight-only fake quantization of a model's Linear layers, through torchao's QAT API.

Symmetric, one scale per group of ``group_size`` input columns (or per output row: ``"channel"``),
int4 codes in [-8, 7], the
straight-through estimator in the backward pass (torchao's ``FakeQuantizedLinear``). The scales
are recomputed from the current weights at every forward (torchao's dynamic weight fake-quant), so
round-to-nearest of the trained weights (``quantize_rtn``) gives the codes the model trained with:
the export (``backends.quant.export``) needs nothing but the final weights.

Only torchao's ``IntxWeightOnlyConfig`` converts on CPU (``Int4WeightOnlyConfig`` needs a GPU
package), and it is the same config for prepare, convert and PTQ, so all three agree bit for bit.
``lm_head`` and the embeddings stay in full precision: vLLM's W4A16 format quantizes the decoder's
Linear layers and lists the rest in its ``ignore``.
"""

from __future__ import annotations

import torch

from skyrl_contracts.schema import QuantizationConfig

QMIN, QMAX = -8, 7


def target_layers(model: torch.nn.Module, cfg: QuantizationConfig) -> dict[str, torch.nn.Linear]:
    """The Linear layers of ``model`` that ``cfg.targets`` select, by name (model order)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and cfg.selects(n)}


def check_layers(layers: dict[str, torch.nn.Linear], cfg: QuantizationConfig) -> None:
    """Refuse what torchao would fail on mid-way, naming the layer (the recipe checks catch it first
    for known architectures: ``skyrl_cli.plan.feasibility``)."""
    if not layers:
        raise ValueError(f"quantization.targets {list(cfg.targets)} select no Linear layer of the model")
    for name, layer in layers.items():
        if not cfg.divides(layer.in_features):
            raise ValueError(
                f"quantization.group_size {cfg.group_size} does not divide the input width {layer.in_features} of {name}"
            )


def weight_config(group_size: int | str):
    """torchao's int4 weight-only config: ``PerGroup(g)``, or ``PerAxis(0)`` (one scale per output
    row) for ``"channel"``."""
    # lazy: torchao; only quantized runs use it (the standby pool preloads it on demand)
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    granularity = PerAxis(0) if group_size == "channel" else PerGroup(group_size)
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=granularity)


def _quantize(model: torch.nn.Module, cfg: QuantizationConfig, config) -> list[str]:
    # lazy: torchao; only quantized runs use it (the standby pool preloads it on demand)
    from torchao.quantization import quantize_

    layers = target_layers(model, cfg)
    check_layers(layers, cfg)
    chosen = set(layers)
    quantize_(model, config, filter_fn=lambda module, fqn: fqn in chosen)
    return list(layers)


def prepare_qat(model: torch.nn.Module, cfg: QuantizationConfig) -> list[str]:
    """Swap the target layers for fake-quantized ones in place (before the optimizer is built);
    returns their names."""
    # lazy: torchao; only quantized runs use it (the standby pool preloads it on demand)
    from torchao.quantization.qat import QATConfig

    return _quantize(model, cfg, QATConfig(weight_config(cfg.group_size), step="prepare"))


def convert_qat(model: torch.nn.Module, cfg: QuantizationConfig) -> list[str]:
    """A ``prepare_qat`` model to real int4 weights (torchao ``IntxUnpackedToInt8Tensor``), in place."""
    # lazy: torchao; only quantized runs use it (the standby pool preloads it on demand)
    from torchao.quantization.qat import QATConfig
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    if not any(isinstance(m, FakeQuantizedLinear) for m in model.modules()):
        raise ValueError("the model has no fake-quantized layer; call prepare_qat first")
    return _quantize(model, cfg, QATConfig(weight_config(cfg.group_size), step="convert"))


def quantize_rtn(model: torch.nn.Module, cfg: QuantizationConfig) -> list[str]:
    """Round-to-nearest int4 of a plain model's target layers, in place (PTQ: the baseline, and the
    export of a model trained under fake-quant)."""
    return _quantize(model, cfg, weight_config(cfg.group_size))


def maybe_prepare_qat(model: torch.nn.Module, cfg: QuantizationConfig | None, say=print) -> torch.nn.Module:
    """The trainers' hook: fake-quant the model when the recipe asks for INT4 QAT, else leave it."""
    if cfg is None or not cfg.int4_qat:
        return model
    names = prepare_qat(model, cfg)
    say(f"INT4 fake-quant ({granularity_name(cfg.group_size)}) on {len(names)} Linear layers")
    return model


def granularity_name(group_size: int | str) -> str:
    return "per channel" if group_size == "channel" else f"group {group_size}"


def int4_codes(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (codes int8 [out, in], scales [out, in / group])}`` of a converted model."""
    # lazy: torchao; only quantized runs use it (the standby pool preloads it on demand)
    from torchao.quantization import IntxUnpackedToInt8Tensor

    found = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and isinstance(weight, IntxUnpackedToInt8Tensor):
            if weight.zero_point.count_nonzero():
                raise ValueError(f"{name}: asymmetric codes (non-zero zero point); the export is symmetric")
            found[name] = (weight.qdata, weight.scale)
    return found


def fake_quant_scales(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The scales each fake-quantized layer used in its last forward (torchao keeps them)."""
    # lazy: torchao; only quantized runs use it (the standby pool preloads it on demand)
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    return {
        name: module.weight_fake_quantizer.scale
        for name, module in model.named_modules()
        if isinstance(module, FakeQuantizedLinear) and module.weight_fake_quantizer.scale is not None
    }
