"""The RL learner process: ``torchrun ... -m backends.train.rl_learner --run-dir DIR --init-from MODEL``.

For each step k it reads ``batches/step-<k>.json`` (written by the orchestrator), runs one
``backends.train.rl.step.RLStep`` on it (advantages over the whole batch, then ``rl.epochs x
rl.mini_batches`` policy updates, each an optimizer step over one slice of whole groups with
dynamic micro-batching inside it; the step reads top to bottom there), and publishes the new policy as ``weights/v<k+1>/`` for the engines. Sync and fully-async RL run the
same learner: only the orchestrator's staleness bound differs, and the off-policy correction
against the rollout logprobs handles whatever lag there is.

The PPO ratio (``rl.loss.ratio``):
- "proximal" (decoupled PPO, the default): the ratio is taken against the trainer's own logprobs
  at the start of the step ("old", one no-grad pass before the first update), and the behaviour
  correction ``min(exp(old - rollout), cap)`` (``rl.async.off_policy``) multiplies the token
  losses. With one update per step the ratio is exactly 1 (old = current), so the clip cannot act
  and the pass is skipped; the loss is then the IS-weighted policy gradient.
- "rollout" (bypass): the ratio is taken directly against the engines' logprobs; it carries the
  behaviour correction itself (clipped by eps_low / eps_high), no separate IS weights and no
  extra pass.

LoRA (``model.lora``): the policy is the base model wrapped with peft adapters and only they train
(ZeRO 0-2; ZeRO-3 with LoRA is a recipe error). Each published version ``weights/v<k>/`` is the
PEFT adapter directory alone, a fraction of the full weights, which the engines load under a
versioned name (``backends.inference.weight_sync.EngineAdapters``); v0 is peft's initial adapter
(B = 0), equal to the base model, so every version the engines sample from is an adapter. The KL
reference is the same module with the adapter disabled: the base weights, with no second copy.

Every rank reads the whole batch and derives the same slices, micro-batch layouts and loss
normalisers (loss tokens / sequences of each slice), so each update's loss is normalised over its
whole slice without communication and does not depend on how it was packed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as tdist

from backends.inference.nccl_sync import NcclPublisher, open_weight_syncer
from backends.models.loading import torch_dtype
from backends.models.lora import apply_lora
from backends.models.tokenizer import load_tokenizer
from backends.quant.fake_quant import maybe_prepare_qat
from backends.train.checkpoint import load_checkpoint, remove_leftovers, save_checkpoint
from backends.train.common import HFExporter, load_recipe, open_events, say
from backends.train.engine import grad_norm, init_distributed, leave_distributed, make_engine
from backends.train.publish import weight_publisher
from backends.train.rl.step import RLStep
from backends.train.schedule import schedule
from skyrl_contracts.episodes import turn_limit
from skyrl_contracts.exchange import RunExchange, StopRequested
from skyrl_contracts.health import SYNC_GAP, SYNC_GAP_BOUND, SyncGapCheck, sync_gap_floor, sync_gap_message
from skyrl_contracts.logs import StartupClock, setup_process_logging
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.samples import Sample
from skyrl_contracts.transports import DEFAULT_TRANSPORT, TRANSPORT_NAMES, TRANSPORTS

BATCH_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class NcclTarget:
    """Where rank 0 sends each version with ``--weight-sync nccl`` (backends.inference.nccl_sync)."""

    engine_urls: tuple[str, ...]
    tensor_parallel: int
    address: str  # host:port of the NCCL group's rendezvous (the plan's free port)


class Learner:
    def __init__(
        self,
        run_dir: Path,
        init_from: Path,
        resume: bool,
        weight_sync: str = DEFAULT_TRANSPORT,
        nccl: NcclTarget | None = None,
        engine_dtype: str = "bfloat16",
    ):
        self.startup = StartupClock("learner")
        self.run_dir = run_dir
        self.recipe = load_recipe(run_dir)
        self.rl = self.recipe.rl
        self.updates = self.rl.epochs * self.rl.mini_batches  # optimizer steps per RL step
        self._join_the_run(init_from)
        model = self._policy_and_reference(init_from)
        self._training_engine(model, engine_dtype)
        self.start_step = self._restore() if resume else 0
        self._weight_sync(weight_sync, nccl, engine_dtype)

    def _join_the_run(self, init_from: Path) -> None:
        """The process group, the run's events and exchange, and the tokenizer."""
        # deepspeed and transformers are imported here, not at module level: their import is most
        # of a learner's start-up, which the startup clock's "imports" lap reports
        # lazy: deepspeed, transformers; timed by the startup clock's "imports" lap
        import deepspeed
        import transformers  # noqa: F401 - inside the "imports" lap, as deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        self.startup.lap("imports")
        self.dist = init_distributed(self.recipe.trainer.device)
        self.startup.lap("distributed")
        self.events = open_events(self.run_dir, self.dist)
        self.exchange = RunExchange(self.run_dir)
        self.tokenizer = load_tokenizer(str(init_from))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def _policy_and_reference(self, init_from: Path):
        """The policy to train (QAT-prepared, with its LoRA adapter) and, for a KL term without
        LoRA, a frozen reference copy (with LoRA the reference is the policy, adapter disabled)."""
        # lazy: transformers; imported in the startup clock's "imports" lap, not at module import
        from transformers import AutoModelForCausalLM

        recipe = self.recipe
        torch.manual_seed(recipe.seed)
        self.dtype = torch_dtype(recipe.model, self.dist.device.type)
        model = maybe_prepare_qat(
            AutoModelForCausalLM.from_pretrained(str(init_from), dtype=self.dtype), recipe.quantization, self.say
        )
        self.lora = recipe.model.lora
        if self.lora is not None:
            model = self._with_adapter(model)
        self.reference = None
        if self.rl.kl.coef > 0 and self.lora is None:
            # under INT4 QAT the reference has the policy's numerics too, so the KL measures drift, not rounding
            reference = maybe_prepare_qat(
                AutoModelForCausalLM.from_pretrained(str(init_from), dtype=self.dtype),
                recipe.quantization,
                lambda _said: None,
            )
            self.reference = reference.to(self.dist.device).eval()
            self.reference.requires_grad_(False)
        self.startup.lap("model")
        return model

    def _training_engine(self, model, engine_dtype: str) -> None:
        """DeepSpeed's engine and schedule around ``model``, the exporter of versions, the RL step."""
        rl, trainer = self.rl, self.recipe.trainer
        self.engine, self.scheduler = make_engine(
            model,
            lr=rl.learning_rate,
            weight_decay=0.0,
            # the scheduler counts optimizer steps: rl.epochs x rl.mini_batches per RL step
            lr_lambda=schedule(rl.warmup_steps * self.updates, rl.steps * self.updates, "constant", 1.0),
            zero_stage=trainer.zero_stage,
            grad_clip=rl.grad_clip,
            bf16=self.dtype == torch.bfloat16,
            gradient_checkpointing=trainer.gradient_checkpointing,
        )
        # LoRA checkpoints (hence final/) hold the adapter, and the merged model only on request
        merge = self.lora is None or self.lora.merge_final
        self.export = HFExporter(
            self.engine, self.tokenizer, self.dist, trainer.zero_stage, merge=merge, engine_dtype=engine_dtype
        )
        self.step_fn = RLStep(rl, self.engine, self.dist, self.pad_id, self.reference, turns=turn_limit(self.recipe))
        self.startup.lap("deepspeed engine")

    def _weight_sync(self, weight_sync: str, nccl: NcclTarget | None, engine_dtype: str) -> None:
        """How versions reach the engines (the plan's transport), and the check of the engines'
        logprobs against the trainer's that this transport's rounding allows."""
        quant = self.recipe.quantization
        floor = sync_gap_floor(engine_dtype, TRANSPORTS[weight_sync].quantized_versions and not quant.int4_qat)
        self.gap_check = None if floor is None else SyncGapCheck(floor)
        self.gap_warned = False
        self.sender = self._open_transfer(nccl)
        self.publisher = weight_publisher(
            weight_sync, self.exchange, self.dist, self.export, self.recipe, self.start_step, self.sender
        )
        self.last_send_s: float | None = None

    def _with_adapter(self, model):
        """The policy wrapped with the recipe's trainable LoRA adapters (base weights frozen)."""
        if self.recipe.trainer.zero_stage == 3:  # refused when the recipe is loaded; a recipe built in code
            raise SystemExit("LoRA with ZeRO-3 is not supported; use trainer.zero_stage <= 2")
        return apply_lora(model, self.lora)

    def _open_transfer(self, nccl: NcclTarget | None):
        """Rank 0's NCCL publisher, or None for the disk path: not asked for, another rank, or the
        group could not be set up (said in one line; every version then goes as files)."""
        if nccl is None or not self.dist.is_main:
            return None

        host, _, port = nccl.address.rpartition(":")
        module = self.engine.module  # HF parameter names; ZeRO 0-2 keep full weights on rank 0
        syncer, why = open_weight_syncer(
            self.dist.device.type, nccl.engine_urls, nccl.tensor_parallel, module, host, int(port)
        )
        if syncer is None:
            self.say(f"NCCL weight transfer unavailable ({why}); weights go through the disk path")
            return None
        self.say(f"weight sync: NCCL broadcast to {len(nccl.engine_urls)} engine(s)")
        return NcclPublisher(self.exchange, syncer, BATCH_TIMEOUT_S)

    def _restore(self) -> int:
        paths = RunDir(self.run_dir)
        checkpoint = paths.latest_rl_checkpoint()
        if checkpoint is None:
            return 0
        if checkpoint != paths.latest_checkpoint():
            self.say(
                f"{paths.latest_checkpoint()} has no orchestrator state (killed before it was written); not resuming from it"
            )
        step = int(load_checkpoint(self.engine, checkpoint)["step"])
        self.say(f"resumed from {checkpoint} at step {step}")
        return step

    def say(self, msg: str) -> None:
        say(self.dist, msg)

    # ----------------------------------------------------------------------------- the loop
    def publish(self, version: int) -> None:
        """``weights/v<k>`` for the engines, by the plan's transport (``backends.train.publish``);
        every rank takes part, and all meet at the barrier after it."""
        self.last_send_s = self.publisher.publish(version)
        if tdist.is_initialized():
            tdist.barrier()

    def _sync_gap_check(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """``SYNC_GAP`` when an on-policy step's logprob gap exceeds what numerics allow
        (``skyrl_contracts.health``); said once in the log."""
        flagged = self.gap_check.judge(metrics) if self.gap_check is not None else None
        if flagged is None:
            return {}
        gap, threshold = flagged
        if not self.gap_warned:
            self.gap_warned = True
            self.say(f"warning: {sync_gap_message(step, gap, threshold)}")
        return {SYNC_GAP_BOUND: threshold, SYNC_GAP: gap}

    def checkpoint(self, step: int) -> None:
        save_checkpoint(self.engine, self.run_dir, step, {"seed": self.recipe.seed}, self.export, self.rl.keep_last)

    def run(self) -> None:
        rl = self.rl
        if self.dist.is_main:
            remove_leftovers(self.run_dir)
        if self.events:
            bound = {} if self.gap_check is None else {SYNC_GAP_BOUND: self.gap_check.floor}
            self.events.log(self.start_step, {"progress/total_steps": rl.steps, **bound})

        if tdist.is_initialized():
            tdist.barrier()  # every rank reads LATEST before anyone publishes: all take the same branch
        if self.exchange.latest_version() != self.start_step:
            self.publish(self.start_step)  # the orchestrator's starting point (also after a resume)
        self.startup.lap(f"publish v{self.start_step}")
        self.say(
            self.startup.line(
                f"learner ready: world {self.dist.world_size}, ZeRO-{self.recipe.trainer.zero_stage}, "
                f"from step {self.start_step}"
            )
        )
        if self.events:
            self.events.log(self.start_step, self.startup.figures())
        for step in range(self.start_step, rl.steps):
            t0 = time.perf_counter()
            batch = self.exchange.read_batch(step, timeout_s=BATCH_TIMEOUT_S)
            samples = [Sample.from_dict(s) for s in batch["samples"]]
            t1 = time.perf_counter()
            metrics = self.step_fn.train(samples)
            t2 = time.perf_counter()
            self.publish(step + 1)
            t3 = time.perf_counter()
            tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
            metrics.update(
                {
                    "train/lr": self.scheduler.get_last_lr()[0],
                    "train/grad_norm": grad_norm(self.engine),
                    "train/tokens_per_s": tokens / max(t2 - t1, 1e-9),
                    "train/samples": len(samples),
                    "timing/wait_for_batch_s": t1 - t0,
                    "timing/train_s": t2 - t1,
                    "timing/publish_weights_s": t3 - t2,
                    **({"timing/weight_send_s": self.last_send_s} if self.last_send_s is not None else {}),
                    **self.publisher.metrics(),
                    **staleness_metrics(samples, step),
                }
            )
            metrics.update(self._sync_gap_check(step + 1, metrics))
            if self.events:
                self.events.log(step + 1, metrics)
            self.say(
                f"step {step + 1}/{rl.steps}: loss {metrics.get('train/policy_loss', 0):+.4f} "
                f"logprob diff {metrics.get('train/logprob_diff', 0):.4f} train {t2 - t1:.2f}s wait {t1 - t0:.2f}s"
            )
            if (rl.save_every and (step + 1) % rl.save_every == 0) or step + 1 == rl.steps:
                self.checkpoint(step + 1)
            if self.dist.is_main and not rl.keep_batches:
                # old weights are pruned by the orchestrator, which knows what engines use
                self.exchange.drop_batch(step)
        if self.events:
            self.events.close()


def staleness_metrics(samples, trained_step: int) -> dict[str, float]:
    """How many versions behind the policy being trained each sample's oldest tokens are."""
    lags = [trained_step - min(s.policy_versions) for s in samples if s.policy_versions]
    if not lags:
        return {}
    return {"async/staleness_mean": sum(lags) / len(lags), "async/staleness_max": float(max(lags))}


def main(argv: list[str] | None = None) -> None:
    setup_process_logging()

    parser = argparse.ArgumentParser(prog="python -m backends.train.rl_learner", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--init-from", required=True, type=Path, help="HF model directory of the initial policy")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument(
        "--weight-sync", choices=TRANSPORT_NAMES, default=DEFAULT_TRANSPORT, help="the plan's transport"
    )
    parser.add_argument("--engine-urls", default="", help="nccl: comma-separated engines to send to")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="nccl: GPUs per engine")
    parser.add_argument("--nccl-address", default="", help="nccl: host:port of the NCCL group's rendezvous")
    parser.add_argument(
        "--engine-dtype", default="bfloat16", help="the engines' dtype: the bound of the sync-gap check"
    )
    args = parser.parse_args(argv)
    nccl = None
    if TRANSPORTS[args.weight_sync].nccl_group:
        nccl = NcclTarget(tuple(u for u in args.engine_urls.split(",") if u), args.tensor_parallel, args.nccl_address)
    learner = Learner(
        args.run_dir.resolve(), args.init_from.resolve(), args.resume, args.weight_sync, nccl, args.engine_dtype
    )

    completed = False
    try:
        learner.run()
        completed = True
    except StopRequested as stop:
        learner.say(f"stopping: {stop}")
        raise SystemExit(1)
    except BaseException as err:
        learner.exchange.request_stop(f"trainer failed: {type(err).__name__}: {err}")
        raise
    finally:
        if learner.sender is not None:
            learner.sender.close()
        leave_distributed(completed)


if __name__ == "__main__":
    sys.exit(main())
