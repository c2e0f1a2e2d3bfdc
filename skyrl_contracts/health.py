"""Run health: the trainer-vs-engine logprob gap that numerics alone cannot explain, and a judge
(``rl.judge``) whose replies mostly give no verdict.

On its own samples of the current version (every sample of a sync step; in ``--async`` only steps
whose whole batch is on-policy), the learner's logprobs and the engines' differ only by arithmetic:
dtype and kernel rounding. A larger mean gap means the engines sample from other weights than the
trainer holds, and the importance weights then hide part of a wrong policy. The learner judges every
step with ``SyncGapCheck``; a flagged step logs its gap as ``SYNC_GAP`` and its threshold as
``SYNC_GAP_BOUND``, and the first one is said in one line (the learner's log); the live view shows
that line and ``summary.json`` records it under ``health``.

Why a growth rule and not one bound per dtype: bf16 numerics depend on the model (how sharp its
distributions are) by an order of magnitude, while a sync that leaves part of the policy behind
(a tied output head kept at its first weights) makes the gap grow as training moves the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from skyrl_contracts.events import MetricEvent

SYNC_GAP = "health/sync_gap"  # a step's mean on-policy gap, logged only when flagged
SYNC_GAP_BOUND = "health/sync_gap_bound"  # the run's numerics floor at start; a flagged step's threshold

# Mean |trainer - engine| logprob per response token that numerics alone produce, by engine dtype
# (fp32 trainer). Measured: a sync round trip of a moved random policy (near-uniform, the hardest
# case) agrees to 1e-6 in fp32 and 2e-3 mean in bf16; RL runs' on-policy steps stay at 1e-4..7e-4
# (quickstart, bf16) and 5e-3..1.2e-2 (a user's BPE-tokenizer model after a short SFT, bf16), flat
# over 60 steps. A tied head left behind by the sync grew from the numerics of step 1 to 0.02-0.03 by
# step 30 (fp32 and bf16).
SYNC_GAP_FLOORS = {"float32": 1e-3, "bfloat16": 1e-2, "float16": 1e-2}
# The first step's engines serve the initial weights, loaded at start, not reloaded: its gap is this
# model's numerics, and later steps may not grow past GROWTH times it. Above CEILING_FACTOR x the
# floor, no step (the first included) is numerics: the engines serve other weights altogether.
GROWTH = 3.0
CEILING_FACTOR = 10.0


def sync_gap_floor(engine_dtype: str, int4_rollouts_without_qat: bool = False) -> float | None:
    """The numerics floor for engines of ``engine_dtype``; None where the check does not apply: INT4
    engines serving a policy the trainer holds in full precision differ by the quantization itself."""
    if int4_rollouts_without_qat:
        return None
    return SYNC_GAP_FLOORS.get(engine_dtype, SYNC_GAP_FLOORS["bfloat16"])


@dataclass
class SyncGapCheck:
    """Judges each learner step's on-policy gap (``train/logprob_diff``) against the numerics of the
    engines: the first judged step against ``CEILING_FACTOR`` x the floor, every later one against
    the larger of the floor and ``GROWTH`` x the first step's gap. A step with stale samples
    (``async/staleness_max`` > 0) carries the policy's own change in its gap and is not judged."""

    floor: float
    baseline: float | None = None  # the first judged step's gap

    def threshold(self) -> float:
        if self.baseline is None:
            return CEILING_FACTOR * self.floor
        return min(max(self.floor, GROWTH * self.baseline), CEILING_FACTOR * self.floor)

    def judge(self, metrics: Mapping[str, float]) -> tuple[float, float] | None:
        """(the step's gap, the threshold it exceeded) when flagged, else None."""
        gap = metrics.get("train/logprob_diff")
        if gap is None or metrics.get("async/staleness_max", 0.0) > 0:
            return None
        threshold = self.threshold()
        if self.baseline is None:
            self.baseline = gap
        return (gap, threshold) if gap > threshold else None


def sync_gap_message(step: int, gap: float, bound: float) -> str:
    return (
        f"step {step}: trainer and engines disagree on the policy's own samples (mean logprob gap {gap:.3g} > "
        f"{bound:.2g}, more than numerics): the engines are likely not serving the trainer's weights "
        "(a weight sync that left part of the model behind, such as a tied output head) or use another "
        "tokenizer or chat template"
    )


def sync_gap_health(events: Iterable[MetricEvent]) -> dict[str, Any] | None:
    """``summary.json``'s ``health`` entry: the steps over the bound, the first and worst, the message."""
    events = list(events)
    over = [e for e in events if e.name == SYNC_GAP]
    if not over:
        return None
    first, worst = min(over, key=lambda e: e.step), max(over, key=lambda e: e.value)
    bound = next((e.value for e in events if e.name == SYNC_GAP_BOUND and e.step == first.step), float("nan"))
    return {
        "sync_gap_steps_over_bound": len(over),
        "sync_gap_first_step": first.step,
        "sync_gap_max": worst.value,
        "sync_gap_bound": bound,
        "message": sync_gap_message(first.step, first.value, bound),
    }


# A judge that gives no verdict for most replies (its template or verdict parser does not fit the
# model) trains the policy on zeros: the run ends with a warning above this share.
JUDGE_NO_VERDICT_SHARE = 0.5


def judge_health(metrics: Mapping[str, float]) -> dict[str, Any] | None:
    """``health`` entries when most of the judge's replies gave no verdict (unparsed, or the request
    failed); None without a judge or when most did."""
    unparsed, errors = metrics.get("judge/unparsed", 0.0), metrics.get("judge/errors", 0.0)
    total = metrics.get("judge/verdicts", 0.0) + unparsed + errors
    if not total or (unparsed + errors) / total <= JUDGE_NO_VERDICT_SHARE:
        return None
    share = (unparsed + errors) / total
    return {
        "judge_no_verdict_share": share,
        "message": (
            f"the judge gave no verdict for {unparsed + errors:.0f} of {total:.0f} replies ({share:.0%}: "
            f"{unparsed:.0f} unparsed, {errors:.0f} failed), each a reward of 0: see judge_verdicts.jsonl "
            "and check rl.judge.template and rl.judge.verdict against what the judge writes"
        ),
    }


def run_health(events: Iterable[MetricEvent], metrics: Mapping[str, float]) -> dict[str, Any] | None:
    """``summary.json``'s ``health``: every check that fired, their messages joined; None when none did."""
    fired = [h for h in (sync_gap_health(events), judge_health(metrics)) if h is not None]
    if not fired:
        return None
    merged: dict[str, Any] = {}
    for health in fired:
        merged.update(health)
    merged["message"] = "; ".join(h["message"] for h in fired)
    return merged
