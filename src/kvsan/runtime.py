"""Per-process kvsan state: configuration, reporter, metrics, the scheduler
step counter, the owner context the hooks push, and the checkers of the
pools this process tracks.

Created lazily and re-created in a forked child (a fork inherits the patched
classes but must not share open report descriptors or exporter threads, nor
the parent's role, counters or pools: :func:`_after_fork_in_child`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import weakref

from .config import Config
from .report import Reporter


#: how the engine names its processes (the adapter's ``role()``,
#: ``identity(role)`` and ``api_server()``; :func:`set_process_names`):
#: None outside an engine, where every process is a front end
_names = None


#: what installs kvsan again in a child multiprocessing forked
#: (:func:`kvsan.plugin.install_forked`; set by the plugin when it installs)
_install_forked = None


def set_fork_installer(install) -> None:
    """``install(parent_runtime)``, called in a forked child once it is named."""
    global _install_forked
    _install_forked = install


def set_process_names(names) -> None:
    """Tell kvsan how the engine names its processes (the engine adapter,
    before the first runtime is made)."""
    global _names
    _names = names


def detect_role() -> str:
    """``engine``, ``worker`` or ``frontend``, from the process's name."""
    return _names.role() if _names is not None else "frontend"


def detect_identity(role: str) -> tuple[int, int]:
    """``(engine, rank)`` of this process, from its name and its parent's:
    0 where a name carries none (the front end, an in-process engine).  A
    worker whose runner kvsan hooks confirms both from the engine's
    parallel state (:func:`set_identity`)."""
    return _names.identity(role) if _names is not None else (0, 0)


def identity_in_name(role: str) -> bool:
    """Whether this process's engine and rank came from names the engine
    gave (False: known only once the engine's parallel state is, as in a
    Ray actor's process; :func:`set_identity` confirms them)."""
    return _names.identity_in_name(role) if _names is not None else True


def set_identity(rt: "Runtime", engine: int, rank: int) -> None:
    """Confirm this process's engine index and rank (once vLLM's parallel
    state is known): every later record and metric carries them, and an
    exporter port that waited for them is bound now."""
    engine, rank = int(engine), int(rank)
    if (engine, rank) != (rt.engine, rt.rank):
        rt.engine, rt.rank = engine, rank
        rt.reporter.engine, rt.reporter.rank = engine, rank
        if rt.metrics is not None:
            rt.metrics.relabel(engine, rank)
    if not rt.identity_known:
        rt.identity_known = True
        rt.reporter.event("kvsan.identity", confirmed_from="parallel config")
        from . import exporter

        exporter.start_port(rt)


class Runtime:
    #: ``step`` is a slot: kvsan's native hooks read it on every allocator
    #: event, at a fixed offset (everything else stays in ``__dict__``).
    #: ``owner_ctx`` is never rebound: the native hooks keep it per runtime.
    #: (The step journal is each pool's: ``AllocatorChecker.journal``.)
    __slots__ = ("step", "__dict__", "__weakref__")

    def __init__(self, config: Config, role: str | None = None, metrics: bool = True):
        self.config = config
        self.pid = os.getpid()
        self.role = role or detect_role()
        #: the data-parallel engine index and the worker's rank in its
        #: engine (0 for an EngineCore and the front end): with ``role``,
        #: on every record and metric
        self.engine, self.rank = detect_identity(self.role)
        #: whether they are known yet (the exporter's port waits for them)
        self.identity_known = identity_in_name(self.role)
        #: N of a front end that is one API server of several, else None
        #: (its exporter port: :func:`kvsan.exporter.port_for`)
        self.api_server = (_names.api_server() if _names is not None and self.role == "frontend"
                           else None)
        self.metrics = None
        if metrics:
            try:
                from .metrics import Metrics

                self.metrics = Metrics(self.role, engine=self.engine, rank=self.rank)
            except ValueError:  # already registered in this registry (re-init)
                self.metrics = None
            except OSError as e:  # PROMETHEUS_MULTIPROC_DIR unwritable: check without metrics
                self.metrics = None
                _say_metrics_off(e)
        self.reporter = Reporter(config, self.role, self.metrics,
                                 engine=self.engine, rank=self.rank)
        self.step = 0
        #: stack of (owner, tag) pushed by request-scoped hooks
        self.owner_ctx: list[tuple[str, str]] = []
        #: tracked pools -> checker (weak keys: a pool that goes away is dropped)
        self.checkers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.hooks_installed: list[str] = []
        self.hooks_missing: list[str] = []
        self.idle_audited = False
        #: the scheduler took a request since its last rest (``kvsan.busy``
        #: written; ``kvsan.idle`` due)
        self.busy = False
        #: seconds spent in kvsan's checks (exported as kvsan_overhead_seconds_total)
        self.overhead_s = 0.0
        #: monotonic time of the next per-step metrics refresh
        self.metrics_due = 0.0
        #: the part of ``overhead_s`` spent in the worker-side (device) hooks
        self.device_s = 0.0
        #: kvsan's C speed-ups are in use in this process (set at install)
        self.native = False
        #: production mode's sampler (:class:`kvsan.checks.sampled.Sampler`),
        #: in a scheduler's process with ``KVSAN_SAMPLE`` set; else None
        self.sampler = None

    def current_owner(self) -> str | None:
        return self.owner_ctx[-1][0] if self.owner_ctx else None

    def get_step(self) -> int:
        return self.step

    def violations(self):
        return list(self.reporter.kept)

    def clear(self) -> None:
        """Forget recorded violations (for tests that reuse one engine)."""
        self.reporter.kept.clear()
        self.reporter.counts.clear()


def _say_metrics_off(exc: OSError) -> None:
    """One line: this process checks, but exports no ``kvsan_*`` series."""
    import sys

    from .exporter import multiproc_dir

    where = multiproc_dir() or "the metrics registry"
    try:
        sys.stderr.write(f"kvsan: metrics off in pid {os.getpid()}: cannot write {where} "
                         f"({exc.strerror or exc}); checks and the report go on\n")
    except Exception:  # noqa: BLE001
        pass


_runtime: Runtime | None = None


def get() -> Runtime | None:
    return _runtime


#: called with the new runtime after every :func:`set_runtime` (the only
#: place that assigns ``_runtime``): code that keeps ``_runtime`` as last
#: read (kvsan's native hooks: ``kvsan._native._hookfast.runtime_changed``) reads it
#: anew.  Registered by whoever keeps it (:func:`kvsan.hooks.use_native`).
_WATCHERS: list = []


def set_runtime(rt: Runtime | None) -> None:
    global _runtime
    _runtime = rt
    for watcher in _WATCHERS:
        watcher(rt)


#: the parent's runtime, between a fork and the moment the child knows who
#: it is (see :func:`_after_fork_in_child`)
_forked_from: Runtime | None = None


def _forked_by_multiprocessing() -> bool:
    """Whether this fork is multiprocessing's (``Process.start`` with the
    fork method): the child's name, hence its role, is set only later, by
    its bootstrap, which then runs :func:`_child_named`."""
    import sys

    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.endswith(("multiprocessing/popen_fork.py",
                                          "multiprocessing/forkserver.py")):
            return True
        f = f.f_back
    return False


def _after_fork_in_child() -> None:
    """A forked child inherits the parent's runtime (and the patched classes,
    and vLLM's "plugins loaded" flag: ``register`` is not called again).
    Nothing of the parent's is kept: its runtime is set aside at once (no
    hook records into it: its report descriptor, counters, pools and role
    are the parent's).  A child multiprocessing starts (how vLLM forks its
    EngineCore and workers) gets kvsan again
    (:func:`set_fork_installer`) once its bootstrap named it
    (``EngineCore``, ``VllmWorker-N``).  A bare ``os.fork`` child does
    not: those are other libraries' helpers, most about to ``exec``
    (Ray's ``ray.init`` starts five), and each would write a report of an
    engine process that never set up a pool, which the CI gate reads as
    an engine that died while starting."""
    global _forked_from
    rt = _runtime
    if rt is None or rt.pid == os.getpid():
        return
    set_runtime(None)
    if rt.reporter._sink is not None:
        rt.reporter._sink.forget_inherited()
    _forked_from = rt if _forked_by_multiprocessing() else None


def _child_named(_obj=None) -> None:
    global _forked_from
    parent, _forked_from = _forked_from, None
    if parent is None or _runtime is not None or _install_forked is None:
        return
    _install_forked(parent)


class _AfterFork:  # (multiprocessing keeps a weak reference to the object)
    pass


_AFTER_FORK = _AfterFork()
os.register_at_fork(after_in_child=_after_fork_in_child)
multiprocessing.util.register_after_fork(_AFTER_FORK, _child_named)
