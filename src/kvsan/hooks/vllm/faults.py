"""Built-in lifetime faults injected into vLLM, for demos, reproductions and
kvsan's own tests (``KVSAN_INJECT=<name>`` or ``kvsan demo --inject``).

Each fault is a real bug of a kind seen in serving engines (see the prior-art
notes), patched through kvsan's one patcher (:func:`kvsan.hooks.instrument`,
restored by :func:`clear` or kvsan's uninstall) *outside* kvsan's hooks, so
kvsan observes the engine exactly as it would observe the buggy engine.
"""

from __future__ import annotations

_KVM = "vllm.v1.core.kv_cache_manager"
_BP = "vllm.v1.core.block_pool"


def _aborted(request) -> bool:
    return getattr(getattr(request, "status", None), "name", "") == "FINISHED_ABORTED"


def _double_unref_on_abort(wrapped, instance, args, kwargs):
    """Cancel path drops the request's references to shared prefix blocks
    twice (vLLM #42571 / SGLang #18694 shape): a block another request still
    reads goes back to the free queue."""
    request = args[0] if args else kwargs["request"]
    blocks = list(instance.get_blocks(request.request_id).blocks[0]) if _aborted(request) else []
    ret = wrapped(*args, **kwargs)
    shared = [b for b in blocks if b.ref_cnt > 0 and not b.is_null]
    if shared:
        instance.block_pool.free_blocks(shared)
    return ret


def _leak_on_abort(wrapped, instance, args, kwargs):
    """Cancel path never returns the request's blocks (vLLM #16662 shape)."""
    request = args[0] if args else kwargs["request"]
    if _aborted(request):
        return None
    return wrapped(*args, **kwargs)


def _touch_without_ref(wrapped, instance, args, kwargs):
    """A prefix hit that takes no reference (vLLM #37076 shape): the block
    can be freed and reused while the hitting request still reads it."""
    ret = wrapped(*args, **kwargs)
    for b in args[0] if args else kwargs["blocks"]:
        if not b.is_null:
            b.ref_cnt -= 1
    return ret


def _prompt_sent_wrong(wrapped, instance, args, kwargs):
    """The worker is sent a new request's prompt with its first token
    changed (the shape of a transport or serialization bug between the
    scheduler and its workers): the worker's copy of the request, and the
    KV it computes, are not those of the tokens the scheduler caches the
    request's blocks under, so every later prefix hit on them reads wrong
    KV under a right key (cache poisoning, no lifetime error)."""
    data = wrapped(*args, **kwargs)
    tokens = getattr(data, "prompt_token_ids", None)
    if tokens:
        tokens = list(tokens)
        tokens[0] = tokens[0] + 1 if tokens[0] < 2 ** 20 else tokens[0] - 1
        data.prompt_token_ids = tokens
    return data


#: what :func:`_scribble_sealed` did, once per process: (block, request)
_scribbled: list = []
#: the worker rank a worker fault is limited to (``@rankN``), or None:
#: checked when the fault fires, against the rank kvsan then knows (a Ray
#: worker's is known only once its runner is hooked)
_only_rank: int | None = None


def _scribble_sealed(wrapped, instance, args, kwargs):
    """A worker writes into a block of the prefix cache outside any slot
    mapping (a stray kernel, a bad copy, a buffer overrun from another
    tensor), on its own shard of the cache only: the first block that a
    running request filled with its prompt's end and its first outputs at
    least two steps ago (sealed, and no other request's: its tokens are
    its own) gets +1 in layer 0, before the step's forward.  Once per
    process; with ``@rankN`` only in that worker (:func:`target`).  The
    block and its request go to the report as ``kvsan.fault_applied``."""
    if not _scribbled and _rank_matches():
        so = args[0] if args else kwargs["scheduler_output"]
        cr = so.scheduled_cached_reqs
        bs = instance.cache_config.block_size
        for rid, done in zip(cr.req_ids, cr.num_computed_tokens):
            state = instance.requests.get(rid)
            if state is None or rid in cr.resumed_req_ids:
                continue
            i = len(state.prompt_token_ids or ()) // bs
            blocks = state.block_ids[0]
            if done >= (i + 1) * bs + 2 and i < len(blocks) and getattr(instance, "kv_caches", None):
                from vllm.v1.kv_cache_interface import group_kernel_blocks

                caches = instance.kv_caches
                first = next(iter(caches.values())) if isinstance(caches, dict) else caches[0]
                group_kernel_blocks(first, instance.kv_cache_config.num_blocks)[blocks[i]] += 1.0
                _scribbled.append((blocks[i], rid))
                from ... import runtime as _rt

                rt = _rt.get()
                if rt is not None:
                    rt.reporter.event("kvsan.fault_applied", fault="scribble_sealed",
                                      block=blocks[i], request=rid)
                break
    return wrapped(*args, **kwargs)


def _rank_matches() -> bool:
    """Whether this worker is the one ``@rankN`` names (any, without it)."""
    if _only_rank is None:
        return True
    from ... import runtime as _rt

    rt = _rt.get()
    return rt is not None and rt.rank == _only_rank


FAULTS = {
    "double_unref_on_abort": (_KVM, "KVCacheManager.free", _double_unref_on_abort),
    "leak_on_abort": (_KVM, "KVCacheManager.free", _leak_on_abort),
    "touch_without_ref": (_BP, "BlockPool.touch", _touch_without_ref),
    "prompt_sent_wrong": ("vllm.v1.core.sched.output", "NewRequestData.from_request",
                          _prompt_sent_wrong),
    "scribble_sealed": ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model",
                        _scribble_sealed),
}

#: faults of the worker side: injected where the model runner runs (a
#: worker process, or the process of an in-process engine), patched when
#: its module is imported; ``<name>@rankN`` limits one to the worker of
#: rank N in its engine (tensor / pipeline parallel)
WORKER_FAULTS = {"scribble_sealed"}

#: the kind each fault is expected to show up as (the one its harm is named
#: by; a fault may report others with it: ``double_unref_on_abort``, charged
#: to the aborted request, is a ``double_release`` too)
EXPECTED = {
    "double_unref_on_abort": "free_with_live_owners",
    "leak_on_abort": "leaked_blocks",
    "touch_without_ref": "free_with_live_owners",
    "prompt_sent_wrong": "input_token_mismatch",
    "scribble_sealed": "checksum_mismatch",
}


def target(spec: str) -> tuple[str, int | None]:
    """``KVSAN_INJECT``'s value as (fault, rank or None): ``name`` or, for
    a worker fault, ``name@rankN``."""
    name, sep, where = spec.strip().partition("@")
    if not sep:
        return name, None
    if name not in WORKER_FAULTS or not (where.startswith("rank") and where[4:].isdigit()):
        raise ValueError(f"KVSAN_INJECT={spec!r} is not accepted; @rankN follows a worker "
                         f"fault only ({', '.join(sorted(WORKER_FAULTS))})")
    return name, int(where[4:])


def applies(spec: str, role: str, rank: int) -> bool:
    """Whether the fault ``spec`` is injected in a process of ``role`` and
    ``rank``: a scheduler fault where the scheduler may run (not in a
    worker), a worker fault where a runner may run, of that rank."""
    name, only_rank = target(spec)
    if name not in WORKER_FAULTS:
        return role != "worker"
    if only_rank is None or only_rank == rank:
        return True
    # where the process name carries no rank (a Ray actor's; a front end,
    # whose in-process engine an external launcher may have made one rank
    # of several) the fault decides when it fires, once the runner told
    # kvsan the rank (:func:`_rank_matches`)
    if role == "frontend":
        return True
    from .processes import ray_actor_class

    return role == "worker" and ray_actor_class() is not None

_active: list = []  # the fault's Target, while injected


def _request_id(args, kwargs) -> str | None:
    req = args[0] if args else kwargs.get("request")
    rid = getattr(req, "request_id", None)
    if rid is None:  # a pool primitive: the request kvsan's hooks attribute it to
        from ... import runtime as _rt
        from .. import owner_here

        rt = _rt.get()
        rid = owner_here(rt) if rt is not None else None
    return rid


def _only(wrapper, only: str):
    """Apply ``wrapper`` only to calls for requests whose id contains ``only``
    (``KVSAN_INJECT_ONLY``): a fault a test can trigger on a live server."""

    def gated(wrapped, instance, args, kwargs):
        rid = _request_id(args, kwargs)
        if rid is None or only not in rid:
            return wrapped(*args, **kwargs)
        return wrapper(wrapped, instance, args, kwargs)

    return gated


def inject(name: str, only: str | None = None) -> None:
    """Inject a built-in fault.  ``only`` (default: ``KVSAN_INJECT_ONLY``)
    limits it to requests whose id contains that string; with vLLM's
    OpenAI server a client picks its request id with ``X-Request-Id``."""
    if only is None:
        import os

        only = os.environ.get("KVSAN_INJECT_ONLY", "").strip() or None
    global _only_rank
    name, rank = target(name)
    if name not in FAULTS:
        raise ValueError(
            f"KVSAN_INJECT={name!r} is not a built-in fault; accepted: {', '.join(FAULTS)}"
        )
    if _active:
        return  # one fault per process (a forked child inherits it)
    _only_rank = rank
    module, qualname, wrapper = FAULTS[name]
    import importlib

    from ... import hooks

    wrapper = _only(wrapper, only) if only and name not in WORKER_FAULTS else wrapper
    fault = hooks.Target(module, qualname, wrapper)
    _active.append(fault)

    def patch(_mod=None):
        if fault in _active:  # (not cleared before the module was imported)
            hooks.instrument([fault])  # the outermost patch: kvsan's hooks are below it

    if name in WORKER_FAULTS:  # where (if) this process imports the runner
        hooks.when_imported(patch, module)
        return
    importlib.import_module(module)
    patch()


def clear() -> None:
    """Take the injected fault out (kvsan's own hooks stay)."""
    from ... import hooks

    if _active:
        hooks.uninstrument(list(_active))
        _active.clear()
    _scribbled.clear()
    global _only_rank
    _only_rank = None
