"""vLLM adapter, device side (worker process; in-process mode and CUDA's
single-process executor run it inside the EngineCore or front end).

Hooks at step level, never inside the forward: under full CUDA-graph replay
Python inside the model does not run, but the step's inputs, slot mapping,
block tables and cache tensors are all visible around ``execute_model``.

* V1 runner (CPU, CUDA fallback): ``execute_model`` (step context, hit
  verification, poison) and ``_prepare_inputs`` (the write guard on the
  slot mapping the forward will use).
* V2 runner (CUDA default): ``execute_model`` (step context, checksums,
  poison) and ``prepare_attn`` (the write guard on the slot mappings its
  Triton kernel built).  Run on vLLM's CPU V2 runner (its kernels in
  Triton's interpreter: tests/test_v2_runner.py); not yet on a GPU.
* Both: a cached block vLLM evicts is verified when the step that reuses
  it begins, before its forward writes the block's new contents.
* Both: sealing after the step: where ``execute_model`` hands the step on
  to ``sample_tokens`` (vLLM 0.32 always does; the drafter of speculative
  decoding writes its layers' KV there), when the runner's next step
  begins, else at the end of ``execute_model``.
* Both: ``shutdown``, where what is still on its way from the device (on a
  GPU in log mode: the last step's guard and checksums) is checked before
  the cache is released.
"""

from __future__ import annotations

import functools
import operator
import weakref
from time import perf_counter as _perf_counter

from ... import hooks as _hooks
from ... import runtime as _rt
from ...checks import native
from ...checks.device import DeviceChecker
from ...checks.device.loads import ConnectorLoads
from .. import Target, guard_failed
from . import adapters
from . import inputs as vllm_inputs
from .processes import engine_index
from .. import guard as _guard
from ..contract import Contract

_V1 = "vllm.v1.worker.gpu_model_runner"
_V2 = "vllm.v1.worker.gpu.model_runner"

_checkers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: runner -> (its cache tensors, their block-major views)
_layer_views: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: one-entry caches in front of those two: [weak ref to the runner, value].
#: A WeakKeyDictionary lookup makes a weak reference per call, and between
#: two forward passes every such call costs several µs (cold caches).
_LAST_CHECKER: list = [None, None]
_LAST_LAYERS: list = [None, None]


def _cached(last: list, table, runner):
    ref = last[0]
    if ref is not None and ref() is runner:
        return last[1]
    value = table.get(runner)
    if value is not None:
        last[:] = [weakref.ref(runner), value]
    return value


def _layers(runner) -> list:
    """Block-major views of the runner's cache tensors, built once per cache
    allocation rather than twice per step; rebuilt when the tensors change
    (vLLM allocates new tensors when it reallocates the cache).  Kept with
    the tensors themselves, so a new tensor is told by identity (the kept
    ones stay alive: no id can be reused)."""
    caches = runner.kv_caches
    tensors = caches.values() if isinstance(caches, dict) else caches
    ref = _LAST_LAYERS[0]  # (_cached, inline: this runs every step)
    cached = _LAST_LAYERS[1] if ref is not None and ref() is runner \
        else _cached(_LAST_LAYERS, _layer_views, runner)
    if cached is not None and len(cached[0]) == len(tensors) \
            and all(map(operator.is_, cached[0], tensors)):
        return cached[1]
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    nb = runner.kv_cache_config.num_blocks
    entry = _layer_views[runner] = (tuple(tensors), [group_kernel_blocks(t, nb) for t in tensors])
    _LAST_LAYERS[:] = [weakref.ref(runner), entry]
    return entry[1]


#: :func:`_guard` for the worker side's checks: ``_dguard(rt, where, fn,
#: *args)``, its time also added to ``rt.device_s``.  A partial, not a
#: wrapper function: it runs a few times per step between forward passes,
#: where every Python frame is a cache miss.
_dguard = functools.partial(_guard, device=True)


def unfollowed(kv_cache_config, dcp_world_size: int = 1) -> str | None:
    """Why the worker view cannot follow this cache, or None.  It follows
    group 0 where that is decoder attention written through the slot
    mappings (full attention and MLA, sliding window, chunked local, and
    their subclasses), whose blocks leave a running request only as the
    scheduler's journal says.  A hybrid model's group 0 may be Mamba or
    linear attention (no slot mapping: the V1 guard would read a mapping of
    zeros and report every write), an encoder's, or a kind whose blocks
    move in ways the journal does not carry; decode context parallelism
    splits a scheduler block over ranks.  The device side is then off for
    that runner, said once: reporting legal traffic would be worse than
    not checking it."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    groups = kv_cache_config.kv_cache_groups
    if not groups:
        return "no KV cache group"
    spec = groups[0].kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    specs = list(inner.values()) if inner else [spec]
    followed = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)
    other = sorted({type(s).__name__ for s in specs if not isinstance(s, followed)})
    if other:
        return f"KV cache group 0 is {', '.join(other)}"
    if dcp_world_size > 1:
        return f"decode context parallel size {dcp_world_size}"
    return None


def _dcp_size(runner) -> int:
    """The runner's decode context parallel size (V1 and V2 both keep the
    parallel config; their own attributes differ)."""
    cfg = getattr(runner, "parallel_config", None)
    size = getattr(cfg, "decode_context_parallel_size", None)
    if size is None:
        size = getattr(runner, "dcp_world_size", None) or getattr(runner, "dcp_size", 1)
    return int(size or 1)


#: runners whose cache the worker view cannot follow (see :func:`unfollowed`)
_unfollowed: "weakref.WeakSet" = weakref.WeakSet()


def _device_checker(rt, runner) -> DeviceChecker | None:
    dc = _cached(_LAST_CHECKER, _checkers, runner)
    if dc is None:
        if not getattr(runner, "kv_caches", None):
            return None  # KV cache not allocated yet (profiling / warm-up)
        if runner in _unfollowed:
            return None
        _identify(rt, runner)
        cfg = runner.kv_cache_config
        why = unfollowed(cfg, _dcp_size(runner))
        if why is not None:
            _unfollowed.add(runner)
            rt.reporter.event("kvsan.device_off", reason=why)
            return None
        layers = _layers(runner)
        dc = DeviceChecker(
            cfg.num_blocks,
            cfg.kv_cache_groups[0].kv_cache_spec.block_size,
            emit=rt.reporter.emit,
            step=rt.get_step,
            checksum=rt.config.checksum,
            checksum_sample=rt.config.checksum_sample,
            poison=rt.config.poison,
            device=layers[0].device if layers else "cpu",
            # on a GPU, log mode checks the step's slot mapping and checksums
            # as they arrive, never stalling the step; raise and abort modes
            # wait for them, so a violation stops the step it is found in
            defer_guard=None if rt.config.mode == "log" else False,
            defer_sums=None if rt.config.mode == "log" else False,
        )
        if _has_connector():
            _loads[dc] = ConnectorLoads(_prefix_caching(runner))
        inputs = vllm_inputs.install(dc, runner)
        reads = vllm_inputs.record_reads(dc, runner)
        rows = vllm_inputs.block_rows(dc, runner)
        _checkers[runner] = dc
        # which checks this runner gets (some are off on some set-ups: a
        # user reading a clean report must be able to tell), once
        rt.reporter.event("kvsan.device_on",
                          runner=type(runner).__name__, device=str(dc.device),
                          num_blocks=dc.num_blocks, block_size=dc.block_size,
                          checksum=dc.checksum, checksum_sample=dc.checksum_sample,
                          poison=dc.poison_on, write_guard=True,
                          input_tokens="recorded" if dc.fed_tokens is not None
                          else "batch rows" if inputs else "off",
                          read_extents=reads, block_rows=rows,
                          # a KV connector's loads are sealed and verified
                          kv_connector=dc in _loads)
    return dc


def parallel_identity(runner) -> tuple[int, int] | None:
    """``(engine, rank)`` of the worker running ``runner``, from vLLM's own
    state: the data-parallel engine index of its parallel config, and its
    rank in its engine's world (TP x PP x PCP; vLLM's world group spans the
    DP engines of a MoE model, and an external launcher's, hence the
    modulo).  None before vLLM's parallel groups exist (a runner outside
    a worker's set-up)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    cfg = runner.parallel_config
    # (one engine's world: an external launcher's ``world_size`` also
    # counts its data-parallel ranks)
    per_engine = (int(cfg.pipeline_parallel_size) * int(cfg.tensor_parallel_size)
                  * int(getattr(cfg, "prefill_context_parallel_size", 1) or 1))
    rank = ps.get_world_group().rank_in_group % max(per_engine, 1)
    return engine_index(cfg), int(rank)


def _identify(rt, runner) -> None:
    """Set the process's engine and rank (on every later record and metric)
    once, when its runner's checker is made: vLLM's parallel state is the
    authority; the process name gave the first guess.  A runner in a front
    end or an EngineCore is its in-process engine's: 0 and 0 for one engine,
    its data-parallel index and rank where an external launcher (torchrun)
    made each process one rank of a data- or tensor-parallel deployment."""
    try:
        got = parallel_identity(runner)
        if got is not None:
            _rt.set_identity(rt, *got)
    except Exception as e:  # noqa: BLE001 - the process name's guess stays
        try:
            rt.reporter.internal_error("worker identity", e)
        except Exception:  # noqa: BLE001 - never raised into vLLM for this
            pass


def _begin(rt, runner, so):
    """The step's start, before the forward: the runner's checker and cache
    tensors (read once for both ends of the step), then :func:`begin_step`.
    Returns (checker, layers) for sealing after the forward, or None before
    the KV cache is allocated.  Between two forward passes every Python
    frame is a cache miss: the checker's one-entry cache is read inline."""
    ref = _LAST_CHECKER[0]
    dc = _LAST_CHECKER[1] if ref is not None and ref() is runner else _device_checker(rt, runner)
    if dc is None:
        return None
    layers = _layers(runner)
    begin_step(rt, dc, so, layers)
    return dc, layers


def begin_step(rt, dc: DeviceChecker, so, layers: list) -> None:
    """Apply what the scheduler sent for this step, before the forward."""
    payload = getattr(so, "kvsan", None)
    if payload is not None:
        rt.step = payload["step"]
    else:
        rt.step += 1
    bs = dc.block_size
    if so.finished_req_ids:
        dc.drop_requests(so.finished_req_ids)
    preempted = getattr(so, "preempted_req_ids", None)
    if preempted:
        dc.drop_requests(preempted)
    if payload is not None:
        if payload["reset"]:
            dc.uncache_all()
        if payload["uncached"]:
            # evicted (most to be handed out again this step): the sealed
            # ones are verified now, before this step's forward rewrites them
            # (a scribble on a cached block nobody holds is reported, with
            # whoever last held it, instead of being lost with it)
            dc.uncache(payload["uncached"], layers)
        for rid, blocks in payload.get("dropped", ()):  # a window moved past them
            dc.release_blocks(rid, blocks)
    new_reqs = so.scheduled_new_reqs
    if new_reqs:
        dc.drop_requests([nr.req_id for nr in new_reqs])  # V2 sends resumed requests as new ones
        adds = [(nr.req_id, nr.block_ids[0], *divmod(nr.num_computed_tokens, bs))
                for nr in new_reqs]
    else:
        adds = []
    cr = so.scheduled_cached_reqs
    # (vLLM 0.34 has no resumed_req_ids: it sends a resumed request in full
    # among the new ones, handled above; 0.30 to 0.33 list it here)
    resumed = getattr(cr, "resumed_req_ids", None)
    if resumed:
        for i, rid in enumerate(cr.req_ids):
            new = cr.new_block_ids[i]
            if rid in resumed:
                dc.drop_request(rid)
                adds.append((rid, new[0] if new else [], *divmod(cr.num_computed_tokens[i], bs)))
            elif new is not None:
                adds.append((rid, new[0], 0))
    else:  # every running request is listed each step; most have no new block
        news = cr.new_block_ids
        if news.count(None) != len(news):
            adds += [(rid, new[0], 0) for rid, new in zip(cr.req_ids, news) if new is not None]
    hits, fresh = dc.add_step(adds, layers) if adds else ((), ())
    loads = _loads.get(dc) if _loads else None
    if loads is not None and payload is not None:
        loads.step(dc, hits, payload)
    copies = getattr(so, "kv_cache_block_copies", None)
    if copies:
        dc.copy_fill([(c.src_block_id, c.dst_block_id) for c in copies])
    if payload is not None:
        if payload["cached"]:
            dc.will_seal(payload["cached"], payload.get("links"))
        if dc.poison_on:
            dc.unpoison(layers, fresh)
            # a block handed out again in this same step is overwritten, not
            # read; one a window moved past stays in its request's block
            # table, where an attention kernel may still load it, masked
            # (NaN times a zero weight is NaN): neither is poisoned
            handed = set(fresh)
            for _, blocks in payload.get("dropped", ()):
                handed.update(blocks)
            dc.poison(layers, [b for b in payload["freed"] if b not in handed])
        if hits:
            # (a connector's loads are told apart from hits with the journal,
            # above; without a journal they cannot be: hits go unchecked)
            if loads is None or payload is not None:
                dc.note_hits(hits)
                dc.verify_step(layers, [b for _, b in hits])
                return
        elif dc.step_hits:  # noted in a step whose guard did not run: not this step's
            dc.note_hits(())
    dc.verify_step(layers)


#: the device checkers of runners with a KV connector -> their ConnectorLoads
_loads: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _prefix_caching(runner) -> bool:
    cfg = getattr(runner, "cache_config", None)
    return bool(getattr(cfg, "enable_prefix_caching", True))


#: vLLM's ``has_kv_transfer_group``, imported on first use (an import
#: statement run every step costs more than the call)
_has_kv_transfer_group = None


def _has_connector() -> bool:
    global _has_kv_transfer_group
    try:
        if _has_kv_transfer_group is None:
            from vllm.distributed.kv_transfer import has_kv_transfer_group

            _has_kv_transfer_group = has_kv_transfer_group
        return _has_kv_transfer_group()
    except Exception:  # noqa: BLE001
        return False


#: id(runner) -> (weak ref to it, checker, layers): a step whose
#: ``execute_model`` returned None, sealed when the runner's next step begins
_unsealed: dict = {}


def _seal_left(rt, runner) -> None:
    """Seal the runner's previous step, if it is still unsealed."""
    left = _unsealed.pop(id(runner), None)
    if left is not None and left[0]() is runner:
        _dguard(rt, "execute_model.seal", left[1].seal, left[2])


def _execute_model(wrapped, instance, args, kwargs):
    rt = _rt._runtime
    if rt is None:
        return wrapped(*args, **kwargs)
    if _unsealed:
        _seal_left(rt, instance)
    so = args[0] if args else kwargs["scheduler_output"]
    # guarded inline, as _dguard does (once per step: its two frames cost
    # more than the check when the caches are cold)
    t0 = _perf_counter()
    try:
        got = _begin(rt, instance, so)
    except Exception as e:  # noqa: BLE001 - report first, never mask
        got = None
        guard_failed(rt, "execute_model.begin", e)  # a violation (raise / abort) propagates
    finally:
        dt = _perf_counter() - t0
        rt.overhead_s += dt
        rt.device_s += dt
    ret = wrapped(*args, **kwargs)
    if got is not None:
        _step_ends(rt, instance, got[0], got[1], ret)
        if _hooks.HOOKFAST is not None:
            _hand_to_native(rt, type(instance))
    return ret


def _step_ends(rt, runner, dc: DeviceChecker, layers, ret) -> None:
    """After vLLM's ``execute_model`` of a step begun by kvsan."""
    if _loads:
        loads = _loads.get(dc)
        if loads is not None and loads.loaded:
            _dguard(rt, "execute_model.loads", loads.verify_after, dc, layers)
    if dc.rows_on:  # the rows as this step's attention read them
        _dguard(rt, "execute_model.rows", vllm_inputs.check_rows, runner, dc)
    if ret is None:
        # vLLM 0.32 finishes the step in sample_tokens, where a drafter
        # (EAGLE, MTP, a draft model) writes its own layers' KV for this
        # step's slots: sealed now, a block's checksums would miss those
        # bytes (a false checksum_mismatch).  vLLM runs sample_tokens
        # before the next execute_model, so the step is sealed there
        # (or at shutdown), with no hook of its own on the step's path.
        # Most steps cache no block: then there is nothing to seal.
        if dc.pending_seal or dc.pending_sums:
            _unsealed[id(runner)] = (weakref.ref(runner), dc, layers)
        # the step's write guard is still reported in the step (on a GPU
        # its slot mapping's copy was queued before the forward)
        if dc.pending_guard is not None:
            _dguard(rt, "execute_model.guard", dc.settle)
    else:
        _dguard(rt, "execute_model.seal", dc.seal, layers)


def _native_step_ends(rt, runner, dc: DeviceChecker, ret) -> None:
    """The native STEP hook's second half (``kvsan._native._hookfast``), for a
    quiet step it began whose checker has something left after vLLM's
    method (a seal, a deferred guard), or whose batch rows the runner
    moved (a request left out of the step, or added back): the cache
    tensors are read here."""
    layers = _dguard(rt, "execute_model.layers", _layers, runner)
    if layers is not None:
        _step_ends(rt, runner, dc, layers, ret)


def _native_guard(rt, runner, counts, got) -> None:
    """The native GUARD hook's second half: ``got`` False, the whole guard
    here (:func:`_guard_step`); None, ``guard_step`` declined the step;
    else the writes it found, to report (and the prefix hits it left)."""
    if got is False:
        _guard_step(rt, runner, counts)
        return
    dc = _cached(_LAST_CHECKER, _checkers, runner)
    if dc is None:
        return
    t0 = _perf_counter()
    try:
        if got is None:
            batch = runner.input_batch
            n = batch.num_reqs
            dc.guard(batch.block_table.block_tables[0].slot_mapping.gpu, batch.req_ids[:n],
                     _ints(counts[:n]))
        else:
            dc.guarded(got)
    except Exception as e:  # noqa: BLE001 - report first, never mask
        guard_failed(rt, "_prepare_inputs.guard", e)  # a violation (raise / abort) propagates
    finally:
        dt = _perf_counter() - t0
        rt.overhead_s += dt
        rt.device_s += dt


def _native_scrub(rt, runner, dc: DeviceChecker) -> None:
    """The native STEP hook's sampled checksums: a step it began whose
    sampled batch is due (guarded as the step's start is in
    :func:`_execute_model`)."""
    _dguard(rt, "execute_model.begin", _scrub, runner, dc)


def _scrub(runner, dc: DeviceChecker) -> None:
    dc.verify_step(_layers(runner))


def _hand_to_native(rt, cls) -> None:
    """From now on the native STEP and GUARD hooks on ``cls`` (when there
    are) begin quiet steps and guard the common ones themselves
    (kvsan._native._hookfast's step_call and guard_call), with this module's
    caches; any other step still comes here.  Inline (it runs after every
    step the Python hook began): a class attribute and a type check per
    hook when they are already handed."""
    hook_type = _hooks._HOOK_TYPE
    # after its own state (weak ref to the runtime, the one-entry checker
    # cache): the STEP hook the unsealed steps and the two Python calls it
    # makes (read here, not at import: benchmarks.workercost times them)
    for attr, rest in (("execute_model", (_unsealed, _seal_left, _native_scrub)),
                       ("_prepare_inputs", (None,))):
        hook = getattr(cls, attr, None)
        if type(hook) is hook_type:
            st = hook.state
            if st is None or st[0]() is not rt:
                hook.state = (weakref.ref(rt), _LAST_CHECKER, *rest)


def _ints(counts) -> list[int]:
    """Tokens per request as Python ints: one C call for vLLM's numpy
    arrays (an ``int()`` per element costs about 0.1 µs each)."""
    return counts.tolist() if hasattr(counts, "tolist") else [int(n) for n in counts]


def _prepare_inputs(wrapped, instance, args, kwargs):
    """V1: the write guard on the slot mapping ``_prepare_inputs`` filled
    for this step's batch (the native GUARD hook does the common step in C
    and hands the rest to :func:`_native_guard`)."""
    ret = wrapped(*args, **kwargs)
    rt = _rt._runtime
    if rt is not None:
        _guard_step(rt, instance, args[1] if len(args) > 1 else kwargs["num_scheduled_tokens"])
    return ret


def _guard_step(rt, runner, num_sched) -> None:
    """Guarded and read inline (once per step, between forward passes,
    where every Python frame is a cache miss)."""
    ref = _LAST_CHECKER[0]
    dc = _LAST_CHECKER[1] if ref is not None and ref() is runner \
        else _cached(_LAST_CHECKER, _checkers, runner)
    if dc is None:
        return
    t0 = _perf_counter()
    try:
        batch = runner.input_batch
        n = batch.num_reqs
        slots = batch.block_table.block_tables[0].slot_mapping.gpu
        rids = batch.req_ids
        # the common step (host memory, the same batch as the last guard) in
        # one C call; any other, or no kvsan._native._devicefast, in Python
        fast = dc._fast
        bad = fast.guard_step(dc, slots, rids, n, num_sched) if fast is not None else None
        if bad is None:
            dc.guard(slots, rids[:n], _ints(num_sched[:n]))
        else:
            dc.guarded(bad)
    except Exception as e:  # noqa: BLE001 - report first, never mask
        guard_failed(rt, "_prepare_inputs.guard", e)  # a violation (raise / abort) propagates
    finally:
        dt = _perf_counter() - t0
        rt.overhead_s += dt
        rt.device_s += dt


def _prepare_attn_v2(wrapped, instance, args, kwargs):
    """V2: the slot mappings ([groups, tokens], built on device by a Triton
    kernel) come back from ``prepare_attn``, outside any CUDA graph."""
    ret = wrapped(*args, **kwargs)
    rt = _rt.get()
    dc = _cached(_LAST_CHECKER, _checkers, instance) if rt is not None else None
    if dc is not None:
        def check():
            batch = args[0] if args else kwargs["input_batch"]
            n = batch.num_reqs
            counts = _ints(batch.num_scheduled_tokens[:n])
            if sum(counts) != batch.num_tokens:  # adaptive speculative verification:
                dc.count_writes(ret[1][0], batch.num_tokens)  # no per-token writers
                return
            dc.guard(ret[1][0], batch.req_ids[:n], counts)
        _dguard(rt, "prepare_attn.guard", check)
    return ret


def _shutdown(wrapped, instance, args, kwargs):
    """Before the runner releases its cache: check what is still on its way
    from the device (a deferred guard, checksums being copied back), so a
    violation of the last steps is reported, not lost with the process."""
    rt = _rt.get()
    dc = _checkers.get(instance) if rt is not None else None
    found = None
    try:
        if dc is not None:
            _seal_left(rt, instance)
            _dguard(rt, "shutdown.flush", dc.flush)
    except BaseException as e:  # noqa: BLE001 - a violation (raise mode): after vLLM's shutdown
        found = e
    finally:  # nothing of ours keeps the runner's cache alive
        _unsealed.pop(id(instance), None)
        forget_runner(instance)
    ret = wrapped(*args, **kwargs)  # releases the cache, whatever was found
    if found is not None:
        raise found
    return ret


def forget_runner(runner=None) -> None:
    """Drop the one-entry caches' references to ``runner`` (to every
    runner: None), so its cache tensors can be released (at shutdown; at
    uninstall)."""
    for last in (_LAST_CHECKER, _LAST_LAYERS):
        ref = last[0]
        if runner is None or (ref is not None and ref() is runner):
            last[:] = [None, None]
    if runner is None:
        _unsealed.clear()
    vllm_inputs.forget_rows()
    if native.DEVICEFAST is not None:  # the buffers guard_step holds between steps
        native.DEVICEFAST.release_held()


def targets() -> list[Target]:
    return [
        Target(_V1, "GPUModelRunner.execute_model", _execute_model, True,
               fast=("STEP", _native_step_ends)),
        Target(_V1, "GPUModelRunner._prepare_inputs", _prepare_inputs, True,
               fast=("GUARD", _native_guard)),
        Target(_V1, "GPUModelRunner.shutdown", _shutdown, True),
        *adapters.targets(),
    ]


def has_v1_runner() -> bool:
    """Whether the installed vLLM has the V1 model runner
    (``vllm/v1/worker/gpu_model_runner.py``): 0.30 to 0.33 do, and their CPU
    build's runner subclasses it; 0.34 removed it, leaving the V2 runner as
    the only GPU one (and the CPU build a standalone runner kvsan does not
    hook).  Found without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(_V1) is not None
    except (ImportError, ValueError):
        return False


def targets_v2() -> list[Target]:
    return [Target(_V2, "GPUModelRunner.execute_model", _execute_model, True),
            Target(_V2, "GPUModelRunner.prepare_attn", _prepare_attn_v2, True),
            Target(_V2, "GPUModelRunner.shutdown", _shutdown, True)]


#: what the worker-side checks rely on in vLLM's V1 runner
#: (:mod:`kvsan.hooks.contract`)
#: what :func:`begin_step` reads of the step the scheduler sends (either
#: runner).  ``CachedRequestData.resumed_req_ids`` is read where there is
#: one (0.30 to 0.33), not required: vLLM 0.34 sends a resumed request
#: among the new ones
_STEP_ATTRS = {
    "vllm.v1.core.sched.output:NewRequestData": ("req_id", "block_ids", "num_computed_tokens"),
    "vllm.v1.core.sched.output:CachedRequestData":
        ("req_ids", "new_block_ids", "num_computed_tokens"),
}

CONTRACT = Contract(
    adapter="worker-v1",
    check="the device checks on the V1 model runner (writes into freed or foreign blocks)",
    methods={
        f"{_V1}:GPUModelRunner.execute_model": ("scheduler_output",),
        f"{_V1}:GPUModelRunner._prepare_inputs": ("scheduler_output", "num_scheduled_tokens"),
        f"{_V1}:GPUModelRunner.shutdown": (),
        f"{adapters._MIXIN}:LoRAModelRunnerMixin._set_active_loras":
            ("prompt_lora_mapping", "token_lora_mapping", "lora_requests"),
    },
    attrs={
        f"{_V1}:GPUModelRunner":
            ("kv_caches", "kv_cache_config", "input_batch", "parallel_config"),
        "vllm.v1.worker.gpu_input_batch:InputBatch":
            ("num_reqs", "req_ids", "block_table",
             *adapters.ATTRS["vllm.v1.worker.gpu_input_batch:InputBatch"]),
        "vllm.lora.request:LoRARequest": adapters.ATTRS["vllm.lora.request:LoRARequest"],
        "vllm.v1.kv_cache_interface:KVCacheConfig": ("num_blocks", "kv_cache_groups"),
        **_STEP_ATTRS,
    },
)
#: the same for the V2 runner, which imports only where Triton works (not
#: on CPU builds): checked where it imports, reported unchecked elsewhere
CONTRACT_V2 = Contract(
    adapter="worker-v2",
    check="the device checks on the V2 model runner",
    optional=True,
    methods={
        f"{_V2}:GPUModelRunner.execute_model": ("scheduler_output",),
        f"{_V2}:GPUModelRunner.prepare_attn": ("input_batch",),
        f"{_V2}:GPUModelRunner.shutdown": (),
    },
    attrs={
        f"{_V2}:GPUModelRunner": ("kv_caches", "kv_cache_config"),
        "vllm.v1.worker.gpu.input_batch:InputBatch":
            ("num_reqs", "req_ids", "num_scheduled_tokens", "num_tokens"),
        **_STEP_ATTRS,
    },
)
