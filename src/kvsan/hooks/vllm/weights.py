"""vLLM adapter for weight changes (EngineCore): when to fingerprint the
weights, and how to reach them.

Trainers update a running engine's weights under many names and shapes: a
named RPC (``update_weights``, ``reload_weights``), a callable passed to
``collective_rpc``, a worker-extension method (``update_named_param``), an
in-process ``model.load_weights``, ``sleep(level=2)`` then ``wake_up``.
kvsan does not guess from names.  It fingerprints the parameters in every
worker (:mod:`kvsan.checks.weights`) and starts a new weights epoch of the
identity audit when the fingerprint moves:

* after every ``EngineCore.collective_rpc``, whatever its method, and after
  ``set_weight_version`` and ``wake_up``: a full fingerprint through one
  more ``collective_rpc`` of the executor (every rank answers);
* when the engine turns from idle to busy (``EngineCore.add_request`` with no
  request in the scheduler) and the worker is in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or a single-GPU executor inside the
  EngineCore): a quick fingerprint, a direct call.  This is what sees a
  ``load_weights`` made on the model without any RPC.  A worker in another
  process is reached only through an RPC, and such an RPC is fingerprinted.

While the executor sleeps its weights may be away: the fingerprint waits
for the wake-up.  Where no fingerprint can be taken (no model reachable),
the names of the known weight-update RPCs and ``set_weight_version`` still
start a new epoch: the names are the fallback, not the rule.
"""

from __future__ import annotations

import weakref

from ... import runtime as _rt
from ...checks.weights import WeightsEpoch, fingerprint
from .. import Target, guard_failed, instrument, uninstrument
from ..contract import Contract
from . import identity as _identity

#: RPC method names that update weights in vLLM and its usual trainers: an
#: epoch starts on them where no fingerprint can be taken
WEIGHT_RPCS = ("update_weights", "finish_weight_update", "reload_weights", "load_weights",
               "update_weights_from", "init_weight_transfer", "update_named_param")

_MODULE = "vllm.v1.engine.core"


def _bump(why: str) -> None:
    epoch = _identity.bump_weights_epoch()
    rt = _rt.get()
    if rt is not None:
        rt.reporter.event("kvsan.weights_epoch", epoch=epoch, reason=why, step=rt.step)


class _EngineWeights(WeightsEpoch):
    """One engine's fingerprints, and whether one is owed (an RPC or a
    wake-up ran while its executor slept)."""

    def __init__(self):
        super().__init__(_bump)
        self.owed = False


#: EngineCore -> its fingerprints (a new engine in this process takes its own
#: baseline)
_engines: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _of(core) -> _EngineWeights:
    w = _engines.get(core)
    if w is None:
        w = _engines[core] = _EngineWeights()
    return w


def worker_fingerprint(worker, full: bool):
    """Run in each worker (a callable RPC): the fingerprint of the model it
    serves, or None where no model is reachable."""
    w = getattr(worker, "worker", worker)  # (WorkerWrapperBase -> its worker)
    runner = getattr(w, "model_runner", None)
    get = getattr(runner, "get_model", None)
    try:
        model = get() if get is not None else getattr(runner, "model", None)
    except (AttributeError, AssertionError, RuntimeError):
        model = None
    if model is None or not hasattr(model, "named_modules"):
        return None
    tensors = _tensors_of.get(model)
    if tensors is None or full:  # (a reload may replace tensors: found again)
        kv = {_storage(t) for t in _flat(getattr(runner, "kv_caches", None))}
        tensors = _tensors_of[model] = weight_tensors(model, kv)
    return fingerprint(tensors, full)


def _flat(caches):
    """The tensors of a runner's ``kv_caches`` (a list, maybe nested)."""
    for c in caches or ():
        if isinstance(c, (list, tuple)):
            yield from _flat(c)
        elif hasattr(c, "untyped_storage"):
            yield c


#: model -> its weight tensors (:func:`weight_tensors`), found again at
#: every full fingerprint
_tensors_of: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def weight_tensors(model, skip: set | None = None) -> list:
    """``(name, tensor)`` of every weight the model computes with: its
    parameters and buffers, and tensors captured by its modules' kernel
    closures (vLLM's CPU backend repacks some linear weights into such a
    closure and empties the parameter).  Not the other tensors a module
    keeps as plain attributes: its KV cache and the LoRA slots (which the
    identity audit follows as adapters) live there and change with
    traffic.  ``skip``: storage addresses never to take (the KV caches).
    Weights held only inside an opaque library handle (the CPU backend's
    oneDNN matmul) cannot be read: see the README's limits."""
    import torch

    out, seen = [], set()
    skip = skip or set()

    def add(name, t):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            if t.device.type == "meta" or _storage(t) not in skip:
                out.append((name, t))

    for name, t in model.named_parameters():
        add(name, t)
    for name, t in model.named_buffers():
        add(name, t)
    for mname, mod in model.named_modules():
        for attr, v in vars(mod).items():
            cells = getattr(v, "__closure__", None) if callable(v) else None
            for i, cell in enumerate(cells or ()):
                try:
                    add(f"{mname}.{attr}#{i}", cell.cell_contents)
                except ValueError:  # (an empty cell)
                    pass
    return out


def _storage(t) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


def _combine(answers) -> tuple[bytes | None, bytes | None]:
    """Every rank's (quick, full) in one: None when any rank had no model
    (or the executor answered something other than one result per rank)."""
    if not isinstance(answers, (list, tuple)) or not answers or any(
            not isinstance(a, (tuple, list)) or len(a) != 2 for a in answers):
        return None, None
    quick = b"".join(a[0] for a in answers)
    full = None if any(a[1] is None for a in answers) else b"".join(a[1] for a in answers)
    return quick, full


def _sleeping(executor) -> bool:
    try:
        return bool(executor.is_sleeping)
    except AttributeError:
        return False


def settle(core, why: str, full: bool = True, fallback: bool = False) -> None:
    """Fingerprint the weights of ``core``'s workers and compare.
    ``fallback``: start an epoch when no fingerprint can be taken."""
    executor = getattr(core, "model_executor", None)  # (RPCs made during its set-up)
    if executor is None:
        return
    w = _of(core)
    if _sleeping(executor):
        w.owed = True
        return
    w.owed = False
    quick, fp = _combine(executor.collective_rpc(worker_fingerprint, args=(full,)))
    if quick is None:
        if fallback:
            _bump(f"{why} (no fingerprint)")
        return
    w.observe(quick, fp, why)


def _guarded(why: str, core, **kw) -> None:
    rt = _rt.get()
    if rt is None:
        return
    try:
        settle(core, why, **kw)
    except Exception as e:  # noqa: BLE001 - report first, never mask
        guard_failed(rt, "weights.fingerprint", e)


def _method_name(method) -> str:
    if isinstance(method, str):
        return method
    return getattr(method, "__qualname__", None) or type(method).__name__


def _collective_rpc(wrapped, instance, args, kwargs):
    method = args[0] if args else kwargs.get("method")
    try:
        return wrapped(*args, **kwargs)
    finally:  # (an RPC that failed half-way may have changed weights too)
        _guarded(f"collective_rpc:{_method_name(method)}", instance,
                 fallback=isinstance(method, str) and method.startswith(WEIGHT_RPCS))


def _set_weight_version(wrapped, instance, args, kwargs):
    ret = wrapped(*args, **kwargs)
    _guarded("set_weight_version", instance, fallback=True)
    return ret


def _wake_up(wrapped, instance, args, kwargs):
    """A wake-up that restores weights may bring others than went to sleep.
    One whose tags leave the weights out (``["kv_cache"]``, what
    ``release_kv_cache_memory`` undoes; ``["scheduling"]``) cannot change
    them, and costs no fingerprint."""
    ret = wrapped(*args, **kwargs)
    tags = kwargs.get("tags", args[0] if args else None)
    if tags is None or "weights" in tags:
        _guarded("wake_up", instance)
    return ret


def _add_request(wrapped, instance, args, kwargs):
    """The engine turns busy.  Fingerprint first when there is no baseline
    yet (the engine's first request: one full fingerprint), when one is owed,
    or, with the worker in this process, at every turn from idle (a quick
    fingerprint, a direct call)."""
    if _rt._runtime is not None:
        w = _engines.get(instance)
        if w is None or w.owed:
            _guarded("first_request" if w is None else "owed", instance)
        elif hasattr(instance.model_executor, "driver_worker"):
            sched = getattr(instance, "scheduler", None)
            if sched is not None and not sched.requests:
                _guarded("idle_to_busy", instance, full=False)
    return wrapped(*args, **kwargs)


def targets() -> list[Target]:
    return [
        Target(_MODULE, "EngineCore.collective_rpc", _collective_rpc),
        Target(_MODULE, "EngineCore.set_weight_version", _set_weight_version),
        Target(_MODULE, "EngineCore.wake_up", _wake_up),
        Target(_MODULE, "EngineCore.add_request", _add_request, subclasses=True),
    ]


def install() -> list[str]:
    installed, _ = instrument(targets())
    return installed


def uninstall() -> None:
    uninstrument(targets())
    _engines.clear()


#: what the weights check relies on in vLLM (:mod:`kvsan.hooks.contract`)
CONTRACT = Contract(
    adapter="weights",
    check="the weights check (cached blocks kept across a weight change)",
    methods={
        f"{_MODULE}:EngineCore.collective_rpc": ("method",),
        f"{_MODULE}:EngineCore.set_weight_version": (),
        f"{_MODULE}:EngineCore.wake_up": (),
        f"{_MODULE}:EngineCore.add_request": (),
    },
    attrs={f"{_MODULE}:EngineCore": ("model_executor", "scheduler"),
           "vllm.v1.core.sched.scheduler:Scheduler": ("requests",)},
)
