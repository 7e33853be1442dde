"""Production mode's rules (``KVSAN_SAMPLE``): a sampled share of requests
gets the lifetime checks, the rest are counted by the engine's own
reference count only.

GWP-ASan and KFENCE guard a few allocations fully and let the rest run at
native speed.  Here the unit is the request: the :class:`Sampler` decides
once per request, at admission, from a keyed hash of its id (the key moves
every epoch, so a request id, or a prefix only some clients send, is not
left out for good).  The adapter *guards* the blocks a sampled request
holds (its reference count traps into :class:`SampledChecker`); every other
block is never seen.

A guarded block knows its sampled owners by name; its other holders are
anonymous, counted in the engine's ``ref_cnt``.  The rule is the full
mode's, with that count standing in for the unnamed owners: a reference
dropped by anyone that leaves fewer references than sampled owners still
holding the block is ``free_with_live_owners``; a block taken back from the
free queue by another request while a sampled owner still holds it is
``reuse_with_live_owners``.  "Still holding" is confirmed against the
engine's own block tables before anything is reported (``holds``), so a
release kvsan could not attribute is forgotten, never reported.

Pool-wide, for every request: after every step the free count is within
the pool (``free_queue_corruption``); when the engine goes idle, every
block but the null block is free (``leaked_blocks``,
``refcount_underflow``) and the free queue counts them all
(``free_queue_corruption``).

Engine-agnostic: block ids, request ids, counts and call sites only.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from typing import Callable

from .. import kinds
from ..report import Violation

#: requests admitted per sampling epoch: the key moves after each
EPOCH_REQUESTS = 1024
#: blocks guarded at most (KFENCE's fixed pool): a request admitted while
#: the budget is spent is not sampled (``budget_full`` counts them)
GUARD_BUDGET = 8192


class Sampler:
    """Which requests are watched: ``rate`` of them, by a keyed hash of
    the request id.  The key is derived from ``seed`` and the epoch number;
    the epoch moves every ``epoch_requests`` admissions."""

    def __init__(self, rate: float, seed: int | None = None,
                 epoch_requests: int = EPOCH_REQUESTS):
        self.rate = rate
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
        self.epoch_requests = epoch_requests
        self.threshold = int(rate * 2 ** 64)
        self.epoch = -1
        self.admitted = 0
        self._key = b""
        self._set_epoch(0)

    def _set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._key = hashlib.blake2b(f"{self.seed}:{epoch}".encode(), digest_size=16).digest()

    def key_value(self, request_id: str, epoch: int | None = None) -> int:
        """The 64-bit hash that decides ``request_id`` in ``epoch`` (default: now)."""
        key = self._key if epoch is None or epoch == self.epoch else hashlib.blake2b(
            f"{self.seed}:{epoch}".encode(), digest_size=16).digest()
        h = hashlib.blake2b(request_id.encode(), digest_size=8, key=key)
        return int.from_bytes(h.digest(), "little")

    def would_sample(self, request_id: str, epoch: int | None = None) -> bool:
        """The decision for ``request_id`` in ``epoch``, without admitting it."""
        return self.key_value(request_id, epoch) < self.threshold

    def admit(self, request_id: str) -> bool:
        """Decide ``request_id`` (once, at its admission) and count it."""
        if self.admitted and self.admitted % self.epoch_requests == 0:
            self._set_epoch(self.epoch + 1)
        self.admitted += 1
        return self.key_value(request_id) < self.threshold


class SampledChecker:
    """The sampled owners of one pool's guarded blocks, and the rules above.

    ``holds(owner, block)``: whether the engine's block tables still list
    ``block`` for ``owner`` (the adapter reads them).  ``emit``: where a
    :class:`Violation` goes.  ``step``: the scheduler step now."""

    def __init__(self, num_blocks: int, emit: Callable, step: Callable[[], int],
                 holds: Callable[[str, int], bool], null_blocks=(), pool: str = "gpu",
                 budget: int = GUARD_BUDGET):
        self.num_blocks = num_blocks
        self.emit = emit
        self.step = step
        self.holds = holds
        self.null_blocks = frozenset(null_blocks)
        self.pool = pool
        self.budget = budget
        #: block -> {sampled owner: (step, call site) of its acquire}
        self.owners: dict[int, dict[str, tuple[int, str]]] = {}
        #: sampled requests alive -> how many blocks each group's table had
        self.live: dict[str, list[int]] = {}
        #: block -> (owner, step, call site) of its last release by a sampled owner
        self.last_release: dict[int, tuple[str, int, str]] = {}
        self.counters: Counter[str] = Counter()
        self.guarded_peak = 0
        #: blocks the engine can hand out (all but the null blocks)
        self.usable = num_blocks - len(self.null_blocks)
        self._free_reported = False

    # -- admission -------------------------------------------------------------
    def admit(self, request_id: str) -> bool:
        """A sampled request enters; False (not watched) when the guard
        budget is spent."""
        if len(self.owners) >= self.budget:
            self.counters["budget_full"] += 1
            return False
        self.live[request_id] = []
        self.counters["sampled_requests"] += 1
        return True

    def ended(self, request_id: str) -> None:
        self.live.pop(request_id, None)

    # -- events on guarded blocks -----------------------------------------------
    def adopt(self, block: int, owner: str, site: str) -> bool:
        """``owner`` (sampled) holds ``block``: True if it was not yet its owner."""
        held = self.owners.get(block)
        if held is None:
            held = self.owners[block] = {}
            if len(self.owners) > self.guarded_peak:
                self.guarded_peak = len(self.owners)
        if owner in held:
            return False
        held[owner] = (self.step(), site)
        self.counters["adopted"] += 1
        return True

    def dropped(self, block: int, ref: int, actor: str | None, site: str) -> bool:
        """One reference to guarded ``block`` dropped (engine count now
        ``ref``) by ``actor`` at ``site``; the adapter calls it only when
        ``ref`` is below the sampled owners' number.  Returns True when the
        block has no sampled owner left (the adapter stops guarding it)."""
        held = self.owners.get(block)
        if held is None:
            return True
        if actor in held:
            del held[actor]
            self.last_release[block] = (actor, self.step(), site)
            self.counters["released"] += 1
        if held and ref < len(held):
            live = self._confirmed(block, held)
            if ref < len(live):
                self._report(kinds.FREE_WITH_LIVE_OWNERS,
                             f"block {block}: a reference dropped by {actor or 'an unnamed caller'} "
                             f"leaves {max(ref, 0)} for {len(live)} sampled owner(s) still holding it",
                             block, live, actor, site)
        if ref < 0:
            self._report(kinds.REFCOUNT_UNDERFLOW,
                         f"block {block}: engine ref count went to {ref}",
                         block, list(held) or [actor or "?"], actor, site)
        if not held:
            del self.owners[block]
            return True
        return False

    def taken(self, block: int, ref_before: int, actor: str | None, site: str) -> None:
        """A reference to guarded ``block`` taken by ``actor``: from the free
        queue (``ref_before`` 0) while a sampled owner still holds it is a reuse."""
        held = self.owners.get(block)
        if not held or ref_before > 0 or actor in held:
            return
        live = self._confirmed(block, held)
        if live:
            self._report(kinds.REUSE_WITH_LIVE_OWNERS,
                         f"block {block}: taken from the free queue by {actor or 'an unnamed caller'} "
                         f"while {len(live)} sampled owner(s) still hold it",
                         block, live, actor, site)

    def short(self, block: int, ref: int, owner: str, site: str) -> None:
        """Found when ``owner`` is seen holding ``block``: fewer references
        than the sampled owners holding it (a reference never taken)."""
        held = self.owners.get(block) or {}
        live = self._confirmed(block, held)
        if ref < len(live):
            self._report(kinds.FREE_WITH_LIVE_OWNERS,
                         f"block {block}: engine ref count {ref} for {len(live)} sampled owner(s) "
                         f"holding it (a reference was never taken, or dropped early)",
                         block, live, owner, site)

    def _confirmed(self, block: int, held: dict) -> list[str]:
        """The sampled owners the engine's tables still show holding
        ``block``; the others' releases were not attributed: forgotten."""
        live = [o for o in held if self.holds(o, block)]
        for o in [o for o in held if o not in live]:
            del held[o]
            self.counters["unattributed_release"] += 1
        return sorted(live)

    # -- request end --------------------------------------------------------------
    def leaked(self, request_id: str, blocks: list[int], site: str) -> None:
        """``request_id``'s release path ran and its tables still list ``blocks``."""
        if blocks:
            self._report(kinds.LEAKED_BLOCKS,
                         f"request {request_id} ended holding {len(blocks)} block(s)",
                         blocks, [request_id], request_id, site)

    # -- pool-wide, every request ------------------------------------------------
    def free_count(self, num_free: int, site: str, unreferenced: int | None = None) -> None:
        """The engine's free count out of its range (checked every step),
        or not the number of unreferenced blocks (``unreferenced``, when
        counted).  Reported once: it stays wrong."""
        if not self._free_reported:
            self._free_reported = True
            what = (f"outside 0..{self.usable} (the pool's usable blocks)" if unreferenced is None
                    else f"but {unreferenced} blocks unreferenced")
            self._report(kinds.FREE_QUEUE_CORRUPTION, f"free count {num_free} {what}",
                         [], ["unsampled"], None, site)

    def conservation(self, refs: list[int], num_free: int, site: str) -> None:
        """The free count equals the blocks no one references (the null
        blocks aside): ``KVSAN_AUDIT_EVERY``'s audit in production mode."""
        unreferenced = sum(1 for b, r in enumerate(refs) if r == 0 and b not in self.null_blocks)
        if num_free != unreferenced:
            self.free_count(num_free, site, unreferenced)

    def idle_audit(self, refs: list[int], num_free: int, site: str = "kvsan.idle") -> int:
        """At idle, every block but the null block is free: ``refs`` is the
        engine's reference count per block, ``num_free`` its free count."""
        held = [b for b, r in enumerate(refs) if r > 0 and b not in self.null_blocks]
        under = [b for b, r in enumerate(refs) if r < 0 and b not in self.null_blocks]
        found = 0
        if held:
            owners = sorted({o for b in held for o in self.owners.get(b, {})} or {"unsampled"})
            self._report(kinds.LEAKED_BLOCKS,
                         f"{len(held)} block(s) still referenced with no request left",
                         held, owners, None, site)
            found += 1
        if under:
            self._report(kinds.REFCOUNT_UNDERFLOW,
                         f"{len(under)} block(s) with a negative reference count at idle",
                         under, ["unsampled"], None, site)
            found += 1
        expected = self.num_blocks - len(self.null_blocks) - len(held)
        if num_free != expected:
            self._report(kinds.FREE_QUEUE_CORRUPTION,
                         f"free count {num_free} at idle, {expected} blocks unreferenced",
                         [], ["unsampled"], None, site)
            found += 1
        self.counters["idle_audits"] += 1
        return found

    def _report(self, kind: str, message: str, blocks, owners, actor, site) -> None:
        blocks = [blocks] if isinstance(blocks, int) else list(blocks)
        self.counters["reported"] += 1
        self.emit(Violation(kind=kind, message=message, blocks=blocks, owners=sorted(set(owners)),
                            actor=actor, step=self.step(), site=site,
                            details=[self.describe(b) for b in blocks[:16]], pool=self.pool))

    def describe(self, block: int) -> dict:
        """What kvsan knows of ``block``: its sampled owners' acquires and
        the last release by a sampled owner."""
        d: dict = {"block": block, "sampled": True}
        held = self.owners.get(block)
        if held:
            d["owners"] = {o: {"step": s, "site": site} for o, (s, site) in sorted(held.items())}
        last = self.last_release.get(block)
        if last is not None:
            d["last_release"] = {"owner": last[0], "step": last[1], "site": last[2]}
        return d

    def stats(self) -> dict:
        return {"guarded": len(self.owners), "guarded_peak": self.guarded_peak,
                "sampled_live": len(self.live), **self.counters}
