"""INT4 export: a compressed-tensors ``pack-quantized`` W4A16 checkpoint (with tokenizer) that vLLM
serves, whose codes and scales are torchao's bit for bit.

torchao quantizes (``backends.quant.fake_quant``); compressed-tensors only packs and describes the
result for vLLM. Its compressor re-quantizes ``weight`` with ``weight_scale``, so each layer gets
torchao's dequantized weight and torchao's scales: ``round(code * s / s)`` gives the code back
exactly, and ``export_w4a16`` unpacks every layer afterwards and refuses to write a checkpoint whose
codes or scales differ.

Also the PTQ process of ``skyrl quantize --ptq``::

    python -m backends.quant.export --run-dir DIR --model SRC_DIR

round-to-nearest of ``SRC_DIR`` into ``DIR/int4/`` (published whole), with events in ``DIR``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.models.loading import plain_copy
from backends.models.tied import add_explicit_head, tied_head
from backends.quant.fake_quant import int4_codes, quantize_rtn
from skyrl_contracts.atomic import publish_dir
from skyrl_contracts.events import EventWriter
from skyrl_contracts.logs import setup_process_logging
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.schema import QuantizationConfig

log = logging.getLogger(__name__)
FORMAT = "pack-quantized"
PROCESS_NAME = "quantizer"


@dataclass(frozen=True)
class ExportReport:
    layers: int  # Linear layers stored as int4
    weights_bytes: int  # safetensors bytes of the export
    source_bytes: int | None = None  # safetensors bytes of the full-precision model exported

    @property
    def size_ratio(self) -> float | None:
        return self.weights_bytes / self.source_bytes if self.source_bytes else None

    def metrics(self) -> dict[str, float]:
        figures = {"quant/int4_layers": self.layers, "quant/export_mb": self.weights_bytes / 2**20}
        if self.size_ratio is not None:
            figures["quant/size_ratio"] = self.size_ratio
        return figures


def weights_bytes(model_dir: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def w4a16_config(group_size: int | str, ignore: list[str]):
    """compressed-tensors' description of the export: int4 symmetric weights, per group of
    ``group_size`` input columns or per output row (``"channel"``), of every Linear layer not in
    ``ignore``; no activation quantization (W4A16)."""
    # lazy: compressed_tensors; only int4 exports use it
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization import QuantizationConfig as CompressionConfig

    if group_size == "channel":
        weights = QuantizationArgs(num_bits=4, type="int", strategy="channel", symmetric=True, dynamic=False)
    else:
        weights = QuantizationArgs(
            num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=True, dynamic=False
        )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    # "frozen": the scales are given (torchao's), not to be calibrated.
    return CompressionConfig(config_groups={"group_0": scheme}, ignore=ignore, quantization_status="frozen")


def _group_size(codes: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int | str:
    """``"channel"`` where every layer has one scale per row, else the one group size of every
    layer's codes."""
    if all(s.shape[1] == 1 for _, s in codes.values()):
        return "channel"
    sizes = {q.shape[1] // s.shape[1] for q, s in codes.values()}
    if len(sizes) == 1:
        return sizes.pop()
    raise ValueError(f"layers quantized with different group sizes {sorted(sizes)}")


def _dequantize(model: torch.nn.Module, codes: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Plain weights (torchao's dequantization) for compressed-tensors to set up and re-quantize."""
    modules = dict(model.named_modules())
    for name in codes:
        modules[name].weight = torch.nn.Parameter(modules[name].weight.dequantize(), requires_grad=False)


def _set_scales(model: torch.nn.Module, codes: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    modules = dict(model.named_modules())
    for name, (_, scale) in codes.items():
        modules[name].weight_scale.data = scale.detach().clone()


def _check_packed(state: dict[str, torch.Tensor], codes: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    # lazy: compressed_tensors; only int4 exports use it
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    for name, (qdata, scale) in codes.items():
        unpacked = unpack_from_int32(state[f"{name}.weight_packed"], 4, qdata.shape)
        if not torch.equal(unpacked.to(torch.int8), qdata) or not torch.equal(state[f"{name}.weight_scale"], scale):
            raise RuntimeError(f"{name}: the packed W4A16 codes or scales differ from torchao's; nothing written")


def _compress(compressor, model: torch.nn.Module) -> None:
    """``compressor.compress_model`` without its multi-rank path: compressed-tensors splits the
    layers over the ranks whenever a process group exists, but a trainer's rank 0 exports alone
    (the other ranks have finished), and its broadcast to them failed."""
    # lazy: compressed_tensors; only int4 exports use it
    from compressed_tensors.compressors.base import compress_module
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils.helpers import is_module_quantized

    for module in model.modules():
        if is_module_quantized(module):
            compress_module(module, compressor.force_compression_format)
    compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED


def export_w4a16(model: torch.nn.Module, tokenizer, out_dir: str | Path) -> ExportReport:
    """Write a torchao-converted model (``fake_quant.convert_qat`` / ``quantize_rtn``) to ``out_dir``
    as a compressed-tensors W4A16 checkpoint. Consumes ``model`` (its layers are compressed in place)."""
    # lazy: compressed_tensors; only int4 exports use it
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config

    codes = int4_codes(model)
    if not codes:
        raise ValueError("the model has no int4 layer to export")
    ignore = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in codes]
    _dequantize(model, codes)
    apply_quantization_config(model, w4a16_config(_group_size(codes), ignore))
    _set_scales(model, codes)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=FORMAT)
    _compress(compressor, model)
    _check_packed(model.state_dict(), codes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    compressor.update_config(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return ExportReport(layers=len(codes), weights_bytes=weights_bytes(out))


def _round_and_export(
    model, tokenizer, out_dir: str | Path, cfg: QuantizationConfig, for_engines: bool
) -> ExportReport:
    """Round-to-nearest int4 of the plain HF ``model`` (in its own dtype) as W4A16 in ``out_dir``;
    consumes ``model``. ``for_engines`` (RL with INT4 rollouts): a tied head is written out, full
    precision like the embedding, as the engines serve it (``backends.models.tied``); a user's export
    keeps the tie."""
    pair = tied_head(model) if for_engines else None
    embedding = model.get_input_embeddings().weight.detach().clone() if pair else None  # the export consumes the model
    quantize_rtn(model, cfg)
    report = export_w4a16(model, tokenizer, out_dir)
    if pair is not None:
        add_explicit_head(out_dir, pair, embedding)
        report = ExportReport(report.layers, weights_bytes(out_dir))
    return report


def export_rtn(
    src_dir: str | Path, out_dir: str | Path, cfg: QuantizationConfig, for_engines: bool = False
) -> ExportReport:
    """Round-to-nearest int4 of the HF model in ``src_dir`` (kept in its saved dtype) as W4A16 in
    ``out_dir`` (``for_engines``: see ``_round_and_export``). For a model trained under fake-quant
    these are the codes it trained with."""
    # lazy: transformers; the learner imports this module (train.common) before its "imports" lap
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype="auto").eval()
    report = _round_and_export(model, AutoTokenizer.from_pretrained(src_dir), out_dir, cfg, for_engines)
    return ExportReport(report.layers, report.weights_bytes, weights_bytes(src_dir))


def publish_int4(
    src_dir: str | Path, run_dir: str | Path, cfg: QuantizationConfig, for_engines: bool = False
) -> ExportReport:
    """``export_rtn`` of ``src_dir`` into ``run_dir/int4/``, published whole (a reader never sees
    half an export)."""
    paths = RunDir(run_dir)
    shutil.rmtree(paths.int4_tmp, ignore_errors=True)
    report = export_rtn(src_dir, paths.int4_tmp, cfg, for_engines)
    publish_dir(paths.int4_tmp, paths.int4)
    return report


def export_version(model, tokenizer, out_dir: Path, cfg: QuantizationConfig, state_dict=None) -> ExportReport:
    """One policy version for INT4 rollouts: the learner's ``model`` (``state_dict``: ZeRO-3's
    gathered tensors) as the W4A16 checkpoint in ``out_dir``, a tied head written out. Rounded in
    memory: a plain copy on the CPU (``plain_copy``), never a full-precision directory on disk.
    Round-to-nearest of the master weights: under fake-quant (int4_qat) exactly the codes the
    learner trained with. The report has no ``source_bytes``: no full-precision files exist."""
    return _round_and_export(plain_copy(model, state_dict), tokenizer, out_dir, cfg, for_engines=True)


def export_after_training(run_dir: str | Path, cfg: QuantizationConfig | None, dist, events, step: int) -> None:
    """The trainers' end hook: with INT4 QAT on, the INT4 export of the just-published ``final/``
    (rank 0; the others have nothing to do)."""
    if cfg is None or not cfg.int4_qat or not dist.is_main:
        return
    t0 = time.perf_counter()
    paths = RunDir(run_dir)
    report = publish_int4(paths.final, run_dir, cfg)
    if events:
        events.log(step, {**report.metrics(), "timing/export_s": time.perf_counter() - t0})
    log.info(
        f"INT4 export: {paths.int4} ({report.layers} layers, {report.weights_bytes / 2**20:.2f} MB, "
        f"{report.size_ratio:.3f}x the full-precision weights)",
    )


def main(argv: list[str] | None = None) -> None:
    setup_process_logging()

    parser = argparse.ArgumentParser(prog="python -m backends.quant.export", description="INT4 PTQ export (W4A16).")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--model", required=True, type=Path, help="HF model directory to quantize")
    parser.add_argument(
        "--setup",
        action="store_true",
        help="a setup job of another stage (RL with INT4 rollouts): "
        "its figures go to the run's events, its progress does not",
    )
    args = parser.parse_args(argv)
    paths = RunDir(args.run_dir)
    cfg = paths.read_recipe().quantization
    if cfg is None:
        raise SystemExit("the run's recipe has no [quantization] section")
    t0 = time.perf_counter()
    with EventWriter(paths.events, PROCESS_NAME) as events:
        if not args.setup:
            events.log(0, {"progress/total_steps": 1})
        report = publish_int4(args.model, args.run_dir, cfg, for_engines=args.setup)
        events.log(0 if args.setup else 1, {**report.metrics(), "timing/export_s": time.perf_counter() - t0})
    log.info(
        f"INT4 PTQ export: {paths.int4} ({report.layers} layers, {report.weights_bytes / 2**20:.2f} MB, "
        f"{report.size_ratio:.3f}x {args.model})",
    )


if __name__ == "__main__":
    sys.exit(main())
