"""A process that fails to start is reported by the one log line that says why, with the log's path."""

from __future__ import annotations

import pytest

from skyrl_cli.launch.supervisor import failure_message, telling_line

# vLLM's API server refusing --max-model-len above the model's max_position_embeddings: its configs
# are pydantic dataclasses, so the ValueError arrives as a ValidationError with a detail line.
VLLM_CONFIG_ERROR = """\
(APIServer pid=41230) INFO 12-03 10:12:01 [utils.py:253] non-default args: {'model_tag': '/runs/mine/sft/final', 'port': 21416}
(APIServer pid=41230) Traceback (most recent call last):
(APIServer pid=41230)   File "<frozen runpy>", line 198, in _run_module_as_main
(APIServer pid=41230)   File "/work/main/backends/inference/serve.py", line 141, in <module>
(APIServer pid=41230)     main()
(APIServer pid=41230)   File "/venv/lib/python3.11/site-packages/vllm/engine/arg_utils.py", line 1362, in create_model_config
(APIServer pid=41230)     return ModelConfig(
(APIServer pid=41230)            ^^^^^^^^^^^^
(APIServer pid=41230)   File "/venv/lib/python3.11/site-packages/pydantic/_internal/_dataclasses.py", line 121, in __init__
(APIServer pid=41230)     s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
(APIServer pid=41230) pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
(APIServer pid=41230)   Value error, User-specified max_model_len (512) is greater than the derived max_model_len \
(max_position_embeddings=256 or model_max_length=None in model's config.json). To allow overriding this maximum, set the \
env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses \
relative position encoding (RoPE), positions exceeding derived_max_model_len lead to nan. [type=value_error, \
input_value=ArgsKwargs((), {'model': ...rocessor_plugin': None}), input_type=ArgsKwargs]
(APIServer pid=41230)     For further information visit https://errors.pydantic.dev/2.12/v/value_error
/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 1 leaked semaphore objects to clean up at shutdown
  warnings.warn('resource_tracker: There appear to be %d '
"""

# The engine core failing in its own process; the front end then ends with a line that only
# points back at it ("See root cause above").
VLLM_ENGINE_CORE_ERROR = """\
(EngineCore_DP0 pid=5121) ERROR 12-03 10:20:44 [core.py:1510] EngineCore failed to start.
(EngineCore_DP0 pid=5121) ERROR 12-03 10:20:44 [core.py:1510] Traceback (most recent call last):
(EngineCore_DP0 pid=5121) ERROR 12-03 10:20:44 [core.py:1510]   File "/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 1495, in run_engine_core
(EngineCore_DP0 pid=5121) ERROR 12-03 10:20:44 [core.py:1510]     engine_core = EngineCoreProc(*args, **kwargs)
(EngineCore_DP0 pid=5121) ERROR 12-03 10:20:44 [core.py:1510]   File "/venv/lib/python3.11/site-packages/vllm/v1/core/kv_cache_utils.py", line 1010, in check_enough_kv_cache_memory
(EngineCore_DP0 pid=5121) ERROR 12-03 10:20:44 [core.py:1510]     raise ValueError(
(EngineCore_DP0 pid=5121) ERROR 12-03 10:20:44 [core.py:1510] ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.
(EngineCore_DP0 pid=5121) Process EngineCore_DP0:
(EngineCore_DP0 pid=5121) Traceback (most recent call last):
(EngineCore_DP0 pid=5121)   File "/usr/lib/python3.11/multiprocessing/process.py", line 314, in _bootstrap
(EngineCore_DP0 pid=5121)     self.run()
(EngineCore_DP0 pid=5121) ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.
(APIServer pid=5100) Traceback (most recent call last):
(APIServer pid=5100)   File "/venv/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup
(APIServer pid=5100)     raise RuntimeError(
(APIServer pid=5100) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': 1}
"""

# A torchrun job: the rank's traceback, then torchrun's own summary, whose exception line is empty.
TORCHRUN_ERROR = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/main/backends/data/sft.py", line 95, in build_sft_data
[rank0]: ValueError: no training sequence keeps a loss token (data.loss_on = 'assistant', data.max_length = 8); raise data.max_length
E1203 10:31:02.117000 812 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) local_rank: 0 (pid: 840)
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 927, in main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
backends.train.sft FAILED
"""


def test_vllm_config_error_gives_its_detail_line():
    line = telling_line(VLLM_CONFIG_ERROR)
    assert line == (
        "ValidationError: ModelConfig: User-specified max_model_len (512) is greater than the derived max_model_len "
        "(max_position_embeddings=256 or model_max_length=None in model's config.json). To allow overriding this "
        "maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
    )


def test_the_root_cause_wins_over_a_line_that_points_at_it():
    line = telling_line(VLLM_ENGINE_CORE_ERROR)
    assert line.startswith(
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"
    )
    assert len(line) <= 300 and "RuntimeError" not in line


def test_a_trainer_rank_error_behind_torchrun():
    assert telling_line(TORCHRUN_ERROR) == (
        "ValueError: no training sequence keeps a loss token (data.loss_on = 'assistant', data.max_length = 8); raise data.max_length"
    )


@pytest.mark.parametrize(
    "tail",
    [
        "",
        "usage: serve.py [-h]\nserve.py: error: unrecognized arguments: --bad\n",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.\n",
    ],
    ids=["empty", "no-exception", "only-a-pointer"],
)
def test_no_telling_line(tail):
    assert telling_line(tail) is None


def test_failure_message_reads_only_the_last_start(tmp_path):
    log = tmp_path / "engine-0.log"
    log.write_text(
        "\n=== 2025-12-03 10:00:00 start: python -m backends.inference.serve m\nValueError: an older start's error\n"
        "\n=== 2025-12-03 10:05:00 start: python -m backends.inference.serve m\n" + VLLM_CONFIG_ERROR
    )
    message = failure_message("engine-0 exited before it was ready (exit code 1)", log)
    first, second = message.splitlines()
    assert first.startswith(
        "engine-0 exited before it was ready (exit code 1): ValidationError: ModelConfig: User-specified"
    )
    assert second == f"log: {log}"
    log.write_text(
        "\n=== 2025-12-03 10:05:00 start: x\nValueError: old\n\n=== 2025-12-03 10:06:00 start: x\nbad flag\n"
    )
    assert failure_message("svc died (exit code 2)", log) == f"svc died (exit code 2); log: {log}\nbad flag"
