"""The recipe schema: the one place every recipe key is named, typed, bounded and documented.

A recipe is frozen once validated (``Recipe``) and is the only configuration the launched processes
receive (as ``recipe.resolved.json`` in the run directory). Derived values (world sizes, ports, paths)
are computed by ``skyrl_cli.plan``, and lengths left to the model (``None`` here) by
``skyrl_cli.recipe.lengths``, never here: validators only check.

This module imports nothing heavy (pydantic only) because ``skyrl recipes validate`` and the backend
processes both load it.
"""

from __future__ import annotations

import re
import string
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from skyrl_contracts.losses import AdvantageKindName, LossKindName

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Probability = Annotated[float, Field(ge=0, le=1)]
LearningRate = Annotated[float, Field(gt=0, le=1)]
# "module.path:attribute"; resolved inside the process that uses it.
ImportRef = Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")]
# rl.environment: an ImportRef, or "<library>:<name>" / "<library>" for another library's environments
# (skyrl_contracts.episodes.environment_library; ids may hold "-", "/" and ".").
EnvironmentRef = Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*(:[\w.\-/]+)?$")]
# "<library>:<name>" (or the bare library): an environment another library defines, run by that
# library's own episode kind (backends.rollout.episodes.<library>).
ENVIRONMENT_LIBRARIES = ("skyrl_gym", "verifiers")


def environment_library(ref: str | None) -> tuple[str, str] | None:
    """(library, name) of a library environment reference; name "" where only the library is given."""
    library, _, name = (ref or "").partition(":")
    return (library, name) if library in ENVIRONMENT_LIBRARIES else None


class Section(BaseModel):
    """Base of every recipe table: immutable, unknown keys rejected."""

    # No float key means anything at infinity (a timeout of inf s crashed the planner's int()).
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)


# --------------------------------------------------------------------------------------------- model


class TinyModelInit(Section):
    """A random-init model created locally (no hub access needed), shaped like a real family."""

    arch: Literal["llama", "qwen2", "qwen3"] = Field(
        "llama",
        description='Model architecture: "llama", "qwen2" (bias on q/k/v) or "qwen3" (q/k RMSNorm, explicit head_dim).',
    )
    tie_embeddings: bool = Field(
        False,
        description="Tie the output head to the input embeddings (tie_word_embeddings), as most small real models do.",
    )
    hidden_size: Annotated[int, Field(ge=8, le=8192)] = Field(128, description="Hidden size.")
    layers: Annotated[int, Field(ge=1, le=128)] = Field(4, description="Number of decoder layers.")
    heads: Annotated[int, Field(ge=1, le=128)] = Field(4, description="Attention heads.")
    intermediate_size: Annotated[int, Field(ge=8, le=65536)] | None = Field(
        None, description="MLP width; default 4 x hidden_size."
    )
    max_position_embeddings: Annotated[int, Field(ge=16, le=131072)] = Field(
        512, description="Longest sequence the model supports."
    )

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> "TinyModelInit":
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by heads ({self.heads})")
        return self


class LoraConfig(Section):
    """LoRA adapters (peft) instead of full fine-tuning."""

    rank: Annotated[int, Field(ge=1, le=1024)] = Field(8, description="LoRA rank r.")
    alpha: PositiveFloat = Field(16.0, description="LoRA alpha (scale = alpha / rank).")
    dropout: Annotated[float, Field(ge=0, lt=1)] = Field(0.0, description="LoRA dropout.")
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj"), description="Module names that get adapters."
    )
    merge_final: bool = Field(
        False,
        description="RL stage: final/ holds the adapter in final/adapter/ and, when true, also the merged model "
        "(final/ itself is then an HF model directory, as after LoRA SFT, which always merges).",
    )


class ModelConfig(Section):
    """The policy model: a local HF checkpoint (``path``) or a tiny model built from ``init``."""

    path: str | None = Field(
        None,
        description="Local HF-format model directory (relative to the recipe), or run:<run>/<stage> for a run's "
        "final model under runs/ where skyrl runs (run:quickstart/sft).",
    )
    init: TinyModelInit | None = Field(None, description="Create a tiny random-init model instead of loading one.")
    tokenizer: str = Field(
        "auto",
        description='"auto" (the model\'s own), "char" (a character tokenizer built for the task), or a local path.',
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description='"auto": the trainer in bfloat16 on GPUs and float32 on CPU; the engines in bfloat16 on GPUs '
        "and on CPUs with native bf16 (AVX-512-BF16 or AMX), else float32.",
    )
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of all weights.")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "ModelConfig":
        if (self.path is None) == (self.init is None):
            raise ValueError("set exactly one of model.path or model.init")
        return self


# ---------------------------------------------------------------------------------------------- data


# data.task = "reasoning_gym:<name>": any reasoning-gym dataset (backends.data.reasoning_gym); the name is
# checked against the installed package by `skyrl recipes validate` (skyrl_cli.recipe.validate).
ReasoningGymTask = Annotated[str, Field(pattern=r"^reasoning_gym:[A-Za-z_]\w*$")]
# Set by the recipe itself (seed, data.train_size, data.eval_size), so the splits follow the recipe.
REASONING_GYM_RESERVED = ("seed", "size")


class ReasoningGymDataset(Section):
    """One dataset of a reasoning-gym mixture (``data.task = "reasoning_gym:composite"``)."""

    weight: PositiveFloat = Field(1.0, description="Relative share of the mixture's rows.")
    config: dict[str, Any] = Field(
        default_factory=dict, description="The dataset's generator options (its config dataclass's fields)."
    )


class ReasoningGymConfig(Section):
    """``[data.reasoning_gym]``: options of a ``reasoning_gym:<name>`` task."""

    config: dict[str, Any] = Field(
        default_factory=dict,
        description="The generator's options (the fields of the dataset's config dataclass, e.g. "
        "max_word_len for spell_backward); seed and size come from the recipe.",
    )
    datasets: dict[str, ReasoningGymDataset] = Field(
        default_factory=dict,
        description='task = "reasoning_gym:composite": the mixture, one `[data.reasoning_gym.datasets.<name>]` '
        "(weight, config) per dataset, sampled by reasoning-gym's CompositeDataset.",
    )
    system_prompt: str | None = Field(
        None,
        description='A prompt of reasoning_gym.utils.SYSTEM_PROMPTS ("default", "direct", ...) as the system '
        "message; unset: the question alone. Answers are always read from <answer>...</answer>.",
    )


class DataConfig(Section):
    """Training and evaluation data: a built-in verifiable task or local files."""

    task: Literal["addition", "reversal", "lookup"] | ReasoningGymTask | None = Field(
        None,
        description='Built-in verifiable task, generated deterministically from the recipe seed; "reasoning_gym:<name>" '
        "for a reasoning-gym dataset (options in [data.reasoning_gym]).",
    )
    reasoning_gym: ReasoningGymConfig | None = Field(
        None, description='Options of a task = "reasoning_gym:<name>" (generator config, mixture, system prompt).'
    )
    train: str | None = Field(None, description="Local JSONL / parquet file or HF dataset directory.")
    eval: str | None = Field(None, description="Held-out split (same formats as train).")
    format: Literal["auto", "messages", "prompt_completion"] = Field(
        "auto", description="Row format: chat `messages` or `prompt`/`completion` (and `answer` for rewards)."
    )
    loss_on: Literal["assistant", "last_assistant", "all"] = Field(
        "assistant", description="Which tokens carry SFT loss."
    )
    train_size: PositiveInt = Field(20000, description="Rows generated for a built-in task's train split.")
    flawed_demos: Probability = Field(
        0.0,
        description="Built-in task: the share of SFT demonstrations a sloppy demonstrator writes (addition: sums "
        "with a carry out of the top digit lose their last digit; lookup: it answers 'unknown' instead of calling "
        "the tool). Held-out accuracy and the RL reward always score the right answer.",
    )
    eval_size: PositiveInt = Field(500, description="Rows in the held-out split (built-in task or cap on files).")
    digits: Annotated[int, Field(ge=1, le=12)] = Field(
        3, description="Operand digits (addition), string length (reversal) or key length (lookup)."
    )
    max_length: Annotated[int, Field(ge=8, le=131072)] | None = Field(
        None,
        description="Sequences are truncated to this many tokens. Unset: the model's max_position_embeddings "
        "(model.init, or model.path's config.json), capped at 512; more than the model's is an error.",
    )

    @field_validator("task", mode="wrap")
    @classmethod
    def _one_line_task_error(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:  # a union's error is one line per member; the author needs one
            raise ValueError(
                f'{value!r} is not a task: "addition", "reversal", "lookup" or "reasoning_gym:<dataset name>"'
            ) from None

    @model_validator(mode="after")
    def _task_or_files(self) -> "DataConfig":
        if self.task is not None and self.train is not None:
            raise ValueError("set exactly one of data.task or data.train")
        rg = self.reasoning_gym
        is_rg = self.task is not None and self.task.startswith("reasoning_gym:")
        if rg is not None and not is_rg:
            raise ValueError('data.reasoning_gym applies to task = "reasoning_gym:<name>" only')
        if not is_rg:
            return self
        rg = rg or ReasoningGymConfig()
        composite = self.task == "reasoning_gym:composite"
        if composite and not rg.datasets:
            raise ValueError("reasoning_gym:composite needs its mixture: [data.reasoning_gym.datasets.<name>]")
        if composite and rg.config:
            raise ValueError("reasoning_gym:composite: set each dataset's options in data.reasoning_gym.datasets")
        if rg.datasets and not composite:
            raise ValueError('data.reasoning_gym.datasets is a mixture: set task = "reasoning_gym:composite"')
        configs = {"config": rg.config, **{f"datasets.{k}.config": d.config for k, d in rg.datasets.items()}}
        for where, config in configs.items():
            if reserved := [key for key in REASONING_GYM_RESERVED if key in config]:
                raise ValueError(
                    f"data.reasoning_gym.{where}: remove {' and '.join(reserved)} (set by the recipe's seed, "
                    "data.train_size and data.eval_size)"
                )
        return self


# ----------------------------------------------------------------------------------------------- sft


class SftConfig(Section):
    """Supervised fine-tuning stage (``skyrl sft``)."""

    steps: PositiveInt = Field(1000, description="Optimizer steps.")
    batch_size: PositiveInt = Field(128, description="Sequences per optimizer step, over all ranks.")
    learning_rate: LearningRate = Field(3e-3, description="Peak learning rate (AdamW).")
    warmup_steps: NonNegativeInt = Field(100, description="Linear warm-up steps.")
    schedule: Literal["cosine", "constant", "linear"] = Field("cosine", description="Decay after warm-up.")
    min_lr_ratio: Probability = Field(0.1, description="Final learning rate as a fraction of the peak.")
    weight_decay: Annotated[float, Field(ge=0)] = Field(0.0, description="AdamW weight decay.")
    grad_clip: Annotated[float, Field(ge=0)] = Field(1.0, description="Max gradient norm; 0 disables clipping.")
    micro_batching: Literal["dynamic", "fixed"] = Field(
        "dynamic", description="dynamic: pack up to max_tokens_per_microbatch; fixed: micro_batch_size sequences."
    )
    max_tokens_per_microbatch: PositiveInt = Field(4096, description="Token budget of one micro-batch (dynamic).")
    micro_batch_size: PositiveInt = Field(8, description="Sequences per micro-batch (fixed).")
    eval_every: NonNegativeInt = Field(250, description="Evaluate every k steps (0: only at the end).")
    save_every: NonNegativeInt = Field(250, description="Checkpoint every k steps (0: only at the end).")
    keep_last: PositiveInt = Field(2, description="Checkpoints kept on disk.")
    stop_at_accuracy: Probability | None = Field(
        None,
        description="Stop early at the first evaluation whose held-out accuracy reaches this; the final "
        "model is that step's (e.g. to leave an RL stage room to improve).",
    )


# ------------------------------------------------------------------------------------------------ rl


class AdvantageConfig(Section):
    kind: AdvantageKindName = Field("grpo", description="Advantage estimator.")
    std_normalize: bool = Field(True, description="GRPO: divide by the group's reward std.")


class PolicyLossConfig(Section):
    kind: LossKindName = Field("ppo_clip", description="Policy loss.")
    eps_low: Annotated[float, Field(ge=0, le=1)] = Field(0.2, description="Lower clip range of the ratio.")
    eps_high: Annotated[float, Field(ge=0, le=10)] = Field(0.28, description="Upper clip range of the ratio.")
    dual_clip_c: Annotated[float, Field(gt=1)] = Field(3.0, description="Dual-clip bound for negative advantages.")
    reduction: Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean", description="How token losses are reduced over the mini-batch (gspo: always per sequence)."
    )
    ratio: Literal["proximal", "rollout"] = Field(
        "proximal",
        description='What the PPO ratio is taken against. "proximal" (decoupled PPO): the trainer\'s own '
        "logprobs at the start of the step, with truncated IS against the engines' logprobs on top; "
        '"rollout" (bypass): the engines\' logprobs directly, no separate IS weights.',
    )


class KlConfig(Section):
    coef: Annotated[float, Field(ge=0)] = Field(0.0, description="Weight of the KL-to-reference loss term (0: off).")
    estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")


class DynamicSamplingConfig(Section):
    enabled: bool = Field(False, description="Drop groups whose rewards are all equal and sample more.")
    max_extra_batches: NonNegativeInt = Field(4, description="Bound on extra sampling batches per step.")


class OffPolicyConfig(Section):
    token_is_cap: PositiveFloat | None = Field(2.0, description="Truncate token importance ratios at this value.")
    seq_is_cap: PositiveFloat | None = Field(None, description="Truncate sequence importance ratios at this value.")
    mask_low: Annotated[float, Field(ge=0)] | None = Field(
        None, description="Mask sequences whose geometric ratio is below."
    )
    mask_high: PositiveFloat | None = Field(None, description="Mask sequences whose geometric ratio is above.")


class AsyncConfig(Section):
    max_staleness: NonNegativeInt = Field(
        2, description="Policy versions generation may run ahead (used with --async)."
    )
    reset_prefix_cache: bool = Field(False, description="Reset the engines' prefix cache after a weight update.")
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig, description="Off-policy correction.")


class AuxiliaryEngines(Section):
    """Engines serving a model beside the policy for the run (a teacher, a judge): vLLM engines of
    their own, never weight-synced, placed after the policy's engines (on CPU the next cores, on GPUs
    the next GPUs)."""

    engines: Annotated[int, Field(ge=1, le=1024)] = Field(
        1, description="Local vLLM engines serving this model (on CPU one core each, after the policy's)."
    )
    tensor_parallel: PositiveInt = Field(
        1, description="GPUs per engine (after the trainer's, the policy engines' and the models' before it)."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description='The engines\' dtype; "auto": as the policy engines (model.dtype).'
    )


class DistillationConfig(AuxiliaryEngines):
    """``[rl.distillation]``: on-policy distillation from a teacher model served on engines of its own
    (never weight-synced). Each sampled trajectory is scored by the teacher (one prompt-logprob pass
    of the whole sequence) and every token the policy sampled gets ``coef x (teacher logprob -
    sampling logprob)`` as its advantage (the per-token reverse KL), added to the task reward's
    advantage, or alone with ``task_reward = false``. The teacher must use the policy's tokenizer."""

    teacher: str = Field(
        description="The teacher: a local HF model directory (relative to the recipe), or run:<run>/<stage>; "
        "same tokenizer as the policy."
    )
    coef: PositiveFloat = Field(1.0, description="Weight of the per-token reverse-KL advantage.")
    task_reward: bool = Field(
        True,
        description="Also train on the task reward's advantage (rl.advantage); false: pure distillation "
        "(rewards are still computed and reported, never trained on).",
    )


JUDGE_FIELDS = ("question", "response", "answer")  # what a judge's template may name


class JudgeConfig(AuxiliaryEngines):
    """``[rl.judge]``: the reward is a judge model's verdict on each response, served on engines of
    its own (never weight-synced). The judge reads ``template`` filled with the row's question, the
    response and the reference answer, answers greedily, and ``verdict`` turns its reply into the
    reward; a reply that cannot be parsed scores 0 and is counted (``judge/unparsed``) with a record
    in ``judge_verdicts.jsonl``, where every verdict is kept."""

    model: str = Field(
        description="The judge: a local HF model directory (relative to the recipe), or run:<run>/<stage>. "
        "Any tokenizer: it reads text."
    )
    template: str = Field(
        "Question: {question}\nReference answer: {answer}\nResponse: {response}\n"
        "Is the response correct? Answer yes or no.",
        description="The judge's prompt (one user message, through the judge's chat template when it has one): "
        "{question} (the prompt's last user message), {response}, {answer} (the row's reference answer); "
        "{{ and }} for literal braces.",
    )
    verdict: Literal["label", "number", "regex"] = Field(
        "label",
        description='How the reply becomes the reward: "label": the first of `labels` the reply says (whole '
        'words, any case); "number": the first number in it; "regex": `pattern`\'s first group, a number '
        "or one of `labels`.",
    )
    labels: dict[str, float] = Field(
        default_factory=lambda: {"yes": 1.0, "no": 0.0},
        description='verdict = "label" (or "regex"): each label\'s reward.',
    )
    pattern: str | None = Field(None, description='verdict = "regex": a regular expression with one group.')
    max_tokens: Annotated[int, Field(ge=1, le=4096)] = Field(16, description="The longest reply the judge writes.")

    @model_validator(mode="after")
    def _verdict_parts(self) -> "JudgeConfig":
        try:
            named = {field for _, field, _, _ in string.Formatter().parse(self.template) if field is not None}
        except ValueError as exc:
            raise ValueError(f"template: {exc} (write {{{{ and }}}} for literal braces)") from None
        unknown = sorted(named - set(JUDGE_FIELDS))
        if unknown:
            raise ValueError(f"template names {unknown}; it may name {', '.join(JUDGE_FIELDS)}")
        if "response" not in named:
            raise ValueError("template must contain {response}: the judge has to see the response")
        if self.verdict == "regex":
            if not self.pattern:
                raise ValueError('verdict = "regex" needs a pattern')
            try:
                groups = re.compile(self.pattern).groups
            except re.error as exc:
                raise ValueError(f"pattern {self.pattern!r}: {exc}") from None
            if groups < 1:
                raise ValueError(f"pattern {self.pattern!r} has no group: its first group is the verdict")
        elif self.pattern is not None:
            raise ValueError(f'pattern acts only with verdict = "regex" (verdict is {self.verdict!r})')
        if self.verdict == "label" and not self.labels:
            raise ValueError('verdict = "label" needs labels (label = reward)')
        return self


class RlConfig(Section):
    """Reinforcement learning stage (``skyrl rl``)."""

    init_from: str = Field("sft", description='"sft" (this recipe\'s SFT output) or a checkpoint directory.')
    steps: PositiveInt = Field(100, description="Training steps (policy versions).")
    prompts_per_step: PositiveInt = Field(32, description="Groups (prompts) per training step.")
    samples_per_prompt: PositiveInt = Field(8, description="Samples per prompt (group size).")
    max_new_tokens: PositiveInt = Field(64, description="Longest response per turn.")
    temperature: Annotated[float, Field(gt=0, le=5)] = Field(1.0, description="Sampling temperature.")
    learning_rate: LearningRate = Field(2e-4, description="Learning rate (AdamW, constant after warm-up).")
    warmup_steps: NonNegativeInt = Field(0, description="Linear warm-up steps.")
    grad_clip: Annotated[float, Field(ge=0)] = Field(1.0, description="Max gradient norm; 0 disables clipping.")
    max_tokens_per_microbatch: PositiveInt = Field(4096, description="Token budget of one training micro-batch.")
    mini_batches: PositiveInt = Field(
        1, description="Policy updates per epoch of a step: each an optimizer step over one slice of the batch."
    )
    epochs: PositiveInt = Field(1, description="Passes over the step's batch (each of mini_batches updates).")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    kl: KlConfig = Field(default_factory=KlConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    environment: EnvironmentRef | None = Field(
        None,
        description="Environment: a class `module:Class`, a skyrl-gym environment `skyrl_gym:<id>` (`skyrl_gym` "
        "alone: each row's `env_class`) or a verifiers environment `verifiers:<module>` (docs/environments.md).",
    )
    env_config: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="skyrl-gym: each environment id's `env_config` (`[rl.env_config.<id>]`), as SkyRL's "
        "`environment.skyrl_gym.<id>`.",
    )
    env_args: dict[str, Any] = Field(
        default_factory=dict,
        description="verifiers: its `[env]` table (`EnvConfig`): `taskset` knobs, seats such as "
        '`agent = { harness = { id = "null" } }`, `id` of a reusable env (e.g. `best-of-n`); the taskset id '
        "comes from rl.environment.",
    )
    environment_modules: list[str] = Field(
        default_factory=list,
        description="Modules imported before the environment is made: where a skyrl-gym environment is "
        "registered (`skyrl_gym.register`). Found next to the recipe like rl.environment.",
    )
    reward: ImportRef | None = Field(None, description="Custom reward function `module:function`.")
    reward_timeout_s: PositiveFloat = Field(10.0, description="A reward call slower than this scores 0.")
    max_turns: PositiveInt | None = Field(
        None,
        description="Model turns per episode of an environment (multi-turn and tool environments; unset: 1). "
        "With rl.agent: the most chat calls one trajectory may make (unset: no cap).",
    )
    tool_parser: str | None = Field(
        None,
        description="vLLM tool parser for the model's tool calls (hermes, pythonic, llama3_json, mistral, ...); "
        "unset: the one the chat template's format implies.",
    )
    tool_timeout_s: PositiveFloat = Field(10.0, description="A tool call slower than this answers with an error.")
    tool_errors: Literal["observe", "end"] = Field(
        "observe",
        description="A failed tool call: the model sees the error as the tool's answer (observe), or it ends "
        "the episode with reward 0 (end).",
    )
    env_concurrency: Annotated[int, Field(ge=1, le=100_000)] = Field(
        256, description="Environment and tool calls (sync or async) running at once."
    )
    agent: ImportRef | None = Field(
        None,
        description="Black-box agent `module:function`: an async function given the dataset row and an "
        "OpenAI-compatible endpoint for one trajectory, returning its reward.",
    )
    distillation: DistillationConfig | None = Field(
        None,
        description="On-policy distillation from a teacher model on engines of its own (docs/distillation.md).",
    )
    judge: JudgeConfig | None = Field(
        None,
        description="The reward is a judge model's verdict, served on engines of its own (docs/distillation.md).",
    )
    keep_batches: bool = Field(
        False,
        description="Keep every step's batch (batches/step-<k>.json: tokens, loss masks, engine logprobs, "
        "rewards) in the run directory for inspection; by default each is deleted once trained on.",
    )
    agent_timeout_s: PositiveFloat = Field(600.0, description="An agent run slower than this scores 0.")
    eval_every: NonNegativeInt = Field(10, description="Evaluate every k steps (0: only at the end).")
    save_every: NonNegativeInt = Field(10, description="Checkpoint every k steps (0: only at the end).")
    keep_last: PositiveInt = Field(2, description="Checkpoints kept on disk.")

    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, populate_by_name=True, allow_inf_nan=False
    )


# ------------------------------------------------------------------------------------------- runtime


class RouterConfig(Section):
    policy: Literal[
        "sticky_least_loaded", "consistent_hash", "round_robin", "power_of_two", "cache_aware", "random"
    ] = Field("sticky_least_loaded", description="vllm-router load-balancing policy.")
    port: Annotated[int, Field(ge=1024, le=65535)] | None = Field(
        None, description="Router port (default: a free one)."
    )
    # Failures between the router and an engine (a 5xx, a reset connection). The rollout client
    # retries too (inference.max_retries); these act first, inside the router, on another engine
    # when one is healthy.
    retries: Annotated[int, Field(ge=0, le=100)] = Field(
        3, description="Router retries of a failed engine request (0: none; then the rollout client's retries act)."
    )
    retry_backoff_ms: Annotated[int, Field(ge=1, le=60_000)] = Field(
        100, description="Router: wait before the first retry; each next one waits 1.5 times longer."
    )
    retry_max_backoff_ms: Annotated[int, Field(ge=1, le=600_000)] = Field(
        5_000, description="Router: the longest wait between two retries."
    )
    circuit_breaker_failures: Annotated[int, Field(ge=0, le=100_000)] = Field(
        10,
        description="Router: failures of one engine that open its circuit breaker (no requests go to it until "
        "circuit_breaker_open_s has passed and a trial request succeeds); 0: no circuit breaker.",
    )
    circuit_breaker_open_s: Annotated[int, Field(ge=1, le=3600)] = Field(
        10, description="Router: how long an open circuit breaker keeps an engine out before a trial request."
    )

    @model_validator(mode="after")
    def _backoff_order(self) -> "RouterConfig":
        if self.retry_max_backoff_ms < self.retry_backoff_ms:
            raise ValueError(
                f"retry_max_backoff_ms ({self.retry_max_backoff_ms}) must be >= retry_backoff_ms ({self.retry_backoff_ms})"
            )
        return self


class SpeculativeConfig(Section):
    method: Literal["ngram", "draft_model", "eagle", "mtp"] = Field(
        "ngram",
        description="vLLM speculative method; GPU engines only (vLLM-CPU samples wrong tokens with it at "
        'temperature > 0). "mtp" needs a policy with MTP layers. See docs/speculative.md.',
    )
    num_speculative_tokens: Annotated[int, Field(ge=1, le=16)] = Field(3, description="Draft depth k.")
    prompt_lookup_max: Annotated[int, Field(ge=1, le=64)] = Field(4, description="n-gram: longest n-gram matched.")
    model: str | None = Field(
        None, description="Draft / EAGLE model directory (draft_model, eagle); same vocab_size as the policy."
    )

    @model_validator(mode="after")
    def _model_when_needed(self) -> "SpeculativeConfig":
        if self.method in ("draft_model", "eagle") and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs a model")
        return self


class InferenceConfig(Section):
    """vLLM engines behind vllm-router."""

    # Each local engine takes a port and a core (or GPUs) of this host: thousands is never a layout.
    engines: Annotated[int, Field(ge=0, le=1024)] = Field(1, description="Local vLLM engines to start (at most 1024).")
    urls: tuple[str, ...] = Field((), description="Already-running engines on other hosts (http://host:port).")
    tensor_parallel: PositiveInt = Field(1, description="GPUs per engine (tensor parallelism).")
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = Field(0.85, description="vLLM GPU memory share.")
    kv_cache_bytes: PositiveInt = Field(64 * 2**20, description="KV cache per engine on CPU.")
    max_model_len: PositiveInt | None = Field(
        None,
        description="Longest prompt + response. Unset: the served model's max_position_embeddings (model.init, "
        "or the config.json of model.path / rl.init_from), capped at 512; more than the model's is an error.",
    )
    max_num_seqs: PositiveInt = Field(64, description="Concurrent sequences per engine.")
    max_concurrency: PositiveInt = Field(64, description="In-flight requests the rollout client allows.")
    request_timeout_s: PositiveFloat = Field(120.0, description="Per-request timeout.")
    max_retries: NonNegativeInt = Field(3, description="Retries of a failed request.")
    router: RouterConfig = Field(default_factory=RouterConfig)
    speculative: SpeculativeConfig | None = Field(None, description="Speculative decoding.")
    weight_sync: Literal["auto", "nccl", "disk", "delta"] = Field(
        "auto",
        description='How the RL stage gets each policy version into the engines. "nccl": trainer rank 0 '
        "broadcasts the weights into the engines (vLLM's NCCL weight transfer; CUDA, local engines, full "
        'fine-tuning with ZeRO 0-2); "disk": safetensors in the run directory and an engine reload; '
        '"delta": files too, each version written as the lossless delta of its bits against the version '
        "before (XOR + zstd), which the engines apply and check themselves; "
        '"auto": nccl where it can run, else disk. LoRA always syncs adapters.',
    )
    full_version_every: PositiveInt = Field(
        10,
        description='With weight_sync = "delta": every N-th version is written whole (and the first one '
        "always). An engine that holds no version to apply a delta to (restarted, or from a pool) reads "
        "the last whole version and the deltas after it.",
    )

    @model_validator(mode="after")
    def _some_engine(self) -> "InferenceConfig":
        if self.engines == 0 and not self.urls:
            raise ValueError("set inference.engines > 0 or give inference.urls")
        return self


class TrainerConfig(Section):
    """DeepSpeed trainer launched with torchrun."""

    ranks: PositiveInt = Field(1, description="Processes per node (torchrun --nproc-per-node).")
    nnodes: PositiveInt = Field(1, description="Nodes (torchrun --nnodes).")
    node_rank: NonNegativeInt = Field(0, description="This node's rank.")
    rdzv_endpoint: str | None = Field(None, description="host:port of the rendezvous (multi-node).")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage.")
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in backward instead of keeping them for the "
        "whole micro-batch (transformers' gradient checkpointing): a micro-batch's activations shrink from every "
        "layer's to each layer's input plus one layer's, for one more forward of the model in each backward.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description='"auto": cuda if available, else cpu.')
    gpus: tuple[NonNegativeInt, ...] | None = Field(None, description="GPU ids for the trainer on this node.")
    threads_per_rank: PositiveInt | None = Field(None, description="CPU threads per rank (default: cores / ranks).")

    @model_validator(mode="after")
    def _layout(self) -> "TrainerConfig":
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank ({self.node_rank}) must be < nnodes ({self.nnodes})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("multi-node training needs trainer.rdzv_endpoint")
        if self.gpus is not None and len(self.gpus) != self.ranks:
            raise ValueError(f"trainer.gpus lists {len(self.gpus)} ids for {self.ranks} ranks")
        return self


# ------------------------------------------------------------------------------------------ cluster


class SlurmConfig(Section):
    """What ``skyrl sft|rl RECIPE --slurm`` puts in the sbatch script besides the layout
    (``skyrl_cli.plan.slurm``). Most clusters need ``partition``, ``account`` and ``time``."""

    partition: str | None = Field(None, description="#SBATCH --partition (unset: the cluster's default).")
    account: str | None = Field(None, description="#SBATCH --account (unset: your default account).")
    time: Annotated[str, Field(pattern=r"^(\d+-)?\d+(:\d{2}){0,2}$")] | None = Field(
        None, description='#SBATCH --time, e.g. "04:00:00" or "1-00:00:00" (unset: the partition\'s limit).'
    )
    gpus_per_node: NonNegativeInt | None = Field(
        None,
        description="#SBATCH --gpus-per-node. Unset: what the busiest node of the layout uses (trainer ranks "
        'and engines x tensor_parallel), 0 when trainer.device = "cpu".',
    )
    cpus_per_node: PositiveInt | None = Field(None, description="#SBATCH --cpus-per-task (one task per node).")
    setup: tuple[str, ...] = Field(
        (),
        description='Shell lines run on the first node before srun, e.g. "source .venv/bin/activate" or '
        '"module load cuda".',
    )


class ClusterConfig(Section):
    """A run across several machines (nodes): which nodes train and which serve. The same
    ``skyrl sft|rl RECIPE`` command runs on every node; its node rank comes from ``--node-rank``
    or Slurm's ``SLURM_NODEID``. Node 0 runs the orchestrator and the router (RL) and hosts the
    trainer's rendezvous; the run directory must be on a file system every node mounts at the
    same path (``skyrl_cli.plan.nodes``)."""

    nodes: Annotated[int, Field(ge=2, le=1024)] = Field(description="Machines in the run (node ranks 0..nodes-1).")
    trainer_nodes: PositiveInt | None = Field(
        None,
        description="Nodes 0..k-1 run trainer ranks (trainer.ranks each). Unset: every node.",
    )
    inference_nodes: NonNegativeInt | None = Field(
        None,
        description="The last m nodes run vLLM engines (inference.engines each; RL only). Unset: every node. "
        "Every node must train or serve: trainer_nodes + inference_nodes >= nodes.",
    )
    address: str | None = Field(
        None,
        description="Node 0's address that the other nodes reach (host name or IP). Unset: the environment's "
        "SKYRL_CLUSTER_ADDRESS, which the --slurm script sets to the job's first node.",
    )
    port: Annotated[int, Field(ge=1024, le=65535)] = Field(
        29500, description="TCP port on node 0 of the trainer's rendezvous (torchrun)."
    )
    arrival_timeout_s: Annotated[float, Field(gt=0, le=86400)] = Field(
        300.0,
        description="How long each node waits for the others' markers in the run directory at the start.",
    )
    heartbeat_timeout_s: Annotated[float, Field(ge=3, le=3600)] = Field(
        30.0,
        description="A node whose heartbeat file in the run directory has not changed for this long counts "
        "as dead: the run ends on every other node.",
    )
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="The --slurm script's settings.")

    @model_validator(mode="after")
    def _every_node_has_a_role(self) -> "ClusterConfig":
        trainer = self.nodes if self.trainer_nodes is None else self.trainer_nodes
        inference = self.nodes if self.inference_nodes is None else self.inference_nodes
        if trainer > self.nodes:
            raise ValueError(f"trainer_nodes ({trainer}) must be <= nodes ({self.nodes})")
        if inference > self.nodes:
            raise ValueError(f"inference_nodes ({inference}) must be <= nodes ({self.nodes})")
        if trainer + inference < self.nodes:
            raise ValueError(
                f"nodes {trainer}..{self.nodes - inference - 1} neither train nor serve: "
                f"trainer_nodes ({trainer}) + inference_nodes ({inference}) must be >= nodes ({self.nodes})"
            )
        return self


ALL_LINEAR = "all-linear"
# Never quantized: the output head and the embeddings (the W4A16 format lists them in its ignore).
FULL_PRECISION_LAYERS = ("lm_head", "embed_tokens")


class QuantizationConfig(Section):
    """INT4 weight-only quantization (symmetric, per group): ``skyrl quantize`` exports a
    compressed-tensors W4A16 checkpoint that vLLM serves."""

    int4_qat: bool = Field(
        False,
        description="Train under INT4 fake-quant: the [sft] stage (and export it as INT4 too; skyrl quantize "
        "--int4-qat does this whatever the value) and the RL learner.",
    )
    int4_rollouts: bool = Field(
        False,
        description="RL stage: the engines serve the INT4 (W4A16) export of every policy version while the learner "
        "keeps full-precision master weights (under fake-quant with int4_qat = true, which shrinks the engine-vs-"
        "trainer logprob gap). Each weight sync re-exports and reloads the INT4 weights.",
    )
    group_size: Literal[32, 64, 128, "channel"] = Field(
        32,
        description="Input columns that share one scale: 32, 64 or 128 (must divide every target's input width), "
        'or "channel": one scale per output row over the whole input width (per-channel, coarser: '
        "smaller scales files, larger rounding errors).",
    )
    targets: tuple[str, ...] = Field(
        (ALL_LINEAR,),
        description='Linear layers to quantize: "all-linear", or parts of module names ("q_proj", "mlp.down_proj", '
        '"mlp": every Linear under mlp). lm_head and the embeddings always stay in full precision.',
    )
    init_from: str = Field(
        "sft",
        description='What skyrl quantize starts from: "sft" (this recipe\'s SFT output) or a checkpoint directory.',
    )

    def divides(self, width: int) -> bool:
        """Whether ``group_size`` fits a layer of input width ``width`` (per-channel fits any)."""
        return self.group_size == "channel" or width % self.group_size == 0

    def selects(self, layer: str) -> bool:
        """Whether the Linear layer named ``layer`` (e.g. ``model.layers.0.mlp.down_proj``) is a target:
        the one definition of ``targets``, for the recipe checks and the backends alike."""
        if layer.split(".")[-1] in FULL_PRECISION_LAYERS:
            return False
        dotted = f".{layer}."  # whole name parts: "mlp" matches every layer under an mlp, never "mlp2"
        return any(t == ALL_LINEAR or f".{t}." in dotted for t in self.targets)


class WandbConfig(Section):
    mode: Literal["offline", "online", "disabled"] = Field("offline", description="W&B mode.")
    project: str = Field("skyrl", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity.")


class LoggingConfig(Section):
    wandb: WandbConfig = Field(default_factory=lambda: WandbConfig(mode="disabled"))
    log_every: PositiveInt = Field(10, description="Training metrics every k steps.")


# ------------------------------------------------------------------------------------------- tinker


class TinkerConfig(Section):
    """Tinker-API server (``skyrl tinker serve``): LoRA training and sampling on the recipe's
    ``[model]`` (``model.path``) for clients of the official ``tinker`` SDK."""

    base_model: str | None = Field(
        None,
        description="The name clients pass as base_model (the model.path string is accepted too). "
        "Unset: the model directory's name.",
    )
    host: str = Field("127.0.0.1", description="Address the API server binds; only this one.")
    port: Annotated[int, Field(ge=1024, le=65535)] = Field(8000, description="API server port.")
    max_lora_rank: Annotated[int, Field(ge=1, le=512)] = Field(
        32, description="Largest LoRA rank a client may ask for."
    )
    max_live_adapters: Annotated[int, Field(ge=1, le=256)] = Field(
        8, description="Training adapters held at once (over all clients); also the engines' --max-loras."
    )
    api_keys: tuple[Annotated[str, Field(pattern=r"^tml-[A-Za-z0-9_.-]{1,200}$")], ...] = Field(
        (), description="Accepted API keys (the SDK requires the tml- prefix); each key is one isolated client."
    )
    api_keys_env: str = Field(
        "SKYRL_TINKER_API_KEYS", description="Environment variable with more accepted keys, comma-separated."
    )
    storage_dir: str | None = Field(
        None,
        description="Database and checkpoints (a relative path: from the recipe file's directory). "
        "Unset: <run dir>/storage (runs/<name>/tinker/storage).",
    )
    max_request_bytes: Annotated[int, Field(ge=1024, le=2**31)] = Field(
        64 * 2**20, description="Largest request body (after decompression); bigger ones get 413."
    )
    max_datums_per_request: PositiveInt = Field(4096, description="Most datums in one forward_backward request.")
    max_sequence_tokens: PositiveInt | None = Field(
        None, description="Longest datum or prompt + max_tokens. Unset: inference.max_model_len."
    )
    max_batch_tokens: PositiveInt = Field(
        32768, description="Token budget of one batched forward/backward pass over all adapters."
    )
    long_poll_s: Annotated[float, Field(gt=0, le=39)] = Field(
        20.0, description="How long retrieve_future waits for a result before answering try_again."
    )


# ------------------------------------------------------------------------------------------- recipe


class Recipe(Section):
    """A whole recipe. At least one of ``[sft]`` and ``[rl]`` must be present."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)] = Field(
        description="Run name; the run directory is runs/<name> unless --run-dir is given."
    )
    seed: NonNegativeInt = Field(0, description="Seed for data generation, sampling and init.")
    model: ModelConfig
    # Required by the sft and rl stages (checked below); a [tinker]-only recipe needs none.
    data: DataConfig = Field(default_factory=lambda: DataConfig(task="addition"))
    sft: SftConfig | None = None
    rl: RlConfig | None = None
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    quantization: QuantizationConfig | None = Field(None, description="INT4 quantization (skyrl quantize).")
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    tinker: TinkerConfig | None = Field(None, description="Tinker-API server (skyrl tinker serve).")
    cluster: ClusterConfig | None = Field(None, description="Several machines: the node layout (skyrl_cli.plan.nodes).")

    @model_validator(mode="after")
    def _some_stage(self) -> "Recipe":
        if self.sft is None and self.rl is None and self.tinker is None:
            raise ValueError("a recipe needs an [sft], an [rl] or a [tinker] section")
        if (self.sft is not None or self.rl is not None) and "data" not in self.model_fields_set:
            raise ValueError("an [sft] or [rl] stage needs a [data] section")
        if self.data.task is None and self.data.train is None and (self.sft is not None or self.rl is not None):
            # A verifiers taskset brings its own tasks (backends.rollout.episodes.verifiers.taskset_rows).
            library = environment_library(self.rl.environment) if self.rl is not None else None
            own_tasks = library is not None and library[0] == "verifiers"
            if not own_tasks or self.sft is not None:
                raise ValueError(
                    "set exactly one of data.task or data.train (neither: an RL-only recipe whose "
                    "rl.environment is a verifiers taskset, which brings its own tasks)"
                )
        if self.model.tokenizer == "char" and self.model.init is None:
            raise ValueError('model.tokenizer = "char" only goes with model.init (a new tiny model)')
        if self.cluster is not None:
            # By value, not by presence: recipe.resolved.json holds every key at its default.
            trainer = self.trainer
            set_by_cluster = [
                key
                for key, default in (("nnodes", 1), ("node_rank", 0), ("rdzv_endpoint", None))
                if getattr(trainer, key) != default
            ]
            if set_by_cluster:
                raise ValueError(
                    f"trainer.{set_by_cluster[0]} is derived from [cluster] (nodes, trainer_nodes, address, port; "
                    "the node rank from --node-rank or SLURM_NODEID): remove it"
                )
            if self.rl is not None and self.cluster.inference_nodes == 0:
                raise ValueError("cluster.inference_nodes = 0: the RL stage needs engines on at least one node")
        return self
