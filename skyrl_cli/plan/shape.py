"""The shape of the recipe's model, read without importing torch or transformers: the numbers the
memory and time estimates (``skyrl_cli.plan.memory``, ``skyrl_cli.plan.roofline``), the INT4 target
checks (``skyrl_cli.plan.feasibility``) and ``skyrl doctor``'s disk check need.

A decoder of the Llama family (Llama, Mistral, Qwen2, Qwen3): per layer the attention projections
q, k, v, o (grouped-query: ``kv_heads`` key/value heads of ``head_dim``), the gated MLP's gate, up and
down projections, two RMSNorms; the embeddings and, unless tied, the output head. The source is the
``config.json`` of ``model.path`` (``rl.init_from`` for what the engines serve) or ``model.init``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from skyrl_cli.recipe.validate import resolve_path
from skyrl_contracts.schema import Recipe, TinyModelInit

# Architectures whose decoder Linear layers are Llama's (names and widths below).
LLAMA_LIKE = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# A tiny model's vocabulary: a character tokenizer's (padded, backends.models.tiny) or, with another
# tokenizer, a guess of the usual size (the tokenizer is not read here).
CHAR_VOCAB = 64
OTHER_TOKENIZER_VOCAB = 32000
# transformers' default vocab_size of each config class, which a config.json without the key gets.
DEFAULT_VOCAB = {"llama": 32000, "mistral": 32000, "qwen2": 151936, "qwen3": 151936}


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool  # the output head is the input embedding matrix
    qkv_bias: bool = False  # Qwen2: biases on q, k and v
    qk_norm: bool = False  # Qwen3: an RMSNorm of head_dim on q and on k

    @property
    def attention(self) -> int:
        """Width of the attention output (heads x head_dim), the input of o_proj."""
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        """Width of k (and of v): kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    def linear_layers(self) -> dict[str, tuple[int, int]]:
        """``(input width, output width)`` of each Linear layer of one decoder layer, by module name."""
        h, i = self.hidden, self.intermediate
        return {
            "self_attn.q_proj": (h, self.attention),
            "self_attn.k_proj": (h, self.kv),
            "self_attn.v_proj": (h, self.kv),
            "self_attn.o_proj": (self.attention, h),
            "mlp.gate_proj": (h, i),
            "mlp.up_proj": (h, i),
            "mlp.down_proj": (i, h),
        }

    def layer_linear_parameters(self) -> int:
        """Weights of one decoder layer's Linear layers (no biases): what INT4 can quantize."""
        return sum(n_in * n_out for n_in, n_out in self.linear_layers().values())

    def layer_parameters(self) -> int:
        bias = self.attention + 2 * self.kv if self.qkv_bias else 0
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return self.layer_linear_parameters() + bias + norms

    def embedding_parameters(self) -> int:
        """The input embeddings plus, when untied, the output head."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def parameters(self) -> int:
        """Every parameter once (a tied head is the embedding matrix)."""
        return self.layers * self.layer_parameters() + self.embedding_parameters() + self.hidden

    def largest_module_parameters(self) -> int:
        """The most parameters one module holds itself (DeepSpeed's ``largest_layer_params``, what
        ZeRO-3 gathers at once): the embedding matrix, or the widest Linear layer."""
        widest = max(n_in * n_out for n_in, n_out in self.linear_layers().values())
        return max(self.vocab * self.hidden, widest)

    @classmethod
    def from_config(cls, config: dict) -> ModelShape | None:
        """From a HF ``config.json``; None for an architecture outside the Llama family or a
        config that does not say its widths (a hand-edited one may hold anything)."""
        model_type = config.get("model_type")
        if model_type not in LLAMA_LIKE:
            return None
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(
                model_type=model_type,
                hidden=hidden,
                intermediate=int(config["intermediate_size"]),
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab=int(config.get("vocab_size") or DEFAULT_VOCAB[model_type]),
                tied=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
                qk_norm=model_type == "qwen3",
            )
        except (KeyError, TypeError, ValueError, ArithmeticError, OverflowError):
            return None

    @classmethod
    def from_init(cls, init: TinyModelInit, tokenizer: str) -> ModelShape:
        """The tiny model ``model.init`` builds (``backends.models.tiny``)."""
        return cls(
            model_type=init.arch,
            hidden=init.hidden_size,
            intermediate=init.intermediate_size or 4 * init.hidden_size,
            layers=init.layers,
            heads=init.heads,
            kv_heads=init.heads,
            head_dim=init.hidden_size // init.heads,
            vocab=CHAR_VOCAB if tokenizer == "char" else OTHER_TOKENIZER_VOCAB,
            tied=init.tie_embeddings,
            qkv_bias=init.arch == "qwen2",
            qk_norm=init.arch == "qwen3",
        )


def config_json(model_dir: Path) -> dict | None:
    """A model directory's ``config.json`` as a dict; None when missing or not a JSON object."""
    try:
        data = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def shape_at(model: str, recipe: Recipe, base_dir: Path) -> ModelShape | None:
    """The shape of ``model``: ``"sft"`` (the recipe's own model, which its SFT stage trains) or a
    checkpoint directory (relative to ``base_dir``)."""
    if model == "sft":
        if recipe.model.init is not None:
            return ModelShape.from_init(recipe.model.init, recipe.model.tokenizer)
        model = recipe.model.path
    config = config_json(resolve_path(model, base_dir))
    return ModelShape.from_config(config) if config is not None else None


def trained_shape(recipe: Recipe, base_dir: Path) -> ModelShape | None:
    """The model the recipe's trainer holds: the RL stage's ``init_from`` when it is a checkpoint
    (the same architecture as the SFT stage's in every recipe that has both)."""
    source = recipe.rl.init_from if recipe.rl is not None else "sft"
    return shape_at(source, recipe, base_dir) or shape_at("sft", recipe, base_dir)
