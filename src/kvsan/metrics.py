"""kvsan's Prometheus metrics (``kvsan_*``).

Labels stay low-cardinality: ``kind`` (a fixed set) and ``role``.  Request ids
never become labels; they are in the logs and the JSONL report.  Gauges
declare a multiprocess mode so that, with ``PROMETHEUS_MULTIPROC_DIR`` set
before launch, vLLM's own ``/metrics`` aggregates the EngineCore's values.
"""

from __future__ import annotations

from .kinds import ALL_KINDS


class Metrics:
    def __init__(self, role: str, registry=None):
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        self.role = role
        self._violations = Counter(
            "kvsan_violations",
            "KV-cache invariant violations detected by kvsan, by kind.",
            ["kind", "role"],
            registry=registry,
        )
        for kind in ALL_KINDS:  # export zeros so dashboards and alerts see every kind
            self._violations.labels(kind=kind, role=role)
        self._internal = Counter(
            "kvsan_internal_errors",
            "Failures inside kvsan itself (never propagated to the engine in log mode).",
            ["role"],
            registry=registry,
        )
        self._internal.labels(role=role)

        def gauge(name, doc):
            return Gauge(name, doc, ["role"], registry=registry, multiprocess_mode="livesum")

        self.live_owned = gauge(
            "kvsan_live_owned_blocks", "Blocks held by at least one live owner."
        ).labels(role=role)
        self.cached_evictable = gauge(
            "kvsan_cached_evictable_blocks",
            "Blocks with no owner that keep a prefix-cache entry (reclaimable, not leaked).",
        ).labels(role=role)
        self.free = gauge(
            "kvsan_free_blocks", "Blocks with no owner and no cache entry."
        ).labels(role=role)
        self.leaked = gauge(
            "kvsan_leaked_blocks", "Blocks still held by requests whose release path has run."
        ).labels(role=role)
        self.tracked_requests = gauge(
            "kvsan_tracked_requests", "Requests that currently hold KV blocks."
        ).labels(role=role)

        self.orphans = gauge(
            "kvsan_orphan_blocks",
            "Blocks with no live owner that are not free (found by the full audit).",
        ).labels(role=role)
        self._overhead = Counter(
            "kvsan_overhead_seconds",
            "Wall time spent inside kvsan's checks (seconds).",
            ["role"],
            registry=registry,
        ).labels(role=role)
        self._steps = Counter(
            "kvsan_scheduler_steps",
            "Scheduler steps observed by kvsan.",
            ["role"],
            registry=registry,
        ).labels(role=role)
        self._flushed_overhead = 0.0
        self._flushed_steps = 0

    def flush_counters(self, overhead_s: float, steps: int) -> None:
        """Advance the overhead and step counters to the runtime's totals.
        The hot path only adds to plain numbers; this runs once per step."""
        d = overhead_s - self._flushed_overhead
        if d > 0:
            self._overhead.inc(d)
            self._flushed_overhead = overhead_s
        n = steps - self._flushed_steps
        if n > 0:
            self._steps.inc(n)
            self._flushed_steps = steps

    def violation(self, kind: str) -> None:
        self._violations.labels(kind=kind, role=self.role).inc()

    def internal_error(self) -> None:
        self._internal.labels(role=self.role).inc()

    def update_pool(self, stats: dict[str, int]) -> None:
        self.live_owned.set(stats["live_owned"])
        self.cached_evictable.set(stats["cached_evictable"])
        self.free.set(stats["free"])
        self.leaked.set(stats["leaked"])
        self.tracked_requests.set(stats["tracked_requests"])
