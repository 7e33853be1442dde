"""vLLM adapter for the cache identity audit (EngineCore).

Producer identity when ``BlockPool.cache_full_blocks`` registers a block;
consumer identity when ``KVCacheCoordinator.allocate_new_computed_blocks``
hands a request its prefix hits (called only for a request that has hits,
not once per request per step as ``allocate_slots`` is; the Request itself
is read from the calling ``allocate_slots`` frame).  What vLLM's block hash
may leave out is tracked here from the truth: the weights epoch (moved by
:mod:`kvsan.hooks.vllm.weights` when the weights' fingerprint moves) and a
LoRA adapter's identity from its files (:func:`_lora_identity`).
Everything is read from the Request, never from vLLM's extra keys.
"""

from __future__ import annotations

import functools
import sys
import weakref
from time import perf_counter as _perf_counter

from ... import hooks as _hooks
from ... import runtime as _rt
from ...checks import identity as _identity
from ...checks.identity import IdentityAudit, RequestIdentity, digest, text
from .. import Target, bind_args, guard_failed, instrument, request_on_stack, uninstrument
from .. import guard as _guard
from . import allocator as _allocator
from ..contract import Contract
from .allocator import CACHE_FULL_BLOCKS_ARGS

_state = {"weights_epoch": 0, "model": None}
#: (adapter name, id, path) -> the loads of it ``EngineCore.add_lora`` made
_lora_epochs: dict[tuple, int] = {}
#: (adapter name, id, path) -> the identity of the weights loaded for it
#: (:func:`_lora_identity`), kept from its load until it is loaded again
#: in place or removed.  Keyed by these fields, never by the LoRARequest: up to
#: vLLM 0.33 a LoRARequest equals (and hashes as) any other of its name, so
#: an adapter loaded again under a new id would be taken for the old one.
_lora_loads: dict[tuple, tuple] = {}
_audits: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # pool -> audit
#: request id -> its identity chain, a weak reference to its Request
#: (:class:`RequestIdentity`).  A plain dict keyed by the id, the Request
#: checked through the chain: a WeakKeyDictionary lookup builds a weak
#: reference and runs Python-level code on every call.  The entry goes when
#: its Request does (:func:`_reap`, the chain's callback).
_chains: dict = {}


def _reap(chain: RequestIdentity) -> None:
    """A Request went: drop its chain (unless a newer Request under the same
    id replaced the entry).  kvsan._native._tokenlinks's ``reap`` does the same
    without a Python frame."""
    chains = _chains
    if chains is None:  # (interpreter shutdown: this module's globals are gone)
        return
    if chains.get(chain.rid) is chain:
        del chains[chain.rid]


def bump_weights_epoch() -> int:
    """A new weights epoch: blocks cached from now on are told apart from
    those cached before (a hit across the two is ``cache_key_mismatch``
    naming ``weights_epoch``)."""
    _state["weights_epoch"] += 1
    _refresh_weights()
    return _state["weights_epoch"]


def weights_epoch() -> int:
    return _state["weights_epoch"]


#: the digest of the weights identity (model, epoch), part of every block's
#: fields: recomputed when either changes (:func:`_refresh_weights`), read
#: as ``_WEIGHTS[0]`` on the hot paths
_WEIGHTS: list = [b""]


def _refresh_weights() -> None:
    _WEIGHTS[0] = digest("weights", text(_state["model"]), text(_state["weights_epoch"]))


_refresh_weights()


#: pool -> the ``requests`` dict (request id -> Request) of the scheduler
#: that allocates from it, so a prefix hit finds its Request with a dict
#: lookup instead of reading the caller's frame locals
_requests_of: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

#: one-entry cache in front of the weak dictionaries: [runtime, weak ref to
#: pool, audit, requests dict or None] (a WeakKeyDictionary lookup makes a
#: weak reference)
_LAST: list = [None, None, None, None]


def _audit(rt, pool) -> IdentityAudit | None:
    last = _LAST
    if rt is not None and last[0] is rt and last[1]() is pool:
        return last[2]
    if rt is None or pool not in rt.checkers:
        return None
    a = _audits.get(pool)
    if a is None:
        a = _audits[pool] = IdentityAudit(rt.reporter.emit, rt.get_step,
                                          getattr(pool, "num_gpu_blocks", 0))
    _LAST[:] = [rt, weakref.ref(pool), a, _requests_of.get(pool)]
    return a


#: (lora, cache_salt) -> their digests: most requests share them, so
#: a new request usually costs no BLAKE2b here (bounded: salts can be many)
_static_memo: dict = {}
_STATIC_MEMO_MAX = 4096


def _static_digests(lora, salt) -> tuple[bytes, bytes]:
    """(LoRA, cache_salt) digests, one shared tuple per distinct combination
    (compared by identity first)."""
    key = (lora, salt)
    out = _static_memo.get(key)
    if out is None:
        if len(_static_memo) >= _STATIC_MEMO_MAX:
            _static_memo.clear()
        out = _static_memo[key] = (
            digest("lora", *((text(x) for x in lora) if lora else (b"",))),
            digest("salt", text(salt)))
    return out


def _lora_identity(lr) -> tuple:
    """What a LoRA adapter changes the KV by: the weights its workers
    loaded for it.  Taken when it is loaded (``add_lora``, or the first
    request that uses it, when the workers load it from its path) and kept
    until it is loaded again in place or removed: files rewritten under a
    loaded adapter change nothing its KV is computed with.  The digest of
    its files where the scheduler can read them (an adapter loaded again
    under the same name and path with other weights differs; one adapter
    under two names or ids does not), else its name, id, path and load
    epoch."""
    key = (lr.lora_name, lr.lora_int_id, lr.lora_path)
    got = _lora_loads.get(key)
    if got is None:
        got = _lora_loads[key] = _loaded(lr, key, False)
    return got


def _loaded(lr, key: tuple, fresh: bool) -> tuple:
    """The identity of what a load of ``lr`` reads (``fresh``: the files
    read again whatever their size and time say)."""
    files = adapter_files_digest(lr.lora_path, fresh)
    if files is not None:
        return ("files", files)
    return (lr.lora_name, lr.lora_int_id, lr.lora_path, _lora_epochs.get(key, 0))


#: adapter path -> (the stat signature of its files, their content digest):
#: an adapter's files are read once per version, not once per request
_adapter_memo: dict = {}


def adapter_files_digest(path, fresh: bool = False) -> bytes | None:
    """Content digest of the adapter at ``path`` (a directory: every
    regular file in it, by name; a file: that file), or None where it cannot
    be read.  Re-read only when a file's size or mtime changes, or when
    ``fresh`` (a load: files rewritten within the clock's resolution keep
    both)."""
    import os

    if not isinstance(path, str) or not path:
        return None
    try:
        if os.path.isdir(path):
            names = sorted(n for n in os.listdir(path)
                           if os.path.isfile(os.path.join(path, n)))
            paths = [os.path.join(path, n) for n in names]
        elif os.path.isfile(path):
            names, paths = [os.path.basename(path)], [path]
        else:
            return None
        sig = tuple((n, st.st_size, st.st_mtime_ns)
                    for n, st in zip(names, map(os.stat, paths)))
        memo = _adapter_memo.get(path)
        if memo is not None and memo[0] == sig and not fresh:
            return memo[1]
        import hashlib

        h = hashlib.blake2b(digest_size=16, person=b"kvsan-lora")
        for n, p in zip(names, paths):
            h.update(n.encode() + b"\0")
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        _adapter_memo[path] = (sig, h.digest())
        return _adapter_memo[path][1]
    except OSError:
        return None


#: what ``kvsan._native._tokenlinks.known_chain`` needs to start the chain of a
#: request without LoRA or cache_salt as :func:`_chain` would
_MAKE: list = [None]


def _reaper():
    """The callback of a chain in :data:`_chains`: kvsan._native._tokenlinks's
    ``reap`` bound to it where built (no Python frame per request end),
    else :func:`_reap`."""
    reap = _identity.reap
    return functools.partial(reap, _chains) if reap is not None else _reap


def _refresh_make() -> None:
    _MAKE[0] = (RequestIdentity, _static_digests(None, None), _reaper())


_refresh_make()


def _chain(request, bs: int, upto: int) -> RequestIdentity:
    known = _identity.known_chain
    if known is not None:  # a known text-only request: the same steps in one C call
        ident = known(_chains, request, bs, upto, _MAKE[0])
        if ident is not None:
            return ident
    rid = request.request_id
    ident = _chains.get(rid)
    if ident is None or ident() is not request:  # a new request (or Request object)
        lr = request.lora_request
        lora = _lora_identity(lr) if lr else None
        ident = RequestIdentity(_static_digests(lora, request.cache_salt),
                                request, _MAKE[0][2], rid)
        _chains[rid] = ident
    if len(ident.tok) < upto:
        # the list behind vLLM's read-only view: slicing it is a C call
        tokens = getattr(request, "_all_token_ids", None)
        if not isinstance(tokens, list):
            tokens = request.all_token_ids
        mm_features, embeds = request.mm_features, request.prompt_embeds
        ident.extend(upto, tokens, bs, _mm_parts(mm_features, bs) if mm_features else None,
                     None if embeds is None else _embed_parts(embeds, bs))
    return ident


def _mm_parts(mm_features, bs: int):
    """Block ``k`` -> the multimodal items overlapping it (identifier and
    offset relative to the block)."""
    feats = [(f.identifier, f.mm_position.offset, f.mm_position.length) for f in mm_features]

    def mm(k):
        lo, hi = k * bs, (k + 1) * bs
        return b"|".join(text((ident_, off - lo)) for ident_, off, n in feats
                         if off < hi and off + n > lo)
    return mm


def _embed_parts(embeds, bs: int):
    """Block ``k`` -> digest of its prompt embeddings."""
    def emb(k):
        if k * bs >= len(embeds):
            return b""
        return hashlib_digest(embeds[k * bs:(k + 1) * bs].detach().cpu().contiguous())
    return emb


def hashlib_digest(t) -> bytes:
    import torch

    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return digest("embeds", t.numpy().tobytes())


def _cache_full_blocks(wrapped, instance, args, kwargs):
    ret = wrapped(*args, **kwargs)
    v = bind_args(args, kwargs, CACHE_FULL_BLOCKS_ARGS)
    _cached(_rt.get(), instance, v["request"], v["blocks"], v["num_cached_blocks"],
            v["num_full_blocks"])
    return ret


def _cached(rt, pool, request, blocks, lo: int, hi: int) -> None:
    """After ``cache_full_blocks``: the producer identity of blocks
    ``[lo, hi)`` it registered for ``request`` (the hook's second half; the
    native allocator hook on the same method calls it as its observer).

    The native cache hook makes the usual records itself (a known text-only
    request); this runs for the rest and hands that route its state.
    Guarded as ``_guard`` does, inline (a frame fewer per call)."""
    last = _LAST
    if rt is None or not (last[0] is rt and last[1]() is pool) and _audit(rt, pool) is None:
        return
    if lo >= hi:
        return
    t0 = _perf_counter()
    try:
        audit = last[2]
        ident = _chain(request, pool.hash_block_size, hi)
        fast = _hooks.SHADOWFAST
        recorded = False
        if fast is not None and type(blocks) is list:  # the same records, read in C
            recorded = fast.identity_record(audit.records, request.request_id, ident,
                                            _WEIGHTS[0], blocks, lo, hi)
            hook, known = _NATIVE_OBSERVED[0], _identity.known_chain
            if known is not None and hook is not None:
                # from now on the native hook makes these records itself for
                # a request whose chain is known or a text-only one it can
                # start (kvsan._native._hookfast's identity_observe)
                hook.identity = (weakref.ref(rt), weakref.ref(pool), audit.records, _chains,
                                 pool.hash_block_size, _WEIGHTS, known, fast.identity_record,
                                 _MAKE)
        if not recorded:  # (C declines a block beyond the records: they grow here)
            audit.on_cached(request.request_id, ident, _WEIGHTS[0],
                            [(i, b.block_id, b.block_hash)
                             for i, b in enumerate(blocks[lo:hi], lo)
                             if not b.is_null and b.block_hash is not None])
    except Exception as e:  # noqa: BLE001 - report first, never mask
        guard_failed(rt, "identity.cache", e)  # a violation (raise / abort modes) propagates
    finally:
        rt.overhead_s += _perf_counter() - t0


def _allocate_new_computed_blocks(wrapped, instance, args, kwargs):
    """Before a request is handed its prefix hits: their producers'
    identities against the request's own.  The native hook takes the clean
    calls once this has handed it its state; guarded inline as ``_guard``
    does."""
    rt = _rt._runtime
    if rt is not None:
        pool = instance.block_pool
        last = _LAST
        if last[0] is rt and last[1]() is pool or _audit(rt, pool) is not None:
            t0 = _perf_counter()
            try:
                if _check_hits(last[2], pool, args, kwargs, sys._getframe(1)):
                    _hand_hits_to_native(rt, pool, last[2], last[3])
            except Exception as e:  # noqa: BLE001 - report first, never mask
                guard_failed(rt, "identity.hit", e)  # a violation propagates (raise / abort)
            finally:
                rt.overhead_s += _perf_counter() - t0
    return wrapped(*args, **kwargs)


def _hand_hits_to_native(rt, pool, audit, requests) -> None:
    """From now on the native hook on ``allocate_new_computed_blocks`` checks
    this pool's clean hits itself (kvsan._native._hookfast's hits_call), where it
    can: the C paths are on and the scheduler's request table is known."""
    hook = _NATIVE_HITS[0]
    known, fast = _identity.known_chain, _hooks.SHADOWFAST
    if hook is not None and known is not None and fast is not None and requests is not None:
        hook.identity = (weakref.ref(rt), weakref.ref(pool), audit.records, _chains,
                         pool.hash_block_size, _WEIGHTS, known, fast.identity_hits, _MAKE,
                         requests, audit)


def _check_hits(audit, pool, args, kwargs, caller) -> bool:
    """The consumer identity of a request's prefix hits against each block's
    producer (``caller``: the frame that made the call, where the Request is
    looked for when the scheduler's table does not have it).  True when the
    hits were compared in C and matched (the native hook can take such calls)."""
    if args:
        v = bind_args(args, kwargs, ("request_id", "new_computed_blocks"))
        rid, hits = v["request_id"], v.get("new_computed_blocks")
    else:
        rid, hits = kwargs["request_id"], kwargs.get("new_computed_blocks")
    blocks = hits[0] if hits else ()
    if not blocks:
        return False
    reqs = _LAST[3]
    request = reqs.get(rid) if reqs is not None else None
    if request is None:
        request = request_on_stack(caller, rid)
        if request is None:
            raise LookupError(f"no Request {rid!r} on the calling stack")
    bs = pool.hash_block_size
    ident = _chain(request, bs, len(blocks))
    weights = _WEIGHTS[0]
    fast = _hooks.SHADOWFAST
    got = (fast.identity_hits(audit.records, ident, weights, blocks)
           if fast is not None and type(blocks) is list else None)
    if got is None:
        stale = [b.block_id for b in blocks if b.block_hash is None and not b.is_null]
        if stale:  # (a key filed for the block aside from its own is a key: vLLM evicts those too)
            extra = getattr(pool, "cached_block_hashes_by_block", None) or ()
            stale = [b for b in stale if not extra or b not in extra]
        if stale:
            _stale_hits(pool, rid, stale)
        audit.on_hits(rid, ident, weights,
                      [(i, b.block_id, b.block_hash) for i, b in enumerate(blocks)
                       if not b.is_null])
        return False
    # compared in C (an int: all matched); each mismatch reported as on_hits does
    compared, mismatches = (got, ()) if type(got) is int else got
    audit.checked += compared
    for i, block, key, known_ in mismatches:
        audit.mismatch(block, key, rid, ident, i, weights, known_)
    return not mismatches


def _stale_hits(pool, rid: str, blocks: list[int]) -> None:
    """Prefix hits served from blocks without a cache key, reported by the
    pool's allocator checker (its table says who holds them now)."""
    rt = _rt._runtime
    ck = rt.checkers.get(pool) if rt is not None else None
    if ck is not None:
        ck.on_stale_hits(rid, blocks, _hooks.call_site(1))


def _add_lora(wrapped, instance, args, kwargs):
    """``EngineCore.add_lora``: the workers load the adapter, unless one of
    its id is loaded and the request does not ask to load it again in
    place (``load_inplace``).  A load starts a new identity for it: its
    files as they are now (read again), or a new load epoch."""
    ret = wrapped(*args, **kwargs)
    rt = _rt._runtime
    if rt is not None and ret is not False:
        lr = args[0] if args else kwargs["lora_request"]
        _guard(rt, "add_lora", _note_load, lr)
    return ret


def _note_load(lr) -> None:
    key = (lr.lora_name, lr.lora_int_id, lr.lora_path)
    if key in _lora_loads and not getattr(lr, "load_inplace", False):
        return  # (already loaded: the workers keep what they have)
    _lora_epochs[key] = _lora_epochs.get(key, 0) + 1
    _lora_loads[key] = _loaded(lr, key, True)


def _remove_lora(wrapped, instance, args, kwargs):
    """``EngineCore.remove_lora``: the adapter's weights leave the workers;
    its next use loads it again, from what its files hold then."""
    ret = wrapped(*args, **kwargs)
    lora_id = args[0] if args else kwargs.get("lora_id")
    for key in [k for k in _lora_loads if k[1] == lora_id]:
        del _lora_loads[key]
    return ret


def _scheduler_init(wrapped, instance, args, kwargs):
    ret = wrapped(*args, **kwargs)
    try:
        _state["model"] = instance.vllm_config.model_config.model
        _refresh_weights()
        _refresh_make()
        _requests_of[instance.kv_cache_manager.block_pool] = instance.requests
        _LAST[0] = None  # a new scheduler: look the pool up again
    except (AttributeError, TypeError):
        pass
    return ret


def targets() -> list[Target]:
    return [
        Target("vllm.v1.core.block_pool", "BlockPool.cache_full_blocks", _cache_full_blocks),
        Target(_HITS_HOOK[0], ".".join(_HITS_HOOK[1:]), _allocate_new_computed_blocks,
               fast=("HITS", _no_second_half)),
        Target("vllm.v1.core.sched.scheduler", "Scheduler.__init__", _scheduler_init),
        Target("vllm.v1.engine.core", "EngineCore.add_lora", _add_lora),
        Target("vllm.v1.engine.core", "EngineCore.remove_lora", _remove_lora),
    ]


_CACHE_HOOK = ("vllm.v1.core.block_pool", "BlockPool", "cache_full_blocks")
_HITS_HOOK = ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator",
              "allocate_new_computed_blocks")


def _no_second_half(*_args) -> None:
    """The hit check's native hook has no second half: what it declines, the
    Python hook does whole, before vLLM's method runs."""


def _native_hook(where: tuple[str, str, str]):
    """The ``kvsan._native._hookfast.Hook`` on the method ``where`` = (module, class,
    attribute) when there is one, else None."""
    import importlib

    try:
        cls = getattr(importlib.import_module(where[0]), where[1])
    except (ImportError, AttributeError):
        return None
    return _hooks.native_hook(cls.__dict__.get(where[2]))


def _native_cache_hook():
    """The allocator's native hook on ``BlockPool.cache_full_blocks`` when
    there is one (the identity audit then rides on it as its observer rather
    than wrapping the method a second time)."""
    return _native_hook(_CACHE_HOOK)


#: the allocator's native hook this audit observes, and this audit's own
#: native hook on the hit check (set by :func:`install`)
_NATIVE_OBSERVED: list = [None]
_NATIVE_HITS: list = [None]


def cached_links(rt, sched, blocks: list[int]):
    """For the step's payload to the workers: ``(block size, [(block,
    parent link, token link)])`` of the blocks ``sched`` cached this step
    whose producer the audit recorded (the tokens the scheduler cached each
    under, as links: never the tokens), or None.  A worker checks the
    tokens it computed a block's KV from against them when it seals the
    block (``input_token_mismatch``)."""
    pool = sched.kv_cache_manager.block_pool
    audit = _audit(rt, pool)
    if audit is None:
        return None
    links = audit.links(blocks)
    return (pool.hash_block_size, links) if links else None


def install() -> list[str]:
    """Patch the identity audit's targets (through kvsan's trampolines: on
    ``cache_full_blocks`` it is a second hook on top of the allocator's, or
    the observer of the allocator's native hook)."""
    ts = targets()
    hook = _native_cache_hook()
    if hook is not None and hook.observer in (None, _cached):
        hook.observer = _cached
        _NATIVE_OBSERVED[0] = hook
        rest = [t for t in ts if t.qualname != ".".join(_CACHE_HOOK[1:])]
        installed, _ = instrument(rest)
        installed += [t.name for t in ts if t not in rest]
    else:
        installed, _ = instrument(ts)
    _NATIVE_HITS[0] = _native_hook(_HITS_HOOK)
    _allocator.CACHED_LINKS[0] = cached_links
    return [f"identity:{t.qualname}" for t in ts if t.name in installed]


def uninstall() -> None:
    hook = _native_cache_hook()
    if hook is not None and hook.observer is _cached:
        hook.observer = None
        hook.identity = None
    _NATIVE_OBSERVED[0] = None
    hits = _NATIVE_HITS[0]
    if hits is not None:
        hits.identity = None
    _NATIVE_HITS[0] = None
    _allocator.CACHED_LINKS[0] = None
    uninstrument(targets())


#: what the identity audit relies on in vLLM (:mod:`kvsan.hooks.contract`)
CONTRACT = Contract(
    adapter="identity",
    check="the identity audit (cached blocks and prefix hits against their tokens)",
    methods={
        "vllm.v1.core.block_pool:BlockPool.cache_full_blocks": CACHE_FULL_BLOCKS_ARGS,
        f"{_HITS_HOOK[0]}:{_HITS_HOOK[1]}.{_HITS_HOOK[2]}": ("request_id", "new_computed_blocks"),
        "vllm.v1.core.sched.scheduler:Scheduler.__init__": (),
        "vllm.v1.engine.core:EngineCore.add_lora": ("lora_request",),
        "vllm.v1.engine.core:EngineCore.remove_lora": ("lora_id",),
    },
    attrs={
        "vllm.v1.core.kv_cache_utils:KVCacheBlock": ("block_id", "block_hash", "is_null"),
        "vllm.v1.core.block_pool:BlockPool": ("hash_block_size",),
        "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator": ("block_pool",),
        "vllm.v1.core.sched.scheduler:Scheduler":
            ("vllm_config", "kv_cache_manager", "requests"),
        "vllm.v1.request:Request": ("request_id", "lora_request", "cache_salt",
                                    "all_token_ids", "mm_features", "prompt_embeds"),
    },
)
