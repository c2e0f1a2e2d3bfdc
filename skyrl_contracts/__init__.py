"""What the driver (``skyrl_cli``) and the launched processes (``backends``) both import: the recipe
schema, the run directory and its atomic files, metric events and run-health checks, the
orchestrator-learner exchange, errors, ports and the names the engines are reached by.

Light by rule (pydantic and the standard library only; ``tests/unit/test_layers.py``): a worker
that imports a contract pulls in nothing of the driver, and the driver nothing of the workers.
"""
