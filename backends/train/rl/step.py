"""One RL step of the learner, top to bottom: ``RLStep.train(samples)``.

1. advantages over the whole batch (``rl.advantage``: grpo, rloo, reinforce_pp; ``rl.advantages``);
2. slices of whole groups (``rl.mini_batches``), each laid out in micro-batches for this rank by
   dynamic micro-batching (token budget ``rl.max_tokens_per_microbatch``, the same layout on every
   rank, zero-weight padding micro-batches where a rank has fewer), with the slice's loss
   denominators (``LossNormalizer``: loss tokens and sequences of the whole slice);
3. the proximal ("old") logprobs, one no-grad pass, when a step makes several updates;
4. ``rl.epochs x rl.mini_batches`` updates, each an optimizer step over one slice: per micro-batch
   the policy's logprobs, the off-policy correction against the engines' logprobs
   (``rl.off_policy``), the policy loss (``rl.losses``) and the KL term, backward; then the step;
5. the step's metrics: summed over ranks, combined over updates.

The process around it (DeepSpeed, the exchange with the orchestrator, publishing versions,
checkpoints) is ``backends.train.rl_learner``; the loss formulas are ``backends.train.rl.losses``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from backends.train.microbatch import IGNORE, laid_out, right_padded, row_positions, token_logprobs
from backends.train.packing import dynamic_layout
from backends.train.rl.advantages import compute_advantages, reverse_kl_advantages
from backends.train.rl.losses import LossNormalizer, kl_loss, merge_metrics, policy_loss
from backends.train.rl.minibatch import group_slices
from backends.train.rl.off_policy import logprob_diff_metrics, off_policy_correction
from skyrl_contracts.losses import ADVANTAGE_KINDS, loss_reduction


class PhaseClock:
    """Seconds per phase of the updates, summed over the step (``lap(name)`` charges the time since
    the last lap to ``name``). On a GPU each lap waits for the queued kernels, so a phase is charged
    with its own work, not with whatever the next one's first synchronisation waits for."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.totals: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.totals[name] = self.totals.get(name, 0.0) + now - self.last
        self.last = now


class RLStep:
    """One learner step over a batch of samples. ``engine``: DeepSpeed's (``backward``, ``step``,
    ``module``; a plain-torch stand-in in the unit tests); ``reference``: the KL reference model, or
    None (with LoRA the reference is the policy with its adapter disabled); ``turns``: the run's
    turn limit (``skyrl_contracts.episodes.turn_limit``; None: an agent's calls are not capped)."""

    def __init__(self, rl, engine, dist, pad_id: int, reference=None, turns: int | None = 1):
        self.rl, self.engine, self.dist, self.pad_id, self.reference = rl, engine, dist, pad_id, reference
        self.turns = turns
        self.updates_per_step = rl.epochs * rl.mini_batches

    def train(self, samples) -> dict[str, float]:
        clock = PhaseClock(self.dist.device)
        rows = sample_rows(samples, batch_advantages(samples, self.rl))  # 1
        updates = self.slices(samples, rows)  # 2
        clock.lap("timing/prepare_s")
        self.fill_old_logprobs(updates)  # 3
        clock.lap("timing/forward_backward_s")
        per_update = []
        for epoch in range(self.rl.epochs):  # 4
            for update in updates:
                metrics: dict[str, float] = {}
                for mb in update.micro_batches:
                    loss = self.loss(mb.to(self.dist.device), update.normalizer, metrics, first_epoch=epoch == 0)
                    # DeepSpeed averages gradients over ranks; the shares must add up, hence * world.
                    self.engine.backward(loss * self.dist.world_size, scale_wrt_gas=False)
                clock.lap("timing/forward_backward_s")
                self.engine.step()
                clock.lap("timing/optimizer_s")
                per_update.append(reduce_metrics(metrics, self.dist.device))
        out = combine_updates(per_update)  # 5
        out.update(clock.totals)
        out["train/num_microbatches"] = sum(u.layout.num_microbatches for u in updates)
        out["train/padding_microbatches"] = sum(u.layout.padding_microbatches() for u in updates)
        out["train/updates"] = float(len(per_update))
        return out

    def slices(self, samples, rows) -> list[Update]:
        """The step's slices (whole groups), each laid out in micro-batches for this rank."""
        updates = []
        # a trajectory longer than max_new_tokens x turns (an agent's calls, uncapped) must not exceed the bound
        longest = max((len(s.loss_mask) for s in samples), default=0)
        for members in group_slices([s.prompt_uid for s in samples], self.rl.mini_batches):
            # a sample whose user code failed before any token holds none: its reward counts in the
            # group's statistics (advantages above), but there is nothing to lay out
            mine_rows = [rows[i] for i in members if len(rows[i][0]) > 0]
            layout = dynamic_layout(
                [len(r[0]) for r in mine_rows], self.dist.world_size, self.rl.max_tokens_per_microbatch, "padded"
            )
            mine = laid_out(
                mine_rows,
                layout,
                self.dist.rank,
                lambda rows: collate_rows(rows, self.pad_id),
                padding_tensors(self.pad_id),
            )
            normalizer = LossNormalizer(
                tokens=float(sum(samples[i].num_loss_tokens for i in members)),
                sequences=float(sum(1 for i in members if samples[i].num_loss_tokens > 0)),
                max_seq_len=max(self.rl.max_new_tokens * (self.turns or 1), longest),
            )
            updates.append(Update(mine, normalizer, layout))
        return updates

    def fill_old_logprobs(self, updates: list[Update]) -> None:
        """The proximal policy: this step's weights before any update, one no-grad pass. Needed
        only when a step makes several updates (with one, old = current exactly)."""
        if self.rl.loss.ratio != "proximal" or self.updates_per_step == 1:
            return
        with torch.no_grad():
            for update in updates:
                for mb in update.micro_batches:
                    mb.old_logprobs = self.logprobs(self.engine, mb.to(self.dist.device)).cpu()

    def loss(self, mb: Tensors, normalizer, metrics: dict, first_epoch: bool) -> torch.Tensor:
        """One micro-batch's share of its slice's loss: policy loss under the off-policy correction,
        plus the KL term; its metrics merged into ``metrics``."""
        rl = self.rl
        logprobs = self.logprobs(self.engine, mb)
        proximal = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
        correction = off_policy_correction(
            proximal, mb.rollout_logprobs, mb.loss_mask, rl.async_.off_policy, normalizer
        )
        if rl.loss.ratio == "rollout":  # the ratio against the sampler carries the correction itself
            old, is_weights = mb.rollout_logprobs, None
        else:
            old, is_weights = proximal, correction.is_weights
        loss, loss_metrics = policy_loss(
            logprobs, old, mb.advantages, correction.loss_mask, rl.loss, normalizer, is_weights=is_weights
        )
        merge_metrics(metrics, loss_metrics)
        merge_metrics(metrics, correction.metrics)
        if first_epoch:  # each sample once; vs the proximal logprobs where there are any
            merge_metrics(metrics, logprob_diff_metrics(proximal, mb.rollout_logprobs, mb.loss_mask, normalizer))
        if rl.kl.coef > 0:
            # the corrected mask: a sequence the geometric mask rejected gets no KL gradient either
            term, kl_metrics = kl_loss(
                logprobs,
                self.reference_logprobs(mb),
                correction.loss_mask,
                coef=rl.kl.coef,
                estimator=rl.kl.estimator,
                reduction=loss_reduction(rl.loss.kind, rl.loss.reduction),
                normalizer=normalizer,
            )
            loss = loss + term
            merge_metrics(metrics, kl_metrics)
        return loss

    def logprobs(self, model, mb: Tensors) -> torch.Tensor:
        """Logprob of every token given the ones before it, aligned with ``input_ids`` (position 0: 0),
        of the tempered distribution the engines sample from (they report processed logprobs)."""

        logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
        if self.rl.temperature != 1.0:
            logits = logits / self.rl.temperature
        labels = torch.cat([mb.input_ids[:, 1:], torch.full_like(mb.input_ids[:, :1], IGNORE)], dim=1)
        next_token = token_logprobs(logits, labels)
        return torch.nn.functional.pad(next_token[:, :-1], (1, 0), value=0.0)

    def reference_logprobs(self, mb: Tensors) -> torch.Tensor:
        """The KL reference's logprobs: the initial model, or with LoRA the policy's own module with
        its adapter switched off for this pass (the frozen base weights are the initial model)."""
        with torch.no_grad():
            if self.reference is not None:
                return self.logprobs(self.reference, mb)
            module = self.engine.module
            with module.disable_adapter():
                return self.logprobs(module, mb)


# ------------------------------------------------------------------------------ the step's pieces


@dataclass
class Tensors:
    """One micro-batch of trajectories as right-padded rows, every tensor [B, T]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None  # the proximal policy's, filled before the first update

    def to(self, device) -> "Tensors":
        moved = (self.input_ids, self.position_ids, self.loss_mask, self.rollout_logprobs, self.advantages)
        old = None if self.old_logprobs is None else self.old_logprobs.to(device)
        return Tensors(*(t.to(device) for t in moved), old_logprobs=old)


@dataclass
class Update:
    """One policy update: this rank's micro-batches of one slice and the slice's loss denominators."""

    micro_batches: list[Tensors]
    normalizer: object  # rl.losses.LossNormalizer
    layout: object  # packing.StepLayout


# Policy metrics reported per update as well (train/update<k>/<name>) when a step has several.
PER_UPDATE_METRICS = (
    "clip_frac",
    "clip_frac_low",
    "clip_frac_high",
    "approx_kl",
    "ratio_mean",
    "ratio_max",
    "ratio_min",
)


def sample_rows(samples, advantages: torch.Tensor) -> list[tuple[list[int], list[float], list[float], list[float]]]:
    """Per sample: token ids, loss mask, rollout logprobs and advantages aligned on the full sequence
    (prompt positions carry no loss). ``advantages``: [N, R] per response token."""
    rows = []
    for i, s in enumerate(samples):
        n_prompt, n_resp = len(s.prompt_ids), len(s.response_ids)
        ids = list(s.prompt_ids) + list(s.response_ids)
        mask = [0.0] * n_prompt + [float(m) for m in s.loss_mask]
        lps = [0.0] * n_prompt + [float(x) for x in s.rollout_logprobs]
        adv = [0.0] * n_prompt + advantages[i, :n_resp].tolist()
        rows.append((ids, mask, lps, adv))
    return rows


def collate_rows(rows, pad_id: int) -> Tensors:
    """``sample_rows`` rows in the ``padded`` layout the SFT micro-batches use (``microbatch.collate``)."""

    ids, mask, lps, adv = zip(*rows)
    input_ids = right_padded(ids, pad_id)
    floats = (right_padded(column, 0.0, torch.float32) for column in (mask, lps, adv))
    return Tensors(input_ids, row_positions(input_ids), *floats)


def padding_tensors(pad_id: int) -> Tensors:
    """A zero-weight micro-batch that keeps ranks in step (ZeRO-2/3 need equal counts): one pad
    token that carries no loss."""
    return collate_rows([([pad_id], [0.0], [0.0], [0.0])], pad_id)


def batch_advantages(samples, rl) -> torch.Tensor:
    """Per response token [N, R]: the task reward's advantage (``rl.advantage``) plus, with
    ``rl.distillation``, the teacher's per-token term (``distillation_advantages``); with
    ``rl.distillation.task_reward = false`` the teacher's term alone."""
    width = max(1, max(len(s.response_ids) for s in samples))
    mask = torch.zeros((len(samples), width))
    for i, s in enumerate(samples):
        mask[i, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    distill = rl.distillation
    if distill is None:
        return task_advantages(samples, rl, mask)
    term = distillation_advantages(samples, mask, distill.coef)
    return task_advantages(samples, rl, mask) + term if distill.task_reward else term


def distillation_advantages(samples, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """The samples' teacher and sampling logprobs as [N, R] rows, into ``reverse_kl_advantages``."""
    teacher, sampling = torch.zeros_like(mask), torch.zeros_like(mask)
    for i, s in enumerate(samples):
        if s.teacher_logprobs is None:
            if s.num_loss_tokens:
                raise ValueError(f"sample {s.session_id} has no teacher logprobs (rl.distillation)")
            continue
        n = len(s.response_ids)
        teacher[i, :n] = torch.tensor(s.teacher_logprobs, dtype=torch.float32)
        sampling[i, :n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    return reverse_kl_advantages(teacher, sampling, mask, coef)


def task_advantages(samples, rl, mask: torch.Tensor) -> torch.Tensor:
    """The task reward's advantages (``rl.advantage``) per response token [N, R]."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    trajectories = trajectory_rows(samples)
    if len(set(trajectories)) == len(samples) or not ADVANTAGE_KINDS[rl.advantage.kind].group_baseline:
        return compute_advantages(rewards, [s.prompt_uid for s in samples], mask, rl.advantage)
    # An agent that rewrote its history left several samples of one trajectory: the group's
    # statistics count each trajectory once, and each of its samples takes its advantage.
    first = sorted(set(trajectories))
    one_each = compute_advantages(
        rewards[first], [samples[i].prompt_uid for i in first], torch.ones((len(first), 1)), rl.advantage
    )[:, 0]
    position = {row: k for k, row in enumerate(first)}
    return one_each[[position[row] for row in trajectories]][:, None] * mask


def trajectory_rows(samples) -> list[int]:
    """For each sample, the index of the first sample of its trajectory (``prompt_uid``, ``index``)."""
    first: dict[tuple[str, int], int] = {}
    return [first.setdefault((s.prompt_uid, s.index), i) for i, s in enumerate(samples)]


def reduce_metrics(metrics: dict[str, float], device) -> dict[str, float]:
    """Sum shares over ranks; ``_max`` / ``_min`` keys by max / min (see rl.losses.merge_metrics)."""
    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return metrics
    # Every rank must contribute the same keys in the same order: gather the key sets first.
    keys: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(keys, sorted(metrics))
    names = sorted(set().union(*map(set, keys)))
    out = {}
    for op, pick, fill in (
        (tdist.ReduceOp.SUM, lambda k: not k.endswith(("_max", "_min")), 0.0),
        (tdist.ReduceOp.MAX, lambda k: k.endswith("_max"), float("-inf")),
        (tdist.ReduceOp.MIN, lambda k: k.endswith("_min"), float("inf")),
    ):
        chosen = [k for k in names if pick(k)]
        if not chosen:
            continue
        t = torch.tensor([metrics.get(k, fill) for k in chosen], dtype=torch.float64, device=device)
        tdist.all_reduce(t, op=op)
        out.update({k: float(v) for k, v in zip(chosen, t.tolist()) if abs(v) != float("inf")})
    return out


def combine_updates(per_update: list[dict[str, float]]) -> dict[str, float]:
    """A step's figures from its updates' figures: the mean over updates (``_max`` / ``_min``:
    the max / min), plus the policy metrics of each update when there are several."""
    names = sorted(set().union(*per_update))
    out: dict[str, float] = {}
    for name in names:
        values = [m[name] for m in per_update if name in m]
        if name.endswith("_max"):
            out[name] = max(values)
        elif name.endswith("_min"):
            out[name] = min(values)
        else:
            out[name] = sum(values) / len(values)
    if len(per_update) > 1:
        for k, metrics in enumerate(per_update, start=1):
            for short in PER_UPDATE_METRICS:
                if f"train/{short}" in metrics:
                    out[f"train/update{k}/{short}"] = metrics[f"train/{short}"]
    return out
