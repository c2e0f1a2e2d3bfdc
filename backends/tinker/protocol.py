"""JSON request bodies of the Tinker protocol (SDK 0.38), checked with pydantic, and the naming rules.

Models ignore fields they do not know (newer SDKs add some) but type-check and bound every field
they use; a field whose feature this server does not implement is refused by name in
``unsupported_sampling`` / the route, never silently dropped.

Identity and names:
- model ids are ``{session_id}:train:{model_seq_id}`` (the SDK derives it itself after a
  create-via-load); the training run id is the same with ``:`` replaced by ``_``;
- checkpoint paths are ``tinker://<run_id>/<kind>/<name>`` with kind ``weights`` (adapter +
  optimizer, from save_state) or ``sampler_weights`` (adapter only).
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

SUPPORTED_SDK = ((0, 38), (0, 39))  # [min, max) of tinker SDK versions this server speaks
CHECKPOINT_KINDS = ("weights", "sampler_weights")
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
ID_RE = re.compile(r"^[A-Za-z0-9_:.-]{1,200}$")


class ProtocolError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


Id = Annotated[str, Field(pattern=ID_RE.pattern)]
SeqId = Annotated[int, Field(ge=1, le=2**53)]
# Numbers that become part of an id: bounded so that the id stays within ID_RE's 200 characters.
IdSeq = Annotated[int, Field(ge=0, le=2**31)]
TorchSeed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # torch.Generator.manual_seed's range
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class ClientConfigRequest(Body):
    sdk_version: str | None = None


class CreateSessionRequest(Body):
    tags: list[str] = Field(default_factory=list, max_length=100)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionRequest(Body):
    session_id: Id


class FinishSessionRequest(Body):
    reason: dict[str, Any] | None = None
    detail: str | None = None


class LoraConfig(Body):
    rank: Annotated[int, Field(ge=1, le=4096)]
    seed: TorchSeed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    type: str = "adamw"


class CreateModelRequest(Body):
    session_id: Id
    model_seq_id: IdSeq
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig | None = None


class ModelRequest(Body):
    model_id: Id


class AdamParams(Body):
    learning_rate: Annotated[float, Field(ge=0, le=10)] = 1e-4
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.95
    eps: Annotated[float, Field(gt=0, le=1)] = 1e-12
    weight_decay: Annotated[float, Field(ge=0, le=10)] = 0.0
    grad_clip_norm: Annotated[float, Field(ge=0)] = 0.0


class OptimStepRequest(Body):
    model_id: Id
    seq_id: SeqId
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsRequest(Body):
    model_id: Id
    seq_id: SeqId
    path: str | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, Any] | None = None


class SaveWeightsForSamplerRequest(SaveWeightsRequest):
    sampling_session_seq_id: IdSeq | None = None
    kind: str | None = None


class LoadWeightsRequest(Body):
    model_id: Id | None = None
    seq_id: SeqId | None = None
    session_id: Id | None = None
    model_seq_id: IdSeq | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool = False
    optimizer_config: OptimizerConfig | None = None


class CreateSamplingSessionRequest(Body):
    session_id: Id
    sampling_session_seq_id: IdSeq = 0
    base_model: str | None = None
    model_path: str | None = None


class Chunk(Body):
    type: str = "encoded_text"
    tokens: list[int] | None = None


class ModelInput(Body):
    chunks: list[Chunk]


class SamplingParams(Body):
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    seed: Int64 | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: Annotated[float, Field(ge=0, le=100)] = 1.0
    top_k: int = -1
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0


class SampleRequest(Body):
    sampling_session_id: Id | None = None
    seq_id: Annotated[int, Field(ge=0)] | None = None
    base_model: str | None = None
    model_path: str | None = None
    num_samples: Annotated[int, Field(ge=1, le=1024)] = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class RetrieveFutureRequest(Body):
    request_id: Annotated[str, Field(max_length=32)]
    allow_metadata_only: bool = False


class TinkerPathRequest(Body):
    tinker_path: str


# ----------------------------------------------------------------------------------- helpers


def owner_of(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()[:24]


def model_id_for(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def run_id_for(model_id: str) -> str:
    return model_id.replace(":", "_")


def tinker_path(run_id: str, kind: str, name: str) -> str:
    return f"tinker://{run_id}/{kind}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """(run_id, kind, name) of ``tinker://<run>/<kind>/<name>``."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise ProtocolError(f"checkpoint path must look like tinker://<run>/<kind>/<name>, got {path!r}")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or not all(parts):
        raise ProtocolError(f"checkpoint path must have three segments tinker://<run>/<kind>/<name>, got {path!r}")
    run_id, kind, name = parts
    if kind not in CHECKPOINT_KINDS:
        raise ProtocolError(f"checkpoint kind {kind!r} is not one of {list(CHECKPOINT_KINDS)}")
    check_name(name)
    if not ID_RE.match(run_id):
        raise ProtocolError(f"malformed training run id {run_id!r}")
    return run_id, kind, name


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name) or name in (".", ".."):
        raise ProtocolError(
            f"checkpoint name {name!r} must be 1-128 characters of letters, digits, '_', '.', '-' (not starting with '.' or '-')"
        )
    return name


def sdk_version_problem(version: str | None) -> str | None:
    """A message when the client's SDK version is outside the tested range, else None."""
    if not version:
        return None
    match = re.match(r"^(\d+)\.(\d+)", version)
    if not match:
        return None
    got = (int(match.group(1)), int(match.group(2)))
    low, high = SUPPORTED_SDK
    if low <= got < high:
        return None
    return (
        f"tinker SDK {version} is not supported by this server: it speaks tinker "
        f">={low[0]}.{low[1]},<{high[0]}.{high[1]} (pip install 'tinker>={low[0]}.{low[1]},<{high[0]}.{high[1]}')"
    )


# the most top-k prompt logprobs a request may ask for: vLLM's default --max-logprobs, which the
# engines run with (a larger k would fail on the engine, after the request was accepted)
MAX_TOPK_PROMPT_LOGPROBS = 20


def prompt_scoring_problem(req: SampleRequest, prompt_len: int, vocab: int) -> str | None:
    """What is wrong with ``req``'s prompt-logprob fields for a prompt of ``prompt_len`` tokens, named."""
    top = min(MAX_TOPK_PROMPT_LOGPROBS, vocab)
    if not 0 <= req.topk_prompt_logprobs <= top:
        return f"topk_prompt_logprobs: must be between 0 and {top}, got {req.topk_prompt_logprobs}"
    n = req.prompt_logprobs_last_n
    if n is not None:
        if not req.prompt_logprobs:
            return "prompt_logprobs_last_n: needs prompt_logprobs = true"
        if not 1 <= n <= prompt_len - 1:
            return f"prompt_logprobs_last_n: must be between 1 and len(prompt) - 1 = {prompt_len - 1}, got {n}"
    return None


def unsupported_sampling(req: SampleRequest) -> str | None:
    """The first sampling feature of ``req`` this server does not implement, named."""
    if req.topk_sample_logprobs:
        return "topk_sample_logprobs is not supported"
    if req.target_prompt_logprobs is not None:
        return "target_prompt_logprobs is not supported"
    if req.prompt_alt_tokens_k:
        return "prompt_alt_tokens_k is not supported"
    if req.record_stability_info:
        return "record_stability_info (StableReinforce) is not supported"
    for chunk in req.prompt.chunks:
        if chunk.type != "encoded_text":
            return f"prompt chunk type {chunk.type!r} is not supported (text tokens only)"
    return None
