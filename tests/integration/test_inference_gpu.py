"""GPU fast path of the weight sync: the trainer broadcasts its weights into an engine over NCCL
(vLLM's weight-transfer engine). Needs two CUDA GPUs (NCCL refuses two ranks on one device) and the
CUDA build of vLLM; skipped elsewhere."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import free_ports, hf_greedy, inference_recipe, single_engine


def _two_gpus() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.device_count() >= 2
    except ImportError:
        return False


pytestmark = [
    pytest.mark.integration,
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs"),
]


def test_nccl_weight_sync_matches_transformers_greedy(tiny_model_dir, pattern_policy, tmp_path):
    import copy

    from backends.inference.nccl_sync import NcclWeightSync
    from backends.rollout.client import RolloutClient
    from skyrl_cli.plan.inference import Machine

    prompts = [[7 + i for i in range(s, s + 5)] for s in (0, 10, 20)]
    model = pattern_policy.model
    expected = [hf_greedy(model, p, 24) for p in prompts]
    trainer_module = copy.deepcopy(model).to("cuda:0")  # the trainer's copy on GPU 0, the engine on GPU 1
    recipe = inference_recipe(engines=1, gpu_memory_utilization=0.3)
    with single_engine(recipe, tiny_model_dir, tmp_path, Machine(device="cuda", engine_gpus=(1,))) as url:
        (port,) = free_ports(1)
        syncer = NcclWeightSync([url], 1, trainer_module, "127.0.0.1", port)
        try:
            result = syncer.sync(1)
        finally:
            syncer.close()
        print(f"NCCL weight sync: {result.seconds * 1000:.1f} ms")

        async def greedy():
            async with RolloutClient(url, max_retries=0) as client:
                return [(await client.generate(p, f"g{i}", 24, 0.0))[0] for i, p in enumerate(prompts)]

        got = asyncio.run(greedy())
    assert [c.token_ids for c in got] == expected
    assert all(c.policy_versions == (1,) for c in got)
