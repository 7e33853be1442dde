"""Built-in lifetime faults injected into vLLM, for demos, reproductions and
kvsan's own tests (``KVSAN_INJECT=<name>`` or ``kvsan demo --inject``).

Each fault is a real bug of a kind seen in serving engines (see the prior-art
notes), applied as a wrapt patch *outside* kvsan's hooks, so kvsan observes
the engine exactly as it would observe the buggy engine.
"""

from __future__ import annotations

import wrapt

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


FAULTS = {
    "double_unref_on_abort": (_KVM, "KVCacheManager.free", _double_unref_on_abort),
    "leak_on_abort": (_KVM, "KVCacheManager.free", _leak_on_abort),
    "touch_without_ref": (_BP, "BlockPool.touch", _touch_without_ref),
    "prompt_sent_wrong": ("vllm.v1.core.sched.output", "NewRequestData.from_request",
                          _prompt_sent_wrong),
}

#: what kvsan is expected to report first for each fault
EXPECTED = {
    "double_unref_on_abort": "free_with_live_owners",
    "leak_on_abort": "leaked_blocks",
    "touch_without_ref": "free_with_live_owners",
    "prompt_sent_wrong": "input_token_mismatch",
}

_active: list[tuple[object, str, object]] = []


def _request_id(args, kwargs) -> str | None:
    req = args[0] if args else kwargs.get("request")
    rid = getattr(req, "request_id", None)
    if rid is None:  # a pool primitive: the request kvsan's hooks attribute it to
        from . import runtime as _rt
        from .hooks.vllm_allocator import owner_here

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
    if name not in FAULTS:
        raise ValueError(
            f"KVSAN_INJECT={name!r} is not a built-in fault; accepted: {', '.join(FAULTS)}"
        )
    if _active:
        return  # one fault per process (a forked child inherits it)
    module, qualname, wrapper = FAULTS[name]
    import importlib

    cls_name, attr = qualname.split(".")
    cls = getattr(importlib.import_module(module), cls_name)
    _active.append((cls, attr, cls.__dict__[attr]))
    wrapt.wrap_function_wrapper(cls, attr, _only(wrapper, only) if only else wrapper)


def clear() -> None:
    while _active:
        cls, attr, original = _active.pop()
        setattr(cls, attr, original)
