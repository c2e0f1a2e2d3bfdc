"""A self-hosted Tinker-API server: the official ``tinker`` SDK drives LoRA training on one shared
base model (batched across adapters) and sampling on vLLM engines with runtime LoRA adapters.

Modules: ``protocol`` (request models, limits), ``wire`` (protobuf bodies and results, through the
SDK's own ``tinker.proto`` module), ``losses`` (Tinker's sum-semantics losses), ``lora_engine``
(the multi-LoRA model: one base, adapter slots, batched passes), ``store`` (SQLite: sessions,
models, futures, checkpoints), ``service`` (``TinkerService`` and its ``JobScheduler`` thread:
per-model seq_id order, batching across adapters, one handler per job kind, checkpoints),
``sampling`` (vLLM engines with runtime LoRA), ``app`` and ``routes_*`` (FastAPI routes, auth),
``server`` (the process entry point).
"""
