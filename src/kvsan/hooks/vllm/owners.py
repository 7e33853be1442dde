"""vLLM adapter, ``kvsan owners`` (EngineCore process): the utility method
``EngineCore.kvsan_owners`` that takes the owners snapshot of the
scheduler's pool between two steps.

The snapshot itself is engine-agnostic (:func:`kvsan.owners.snapshot`);
this module only reads vLLM's scheduler and block pool for it, and makes
the front end's side: the utility call from a ``vllm.LLM`` or an engine
client, and ``GET /kvsan/owners`` on vLLM's API server (the
``vllm.endpoint_plugins`` entry point).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ... import runtime as _rt
from ...owners import ROUTE, SCHEMA, UTILITY, snapshot
from ..contract import Contract
from .allocator import _scheduler_checker


def scheduler_snapshot(rt, scheduler) -> dict[str, Any]:
    """The snapshot of a vLLM scheduler's device pool."""
    ck = _scheduler_checker(rt, scheduler)
    if ck is None:
        return {"schema": SCHEMA, "pid": os.getpid(), "role": rt.role, "engine": rt.engine,
                "step": rt.step, "error": "kvsan tracks no block pool in this process"}
    blocks = scheduler.kv_cache_manager.block_pool.blocks
    refs = [b.ref_cnt for b in blocks]
    linked = [b.prev_free_block is not None for b in blocks]
    return snapshot(ck, refs, linked, scheduler.requests, rt.step, rt.pid, rt.role, rt.engine)


def _engine_core_kvsan_owners(self) -> dict[str, Any]:
    """``EngineCore.kvsan_owners``: a utility method (runs between steps)."""
    rt = _rt.get()
    if rt is None:
        return {"schema": SCHEMA, "pid": os.getpid(), "error": "kvsan is off in this engine"}
    try:
        return scheduler_snapshot(rt, self.scheduler)
    except Exception as e:  # noqa: BLE001 - a query must never hurt the engine
        try:
            rt.reporter.internal_error("owners", e)
        except Exception:  # noqa: BLE001
            pass
        return {"schema": SCHEMA, "pid": os.getpid(), "engine": rt.engine,
                "error": f"{type(e).__name__}: {e}"}


_ENGINE_CORE = ("vllm.v1.engine.core", "EngineCore")


def install_engine_method() -> bool:
    """Add ``EngineCore.kvsan_owners`` (idempotent).  False if not found."""
    import importlib

    try:
        cls = getattr(importlib.import_module(_ENGINE_CORE[0]), _ENGINE_CORE[1])
    except (ImportError, AttributeError):
        return False
    if UTILITY not in cls.__dict__:
        setattr(cls, UTILITY, _engine_core_kvsan_owners)
    return True


def uninstall_engine_method() -> None:
    mod = sys.modules.get(_ENGINE_CORE[0])
    cls = getattr(mod, _ENGINE_CORE[1], None) if mod is not None else None
    if cls is not None and cls.__dict__.get(UTILITY) is _engine_core_kvsan_owners:
        delattr(cls, UTILITY)


#: what ``kvsan owners`` relies on in vLLM (:mod:`kvsan.hooks.contract`)
CONTRACT = Contract(
    adapter="owners",
    check="kvsan owners (EngineCore.kvsan_owners snapshots)",
    attrs={
        f"{_ENGINE_CORE[0]}:{_ENGINE_CORE[1]}": ("scheduler",),
        "vllm.v1.core.sched.scheduler:Scheduler": ("kv_cache_manager", "requests"),
        "vllm.v1.core.kv_cache_manager:KVCacheManager": ("block_pool",),
        "vllm.v1.core.block_pool:BlockPool": ("blocks",),
        "vllm.v1.core.kv_cache_utils:KVCacheBlock": ("ref_cnt", "prev_free_block"),
    },
)


# ------------------------------------------------------------ front end
def from_llm(llm) -> list[dict[str, Any]]:
    """Snapshots from a ``vllm.LLM`` (in-process or multi-process)."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is not None and hasattr(core, "scheduler"):  # InprocClient
        method = getattr(core, UTILITY, None)  # (added where kvsan is installed)
        return [method() if method is not None else
                {"schema": SCHEMA, "pid": os.getpid(), "error": "kvsan is off in this engine"}]
    return [client.call_utility(UTILITY)]


async def from_client(core) -> list[dict[str, Any]]:
    """One snapshot per engine from an asyncio engine-core client (what an
    ``AsyncLLM`` / ``vllm serve`` front end holds as ``engine_core``).

    With data parallelism the client manages several EngineCores and its
    ``call_utility_async`` answers with the first engine's result only
    (``DPLBAsyncMPClient``), so every engine is asked
    (``call_utility_all_async``, in engine order).  Each answer says which
    engine it is (``engine``); one without it (an older kvsan in that
    engine) is labelled by its position."""
    if hasattr(core, "call_utility_all_async"):
        engines = list(await core.call_utility_all_async(UTILITY))
    else:
        engines = [await core.call_utility_async(UTILITY)]
    for i, e in enumerate(engines):
        if isinstance(e, dict):
            e.setdefault("engine", i)
    return engines


# ------------------------------------------------ API server side (vLLM)
#: at most one engine snapshot per this many seconds, shared by every caller
#: of ``GET /kvsan/owners`` (each snapshot runs between two engine steps; a
#: dashboard polling many times a second must not make the engine pay for it)
MIN_INTERVAL_S = 1.0


def api_tokens(args) -> list[str]:
    """The keys vLLM's API server requires, by vLLM's own rule
    (``init_entrypoints_middleware``): ``--api-key`` (one or several), else
    ``VLLM_API_KEY``."""
    keys = getattr(args, "api_key", None) if args is not None else None
    if isinstance(keys, str):
        keys = [keys]
    return [k for k in (keys or [os.environ.get("VLLM_API_KEY")]) if k]


def authorized(tokens_sha: list[bytes], header: str | None) -> bool:
    """``Authorization: Bearer <key>`` against the keys' digests, compared in
    constant time, as vLLM's ``AuthenticationMiddleware`` does."""
    import hashlib
    import secrets

    if not tokens_sha:
        return True
    scheme, _, param = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(param.encode("utf-8")).digest()
    ok = False
    for t in tokens_sha:
        ok |= secrets.compare_digest(digest, t)
    return ok


class SharedSnapshot:
    """One engine snapshot at a time, at most one per ``interval`` seconds:
    callers that arrive while one is being taken wait for it, callers within
    ``interval`` of the last get it again (its ``time`` says when it was
    taken).  ``take`` is the coroutine function that asks the engines."""

    def __init__(self, take, interval: float = MIN_INTERVAL_S):
        self.take = take
        self.interval = interval
        self.taken = 0  # snapshots asked of the engines (for the tests)
        self._last: tuple[float, Any] | None = None
        self._pending = None

    async def get(self):
        import asyncio
        import time

        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval:
            return self._last[1]
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._refresh())
        return await asyncio.shield(self._pending)

    async def _refresh(self):
        import time

        try:
            self.taken += 1
            result = await self.take()
            self._last = (time.monotonic(), result)
            return result
        finally:
            self._pending = None


def _encoded(engines) -> bytes:
    """The response body for one snapshot, encoded once however many
    callers it answers (a poll then costs the server a lookup and a send)."""
    import json

    return json.dumps({"schema": SCHEMA, "engines": engines}, default=str,
                      separators=(",", ":")).encode()


class EndpointPlugin:
    """``vllm.endpoint_plugins`` entry point: ``GET /kvsan/owners``, behind the
    same API key as vLLM's own routes (vLLM's middleware guards ``/v1``
    only), at most one engine snapshot per :data:`MIN_INTERVAL_S`."""

    name = "kvsan"
    required_tasks = None

    def attach_router(self, app) -> None:
        from fastapi import APIRouter, Request
        from fastapi.responses import JSONResponse, Response

        router = APIRouter()

        async def kvsan_owners(request: Request):
            state = request.app.state
            if not authorized(getattr(state, "kvsan_api_tokens", []),
                              request.headers.get("Authorization")):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            shared = getattr(state, "kvsan_owners", None)
            if shared is None:
                return JSONResponse({"error": "no engine behind this server"}, status_code=503)
            try:
                body = await shared.get()
            except Exception as e:  # noqa: BLE001
                return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)
            return Response(content=body, media_type="application/json")

        # this module uses postponed annotations; FastAPI needs the class
        kvsan_owners.__annotations__ = {"request": Request}
        router.add_api_route(ROUTE, kvsan_owners, methods=["GET"])
        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        import hashlib

        state.kvsan_api_tokens = [hashlib.sha256(t.encode("utf-8")).digest()
                                  for t in api_tokens(args)]
        core = getattr(engine_client, "engine_core", None)
        async def take():
            return _encoded(await from_client(core))

        state.kvsan_owners = SharedSnapshot(take) if core is not None else None


def endpoint_plugin() -> EndpointPlugin:
    return EndpointPlugin()
