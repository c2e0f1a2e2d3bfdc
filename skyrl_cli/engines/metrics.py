"""Engine and router metrics as MetricEvents for the live view.

Each engine's Prometheus ``/metrics`` is parsed (``prometheus_client``'s parser) into an
``EngineSnapshot`` of the gauges and counters we show; two snapshots some seconds apart give rates
and interval ratios. Events (the names of ``skyrl_contracts.events``):

    engine/kv_cache_usage         mean KV-cache use over engines (0..1)
    engine/running, engine/waiting  requests, summed over engines
    engine/running_cv             coefficient of variation of running requests across engines
                                  (load balance: 0 is perfect; the routing anchor metric)
    engine/preemptions            preemptions in the interval, summed
    engine/prefix_cache_hit_rate  prefix-cache hits / queries (tokens) in the interval
    engine/gen_tokens_per_s       generated tokens per second, summed
    spec/drafts                   speculative decoding (only while the engines speculate; zeros
    spec/draft_tokens             included): verification steps that had a draft, draft tokens
    spec/accepted_tokens          proposed, draft tokens accepted, run totals over the engines
                                  since the scraper's first scrape
    spec/acceptance_rate          accepted / proposed draft tokens, run total (0 with no drafts)
    spec/mean_accepted_length     1 + accepted / drafts: tokens per verification step, run total
                                  (1 with no drafts: every step then yields its one token)
    engine/<i>/...                the same per engine (kv_cache_usage, running, waiting, gen_tokens_per_s)
    router/workers                workers in the router's rotation
    router/load/<i>               the router's load figure per worker, where the engines report one

``MetricsScraper`` polls in a daemon thread and logs through an ``EventWriter``; a failed scrape
is skipped, never raised (metrics must not stop a run).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import httpx

from skyrl_contracts.events import EventWriter

log = logging.getLogger(__name__)


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (several models / engines in one server)."""
    # lazy: prometheus_client; skyrl --help and the light commands stay light
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


@dataclass(frozen=True)
class EngineSnapshot:
    time: float
    kv_cache_usage: float
    running: float
    waiting: float
    preemptions: float  # counters from here on: totals since the engine started
    prefix_queries: float
    prefix_hits: float
    generation_tokens: float
    spec_drafts: float
    spec_draft_tokens: float
    spec_accepted_tokens: float
    # vLLM registers the spec_decode counters only when the engine was started with a
    # --speculative-config: their presence (zeros included) says the engine speculates.
    speculative: bool = False

    @classmethod
    def from_metrics(cls, values: Mapping[str, float], now: float) -> "EngineSnapshot":
        get = lambda name: float(values.get(f"vllm:{name}", 0.0))  # noqa: E731
        return cls(
            time=now,
            kv_cache_usage=get("kv_cache_usage_perc"),
            running=get("num_requests_running"),
            waiting=get("num_requests_waiting"),
            preemptions=get("num_preemptions_total"),
            prefix_queries=get("prefix_cache_queries_total"),
            prefix_hits=get("prefix_cache_hits_total"),
            generation_tokens=get("generation_tokens_total"),
            spec_drafts=get("spec_decode_num_drafts_total"),
            spec_draft_tokens=get("spec_decode_num_draft_tokens_total"),
            spec_accepted_tokens=get("spec_decode_num_accepted_tokens_total"),
            speculative="vllm:spec_decode_num_drafts_total" in values,
        )


@dataclass(frozen=True)
class Interval:
    """Counter increments between two snapshots of one engine. A restarted engine's counters start
    over; a negative increment is read as 'restarted' and the new total is taken as the increment."""

    seconds: float
    preemptions: float
    prefix_queries: float
    prefix_hits: float
    generation_tokens: float
    spec_drafts: float
    spec_draft_tokens: float
    spec_accepted_tokens: float

    @classmethod
    def between(cls, prev: EngineSnapshot, cur: EngineSnapshot) -> "Interval":
        def inc(name: str) -> float:
            a, b = getattr(prev, name), getattr(cur, name)
            return b - a if b >= a else b

        return cls(
            seconds=max(cur.time - prev.time, 1e-9),
            preemptions=inc("preemptions"),
            prefix_queries=inc("prefix_queries"),
            prefix_hits=inc("prefix_hits"),
            generation_tokens=inc("generation_tokens"),
            spec_drafts=inc("spec_drafts"),
            spec_draft_tokens=inc("spec_draft_tokens"),
            spec_accepted_tokens=inc("spec_accepted_tokens"),
        )


def spec_decode_stats(draft_tokens: float, drafts: float, accepted: float) -> dict[str, float]:
    """Acceptance rate and mean accepted length (tokens per verification step, vLLM's definition).
    With no drafts they are 0 and 1, not left out: "speculation on, nothing proposed" is a figure
    (n-gram lookup finds nothing to propose in short answers that do not repeat their prompt)."""
    return {
        "spec/acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else 0.0,
        "spec/mean_accepted_length": 1.0 + accepted / drafts if drafts > 0 else 1.0,
    }


@dataclass
class SpecTotals:
    """Speculative-decoding counters summed over engines and intervals (so over engine restarts
    too) since the scraper's first scrape: the run's totals, not the engines' lifetimes (a pool's
    engines served other runs before)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0

    def add(self, interval: Interval) -> None:
        self.drafts += interval.spec_drafts
        self.draft_tokens += interval.spec_draft_tokens
        self.accepted_tokens += interval.spec_accepted_tokens

    def events(self) -> dict[str, float]:
        return {
            "spec/drafts": self.drafts,
            "spec/draft_tokens": self.draft_tokens,
            "spec/accepted_tokens": self.accepted_tokens,
            **spec_decode_stats(self.draft_tokens, self.drafts, self.accepted_tokens),
        }


def coefficient_of_variation(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    if mean == 0:
        return 0.0
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / mean


def engine_events(
    snapshots: Mapping[int, EngineSnapshot],
    intervals: Mapping[int, Interval | None],
    spec_totals: SpecTotals | None = None,
) -> dict[str, float]:
    """Metric events for the engines that answered, keyed by engine index (``intervals[i]`` is None
    on an engine's first scrape). ``spec_totals``: the run's speculative-decoding totals, this
    interval included, reported when an engine speculates."""
    if not snapshots:
        return {}
    snaps = list(snapshots.values())
    events: dict[str, float] = {
        "engine/kv_cache_usage": sum(s.kv_cache_usage for s in snaps) / len(snaps),
        "engine/running": sum(s.running for s in snaps),
        "engine/waiting": sum(s.waiting for s in snaps),
        "engine/running_cv": coefficient_of_variation([s.running for s in snaps]),
    }
    for i, snap in snapshots.items():
        events[f"engine/{i}/kv_cache_usage"] = snap.kv_cache_usage
        events[f"engine/{i}/running"] = snap.running
        events[f"engine/{i}/waiting"] = snap.waiting
    known = {i: iv for i, iv in intervals.items() if iv is not None}
    if known:
        ivs = list(known.values())
        events["engine/preemptions"] = sum(iv.preemptions for iv in ivs)
        events["engine/gen_tokens_per_s"] = sum(iv.generation_tokens / iv.seconds for iv in ivs)
        queries = sum(iv.prefix_queries for iv in ivs)
        if queries > 0:
            events["engine/prefix_cache_hit_rate"] = sum(iv.prefix_hits for iv in ivs) / queries
        for i, iv in known.items():
            events[f"engine/{i}/gen_tokens_per_s"] = iv.generation_tokens / iv.seconds
    if spec_totals is not None and any(s.speculative for s in snaps):
        events.update(spec_totals.events())
    return events


def router_events(loads: Mapping, engine_urls: Sequence[str]) -> dict[str, float]:
    """From the router's ``/get_loads``: ``{"workers": [{"worker": url, "load": n}, ...]}``.
    vLLM engines do not report a load to the router (it shows -1); those are left out."""
    workers = loads.get("workers") or []
    events: dict[str, float] = {"router/workers": float(len(workers))}
    index = {url.rstrip("/"): i for i, url in enumerate(engine_urls)}
    for entry in workers:
        i = index.get(str(entry.get("worker", "")).rstrip("/"))
        load = entry.get("load")
        if i is not None and isinstance(load, (int, float)) and load >= 0:
            events[f"router/load/{i}"] = float(load)
    return events


class MetricsScraper:
    """Polls engines (and the router) every ``period_s`` and logs events at ``step_fn()``."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        writer: EventWriter,
        router_url: str | None = None,
        period_s: float = 5.0,
        step_fn: Callable[[], int] = lambda: 0,
    ):
        self.engine_urls = list(engine_urls)
        self.router_url = router_url
        self.writer = writer
        self.period_s = period_s
        self.step_fn = step_fn
        self._previous: dict[str, EngineSnapshot] = {}
        self.spec_totals = SpecTotals()
        self._lock = threading.Lock()  # flush() scrapes from the caller's thread too
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http = httpx.Client(timeout=min(5.0, period_s))

    def scrape_once(self) -> dict[str, float]:
        with self._lock:
            return self._scrape()

    def _scrape(self) -> dict[str, float]:
        snapshots: dict[int, EngineSnapshot] = {}
        intervals: dict[int, Interval | None] = {}
        for i, url in enumerate(self.engine_urls):
            try:
                text = self._http.get(f"{url}/metrics").text
                snap = EngineSnapshot.from_metrics(parse_prometheus(text), time.time())
            except (httpx.HTTPError, ValueError) as err:
                log.debug("metrics scrape of %s failed: %s", url, err)
                continue
            prev = self._previous.get(url)
            intervals[i] = Interval.between(prev, snap) if prev is not None else None
            if intervals[i] is not None:
                self.spec_totals.add(intervals[i])
            snapshots[i] = snap
            self._previous[url] = snap
        events = engine_events(snapshots, intervals, self.spec_totals)
        if self.router_url:
            try:
                events.update(router_events(self._http.get(f"{self.router_url}/get_loads").json(), self.engine_urls))
            except (httpx.HTTPError, ValueError) as err:
                log.debug("router loads scrape failed: %s", err)
        return events

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.flush()

    def flush(self) -> None:
        """Scrape and log now: the run's last figures (the final speculative-decoding totals among
        them) before its summary is written, whatever the period left unscraped. Never raises."""
        try:
            events = self.scrape_once()
            if events:
                self.writer.log(self.step_fn(), events)
        except Exception as err:  # noqa: BLE001 - a metrics failure never stops a run
            log.warning("metrics scraper: %s", err)

    def start(self) -> "MetricsScraper":
        self.scrape_once()  # baseline counters, so the first logged interval has rates
        self._thread = threading.Thread(target=self._run, name="engine-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.period_s + 5)
        self._http.close()
