"""Engines as the driver manages them: start-up order and readiness (``stack``), restarting an
engine that died (``recovery``), scraping their ``/metrics`` (``metrics``) and vllm-router's admin
routes (``router``). Runs inside the ``skyrl`` process; light (httpx, prometheus-client on use)."""
