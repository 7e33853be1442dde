"""kvsan's Prometheus metrics (``kvsan_*``).

Labels stay low-cardinality: ``kind`` (a fixed set), ``role``, ``engine``
and ``rank`` (see :data:`LABELS`).  Request ids
never become labels; they are in the logs and the JSONL report.  Gauges
declare a multiprocess mode so that, with ``PROMETHEUS_MULTIPROC_DIR`` set
before launch, vLLM's own ``/metrics`` aggregates the EngineCore's values.
"""

from __future__ import annotations

from .kinds import ALL_KINDS
from .reportsink import REASONS


#: the labels of every ``kvsan_*`` series besides ``kind``: which process
#: (``role``: frontend, engine or worker), of which data-parallel engine
#: (``engine``, 0 without DP) and which worker rank in it (``rank``, 0 for
#: the EngineCore and the front end).  A fixed, small set.
LABELS = ("role", "engine", "rank")


class Metrics:
    def __init__(self, role: str, registry=None, engine: int = 0, rank: int = 0):
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        self.role = role
        self._violations = Counter(
            "kvsan_violations",
            "KV-cache invariant violations detected by kvsan, by kind.",
            ["kind", *LABELS],
            registry=registry,
        )
        self._internal_family = Counter(
            "kvsan_internal_errors",
            "Failures inside kvsan itself (never propagated to the engine in log mode).",
            list(LABELS),
            registry=registry,
        )

        def gauge(name, doc):
            return Gauge(name, doc, list(LABELS), registry=registry, multiprocess_mode="livesum")

        self._gauges = {
            "live_owned": gauge(
                "kvsan_live_owned_blocks", "Blocks held by at least one live owner."),
            "cached_evictable": gauge(
                "kvsan_cached_evictable_blocks",
                "Blocks with no owner that keep a prefix-cache entry (reclaimable, not leaked)."),
            "free": gauge("kvsan_free_blocks", "Blocks with no owner and no cache entry."),
            "leaked": gauge(
                "kvsan_leaked_blocks",
                "Blocks still held by requests whose release path has run."),
            "tracked_requests": gauge(
                "kvsan_tracked_requests", "Requests that currently hold KV blocks."),
            "orphans": gauge(
                "kvsan_orphan_blocks",
                "Blocks with no live owner that are not free (found by the full audit)."),
        }
        self._overhead_family = Counter(
            "kvsan_overhead_seconds",
            "Wall time spent inside kvsan's checks (seconds).",
            list(LABELS),
            registry=registry,
        )
        self._steps_family = Counter(
            "kvsan_scheduler_steps",
            "Scheduler steps observed by kvsan.",
            list(LABELS),
            registry=registry,
        )
        #: ``reason``: one of :data:`kvsan.reportsink.REASONS`
        self._lost_family = Counter(
            "kvsan_records_lost",
            "Report records kvsan could not write (disk full, read-only, stalled, ...).",
            ["reason", *LABELS],
            registry=registry,
        )
        #: which checks run (``mode``: staging, every request; production,
        #: the sampled share ``sample_rate``): a dashboard reading 0
        #: violations knows how much was watched.  One series per process.
        self._mode_family = Gauge(
            "kvsan_mode_info",
            "kvsan's check mode (staging: every request; production: a sampled share).",
            ["mode", "sample_rate", *LABELS], registry=registry, multiprocess_mode="livemax")
        self._mode: tuple[str, str] | None = None
        self._sampling_family = {
            "admitted": gauge("kvsan_admitted_requests",
                              "Requests the scheduler admitted since start (production mode)."),
            "sampled": gauge("kvsan_sampled_requests",
                             "Requests production mode sampled and checked since start."),
            "guarded": gauge("kvsan_guarded_blocks",
                             "Blocks production mode guards now (held by sampled requests)."),
        }
        self._flushed_overhead = 0.0
        self._flushed_steps = 0
        self._bind(engine, rank)

    def set_mode(self, mode: str, sample_rate: float) -> None:
        """``kvsan_mode_info{mode, sample_rate} 1`` for this process."""
        self._mode = (mode, f"{sample_rate:g}")
        self._mode_family.clear()
        self._mode_family.labels(mode=self._mode[0], sample_rate=self._mode[1],
                                 **self._labels).set(1)

    def update_sampling(self, admitted: int, sampled: int, guarded: int) -> None:
        self._sampling["admitted"].set(admitted)
        self._sampling["sampled"].set(sampled)
        self._sampling["guarded"].set(guarded)

    def _bind(self, engine: int, rank: int) -> None:
        """Bind every series to this process's labels."""
        self.engine, self.rank = int(engine), int(rank)
        self._labels = dict(role=self.role, engine=str(self.engine), rank=str(self.rank))
        for kind in ALL_KINDS:  # export zeros so dashboards and alerts see every kind
            self._violations.labels(kind=kind, **self._labels)
        for reason in REASONS:
            self._lost_family.labels(reason=reason, **self._labels)
        self._internal = self._internal_family.labels(**self._labels)
        for attr, family in self._gauges.items():
            setattr(self, attr, family.labels(**self._labels))
        self._overhead = self._overhead_family.labels(**self._labels)
        self._steps = self._steps_family.labels(**self._labels)
        self._sampling = {k: f.labels(**self._labels) for k, f in self._sampling_family.items()}
        if self._mode is not None:
            self.set_mode(self._mode[0], float(self._mode[1]))

    def relabel(self, engine: int, rank: int) -> None:
        """This process's engine or rank turned out other than its name
        said: its series move to the right labels (counters keep their
        counts; the old label set is removed, where the registry allows)."""
        old = dict(self._labels)
        counts = {kind: self._violations.labels(kind=kind, **old)._value.get()
                  for kind in ALL_KINDS}
        internal = self._internal._value.get()
        overhead, steps = self._overhead._value.get(), self._steps._value.get()
        lost = {reason: self._lost_family.labels(reason=reason, **old)._value.get()
                for reason in REASONS}
        try:
            for kind in ALL_KINDS:
                self._violations.remove(kind, *old.values())
            for reason in REASONS:
                self._lost_family.remove(reason, *old.values())
            for family in (self._internal_family, self._overhead_family, self._steps_family,
                           *self._gauges.values(), *self._sampling_family.values()):
                family.remove(*old.values())
        except Exception:  # noqa: BLE001 - multiprocess mode keeps what was written
            pass
        self._bind(engine, rank)
        for kind, n in counts.items():
            if n:
                self._violations.labels(kind=kind, **self._labels).inc(n)
        for reason, n in lost.items():
            if n:
                self._lost_family.labels(reason=reason, **self._labels).inc(n)
        for child, n in ((self._internal, internal), (self._overhead, overhead),
                         (self._steps, steps)):
            if n:
                child.inc(n)

    def forked(self, role: str, engine: int, rank: int) -> "Metrics":
        """In a forked child: the families are registered already (the
        registry is inherited), but their series and values are the
        parent's.  Drop them all and bind this process's labels: the child
        exports its own counts only (the parent keeps exporting its own)."""
        for family in (self._violations, self._internal_family, self._overhead_family,
                       self._steps_family, self._lost_family, *self._gauges.values(),
                       self._mode_family, *self._sampling_family.values()):
            family.clear()
        self._mode = None
        self.role = role
        self._flushed_overhead = 0.0
        self._flushed_steps = 0
        self._bind(engine, rank)
        return self

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
        self._violations.labels(kind=kind, **self._labels).inc()

    def internal_error(self) -> None:
        self._internal.inc()

    def records_lost(self, reason: str, n: int = 1) -> None:
        self._lost_family.labels(reason=reason, **self._labels).inc(n)

    def update_pool(self, stats: dict[str, int]) -> None:
        self.live_owned.set(stats["live_owned"])
        self.cached_evictable.set(stats["cached_evictable"])
        self.free.set(stats["free"])
        self.leaked.set(stats["leaked"])
        self.tracked_requests.set(stats["tracked_requests"])
