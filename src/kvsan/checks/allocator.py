"""Allocator-side lifetime invariants, checked at the call that breaks them.

The adapter reports what the engine did (allocate, share, release, retain,
transfer, cache, request ended) together with what it observed on the engine's
blocks (reference count, free-queue membership).  The checker keeps the
:class:`~kvsan.shadow.ShadowTable` in step and returns nothing: violations go
to ``emit``.

Invariants:
* a block reaches the free queue, or is handed to a new owner, only when no
  live owner holds it (``free_with_live_owners``, ``reuse_with_live_owners``,
  ``evict_with_live_owners``);
* every release matches an acquire by the same owner (``double_release``,
  ``invalid_release``) and never drives the engine's count below zero
  (``refcount_underflow``);
* the engine's count equals the number of owners (``refcount_mismatch``);
* the free queue holds only unreferenced blocks, each once
  (``free_queue_corruption``);
* when a request's release path has run it holds nothing (``leaked_blocks``);
* where the engine's steps overlap and something outside their order may
  write a block handed on (a KV connector's loads), a step scheduled and not
  yet processed owns the blocks it reads and writes for its requests
  (``step:<n>``): none of them goes back to the free queue, or to a new
  owner, before that step's output is processed (:meth:`inflight_released`);
* a transfer outside the engine's count (a KV connector's load into a
  request's blocks, its send or a store job's read from them) holds them as a
  lease (``load:<rid>``, ``send:<rid>``, ``store:<job>``) until it reports
  done: none of them goes back to the free queue, or to a new owner, before
  (:meth:`lease`);
* an engine that stops stepping leaves no finished request holding blocks on
  a delayed-free path (:meth:`on_engine_stops`), and one that keeps stepping
  without progress does not strand requests holding blocks (:meth:`on_stall`).
"""

from __future__ import annotations

from collections import Counter
from itertools import filterfalse
from typing import Callable, Iterable, Sequence

import numpy as np

from .. import kinds
from ..journal import StepJournal
from ..report import Violation
from ..shadow import ShadowTable

UNATTRIBUTED = "<unattributed>"
#: order in which a release without a known owner picks a non-request owner
_NONREQUEST_ORDER = ("deferred:", "cow:", "pin:", "anon:")
#: owner prefix of a request's blocks that its KV connector holds after the
#: request finished (the connector delayed the free: an async save or send)
XFER = "xfer:"
#: owner prefix of a step scheduled and not yet processed (``step:<n>``, n
#: the step it was scheduled at), for the blocks it reads and writes
STEP = "step:"
#: the owners that hold a request's blocks for it after it let them go
#: (a fenced free, a connector's transfer, a pending copy)
_HELD_FOR = ("deferred:", XFER, "cow:")


class AllocatorChecker:
    #: ``fast`` and ``journal`` are slots: an engine adapter's native hooks
    #: read them on every event, at a fixed offset (everything else stays in
    #: ``__dict__``)
    __slots__ = ("fast", "journal", "__dict__", "__weakref__")

    def __init__(
        self,
        num_blocks: int,
        emit: Callable[[Violation], None],
        step: Callable[[], int] = lambda: 0,
        null_blocks: Iterable[int] = (0,),
        pool: str = "gpu",
    ):
        self.shadow = ShadowTable(num_blocks, null_blocks)
        #: what this pool's allocator did to cache state since its
        #: scheduler's last step, for that scheduler's workers (filed by the
        #: engine adapter; never rebound: its native hooks keep it)
        self.journal = StepJournal()
        self.emit = emit
        self.step = step
        self.pool = pool
        #: blocks whose refcount mismatch was reported and not yet resolved
        self._mismatched: set[int] = set()
        #: finished requests on a legal delayed-free path: rid -> step it finished
        self.pending_release: dict[str, int] = {}
        #: finished requests whose blocks their KV connector holds
        #: (``xfer:<rid>``; the shadow table has the blocks)
        self.connector_held: set[str] = set()
        #: (kind, block, owner) already reported by a full audit
        self._audit_seen: set[tuple] = set()
        #: movements seen: allocated, shared, released, evicted, preempted
        self._counters: Counter[str] = Counter()
        self.shadow.clock = step
        #: how recent requests ended: rid -> (reason, step), bounded (``kvsan owners``)
        self.recent_ends: dict[str, tuple[str, int]] = {}
        #: the last value filed there (see :meth:`_note_end`)
        self._end_value: tuple[str, int] = ("", -1)
        #: the status a delayed-free request finished with: rid -> reason
        self.pending_reasons: dict[str, str] = {}
        #: transfers outside the engine's count: lease -> the blocks it
        #: holds (the shadow's ``leased`` maps each block back), and the step
        #: each began (:meth:`lease`)
        self.leases: dict[str, list[int]] = {}
        self.lease_since: dict[str, int] = {}
        #: an adapter wants every step of this pool's scheduler, not only
        #: those with more to do (a KV connector's new loads are leased at
        #: the step's end); read by the native SCHED hook
        self.every_step = False
        #: the adapter's count of steps without progress
        #: (:class:`~kvsan.checks.liveness.StallWatch`), made when first needed
        self.stall = None
        #: an engine adapter's fast path for clean events, or None (set by
        #: :meth:`use_fast`).  It applies an event to the table only after
        #: checking that this checker would find nothing wrong with it, and
        #: does the event's bookkeeping too (``counters``, the shadow's
        #: totals and held counts, through ``_hold``/``_unhold`` for an
        #: owner's first and last reference); anything else comes here.  A
        #: plain attribute: the adapter's hooks read it on every event.
        self.fast = None

    def use_fast(self, table) -> None:
        """Take ``table`` as :attr:`fast`.  Counts it keeps for itself are
        added by its ``settle()`` before anything reads them."""
        sh = self.shadow
        if sh.settle is not None:  # what the table being replaced still keeps
            sh.settle()
        self.fast = table
        sh.settle = getattr(table, "settle", None)

    @property
    def counters(self) -> Counter[str]:
        """Movements seen: allocated, shared, released, evicted, preempted."""
        settle = self.shadow.settle
        if settle is not None:
            settle()
        return self._counters

    # -- reporting helper ---------------------------------------------------
    def _report(self, kind, message, blocks, owners, actor, site):
        sh = self.shadow
        self.emit(
            Violation(
                kind=kind,
                message=message,
                blocks=list(blocks),
                owners=sorted(set(owners)),
                actor=actor,
                step=self.step(),
                site=site,
                details=[sh.describe(b) for b in blocks],
                pool=self.pool,
            )
        )

    def _check_refcount(self, b: int, ref: int, actor, site) -> None:
        expected = self.shadow.num_owners(b)
        if ref == expected:
            self._mismatched.discard(b)
        elif b not in self._mismatched and ref >= 0:
            self._mismatched.add(b)
            self._report(
                kinds.REFCOUNT_MISMATCH,
                f"block {b}: engine ref count {ref} but {expected} owner(s) hold it",
                [b],
                self.shadow.owners(b),
                actor,
                site,
            )

    # -- events -------------------------------------------------------------
    def on_allocate(self, obs: Sequence[tuple[int, int]], owner: str, site: str) -> list[int]:
        """Fresh blocks handed to ``owner``.  ``obs`` = (block, ref after).
        Returns the blocks that were cached (evicted to be reused)."""
        sh = self.shadow
        step = self.step()
        sid = sh.site_id(site)
        counters = self._counters
        counters["allocated"] += len(obs)
        null, nown, cached, leased = sh.null, sh.nown, sh.cached, sh.leased
        fresh, evicted = [], []
        for b, ref in obs:
            if b in null:
                continue
            fresh.append(b)
            if leased and b in leased:
                self._reuse_leased(b, owner, site)
            if cached[b]:
                evicted.append(b)
            if nown[b]:
                self._void_prior_owners(b, owner, site)
            if cached[b]:
                sh.set_uncached(b)
        if evicted:
            counters["evicted"] += len(evicted)
        sh.acquire(fresh, owner, step, sid)
        mism = self._mismatched
        for b, ref in obs:
            if ref != nown[b] or (mism and b in mism):
                if b not in null:
                    self._check_refcount(b, ref, owner, site)
        return evicted

    def _void_prior_owners(self, b: int, owner: str, site: str) -> None:
        """A block handed to ``owner`` still had owners: a violation if any
        is live; either way the engine gave it away, so their claims end."""
        sh = self.shadow
        prior = sh.owners(b)
        live = [o for o in prior if o not in sh.ended]
        if live:
            if sh.cached[b]:
                self._report(
                    kinds.EVICT_WITH_LIVE_OWNERS,
                    f"block {b} evicted from the prefix cache to be reused while "
                    f"{', '.join(live)} still own(s) it",
                    [b], live, owner, site,
                )
            self._report(
                kinds.REUSE_WITH_LIVE_OWNERS,
                f"block {b} handed to {owner} while {', '.join(live)} still own(s) it",
                [b], live, owner, site,
            )
        for o in prior:
            sh.remove_owner(b, o)

    def on_share(self, obs: Sequence[tuple[int, int, bool]], owner: str, site: str) -> None:
        """Cached blocks taken by ``owner`` (prefix hit or pin).
        ``obs`` = (block, ref after, still linked in the free queue)."""
        sh = self.shadow
        step = self.step()
        sid = sh.site_id(site)
        if obs:  # (no key for nothing shared: the native table adds none either)
            self._counters["shared"] += len(obs)
        null = sh.null
        sh.acquire([o[0] for o in obs if o[0] not in null], owner, step, sid)
        nown, mism = sh.nown, self._mismatched
        for b, ref, linked in obs:
            if b in null:
                continue
            if linked:
                self._report(
                    kinds.FREE_QUEUE_CORRUPTION,
                    f"block {b} is referenced by {owner} but still linked in the free queue",
                    [b], sh.owners(b), owner, site,
                )
            if ref != nown[b] or (mism and b in mism):
                self._check_refcount(b, ref, owner, site)

    def resolve_releaser(self, b: int, actor: str | None) -> str:
        """The owner a release is charged to: the request named by the call
        context, else a non-request owner of the block, else unattributed."""
        if actor is not None:
            return actor
        sh = self.shadow
        owners = sh.owners(b)
        for prefix in _NONREQUEST_ORDER:
            for o in owners:
                if o.startswith(prefix) and o in sh.nonrequest:
                    return o
        return UNATTRIBUTED

    def on_release(
        self,
        obs: Sequence[tuple[int, int, bool, int, bool]],
        actor: str | None,
        site: str,
    ) -> None:
        """References dropped.  ``obs`` = (block, ref before, linked before,
        ref after, linked after), one entry per reference the engine dropped."""
        sh = self.shadow
        step = self.step()
        sid = sh.site_id(site)
        in_call: set[int] = set()
        self._counters["released"] += len(obs)
        null, nown, mism = sh.null, sh.nown, self._mismatched
        rel_owner, rel_step, rel_site = sh.rel_owner, sh.rel_step, sh.rel_site
        leased = sh.leased
        told = ()  # blocks whose transfer this call's report already names
        for b, ref_before, linked_before, ref_after, linked_after in obs:
            if b in null:
                continue
            repeated = b in in_call
            in_call.add(b)
            releaser = actor if actor is not None else self.resolve_releaser(b, None)
            if not sh.remove_owner(b, releaser):
                if not releaser.startswith(XFER) and sh.is_owner(b, XFER + releaser):
                    # the request's connector transfer still holds the block
                    sh.remove_owner(b, XFER + releaser)
                    told = told or set()
                    told.add(b)
                    self._report(
                        kinds.FREE_WITH_LIVE_OWNERS,
                        f"{releaser} released block {b} while its KV connector transfer "
                        f"({XFER}{releaser}) still reads or writes it: its free was delayed "
                        "until the connector reports the request finished",
                        [b], [XFER + releaser], releaser, site,
                    )
                elif repeated or (sh.rel_owner[b] == releaser and releaser != UNATTRIBUTED):
                    self._report(
                        kinds.DOUBLE_RELEASE,
                        f"{releaser} released block {b} twice (first at step {sh.rel_step[b]} "
                        f"from {sh.sites[sh.rel_site[b]]})",
                        [b], [releaser], releaser, site,
                    )
                elif ref_after >= 0:
                    self._report(
                        kinds.INVALID_RELEASE,
                        f"{releaser} released block {b}, which it never acquired",
                        [b], [releaser], releaser, site,
                    )
            if ref_after < 0:
                self._report(
                    kinds.REFCOUNT_UNDERFLOW,
                    f"block {b} released by {releaser} with no reference left "
                    f"(engine ref count {ref_before} -> {ref_after})",
                    [b], [releaser], releaser, site,
                )
            rel_owner[b] = releaser
            rel_step[b] = step
            rel_site[b] = sid
            if ref_after == 0 and linked_after:
                if linked_before:
                    self._report(
                        kinds.FREE_QUEUE_CORRUPTION,
                        f"block {b} inserted into the free queue while already in it",
                        [b], sh.owners(b), releaser, site,
                    )
                live = sh.live_owners(b) if nown[b] else None
                if live:
                    mism.add(b)  # the count gap is this same fault
                if leased and b in leased and b not in told:
                    live = (live or []) + leased[b]  # a transfer still reads or writes it
                if live:
                    self._report(
                        kinds.FREE_WITH_LIVE_OWNERS,
                        f"block {b} returned to the free queue by {releaser} while "
                        f"{', '.join(live)} still own(s) it",
                        [b], live, releaser, site,
                    )
            if ref_after != nown[b] or (mism and b in mism):
                self._check_refcount(b, ref_after, releaser, site)

    def on_retain(self, b: int, ref: int, owner: str, site: str) -> None:
        """A non-request owner took an extra reference directly (CoW retention)."""
        sh = self.shadow
        sh.nonrequest.add(owner)
        sh.add_owner(b, owner)
        sh.note_acquire(b, owner, self.step(), sh.site_id(site))
        self._check_refcount(b, ref, owner, site)

    def on_transfer(self, blocks: Iterable[int], src: str, dst: str, site: str) -> None:
        """Ownership handed from ``src`` to ``dst`` without touching the engine
        count (a request's reference kept alive by a CoW copy or a fenced free)."""
        sh = self.shadow
        for b in blocks:
            if b in sh.null:
                continue
            if sh.remove_owner(b, src):
                sh.nonrequest.add(dst)
                sh.add_owner(b, dst)
            else:
                self._report(
                    kinds.INVALID_RELEASE,
                    f"{src} handed over block {b}, which it does not hold",
                    [b], [src], src, site,
                )

    # -- transfers outside the engine's count --------------------------------
    def lease(self, name: str, blocks: Iterable[int]) -> None:
        """A transfer ``name`` reads or writes ``blocks`` outside the steps'
        order and outside the engine's count (a KV connector's load into a
        request's blocks, its send or a store job's read from them): it is a
        live owner of each until :meth:`end_lease`.  It adds no reference,
        so the table's counts stay the engine's; the check is where a block
        goes back to the free queue (:meth:`on_release`) or to a new owner
        (:meth:`on_allocate`).  A lease only protects: a transfer that never
        reports done holds nothing (its request's blocks are the leak
        checks' business) and ends after the grace period
        (:meth:`sweep_leases`)."""
        sh = self.shadow
        null, leased = sh.null, sh.leased
        got = self.leases.setdefault(name, [])
        for b in blocks:
            if b in null:
                continue
            holders = leased.get(b)
            if holders is None:
                leased[b] = [name]
            elif name in holders:
                continue
            else:
                holders.append(name)
            got.append(b)
        self.lease_since.setdefault(name, self.step())

    def end_lease(self, name: str) -> None:
        """Transfer ``name`` reported done: its blocks are the engine's again."""
        blocks = self.leases.pop(name, None)
        self.lease_since.pop(name, None)
        if blocks:
            self._unlease(name, blocks)

    def _unlease(self, name: str, blocks: Iterable[int]) -> None:
        leased = self.shadow.leased
        for b in blocks:
            holders = leased.get(b)
            if holders and name in holders:
                holders.remove(name)
                if not holders:
                    del leased[b]

    def _reuse_leased(self, b: int, owner: str, site: str) -> None:
        """Fresh block ``b``, handed to ``owner``, is still under a
        transfer: the new owner's KV and the transfer's meet in it.  The
        transfers' claims on it end with the report (the engine gave it
        away; the free that let it go was reported where it happened)."""
        holders = list(self.shadow.leased.get(b, ()))
        self._report(
            kinds.REUSE_WITH_LIVE_OWNERS,
            f"block {b} handed to {owner} while {', '.join(holders)} (a KV transfer not "
            "yet reported done) still reads or writes it",
            [b], holders, owner, site,
        )
        for name in holders:
            blocks = self.leases.get(name)
            if blocks is not None and b in blocks:
                blocks.remove(b)
            self._unlease(name, (b,))

    def sweep_leases(self, grace_steps: int) -> None:
        """Leases older than the grace period end: a transfer the engine
        never reported done (its report lost, or its request dropped) must
        not turn the blocks' later, legal frees into reports."""
        now = self.step()
        for name in [n for n, since in self.lease_since.items() if now - since > grace_steps]:
            self.end_lease(name)

    # -- liveness -------------------------------------------------------------
    def on_engine_stops(self, still_tracked, site: str) -> None:
        """The scheduler answered that it has no work: the engine stops
        stepping until a new request arrives.  A delayed free completes on a
        step (the connector's "done" arrives with a step's output), so a
        finished request still holding blocks on a delayed-free path keeps
        them for as long as the engine is idle: each is a leak now
        (``still_tracked``: the requests the engine still holds state for;
        those it already let go are drained first)."""
        if not self.pending_release:
            return
        self.drain_pending(still_tracked, site)
        for rid in list(self.pending_release):
            reason = self.pending_reasons.get(rid, "finished")
            self.on_request_released(
                rid, f"{reason}; the engine stopped stepping with its delayed free pending",
                site)

    def on_stall(self, holders: Sequence[tuple[str, str]], steps: int, free: int | None,
                 site: str) -> None:
        """The engine stepped ``steps`` times without progress (no token
        scheduled, no request finished, no transfer done, none pending,
        none waiting on anything outside the engine) while ``holders``
        ((request, state)) hold blocks: none can run and none will let its
        blocks go, so they are held for good (a deadlock under KV
        pressure).  One report names every holder and every block."""
        sh = self.shadow
        blocks, owners, parts = [], [], []
        for rid, state in holders:
            held = sh.blocks_of(rid)
            if not held:
                continue
            blocks += held
            owners.append(rid)
            parts.append(f"{rid} ({state}, {len(held)} block(s))")
        if not owners:
            return
        free_txt = "" if free is None else f" with {free} free block(s)"
        self._report(
            kinds.LEAKED_BLOCKS,
            f"the engine stepped {steps} times without progress{free_txt} while "
            f"{', '.join(parts)} hold blocks none of them can run with: a stall; they are "
            "never released",
            sorted(set(blocks)), owners, owners[0], site,
        )

    def table_still_references(self, owner: str, blocks: Sequence[int], site: str) -> None:
        """After ``owner``'s free ran, its block table still lists ``blocks``:
        any of them it no longer owns has been freed under a live reader."""
        sh = self.shadow
        stale = [b for b in blocks if b not in sh.null and not sh.is_owner(b, owner)]
        if stale:
            self._report(
                kinds.FREE_WITH_LIVE_OWNERS,
                f"{owner}'s blocks {stale} were released but its block table still "
                "references them",
                stale, [owner], owner, site,
            )

    def on_cached(self, items: Iterable[tuple[int, bytes | None]]) -> None:
        sh = self.shadow
        for b, key in items:
            if b not in sh.null:
                sh.set_cached(b, key)

    def on_uncached(self, blocks: Iterable[int]) -> None:
        sh = self.shadow
        for b in blocks:
            sh.set_uncached(b)

    def on_uncache_all(self) -> None:
        sh = self.shadow
        for b in sh.cached_blocks():
            sh.set_uncached(b)

    def on_stale_hits(self, consumer: str, blocks: Sequence[int], site: str) -> None:
        """``consumer`` was served ``blocks`` as prefix hits, but none of
        them carries a cache key (the adapter checks the engine's keys).
        The engine's cache map hands out only blocks registered under a
        key, and an eviction drops the key and the map entry together; a
        block without a key behind a hit is a map entry left behind when
        the block's key was dropped (evicted, or handed out fresh without
        an eviction), so the hit reads whatever the block holds now.  The
        owners at stake: ``consumer`` and whoever holds the block now."""
        sh = self.shadow
        for b in blocks:
            holders = [o for o in sh.owners(b) if o != consumer]
            now = f", which {', '.join(holders)} hold(s) now" if holders else ""
            self._report(
                kinds.STALE_CACHE_HIT,
                f"{consumer} was served block {b} as a prefix hit, but the block carries no "
                f"cache key: the cache map still points a key at it after its key was "
                f"dropped{now}",
                [b], holders + [consumer], consumer, site,
            )

    # -- steps in flight ----------------------------------------------------
    def inflight_released(self, step: int, rid: str, obs: Sequence[tuple[int, int]],
                          evicted, site: str | None = None) -> list[int]:
        """Blocks that the step scheduled at ``step``, whose output the
        engine has not processed yet, reads or writes for ``rid``, looked at
        after ``rid`` let some go.  ``obs``: (block, the engine's reference
        count now); ``evicted``: the blocks evicted to be reused since the
        last look (a container).  The step is a live owner (``step:<n>``) of
        each: one no longer held for ``rid`` (by it, or by a fenced free,
        connector transfer or copy made for it) and back in the free queue
        is ``free_with_live_owners``; one handed to a new owner since (a
        reference again, and fresh: uncached, or evicted) is also
        ``reuse_with_live_owners``.  One taken by a prefix hit (still cached
        under its key) or still shared is only read by both: nothing.
        ``site``: the faulty call, else the block's last release.  Returns
        the blocks reported freed and not yet reused (the adapter watches
        them for a reuse until the step is processed)."""
        sh = self.shadow
        owner = f"{STEP}{step}"
        held_for = (rid,) + tuple(p + rid for p in _HELD_FOR)
        watch = []
        for b, ref in obs:
            if b in sh.null or any(sh.is_owner(b, o) for o in held_for):
                continue
            if ref > 0 and sh.cached[b] and b not in evicted:
                continue  # a prefix hit on it, or another holder: readers only
            where = site or sh.sites[sh.rel_site[b]]
            self._report(
                kinds.FREE_WITH_LIVE_OWNERS,
                f"block {b} returned to the free queue by {rid} while step {step}, "
                f"scheduled and not yet processed, still reads or writes it for {rid}",
                [b], [owner], rid, where,
            )
            if ref > 0:
                self.inflight_reused(step, b)
            else:
                watch.append(b)
        return watch

    def inflight_reused(self, step: int, b: int) -> None:
        """Block ``b``, freed under the step scheduled at ``step`` (see
        :meth:`inflight_released`), was handed to a new owner before that
        step's output was processed (reported at its last acquire's site)."""
        sh = self.shadow
        holders = sh.owners(b)
        site = sh.sites[sh.acq_site[b]]
        self._report(
            kinds.REUSE_WITH_LIVE_OWNERS,
            f"block {b} handed to {', '.join(holders) or 'a new owner'} while step {step}, "
            "scheduled and not yet processed, still reads or writes it",
            [b], [f"{STEP}{step}"], holders[0] if holders else None, site,
        )

    # -- request lifecycle --------------------------------------------------
    def on_request_released(self, rid: str, reason: str, site: str, final: bool = True) -> None:
        """``rid``'s release path has run (finish, abort, preemption): it must
        hold nothing.  ``final`` marks a request that will never come back
        (not a preemption), so what it still holds is leaked for good."""
        if self.pending_release:
            self.pending_release.pop(rid, None)
            self.pending_reasons.pop(rid, None)
        if self.connector_held and final:  # (what the connector kept is the request's)
            self.on_connector_done(rid, site)
        if final:
            self._note_end(rid, reason)
        if not final:
            self._counters["preempted"] += 1
        sh = self.shadow
        if not sh.held.get(rid) or rid in sh.ended:
            return  # clean, or this leak is already reported
        blocks = sh.blocks_of(rid)
        if final:
            sh.ended[rid] = (reason, self.step())
        self._report(
            kinds.LEAKED_BLOCKS,
            f"request {rid} ({reason}) still holds {len(blocks)} block(s) after its "
            "release path ran",
            blocks, [rid], rid, site,
        )

    RECENT_ENDS = 4096

    def _note_end(self, rid: str, reason: str) -> None:
        """File ``rid``'s end in :attr:`recent_ends`.  The ends of one step
        for one reason share their ``(reason, step)`` tuple: one per end was
        one more object per request for the garbage collector, and every
        one stayed until RECENT_ENDS were filed (kvsan._native._hookfast's clean
        end shares its own the same way)."""
        ends = self.recent_ends
        ends.pop(rid, None)
        value, step = self._end_value, self.step()
        if value[1] != step or value[0] != reason:
            value = self._end_value = (reason, step)
        ends[rid] = value
        if len(ends) > self.RECENT_ENDS:
            del ends[next(iter(ends))]

    def on_request_pending_release(self, rid: str, reason: str | None = None) -> None:
        """``rid`` finished (``reason``) but the engine legally delays its free."""
        self.pending_release.setdefault(rid, self.step())
        if reason is not None:
            self.pending_reasons[rid] = reason

    def on_connector_hold(self, rid: str, blocks: Sequence[int], site: str) -> None:
        """``rid`` finished and its KV connector delayed the free of
        ``blocks`` (its references): they pass to ``xfer:<rid>`` until the
        connector reports the transfer finished (:meth:`on_connector_done`).
        The request releasing one of them before then frees it under the
        connector's read or write (``free_with_live_owners``)."""
        self.on_transfer(blocks, rid, XFER + rid, site)
        self.connector_held.add(rid)

    def on_connector_done(self, rid: str, site: str) -> None:
        """The connector reported ``rid``'s transfer finished: what it still
        holds is the request's again, for the scheduler's late free."""
        if rid not in self.connector_held:
            return
        self.connector_held.discard(rid)
        dst = XFER + rid
        if self.shadow.held_count(dst):
            self.on_transfer(self.shadow.blocks_of(dst), dst, rid, site)
        self.shadow.nonrequest.discard(dst)  # (one per request: not kept)

    def drain_pending(self, still_tracked, site: str) -> None:
        """The delayed frees the engine has completed since: each request of
        :attr:`pending_release` no longer in ``still_tracked`` (the requests
        the engine still holds state for) has run its release path and must
        hold nothing.  An adapter calls it once per step, so the engine's
        late free needs no hook of its own."""
        # in the order they ended; a C loop (no Python frame per request):
        # on a prefill node whose consumers are slow, thousands can be pending
        done = list(filterfalse(still_tracked.__contains__, self.pending_release))
        for rid in done:
            self.on_request_released(rid, self.pending_reasons.get(rid, "finished"), site)

    def sweep(self, grace_steps: int, site: str = "kvsan.sweep") -> None:
        """Delayed frees that outlived their grace period are leaks."""
        if not self.pending_release:
            return
        now = self.step()
        late = []
        for rid, since in self.pending_release.items():
            if now - since <= grace_steps:
                break  # kept in the order they ended: the rest are younger
            late.append((rid, since))
        for rid, since in late:
            self.on_request_released(rid, f"delayed free pending {now - since} steps", site)

    # -- full audit ---------------------------------------------------------
    def _disagreeing(self, refs, linked) -> list[int]:
        """Non-null blocks whose engine view (count, free-queue membership)
        disagrees with the table: count != owners, linked while referenced
        or owned, or neither linked nor referenced nor owned."""
        sh = self.shadow
        n = sh.num_blocks
        if n == 0:
            return []
        ref_v = np.asarray(refs, dtype=np.int64)[:n]
        lnk_v = np.asarray(linked, dtype=bool)[:n]
        own_v = np.frombuffer(sh.nown, dtype=np.int32)
        free_v = (ref_v == 0) & (own_v == 0)
        bad = ref_v != own_v
        del own_v  # release the view of the array's buffer
        bad |= lnk_v ^ free_v
        for b in sh.null:
            if 0 <= b < n:
                bad[b] = False
        return np.flatnonzero(bad).tolist()

    def audit(
        self,
        refs: Sequence[int],
        linked: Sequence[bool],
        live_requests: set[str] | None,
        site: str = "kvsan.audit",
        free_count: int | None = None,
    ) -> int:
        """Compare the whole table with the engine's view; returns findings.
        ``refs``/``linked``: the engine's count and free-queue membership per
        block (sequences or numpy arrays); ``live_requests``: requests the
        engine still tracks (None: unknown); ``free_count``: the number of
        free blocks the engine's free queue counts (None: unknown), which
        must be the number linked in it: the scheduler admits and preempts
        by that count, so a count below it strands blocks nobody holds, and
        one above it hands out blocks the queue does not have.

        Vectorised: one numpy pass over the pool finds the blocks where the
        engine and the table disagree, and only those are examined one by one
        (a 1M-block pool takes milliseconds, not seconds)."""
        sh = self.shadow
        found = 0
        seen = self._audit_seen

        def once(kind, b, owner, message, blocks, owners):
            nonlocal found
            key = (kind, b, owner)
            if key in seen:
                return
            seen.add(key)
            found += 1
            self._report(kind, message, blocks, owners, None, site)

        for b in self._disagreeing(refs, linked):
            ref = int(refs[b])
            n = sh.nown[b]
            if ref != n and b not in self._mismatched:
                once(kinds.REFCOUNT_MISMATCH, b, ref,
                     f"block {b}: engine ref count {ref} but {n} owner(s) hold it",
                     [b], sh.owners(b))
            if bool(linked[b]) and (ref != 0 or n):
                once(kinds.FREE_QUEUE_CORRUPTION, b, ref,
                     f"block {b} is in the free queue with ref count {ref} and {n} owner(s)",
                     [b], sh.owners(b))
            if not bool(linked[b]) and ref == 0 and n == 0:
                once(kinds.LEAKED_BLOCKS, b, None,
                     f"block {b} is neither free nor owned (orphan)", [b], [])
        if free_count is not None:
            n_linked = int(np.count_nonzero(np.asarray(linked, dtype=bool)[:sh.num_blocks]))
            if free_count != n_linked:
                once(kinds.FREE_QUEUE_CORRUPTION, None, ("count", free_count, n_linked),
                     f"the free queue counts {free_count} free block(s) but {n_linked} "
                     "are linked in it", [], [])
        if live_requests is not None:
            for owner in sorted(sh.held):  # (one order for either map, any hash seed)
                if owner in sh.nonrequest or owner in sh.ended or owner in live_requests:
                    continue
                blocks = sh.blocks_of(owner)
                once(kinds.LEAKED_BLOCKS, None, owner,
                     f"{owner} holds {len(blocks)} block(s) but the engine no longer "
                     "tracks it", blocks, [owner])
                sh.ended[owner] = ("unknown to the scheduler", self.step())
        return found
