"""The SFT trainer process: ``torchrun ... -m backends.train.sft --run-dir DIR [--resume]``.

Reads ``DIR/recipe.resolved.json``; writes events (rank 0) to ``DIR/events.jsonl``, checkpoints to
``DIR/checkpoints/step-<n>/`` and the final model + tokenizer to ``DIR/final/``.

Every rank builds the same data, the same global batch for each step (a pure function of seed and
step, see ``backends.data.sft``) and the same micro-batch layout (``backends.train.packing``), so the
number of micro-batches per rank and the global loss-token count are known everywhere without
communication; only the gradients and the logged sums are reduced.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from backends.data.sft import batch_indices, build_sft_data, load_source
from backends.models.loading import load_model, load_tokenizer_for, torch_dtype
from backends.models.lora import apply_lora
from backends.quant.export import export_after_training
from backends.quant.fake_quant import maybe_prepare_qat
from backends.train.checkpoint import load_checkpoint, remove_leftovers, save_checkpoint
from backends.train.common import HFExporter, load_recipe, open_events, say
from backends.train.engine import (
    all_gather_list,
    all_reduce_sum,
    grad_norm,
    init_distributed,
    leave_distributed,
    make_engine,
)
from backends.train.engine import train_step as optimizer_step
from backends.train.evaluate import eval_accuracy, eval_loss
from backends.train.microbatch import rank_micro_batches
from backends.train.packing import dynamic_layout, fixed_layout
from backends.train.schedule import schedule
from skyrl_contracts.atomic import publish_dir
from skyrl_contracts.logs import setup_process_logging
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.schema import Recipe


class Window:
    """Sums over the steps since the last log line."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.nll = 0.0
        self.loss_tokens = 0
        self.real_tokens = 0
        self.efficiency = 0.0
        self.steps = 0
        self.started = time.perf_counter()

    def add(self, nll: float, loss_tokens: int, lengths: list[int], layout) -> None:
        self.nll += nll
        self.loss_tokens += loss_tokens
        self.real_tokens += sum(lengths)
        self.efficiency += layout.packing_efficiency(lengths)
        self.steps += 1


def step_layout(lengths, recipe: Recipe, world_size: int, layout_kind: str):
    sft = recipe.sft
    if sft.micro_batching == "fixed":
        return fixed_layout(len(lengths), world_size, sft.micro_batch_size)
    return dynamic_layout(lengths, world_size, sft.max_tokens_per_microbatch, layout_kind)


def packed_layout_kind(model) -> str:
    """Padding-free rows only where attention has a variable-length kernel (flash-attention);
    with sdpa/eager a block-diagonal mask costs (sum L)^2, so sorted padded micro-batches are faster."""
    impl = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    return "padding_free" if impl.startswith("flash_attention") else "padded"


class SFTTrainer:
    def __init__(self, run_dir: Path, resume: bool):
        # lazy: deepspeed (logs on import); after main's setup_process_logging
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        self.run_dir = run_dir
        self.recipe = recipe = load_recipe(run_dir)
        self.sft, self.trainer = recipe.sft, recipe.trainer
        if self.sft is None:
            raise SystemExit("recipe has no [sft] section")
        if recipe.model.lora is not None and self.trainer.zero_stage == 3:
            raise SystemExit("LoRA with ZeRO-3 is not supported; use trainer.zero_stage <= 2")
        self.dist = init_distributed(self.trainer.device)
        self.events = open_events(run_dir, self.dist)
        self.started = time.perf_counter()
        self._load_data()
        self._build_engine()
        if self.dist.is_main:
            remove_leftovers(run_dir)
        # end_step is earlier than sft.steps when a resumed run had already stopped at sft.stop_at_accuracy
        self.start_step, self.end_step = self._restore() if resume else (0, self.sft.steps)
        self.say(
            f"trainer ready: world {self.dist.world_size}, ZeRO-{self.trainer.zero_stage}, {self.sft.micro_batching} "
            f"micro-batching ({self.layout_kind}), device {self.dist.device}, start-up {time.perf_counter() - self.started:.1f}s"
        )
        if self.events:  # ready to step: where summary.json's start-up ends (skyrl_cli.metrics.summary.time_split)
            self.events.log(0, {"progress/total_steps": self.sft.steps})

    def say(self, msg: str) -> None:
        say(self.dist, msg)

    def _load_data(self) -> None:
        recipe, dist = self.recipe, self.dist
        source = load_source(recipe.data, recipe.seed)
        self.tokenizer = load_tokenizer_for(recipe.model, source.alphabet())
        shard = (dist.rank, dist.world_size)
        self.data = data = build_sft_data(source, self.tokenizer, recipe.data, shard=shard, gather=all_gather_list)
        self.say(
            f"data: {len(data.train)} train / {len(data.eval)} eval sequences ({data.dropped} dropped) "
            f"in {time.perf_counter() - self.started:.1f}s"
        )

    def _build_engine(self) -> None:
        recipe, sft = self.recipe, self.sft
        torch.manual_seed(recipe.seed)
        model = maybe_prepare_qat(load_model(recipe.model, self.tokenizer, recipe.seed), recipe.quantization, self.say)
        self.layout_kind = packed_layout_kind(model)
        if recipe.model.lora is not None:
            model = apply_lora(model, recipe.model.lora)
        self.engine, self.scheduler = make_engine(
            model,
            lr=sft.learning_rate,
            weight_decay=sft.weight_decay,
            lr_lambda=schedule(sft.warmup_steps, sft.steps, sft.schedule, sft.min_lr_ratio),
            zero_stage=self.trainer.zero_stage,
            grad_clip=sft.grad_clip,
            bf16=torch_dtype(recipe.model, self.dist.device.type) == torch.bfloat16,
            gradient_checkpointing=self.trainer.gradient_checkpointing,
        )
        self.export = HFExporter(self.engine, self.tokenizer, self.dist, self.trainer.zero_stage)

    def _restore(self) -> tuple[int, int]:
        """(start step, end step) from the newest complete checkpoint, or from scratch without one."""
        checkpoint = RunDir(self.run_dir).latest_checkpoint()
        if checkpoint is None:
            self.say("no complete checkpoint to resume from; starting at step 0")
            return 0, self.sft.steps
        state = load_checkpoint(self.engine, checkpoint)
        start = int(state["step"])
        self.say(f"resumed from {checkpoint} at step {start}")
        return start, start if state.get("stopped_early") else self.sft.steps

    # ----------------------------------------------------------------------------- one step
    def train_step(self, step: int):
        """One optimizer step on the global batch of ``step``; returns its lr, layout and lengths."""
        train, dist = self.data.train, self.dist
        batch = [train[i] for i in batch_indices(self.recipe.seed, step, self.sft.batch_size, len(train))]
        lengths = [len(ex) for ex in batch]
        layout = step_layout(lengths, self.recipe, dist.world_size, self.layout_kind)
        micro_batches = rank_micro_batches(batch, layout, dist.rank, self.tokenizer.pad_token_id)
        loss_tokens = sum(ex.loss_tokens for ex in batch)
        lr = self.scheduler.get_last_lr()[0]
        self.window.add(
            optimizer_step(self.engine, micro_batches, loss_tokens, dist.world_size), loss_tokens, lengths, layout
        )
        return lr, layout, lengths

    def log_window(self, done: int, lr: float, layout, lengths: list[int]) -> None:
        """Train metrics over the steps since the last log line (the layout figures: the last step's)."""
        window, sft = self.window, self.sft
        (nll,) = all_reduce_sum([window.nll], self.dist.device)
        elapsed = time.perf_counter() - window.started
        metrics = {
            "train/loss": nll / max(1, window.loss_tokens),
            "train/lr": lr,
            "train/tokens_per_s": window.real_tokens / elapsed,
            "train/grad_norm": grad_norm(self.engine),
            "train/num_microbatches": layout.num_microbatches,
            "train/padding_microbatches": layout.padding_microbatches(),
            "train/packing_efficiency": window.efficiency / window.steps,
            "train/rank_imbalance": layout.rank_imbalance(lengths),
            "train/epoch": done * sft.batch_size / len(self.data.train),
        }
        if self.events:
            self.events.log(done, metrics)
        self.say(
            f"step {done}/{sft.steps}: loss {metrics['train/loss']:.4f} lr {lr:.2e} "
            f"tokens/s {metrics['train/tokens_per_s']:,.0f}"
        )
        window.reset()

    def evaluate(self, step: int) -> float:
        t0 = time.perf_counter()
        module, data, tokenizer = self.engine.module, self.data, self.tokenizer
        loss = eval_loss(module, data.eval, self.dist, self.sft.max_tokens_per_microbatch, tokenizer.pad_token_id)
        if not data.eval_items:  # a tool task: accuracy needs the tool loop, which the RL stage runs
            if self.events:
                self.events.log(step, {"eval/loss": loss, "timing/eval_s": time.perf_counter() - t0})
            self.say(f"step {step}: eval loss {loss:.4f}")
            return float("nan")
        accuracy = eval_accuracy(
            module,
            tokenizer,
            data.eval_items,
            data.scorer,
            data.max_new_tokens,
            self.dist,
            synced=self.trainer.zero_stage == 3,
        )
        if self.events:
            self.events.log(
                step, {"eval/loss": loss, "eval/accuracy": accuracy, "timing/eval_s": time.perf_counter() - t0}
            )
        self.say(f"step {step}: eval loss {loss:.4f} accuracy {accuracy:.4f}")
        return accuracy

    def checkpoint(self, step: int, **extra) -> None:
        t0 = time.perf_counter()
        state = {"seed": self.recipe.seed, "samples": step * self.sft.batch_size, **extra}
        save_checkpoint(self.engine, self.run_dir, step, state, self.export, self.sft.keep_last)
        if self.events:
            self.events.log(step, {"timing/checkpoint_s": time.perf_counter() - t0})

    def _stops_early(self, done: int, accuracy: float) -> bool:
        """Whether held-out accuracy reached sft.stop_at_accuracy before the last step; if so, says so
        and writes the checkpoint that marks the run as stopped."""
        target = self.sft.stop_at_accuracy
        if target is None or not accuracy >= target or done >= self.sft.steps:  # nan: not measured
            return False
        self.say(f"step {done}: held-out accuracy {accuracy:.4f} reached sft.stop_at_accuracy = {target}; stopping")
        if self.events:
            self.events.log(done, {"progress/stopped_early": 1.0})
        self.checkpoint(done, stopped_early=True)
        return True

    def run_step(self, step: int) -> bool:
        """Train, log, evaluate and checkpoint as the recipe says for ``step``; False once stopped early."""
        sft, done = self.sft, step + 1
        lr, layout, lengths = self.train_step(step)
        if done % self.recipe.logging.log_every == 0 or done == sft.steps:
            self.log_window(done, lr, layout, lengths)
        if (sft.eval_every and done % sft.eval_every == 0) or done == sft.steps:
            accuracy = self.evaluate(done)
            self.window.started = time.perf_counter()  # eval time is not training throughput
            if self._stops_early(done, accuracy):
                return False
        if (sft.save_every and done % sft.save_every == 0) or done == sft.steps:
            self.checkpoint(done)
            self.window.started = time.perf_counter()
        return True

    # ----------------------------------------------------------------------------- the loop
    def publish_final(self) -> None:
        """The last step's weights as final/, published atomically like a checkpoint."""
        paths = RunDir(self.run_dir)
        self.export(paths.final_tmp)
        if self.dist.is_main:
            publish_dir(paths.final_tmp, paths.final)
            self.say(f"final model: {paths.final} ({time.perf_counter() - self.started:.1f}s in total)")

    def run(self) -> None:
        self.window = Window()
        for step in range(self.start_step, self.end_step):
            if not self.run_step(step):
                break
        self.publish_final()
        export_after_training(self.run_dir, self.recipe.quantization, self.dist, self.events, self.end_step)
        if self.events:
            self.events.close()


def main(argv: list[str] | None = None) -> None:
    setup_process_logging()
    parser = argparse.ArgumentParser(prog="python -m backends.train.sft", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    args = parser.parse_args(argv)

    SFTTrainer(args.run_dir.resolve(), args.resume).run()
    leave_distributed(completed=True)


if __name__ == "__main__":
    sys.exit(main())
