"""``skyrl doctor [RECIPE]``: is this machine set up for the recipe, before a long run starts?

- ``checks``: the ``Check`` line (pass / fail / skip, with the fix of a failure);
- ``environment``: Python and packages against the tested set, GPUs, that DeepSpeed, vLLM and
  vllm-router import and start, the engine smoke test (``--smoke``);
- ``layout``: the recipe against this machine: its GPU layout and memory, its ports, disk space for
  its checkpoints, gloo / NCCL and its remote hosts.

Light at import (the standard library and skyrl's light modules); what needs torch, vLLM or
DeepSpeed runs in a child process with a time limit, so a broken install is reported, not crashed on.
"""
