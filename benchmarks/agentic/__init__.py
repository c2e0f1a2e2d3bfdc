"""Environments for the agentic benchmarks (``benchmarks/bench_agentic_routing.py``)."""
