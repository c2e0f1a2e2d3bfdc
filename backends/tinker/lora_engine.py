"""The multi-LoRA trainer: one frozen base model, many LoRA adapters, batched passes across them.

Every targeted ``nn.Linear`` of the base model is wrapped in a ``MultiLoraLinear``. A pass over a
batch whose rows belong to different adapters runs the base model's matmuls **once** over all rows;
each wrapped layer then adds, for every adapter present, ``scale * (x[rows] @ A.T) @ B.T`` to that
adapter's rows only. Inside a micro-batch each adapter's rows are contiguous, so ``rows`` is a
slice (a view, no gather and scatter of activations). So N tenants' forward/backward costs one base
pass plus N small low-rank products, and each adapter's gradient comes from its own rows. On a CPU
core the base matmuls cost in proportion to their rows, so the sharing pays on GPUs
(benchmarks/RESULTS.md, "Tinker server").

Each adapter owns its parameters (``A [r, in]``, ``B [out, r]`` per wrapped layer) and its own
``torch.optim.AdamW``; an optimizer step, weight decay or gradient clipping of one adapter never
touches another. Gradients accumulate in the parameters' ``.grad`` across forward/backward calls
until that adapter's ``optim_step``; forward-only passes run under ``torch.no_grad``.

The engine runs on the GPU when there is one (``device``), else on the CPU, in fp32.

Checkpoints are PEFT adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``),
which vLLM loads as runtime LoRA adapters and peft loads onto the base model; training checkpoints
add the optimizer state (``optimizer.pt``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig as PeftLoraConfig
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from backends.tinker.losses import datum_loss

# Module names per LoRA group of the SDK's lora_config (Llama / Qwen / Mistral naming).
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
LORA_ALPHA = 32.0  # scale = alpha / rank, as in skyrl-tx; written to adapter_config.json
PEFT_PREFIX = "base_model.model."
OPTIMIZER_FILE = "optimizer.pt"


class EngineError(ValueError):
    """A request the engine cannot serve (reported to the client as a user error)."""


class _Routing:
    """Which rows of the current batch belong to which adapter: ``(adapter, start, end)``, set
    around each pass."""

    def __init__(self) -> None:
        self.groups: list[tuple[Adapter, int, int]] = []


class MultiLoraLinear(nn.Module):
    """``base(x)`` plus, per adapter present in the batch, its low-rank update on its own rows."""

    def __init__(self, base: nn.Linear, path: str, routing: _Routing):
        super().__init__()
        self.base = base
        self.path = path
        self._routing = routing

    @property
    def weight(self):  # tied-embedding code and generation helpers read .weight
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for adapter, start, end in self._routing.groups:
            pair = adapter.weights.get(self.path)
            if pair is None:
                continue
            a, b = pair
            # in place on a slice of the base output: autograd records it, and the base's backward
            # needs its input and weight, not its output
            out[start:end] += ((x[start:end] @ a.t()) @ b.t()) * adapter.scale
        return out


@dataclass
class Adapter:
    model_id: str
    rank: int
    alpha: float
    modules: tuple[str, ...]  # short names (q_proj, ...)
    weights: dict[str, tuple[nn.Parameter, nn.Parameter]] = field(default_factory=dict)
    optimizer: torch.optim.AdamW | None = None
    steps: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def parameters(self) -> list[nn.Parameter]:
        return [p for pair in self.weights.values() for p in pair]


@dataclass(frozen=True)
class DatumIn:
    tokens: Sequence[int]  # model input
    targets: Sequence[int]  # same length as tokens
    inputs: Mapping[str, np.ndarray]  # float loss inputs, same length


@dataclass(frozen=True)
class WorkItem:
    """One request's share of a batched pass: an adapter, its datums, its loss."""

    model_id: str
    datums: Sequence[DatumIn]
    loss_fn: str
    config: Mapping[str, float]


@dataclass
class WorkResult:
    logprobs: list[np.ndarray]
    elementwise_loss: list[np.ndarray]
    loss_sum: float


class LoraEngine:
    def __init__(
        self,
        model_dir: str | os.PathLike,
        max_rank: int,
        max_adapters: int,
        max_batch_tokens: int = 32768,
        device: str | None = None,
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model_dir = str(model_dir)
        self.max_rank = max_rank
        self.max_adapters = max_adapters
        self.max_batch_tokens = max_batch_tokens
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).to(self.device)
        self.model.eval()  # no dropout; gradients still flow into the adapters
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.max_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None
        self._routing = _Routing()
        self.layers: dict[str, MultiLoraLinear] = {}
        wanted = set(ATTN_MODULES + MLP_MODULES + UNEMBED_MODULES)
        for path, module in list(self.model.named_modules()):
            if isinstance(module, nn.Linear) and path.rsplit(".", 1)[-1] in wanted:
                wrapped = MultiLoraLinear(module, path, self._routing)
                self.model.set_submodule(path, wrapped)
                self.layers[path] = wrapped
        self.adapters: dict[str, Adapter] = {}

    # ------------------------------------------------------------------------------ adapters

    @staticmethod
    def modules_for(train_attn: bool, train_mlp: bool, train_unembed: bool) -> tuple[str, ...]:
        return (
            (ATTN_MODULES if train_attn else ())
            + (MLP_MODULES if train_mlp else ())
            + (UNEMBED_MODULES if train_unembed else ())
        )

    def _check_room(self, model_id: str) -> None:
        if model_id not in self.adapters and len(self.adapters) >= self.max_adapters:
            raise EngineError(
                f"all {self.max_adapters} adapter slots are in use (tinker.max_live_adapters); "
                "finish a session or unload a model first"
            )

    def create_adapter(self, model_id: str, rank: int, modules: Sequence[str], seed: int | None = None) -> Adapter:
        if not 1 <= rank <= self.max_rank:
            raise EngineError(f"lora rank {rank} is outside 1..{self.max_rank} (tinker.max_lora_rank)")
        if not modules:
            raise EngineError("lora_config trains nothing: set one of train_attn, train_mlp, train_unembed")
        self._check_room(model_id)
        gen = torch.Generator().manual_seed(seed if seed is not None else 0)
        adapter = Adapter(model_id, rank, LORA_ALPHA, tuple(modules))
        for path, layer in self.layers.items():
            if path.rsplit(".", 1)[-1] not in modules:
                continue
            base = layer.base
            a = torch.empty(rank, base.in_features)
            # peft's default: A ~ kaiming-uniform(a=sqrt(5)), B = 0 (the adapter starts as a no-op)
            bound = 1.0 / math.sqrt(base.in_features)
            a.uniform_(-bound, bound, generator=gen)
            b = torch.zeros(base.out_features, rank)
            adapter.weights[path] = (nn.Parameter(a.to(self.device)), nn.Parameter(b.to(self.device)))
        if not adapter.weights:
            raise EngineError(f"the base model has none of the modules {list(modules)}")
        self.adapters[model_id] = adapter
        return adapter

    def drop_adapter(self, model_id: str) -> None:
        self.adapters.pop(model_id, None)

    def adapter(self, model_id: str) -> Adapter:
        try:
            return self.adapters[model_id]
        except KeyError:
            raise EngineError(f"model {model_id} is not loaded in the trainer") from None

    # -------------------------------------------------------------------------------- passes

    def run(self, items: Sequence[WorkItem], with_grad: bool) -> list[WorkResult]:
        """One batched pass (micro-batched to ``max_batch_tokens``) over the datums of ``items``,
        which may belong to different adapters; ``with_grad``: backward of the summed losses."""
        rows = [(i, j, d) for i, item in enumerate(items) for j, d in enumerate(item.datums)]
        for item in items:
            self.adapter(item.model_id)
        results = [
            WorkResult([None] * len(item.datums), [None] * len(item.datums), 0.0)  # type: ignore[list-item]
            for item in items
        ]
        # Longest first keeps the padding of each micro-batch small.
        rows.sort(key=lambda r: -len(r[2].tokens))
        start = 0
        while start < len(rows):
            width = len(rows[start][2].tokens)
            count = max(1, self.max_batch_tokens // max(width, 1))
            self._micro_batch(items, rows[start : start + count], results, with_grad)
            start += count
        return results

    def _micro_batch(self, items, rows, results, with_grad: bool) -> None:
        rows = self._by_adapter(items, rows)
        width = max(len(d.tokens) for _, _, d in rows)
        n = len(rows)
        input_ids = torch.zeros(n, width, dtype=torch.long)
        targets = torch.zeros(n, width, dtype=torch.long)
        mask = torch.zeros(n, width, dtype=torch.long)
        for r, (_, _, d) in enumerate(rows):
            length = len(d.tokens)
            input_ids[r, :length] = torch.as_tensor(d.tokens, dtype=torch.long)
            targets[r, :length] = torch.as_tensor(d.targets, dtype=torch.long)
            mask[r, :length] = 1
        spans: dict[str, list[int]] = {}
        for r, (i, _, _) in enumerate(rows):
            spans.setdefault(items[i].model_id, [r, r])[1] = r + 1
        self._routing.groups = [(self.adapters[mid], start, end) for mid, (start, end) in spans.items()]
        input_ids, targets, mask = input_ids.to(self.device), targets.to(self.device), mask.to(self.device)
        try:
            with torch.enable_grad() if with_grad else torch.no_grad():
                logits = self.model(input_ids=input_ids, attention_mask=mask).logits.float()
                logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
                total = logits.new_zeros(())
                for r, (i, j, d) in enumerate(rows):
                    length = len(d.tokens)
                    lp = logprobs[r, :length]
                    inputs = {k: torch.as_tensor(v, dtype=torch.float32).to(self.device) for k, v in d.inputs.items()}
                    elementwise = datum_loss(items[i].loss_fn, lp, inputs, items[i].config)
                    loss = elementwise.sum()
                    total = total + loss
                    res = results[i]
                    res.logprobs[j] = lp.detach().cpu().numpy().astype(np.float32)
                    res.elementwise_loss[j] = elementwise.detach().cpu().numpy().astype(np.float32)
                    res.loss_sum += float(loss.detach())
                if with_grad and total.requires_grad:
                    total.backward()
        finally:
            self._routing.groups = []

    @staticmethod
    def _by_adapter(items, rows):
        """``rows`` with each adapter's rows next to each other (a stable sort: the micro-batch's
        width, its longest row, does not change)."""
        order: dict[str, int] = {}
        for item in items:
            order.setdefault(item.model_id, len(order))
        return sorted(rows, key=lambda r: order[items[r[0]].model_id])

    # ----------------------------------------------------------------------------- optimizer

    def optim_step(
        self,
        model_id: str,
        learning_rate: float,
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-12,
        weight_decay: float = 0.0,
        grad_clip_norm: float = 0.0,
    ) -> dict[str, float]:
        """AdamW (decoupled weight decay) on this adapter only, then its gradients are cleared."""
        adapter = self.adapter(model_id)
        params = adapter.parameters()
        if adapter.optimizer is None:
            adapter.optimizer = torch.optim.AdamW(params, lr=learning_rate, betas=(beta1, beta2), eps=eps)
        for group in adapter.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        grads = [p.grad for p in params if p.grad is not None]
        norm = (
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        )
        if grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(params, grad_clip_norm)
        for p in params:  # a parameter without a gradient (no datum touched it) still decays
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        return {"grad_norm:mean": norm, "learning_rate:mean": learning_rate}

    # ---------------------------------------------------------------------------- checkpoints

    def save(self, model_id: str, out_dir: str | os.PathLike, with_optimizer: bool) -> Path:
        """A PEFT adapter directory (plus ``optimizer.pt`` when ``with_optimizer``)."""
        adapter = self.adapter(model_id)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for path, (a, b) in adapter.weights.items():
            tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a.detach().cpu().contiguous().clone()
            tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = b.detach().cpu().contiguous().clone()
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = PeftLoraConfig(
            r=adapter.rank,
            lora_alpha=adapter.alpha,
            lora_dropout=0.0,
            target_modules=sorted(adapter.modules),
            task_type="CAUSAL_LM",
            base_model_name_or_path=self.model_dir,
        )
        config.save_pretrained(str(out))
        if with_optimizer:
            state = {
                "steps": adapter.steps,
                "order": list(adapter.weights),
                "optimizer": adapter.optimizer.state_dict() if adapter.optimizer is not None else None,
            }
            torch.save(state, out / OPTIMIZER_FILE)
        return out

    def load(self, model_id: str, ckpt_dir: str | os.PathLike, with_optimizer: bool) -> Adapter:
        """Create (or replace) ``model_id``'s adapter from a PEFT directory written by ``save``."""
        ckpt = Path(ckpt_dir)
        try:
            config = json.loads((ckpt / "adapter_config.json").read_text())
            tensors = load_file(str(ckpt / "adapter_model.safetensors"))
        except (OSError, ValueError, SafetensorError) as err:
            raise EngineError(f"checkpoint {ckpt.name} is unreadable: {err}") from None
        rank = int(config["r"])
        if rank > self.max_rank:
            raise EngineError(f"checkpoint rank {rank} is above tinker.max_lora_rank = {self.max_rank}")
        targets = config.get("target_modules") or []
        modules = tuple(targets) if isinstance(targets, list) else (targets,)
        if model_id not in self.adapters:
            self._check_room(model_id)
        adapter = Adapter(model_id, rank, float(config.get("lora_alpha", LORA_ALPHA)), modules)
        for path in self.layers:
            a = tensors.get(f"{PEFT_PREFIX}{path}.lora_A.weight")
            b = tensors.get(f"{PEFT_PREFIX}{path}.lora_B.weight")
            if a is None or b is None:
                continue
            adapter.weights[path] = (nn.Parameter(a.float().to(self.device)), nn.Parameter(b.float().to(self.device)))
        if not adapter.weights:
            raise EngineError(f"checkpoint {ckpt.name} holds no LoRA weights for this base model")
        if with_optimizer:
            opt_file = ckpt / OPTIMIZER_FILE
            if not opt_file.exists():
                raise EngineError(f"checkpoint {ckpt.name} has no optimizer state (a sampler checkpoint?)")
            try:
                state = torch.load(opt_file, weights_only=False, map_location=self.device)
            except Exception as err:  # a damaged file: pickle, zip and torch errors alike
                raise EngineError(f"checkpoint {ckpt.name}: its optimizer state is unreadable: {err}") from None
            adapter.steps = int(state.get("steps", 0))
            if state.get("optimizer") is not None:
                if list(adapter.weights) != state["order"]:
                    raise EngineError(f"checkpoint {ckpt.name}: optimizer state does not match its weights")
                adapter.optimizer = torch.optim.AdamW(adapter.parameters())
                adapter.optimizer.load_state_dict(state["optimizer"])
        self.adapters[model_id] = adapter
        return adapter
