"""``kvsan owners``: who holds the KV blocks of a running engine.

The snapshot is taken *inside the EngineCore, between two steps*, so the
shadow table, vLLM's block pool and the scheduler's request states are read
at one consistent moment:

* kvsan's general plugin adds a utility method ``EngineCore.kvsan_owners``
  in the EngineCore process (:mod:`kvsan.hooks.vllm.owners`, which reads
  vLLM's scheduler for the engine-agnostic :func:`snapshot` here).  vLLM's EngineCore runs utility calls from its
  own busy loop, in its main thread, between steps.
* kvsan's endpoint plugin (:mod:`kvsan.hooks.vllm.owners`, entry point
  group ``vllm.endpoint_plugins``,
  loaded only when the operator allowlists it: ``VLLM_PLUGINS=kvsan``, as
  vLLM requires for every plugin that adds HTTP routes) serves
  ``GET /kvsan/owners`` on the server's own port and makes that utility call
  on every engine (``call_utility_all_async``).
* ``kvsan owners http://host:port`` fetches and prints it.

With ``vllm.LLM``, :func:`kvsan.owners_from_llm` makes the same call.

Everything here is token-free: request ids, block ids, counts, steps,
seconds and hash digests.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

SCHEMA = 1
ROUTE = "/kvsan/owners"
_NONREQUEST = ("cow:", "deferred:", "pin:", "anon:")
#: owner rows and orphans sent at most (the counts are always complete)
MAX_ROWS = 10_000


# ------------------------------------------------------------ the snapshot
def state_of(owner: str, sched_requests, ended: dict, recent_ends: dict) -> str:
    """running, waiting, preempted, finished, aborted, unknown (to the
    scheduler), or the kind of a non-request owner (cow, deferred, pin, anon)."""
    for prefix in _NONREQUEST:
        if owner.startswith(prefix):
            return prefix[:-1]
    req = sched_requests.get(owner) if sched_requests is not None else None
    if req is not None:
        status = getattr(getattr(req, "status", None), "name", "") or ""
        return _status_state(status.lower())
    if owner in ended:
        return _reason_state(ended[owner][0])
    if owner in recent_ends:
        return _reason_state(recent_ends[owner][0])
    return "unknown"


def _status_state(status: str) -> str:
    if status.startswith("waiting"):
        return "waiting"
    if status in ("running", "preempted"):
        return status
    if status == "finished_aborted":
        return "aborted"
    if status.startswith("finished"):
        return "finished"
    return status or "unknown"


def _reason_state(reason: str) -> str:
    if reason == "unknown to the scheduler":
        return "unknown"
    if "aborted" in reason:
        return "aborted"
    if reason == "preempted":
        return "preempted"
    return "finished"


def orphan_blocks(shadow, refs, linked) -> list[int]:
    """Blocks with no live owner that are not free: not in the engine's free
    queue (and not the null block), while every owner kvsan knows has ended
    or there is none.  ``refs``/``linked``: the engine's per-block view
    (sequences or numpy arrays).  Vectorised for the common case (nothing
    has ended with blocks held): milliseconds on a 1M-block pool."""
    import numpy as np

    own0, ended, null = shadow.own0, shadow.ended, shadow.null
    n = shadow.num_blocks
    unlinked = ~np.asarray(linked, dtype=bool)[:n]
    nown = getattr(shadow, "nown", None)
    if nown is not None:
        owned = np.frombuffer(nown, dtype=np.int32, count=n) > 0
    else:
        owned = np.fromiter((o is not None for o in own0), dtype=bool, count=n)
    candidates = unlinked & ~owned  # not free, no owner at all
    if ended:
        dead = np.fromiter((o is not None and o in ended for o in own0), dtype=bool, count=n)
        for b in np.flatnonzero(dead & unlinked):
            if all(x in ended for x in shadow.extras(int(b))):
                candidates[b] = True
    for b in null:
        if 0 <= b < n:
            candidates[b] = False
    return [int(b) for b in np.flatnonzero(candidates)]


def snapshot(checker, refs, linked, sched_requests=None, step: int = 0,
             pid: int | None = None, role: str = "engine",
             engine: int = 0) -> dict[str, Any]:
    """Who holds the blocks of one pool.  Engine-agnostic: ``refs`` and
    ``linked`` are the engine's per-block reference counts and free-queue
    membership, ``sched_requests`` maps request id -> object with a
    ``status`` (None: unknown).  ``engine``: the data-parallel engine index
    of the EngineCore that owns the pool (each engine has its own table)."""
    sh = checker.shadow
    now = time.monotonic()
    live: dict[str, int] = {}
    cached_held: dict[str, int] = {}
    evictable: dict[str, int] = {}
    own0, own1, cached = sh.own0, sh.own1, sh.cached
    extras = sh.extras
    for b in range(sh.num_blocks):
        if b in sh.null:
            continue
        o = own0[b]
        if o is None:
            if cached[b]:  # unowned, keeps its cache entry: charged to its last releaser
                r = sh.rel_owner[b]
                if r is not None:
                    evictable[r] = evictable.get(r, 0) + 1
            continue
        for x in (o, *extras(b)) if own1[b] is not None else (o,):
            live[x] = live.get(x, 0) + 1
            if cached[b]:
                cached_held[x] = cached_held.get(x, 0) + 1
    rows = []
    for owner in set(live) | set(evictable):
        since = sh.since_of(owner)
        rows.append({
            "owner": owner,
            "state": state_of(owner, sched_requests, sh.ended, checker.recent_ends),
            "live_blocks": live.get(owner, 0),
            "cached_live_blocks": cached_held.get(owner, 0),
            "cached_evictable_blocks": evictable.get(owner, 0),
            "held_s": round(now - since[0], 3) if since and owner in live else None,
            "since_step": since[1] if since and owner in live else None,
            "leaked": owner in sh.ended,
        })
    rows.sort(key=lambda r: (-r["live_blocks"], -r["cached_evictable_blocks"], r["owner"]))
    orphans = orphan_blocks(sh, refs, linked)
    orphan_rows = []
    for b in orphans[:MAX_ROWS]:
        d = sh.describe(b)
        d["ref_cnt"] = refs[b]
        orphan_rows.append(d)
    ends: dict[str, int] = {}
    for reason, _step in checker.recent_ends.values():
        st = _reason_state(reason)
        ends[st] = ends.get(st, 0) + 1
    stats = sh.stats()
    stats["orphans"] = len(orphans)
    stats["num_blocks"] = sh.num_blocks
    return {
        "schema": SCHEMA,
        "pid": os.getpid() if pid is None else pid,
        "role": role,
        "engine": engine,
        "step": step,
        "time": time.time(),
        "pool": stats,
        "owners": rows[:MAX_ROWS],
        "owners_total": len(rows),
        "orphans": orphan_rows,
        #: how the last (up to 4096) requests that released their blocks ended
        "recent_ends": ends,
    }


#: the engine's utility method that takes the snapshot between two steps
#: (vLLM's: :mod:`kvsan.hooks.vllm.owners`)
UTILITY = "kvsan_owners"


# ------------------------------------------------------------- the client
def fetch(url: str, timeout: float = 30.0, api_key: str | None = None) -> dict[str, Any]:
    """``GET /kvsan/owners``; ``api_key``: the server's ``--api-key`` (sent as
    vLLM's own routes expect it, ``Authorization: Bearer``)."""
    from urllib.request import Request, urlopen

    base = url.rstrip("/")
    if not base.endswith(ROUTE):
        base += ROUTE
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urlopen(Request(base, headers=headers), timeout=timeout) as resp:  # noqa: S310
        return json.loads(resp.read().decode())


def _fmt_age(s) -> str:
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


def render(doc: dict[str, Any], out=sys.stdout, limit: int | None = None) -> int:
    """Print the snapshot(s); returns the number of orphan blocks."""
    engines = doc.get("engines", [doc])
    orphans = 0
    for i, e in enumerate(engines):
        i = e.get("engine", i)  # the data-parallel engine index it reported
        if "error" in e:
            print(f"engine {i}: {e['error']}", file=out)
            continue
        pool = e["pool"]
        print(f"engine {i} (pid {e['pid']}, step {e['step']}): "
              f"{pool['num_blocks']} blocks: {pool['live_owned']} live-owned, "
              f"{pool['cached_evictable']} cached-evictable, {pool['free']} free, "
              f"{pool['leaked']} leaked, {pool['orphans']} orphan(s)", file=out)
        rows = e["owners"]
        holders = [r for r in rows if r["live_blocks"]]
        print(f"  {len(holders)} owner(s) hold blocks; "
              f"{len(rows) - len(holders)} more left cached-evictable blocks only", file=out)
        print(f"  {'owner':<44} {'state':<10} {'live':>5} {'cached':>6} "
              f"{'evictable':>9} {'held for':>9} {'since step':>10}", file=out)
        for r in rows[:limit] if limit else rows:
            state = r["state"] + ("!" if r.get("leaked") else "")
            since = "-" if r["since_step"] is None else str(r["since_step"])
            print(f"  {r['owner'][:44]:<44} {state:<10} {r['live_blocks']:>5} "
                  f"{r['cached_live_blocks']:>6} {r['cached_evictable_blocks']:>9} "
                  f"{_fmt_age(r['held_s']):>9} {since:>10}", file=out)
        if limit and len(rows) > limit:
            print(f"  ... {len(rows) - limit} more (use --json)", file=out)
        ends = e.get("recent_ends") or {}
        if ends:
            print("  recently ended: " + ", ".join(f"{n} {k}" for k, n in sorted(ends.items())),
                  file=out)
        orphans += pool["orphans"]
        if e["orphans"]:
            print(f"  orphans (no live owner, not free): {len(e['orphans'])}", file=out)
            for o in e["orphans"]:
                la, lr = o["last_acquire"], o["last_release"]
                print(f"    block {o['block']}: ref_cnt {o['ref_cnt']}, owners {o['owners']}, "
                      f"last acquire {la['owner']}@{la['step']} {la['site']}, "
                      f"last release {lr['owner']}@{lr['step']} {lr['site']}", file=out)
    return orphans
