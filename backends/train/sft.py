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

from skyrl_cli.atomic import publish_dir
from skyrl_cli.metrics.events import EventWriter
from skyrl_cli.recipe.schema import Recipe
from skyrl_cli.rundir import FINAL_TMP

PROCESS_NAME = "trainer"


def load_recipe(run_dir: Path) -> Recipe:
    return Recipe.model_validate_json((run_dir / "recipe.resolved.json").read_text())


class HFExporter:
    """Writes the trained model (+ tokenizer) as an HF directory; collective under ZeRO-3."""

    def __init__(self, engine, tokenizer, dist, zero_stage: int):
        self.engine, self.tokenizer, self.dist, self.zero_stage = engine, tokenizer, dist, zero_stage

    def __call__(self, out_dir: Path) -> None:
        from backends.models.loading import save_hf
        from backends.models.lora import is_peft, merged_copy, save_adapter

        state_dict = self.engine._zero3_consolidated_16bit_state_dict() if self.zero_stage == 3 else None
        if not self.dist.is_main:
            return
        module = self.engine.module
        if is_peft(module):
            save_hf(merged_copy(module), self.tokenizer, out_dir)
            save_adapter(module, out_dir / "adapter")
        else:
            save_hf(module, self.tokenizer, out_dir, state_dict=state_dict)


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


def step_layout(lengths, recipe: Recipe, world_size: int, layout_kind: str):
    from backends.train.packing import dynamic_layout, fixed_layout

    sft = recipe.sft
    if sft.micro_batching == "fixed":
        return fixed_layout(len(lengths), world_size, sft.micro_batch_size)
    return dynamic_layout(lengths, world_size, sft.max_tokens_per_microbatch, layout_kind)


def packed_layout_kind(model) -> str:
    """Padding-free rows only where attention has a variable-length kernel (flash-attention);
    with sdpa/eager a block-diagonal mask costs (sum L)^2, so sorted padded micro-batches are faster."""
    impl = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    return "padding_free" if impl.startswith("flash_attention") else "padded"


def train(run_dir: Path, resume: bool) -> None:
    import deepspeed

    from backends.data.sft import batch_indices, build_sft_data, load_source
    from backends.models.loading import load_model, load_tokenizer_for, torch_dtype
    from backends.models.lora import apply_lora
    from backends.train.checkpoint import latest_checkpoint, load_checkpoint, remove_leftovers, save_checkpoint
    from backends.train.engine import all_gather_list, all_reduce_sum, grad_norm, init_distributed, make_engine, train_step
    from backends.train.evaluate import eval_accuracy, eval_loss
    from backends.train.microbatch import rank_micro_batches
    from backends.train.schedule import schedule

    deepspeed.utils.logger.setLevel(logging.WARNING)
    recipe = load_recipe(run_dir)
    sft, trainer = recipe.sft, recipe.trainer
    if sft is None:
        raise SystemExit("recipe has no [sft] section")
    if recipe.model.lora is not None and trainer.zero_stage == 3:
        raise SystemExit("LoRA with ZeRO-3 is not supported; use trainer.zero_stage <= 2")
    dist = init_distributed(trainer.device)
    events = EventWriter(run_dir / "events.jsonl", PROCESS_NAME) if dist.is_main else None
    say = (lambda msg: print(msg, flush=True)) if dist.is_main else (lambda msg: None)
    if events:
        events.log(0, {"progress/total_steps": sft.steps})

    started = time.perf_counter()
    source = load_source(recipe.data, recipe.seed)
    tokenizer = load_tokenizer_for(recipe.model, source.alphabet())
    data = build_sft_data(source, tokenizer, recipe.data, shard=(dist.rank, dist.world_size), gather=all_gather_list)
    say(f"data: {len(data.train)} train / {len(data.eval)} eval sequences ({data.dropped} dropped) "
        f"in {time.perf_counter() - started:.1f}s")

    torch.manual_seed(recipe.seed)
    model = load_model(recipe.model, tokenizer, recipe.seed)
    layout_kind = packed_layout_kind(model)
    if recipe.model.lora is not None:
        model = apply_lora(model, recipe.model.lora)
    bf16 = torch_dtype(recipe.model, dist.device.type) == torch.bfloat16
    engine, scheduler = make_engine(
        model,
        lr=sft.learning_rate,
        weight_decay=sft.weight_decay,
        lr_lambda=schedule(sft.warmup_steps, sft.steps, sft.schedule, sft.min_lr_ratio),
        zero_stage=trainer.zero_stage,
        grad_clip=sft.grad_clip,
        bf16=bf16,
    )
    export = HFExporter(engine, tokenizer, dist, trainer.zero_stage)

    start_step = 0
    end_step = sft.steps  # earlier when a resumed run had already stopped at sft.stop_at_accuracy
    if dist.is_main:
        remove_leftovers(run_dir)
    if resume:
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is not None:
            state = load_checkpoint(engine, checkpoint)
            start_step = int(state["step"])
            if state.get("stopped_early"):
                end_step = start_step
            say(f"resumed from {checkpoint} at step {start_step}")
        else:
            say("no complete checkpoint to resume from; starting at step 0")
    say(f"trainer ready: world {dist.world_size}, ZeRO-{trainer.zero_stage}, {sft.micro_batching} micro-batching "
        f"({layout_kind}), device {dist.device}, start-up {time.perf_counter() - started:.1f}s")

    def evaluate(step: int) -> float:
        t0 = time.perf_counter()
        module = engine.module
        loss = eval_loss(module, data.eval, dist, sft.max_tokens_per_microbatch, tokenizer.pad_token_id)
        accuracy = eval_accuracy(
            module, tokenizer, data.eval_items, data.scorer, data.max_new_tokens, dist, synced=trainer.zero_stage == 3
        )
        if events:
            events.log(step, {"eval/loss": loss, "eval/accuracy": accuracy, "timing/eval_s": time.perf_counter() - t0})
        say(f"step {step}: eval loss {loss:.4f} accuracy {accuracy:.4f}")
        return accuracy

    def checkpoint(step: int, **extra) -> None:
        t0 = time.perf_counter()
        state = {"seed": recipe.seed, "samples": step * sft.batch_size, **extra}
        save_checkpoint(engine, run_dir, step, state, export, sft.keep_last)
        if events:
            events.log(step, {"timing/checkpoint_s": time.perf_counter() - t0})

    window = Window()
    pad_id = tokenizer.pad_token_id
    n_train = len(data.train)
    for step in range(start_step, end_step):
        batch = [data.train[i] for i in batch_indices(recipe.seed, step, sft.batch_size, n_train)]
        lengths = [len(ex) for ex in batch]
        layout = step_layout(lengths, recipe, dist.world_size, layout_kind)
        micro_batches = rank_micro_batches(batch, layout, dist.rank, pad_id)
        loss_tokens = sum(ex.loss_tokens for ex in batch)
        lr = scheduler.get_last_lr()[0]
        window.nll += train_step(engine, micro_batches, loss_tokens, dist.world_size)
        window.loss_tokens += loss_tokens
        window.real_tokens += sum(lengths)
        window.efficiency += layout.packing_efficiency(lengths)
        window.steps += 1
        done = step + 1

        if done % recipe.logging.log_every == 0 or done == sft.steps:
            (nll,) = all_reduce_sum([window.nll], dist.device)
            elapsed = time.perf_counter() - window.started
            metrics = {
                "train/loss": nll / max(1, window.loss_tokens),
                "train/lr": lr,
                "train/tokens_per_s": window.real_tokens / elapsed,
                "train/grad_norm": grad_norm(engine),
                "train/num_microbatches": layout.num_microbatches,
                "train/padding_microbatches": layout.padding_microbatches(),
                "train/packing_efficiency": window.efficiency / window.steps,
                "train/rank_imbalance": layout.rank_imbalance(lengths),
                "train/epoch": done * sft.batch_size / n_train,
            }
            if events:
                events.log(done, metrics)
            say(f"step {done}/{sft.steps}: loss {metrics['train/loss']:.4f} lr {lr:.2e} "
                f"tokens/s {metrics['train/tokens_per_s']:,.0f}")
            window.reset()
        if (sft.eval_every and done % sft.eval_every == 0) or done == sft.steps:
            accuracy = evaluate(done)
            window.started = time.perf_counter()  # eval time is not training throughput
            if sft.stop_at_accuracy is not None and accuracy >= sft.stop_at_accuracy and done < sft.steps:
                say(f"step {done}: held-out accuracy {accuracy:.4f} reached sft.stop_at_accuracy = {sft.stop_at_accuracy}; stopping")
                if events:
                    events.log(done, {"progress/stopped_early": 1.0})
                checkpoint(done, stopped_early=True)
                break
        if (sft.save_every and done % sft.save_every == 0) or done == sft.steps:
            checkpoint(done)
            window.started = time.perf_counter()

    # The final model: the last step's weights, published atomically like a checkpoint.
    tmp = run_dir / FINAL_TMP
    export(tmp)
    if dist.is_main:
        publish_dir(tmp, run_dir / "final")
        say(f"final model: {run_dir / 'final'} ({time.perf_counter() - started:.1f}s in total)")
    if events:
        events.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m backends.train.sft", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    args = parser.parse_args(argv)
    train(args.run_dir.resolve(), args.resume)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
