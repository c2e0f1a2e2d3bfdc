"""Tinker's loss functions, with Tinker's **sum** semantics (no per-sequence or per-token mean).

Every loss takes, for one datum, ``logprobs``: the current policy's log-probability of each target
token (shape ``[N]``, with gradient) and the datum's ``loss_fn_inputs`` (tensors of shape ``[N]``)
and returns the per-token loss (``elementwise_loss``, summed for the datum's loss):

- ``cross_entropy``:       ``-(weights * logp)``; weights may be any float, negative too (the SDK's
                           ``forward_backward_custom`` sends ``-dL/dlogp`` as weights)
- ``importance_sampling``: ``-(ratio * A)``, ``ratio = exp(logp - sampler_logp)``
- ``ppo``:                 ``-min(ratio * A, clip(ratio, lo, hi) * A)``
- ``cispo``:               ``-(sg(clip(ratio, lo, hi)) * logp * A)``

``lo``/``hi`` are ``clip_low_threshold``/``clip_high_threshold`` (ratio bounds, default 0.8 and 1.2)
from ``loss_fn_config``, or per token from inputs of those names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2


class LossInputError(ValueError):
    """A request whose loss inputs do not fit the loss function (a 400 at the API)."""


@dataclass(frozen=True)
class LossSpec:
    required: tuple[str, ...]
    optional: tuple[str, ...]
    config_keys: tuple[str, ...]
    fn: Callable


def _ratio(logprobs, inputs):
    # lazy: torch; the HTTP routes (routes_training) import this module without it
    import torch

    return torch.exp(logprobs - inputs["logprobs"])


def _bounds(inputs, config):
    low = inputs.get("clip_low_threshold", config.get("clip_low_threshold", DEFAULT_CLIP_LOW))
    high = inputs.get("clip_high_threshold", config.get("clip_high_threshold", DEFAULT_CLIP_HIGH))
    return low, high


def _clamp(x, low, high):
    # lazy: torch; the HTTP routes (routes_training) import this module without it
    import torch

    low_t = low if isinstance(low, torch.Tensor) else torch.full_like(x, float(low))
    high_t = high if isinstance(high, torch.Tensor) else torch.full_like(x, float(high))
    return torch.minimum(torch.maximum(x, low_t), high_t)


def cross_entropy(logprobs, inputs, config):
    # lazy: torch; the HTTP routes (routes_training) import this module without it
    import torch

    weights = inputs.get("weights")
    if weights is None:
        weights = torch.ones_like(logprobs)
    return -(weights * logprobs)


def importance_sampling(logprobs, inputs, config):
    return -(_ratio(logprobs, inputs) * inputs["advantages"])


def ppo(logprobs, inputs, config):
    # lazy: torch; the HTTP routes (routes_training) import this module without it
    import torch

    ratio = _ratio(logprobs, inputs)
    adv = inputs["advantages"]
    low, high = _bounds(inputs, config)
    return -torch.minimum(ratio * adv, _clamp(ratio, low, high) * adv)


def cispo(logprobs, inputs, config):
    ratio = _ratio(logprobs, inputs)
    low, high = _bounds(inputs, config)
    return -(_clamp(ratio, low, high).detach() * logprobs * inputs["advantages"])


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_CLIP = ("clip_low_threshold", "clip_high_threshold")

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("target_tokens",), ("weights",), (), cross_entropy),
    "importance_sampling": LossSpec(_RL_INPUTS, (), (), importance_sampling),
    "ppo": LossSpec(_RL_INPUTS, _CLIP, _CLIP, ppo),
    "cispo": LossSpec(_RL_INPUTS, _CLIP, _CLIP, cispo),
}
# Named by the SDK but not served here: refused at the request.
KNOWN_UNSUPPORTED = ("dro", "gspo", "stable_reinforce", "custom")


def check_loss(loss_fn: str, config: Mapping[str, object], input_names: set[str]) -> LossSpec:
    """The spec of ``loss_fn`` after checking the config keys and one datum's input names;
    ``LossInputError`` names what does not fit."""
    spec = LOSSES.get(loss_fn)
    if spec is None:
        if loss_fn in KNOWN_UNSUPPORTED:
            raise LossInputError(
                f"loss_fn {loss_fn!r} is not supported by this server (supported: {', '.join(LOSSES)})"
            )
        raise LossInputError(f"unknown loss_fn {loss_fn!r} (supported: {', '.join(LOSSES)})")
    unknown_cfg = sorted(set(config) - set(spec.config_keys))
    if unknown_cfg:
        raise LossInputError(
            f"loss_fn_config keys {unknown_cfg} are not used by {loss_fn!r} (it takes {list(spec.config_keys)})"
        )
    for key in spec.config_keys:
        if key in config and not isinstance(config[key], (int, float)):
            raise LossInputError(f"loss_fn_config.{key} must be a number")
    missing = [name for name in spec.required if name not in input_names]
    if missing:
        raise LossInputError(f"loss_fn {loss_fn!r} needs loss_fn_inputs {missing}")
    unknown = sorted(input_names - set(spec.required) - set(spec.optional))
    if unknown:
        raise LossInputError(f"loss_fn_inputs {unknown} are not used by {loss_fn!r} (refused rather than ignored)")
    return spec


def datum_loss(loss_fn: str, logprobs, inputs: Mapping[str, object], config: Mapping[str, float]):
    """Per-token loss of one datum (``inputs`` as float tensors of logprobs' shape, target tokens excluded)."""
    return LOSSES[loss_fn].fn(logprobs, inputs, config)
