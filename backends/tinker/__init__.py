"""A self-hosted Tinker-API server: the official ``tinker`` SDK drives LoRA training on one shared
base model (batched across adapters) and sampling on vLLM engines with runtime LoRA adapters.

Modules: ``protocol`` (request models, limits), ``wire`` (protobuf bodies and results, through the
SDK's own ``tinker.proto`` module), ``losses`` (Tinker's sum-semantics losses), ``lora_engine``
(multi-LoRA trainer), ``store`` (SQLite: sessions, models, futures, checkpoints), ``service``
(the trainer thread: per-model seq_id order, batching, checkpoints), ``sampling`` (vLLM engines), ``app`` (FastAPI routes, auth),
``server`` (the process entry point).
"""
