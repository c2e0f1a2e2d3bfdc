"""How every process reaches a vLLM engine: the name it serves the policy under and the routes
skyrl calls beyond the OpenAI ones. The launch plan starts engines with these, the rollout client,
the weight sync and the Tinker server address them."""

SERVED_MODEL_NAME = "policy"  # --served-model-name of every engine: the base policy (LoRA versions: policy-v<k>)
GENERATE_PATH = "/inference/v1/generate"  # token ids in and out, per-token weight versions (--enable-scale-out)
