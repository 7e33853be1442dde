"""The shadow ownership table: kvsan's own record of every KV block.

Engine-agnostic: blocks are integer ids, owners are strings (a request id, or
a non-request owner such as ``cow:<req>`` for copy-on-write retention,
``deferred:<req>`` for a fenced free, ``pin:<site>`` for a connector pin).

Layout is per-block arrays, not an object per block, so a 1M-block pool costs
tens of bytes per block: the first owner of a block lives in ``own0``, its
second in ``own1`` (most shared blocks have two owners: a prefix hit; a slot
in a list is a store where a dict entry was a hash insert and delete per
shared block and event); the owners from the third on live in ``more`` (the
one further owner itself, a list only from two on: a list and its item
array cost 64 bytes more); ``nown`` counts the owners of every block (a C
int array, so the full audit compares it with the engine's counts as one
vector).  Provenance of the last acquire and release is kept per block as
(owner, step, interned call site).  About 57 bytes per block (8 own0, 8
own1, 4 nown, 1 cached, 8 hash reference, 2 x (8 + 4 + 2) provenance).
"""

from __future__ import annotations

from array import array
import sys as _sys
import time as _time
from typing import Iterable


#: call sites interned per table (their ids are 2-byte array items)
MAX_SITES = 1 << 16


def _zero() -> int:
    return 0


#: time.monotonic's clock read at its last tick (a few ms; never later than
#: time.monotonic()): "held since" is reported in seconds, and
#: kvsan._native._shadowfast's map reads the same clock (Linux's clock id 6;
#: Python's time module does not name it)
_COARSE = getattr(_time, "CLOCK_MONOTONIC_COARSE",
                  6 if _sys.platform.startswith("linux") else None)


def _held_clock() -> float:
    return _time.monotonic() if _COARSE is None else _time.clock_gettime(_COARSE)


class PyHold:
    """What an owner holds: ``n`` references, since ``when``
    (complex(monotonic time, step)), as read from :class:`HeldMap`."""

    __slots__ = ("n", "when")

    def __init__(self, n: int, when: complex):
        self.n = n
        self.when = when

    def __repr__(self) -> str:
        return f"Hold(n={self.n}, when={self.when!r})"


class PyHeldMap:
    """owner -> what it holds: ``take`` / ``drop`` change it, reads give
    :class:`Hold` records (kvsan._native._shadowfast's map, in Python: used where
    that module is not built; tests hold the two to one behaviour)."""

    __slots__ = ("_d",)

    def __init__(self):
        self._d: dict[str, PyHold] = {}

    def _key(self, owner):
        if not isinstance(owner, str):
            raise TypeError(f"kvsan shadow.held: an owner is a str, not "
                            f"{type(owner).__name__}")
        return owner

    def take(self, owner: str, n: int, step: int) -> None:
        h = self._d.get(self._key(owner))
        if h is not None:
            h.n += n
        else:
            self._d[owner] = PyHold(n, complex(_held_clock(), step))

    def drop(self, owner: str, n: int) -> int:
        h = self._d[self._key(owner)]
        h.n -= n
        if not h.n:
            del self._d[owner]
        return h.n

    def get(self, owner, default=None):
        h = self._d.get(owner) if isinstance(owner, str) else None
        return default if h is None else PyHold(h.n, h.when)

    def __getitem__(self, owner) -> PyHold:
        h = self._d[self._key(owner)]
        return PyHold(h.n, h.when)

    def __contains__(self, owner) -> bool:
        return isinstance(owner, str) and owner in self._d

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self):
        return iter(list(self._d))

    def keys(self) -> list[str]:
        return list(self._d)

    def items(self) -> list[tuple[str, PyHold]]:
        return [(o, PyHold(h.n, h.when)) for o, h in self._d.items()]

    def __repr__(self) -> str:
        return f"HeldMap({self.items()!r})"


#: the map a new :class:`ShadowTable` keeps ``held`` in, and the record it
#: reads out: these until :func:`kvsan.hooks.use_native` switches to
#: kvsan._native._shadowfast's (entries inline); never with KVSAN_NATIVE=0
HeldMap, Hold = PyHeldMap, PyHold


class ShadowTable:
    def __init__(self, num_blocks: int, null_blocks: Iterable[int] = (0,)):
        n = int(num_blocks)
        self.num_blocks = n
        self.null = frozenset(null_blocks)
        self.own0: list[str | None] = [None] * n
        #: the second owner of each block (set only while own0 is)
        self.own1: list[str | None] = [None] * n
        #: block -> its third owner (a str), or a list of its owners from the
        #: third on (two or more; only while own1 is set)
        self.more: dict[int, str | list[str]] = {}
        #: number of owners of each block (1 + len(extras(b)) when own0[b] is set)
        self.nown = array("i", bytes(4 * n))
        self.cached = bytearray(n)
        #: cache key of each cached block (a reference to the engine's key)
        self.hashes: list[bytes | None] = [None] * n
        self.acq_owner: list[str | None] = [None] * n
        self.acq_step = array("i", bytes(4 * n))
        #: interned call sites, 2 bytes each (:data:`MAX_SITES`)
        self.acq_site = array("H", bytes(2 * n))
        self.rel_owner: list[str | None] = [None] * n
        self.rel_step = array("i", bytes(4 * n))
        self.rel_site = array("H", bytes(2 * n))
        self.sites: list[str] = ["?"]
        self._site_ids: dict[str, int] = {"?": 0}
        #: owner -> what it holds (:class:`HeldMap`: its references, >= 1,
        #: and since when it holds any, (monotonic time, step), inline; read
        #: as :class:`Hold` records).  Only owners holding >= 1; read
        #: through :meth:`held_count` and :meth:`since_of`.
        self.held = HeldMap()
        #: requests whose release path ran while they still held blocks
        self.ended: dict[str, tuple[str, int]] = {}
        #: owners that are not requests (cow:, deferred:, pin:, anon:)
        self.nonrequest: set[str] = set()
        #: block -> the transfers that hold it outside the engine's count
        #: (a KV connector's load into it, a send or save from it): leases,
        #: kept by :class:`~kvsan.checks.allocator.AllocatorChecker`.  Only
        #: blocks with one; an adapter's fast path takes any event on them
        #: to the checker.
        self.leased: dict[int, list[str]] = {}
        #: the step counter (set by the checker); read only for new owners
        self.clock = _zero
        self._n_owned = 0
        self._n_cached_free = 0
        #: an adapter's fast path that keeps part of the totals (and its
        #: checker's counters) as C integers: called before they are read.
        #: They are sums, so updates here go to ``_n_owned`` /
        #: ``_n_cached_free`` directly, in any order with the fast path's.
        self.settle = None

    # -- totals (blocks with an owner; cached blocks without one) -----------
    @property
    def n_owned(self) -> int:
        if self.settle is not None:
            self.settle()
        return self._n_owned

    @n_owned.setter
    def n_owned(self, value: int) -> None:
        self._n_owned = value

    @property
    def n_cached_free(self) -> int:
        if self.settle is not None:
            self.settle()
        return self._n_cached_free

    @n_cached_free.setter
    def n_cached_free(self, value: int) -> None:
        self._n_cached_free = value

    # -- interning ----------------------------------------------------------
    def site_id(self, site: str | None) -> int:
        """The interned id of call site ``site``; 0 ("?") once
        :data:`MAX_SITES` are interned (sites are code locations: a few
        hundred in a real engine)."""
        if not site:
            return 0
        sid = self._site_ids.get(site)
        if sid is None:
            if len(self.sites) >= MAX_SITES:
                return 0
            sid = self._site_ids[site] = len(self.sites)
            self.sites.append(site)
        return sid

    def since_of(self, owner: str) -> tuple[float, int] | None:
        """(monotonic time, step) at which ``owner`` began to hold blocks
        (``kvsan owners``: "for how long")."""
        h = self.held.get(owner)
        return None if h is None else (h.when.real, int(h.when.imag))

    def held_count(self, owner: str) -> int:
        """The references ``owner`` holds (0: none)."""
        h = self.held.get(owner)
        return 0 if h is None else h.n

    # -- owners -------------------------------------------------------------
    def extras(self, b: int) -> list[str]:
        """The owners of ``b`` after its first (``own1`` and ``more``'s)."""
        o1 = self.own1[b]
        if o1 is None:
            return []
        extra = self.more.get(b)
        if extra is None:
            return [o1]
        return [o1, *extra] if type(extra) is list else [o1, extra]

    def owners(self, b: int) -> list[str]:
        o = self.own0[b]
        if o is None:
            return []
        return [o, *self.extras(b)]

    def live_owners(self, b: int) -> list[str]:
        ended = self.ended
        return [o for o in self.owners(b) if o not in ended]

    def num_owners(self, b: int) -> int:
        return self.nown[b]

    def is_owner(self, b: int, owner: str) -> bool:
        if self.own0[b] == owner or self.own1[b] == owner:
            return True
        extra = self.more.get(b)
        if extra is None:
            return False
        return owner in extra if type(extra) is list else extra == owner

    def _add_extra(self, b: int, owner: str) -> None:
        """``owner`` is one more owner of ``b``, whose first owner is set."""
        if self.own1[b] is None:
            self.own1[b] = owner
            return
        more = self.more
        extra = more.get(b)
        if extra is None:
            more[b] = owner
        elif type(extra) is list:
            extra.append(owner)
        else:
            more[b] = [extra, owner]

    def _pop_extra(self, b: int, extra, at: int = -1) -> str:
        """Take the owner at ``at`` out of ``extra``, ``b``'s entry in
        ``more``; a list left with one owner becomes that owner."""
        if type(extra) is not list:
            del self.more[b]
            return extra
        got = extra.pop(at)
        if len(extra) == 1:
            self.more[b] = extra[0]
        elif not extra:
            del self.more[b]
        return got

    def _pop_second(self, b: int) -> str | None:
        """Take ``b``'s second owner out (its place taken by the last of
        ``more``'s): the owner that moves up when one before it leaves."""
        extra = self.more.get(b)
        if extra is not None:
            return self._pop_extra(b, extra)
        o1 = self.own1[b]
        self.own1[b] = None
        return o1

    def add_owner(self, b: int, owner: str) -> None:
        if self.own0[b] is None:
            self.own0[b] = owner
            self._n_owned += 1
            if self.cached[b]:
                self._n_cached_free -= 1
        else:
            self._add_extra(b, owner)
        self.nown[b] += 1
        self._hold(owner, 1)

    def _hold(self, owner: str, n: int) -> None:
        """``owner`` holds ``n`` more references (since when, if it held none)."""
        held = self.held
        held.take(owner, n, 0 if owner in held else self.clock())

    def _unhold(self, owner: str, n: int) -> None:
        """``owner`` holds ``n`` references fewer; one that holds nothing is
        forgotten.  ``kvsan._native._shadowfast`` calls it by name for an owner that
        drops what it does not hold (KeyError here)."""
        if not self.held.drop(owner, n):
            self.ended.pop(owner, None)
            self.nonrequest.discard(owner)

    def acquire(self, blocks, owner: str, step: int, site: int) -> None:
        """``owner`` takes one reference on each of ``blocks``, with
        provenance: :meth:`add_owner` + :meth:`note_acquire` per block, the
        owner's count updated once (the allocator hot path)."""
        own0, nown, cached = self.own0, self.nown, self.cached
        acq_owner, acq_step, acq_site = self.acq_owner, self.acq_step, self.acq_site
        n = 0
        for b in blocks:
            if own0[b] is None:
                own0[b] = owner
                self._n_owned += 1
                if cached[b]:
                    self._n_cached_free -= 1
            else:
                self._add_extra(b, owner)
            nown[b] += 1
            acq_owner[b] = owner
            acq_step[b] = step
            acq_site[b] = site
            n += 1
        if n:
            self._hold(owner, n)

    def remove_owner(self, b: int, owner: str) -> bool:
        """Drop one reference of ``owner`` on ``b``; False if it held none."""
        if self.own0[b] == owner:
            if self.own1[b] is not None:
                self.own0[b] = self._pop_second(b)
            else:
                self.own0[b] = None
                self._n_owned -= 1
                if self.cached[b]:
                    self._n_cached_free += 1
        elif self.own1[b] is None:
            return False
        elif self.own1[b] == owner:
            extra = self.more.get(b)
            self.own1[b] = None if extra is None else self._pop_extra(b, extra)
        else:
            extra = self.more.get(b)
            if extra is None:
                return False
            if type(extra) is list:
                if owner not in extra:
                    return False
                self._pop_extra(b, extra, extra.index(owner))
            elif extra == owner:
                self._pop_extra(b, extra)
            else:
                return False
        self.nown[b] -= 1
        self._unhold(owner, 1)
        return True

    def clear_owners(self, b: int) -> list[str]:
        dropped = self.owners(b)
        for o in dropped:
            self.remove_owner(b, o)
        return dropped

    def blocks_of(self, owner: str) -> list[int]:
        """All blocks ``owner`` holds.  O(pool): used on violation paths and
        by on-demand queries only, never per step."""
        out = [b for b, o in enumerate(self.own0) if o == owner]
        out += [b for b, o in enumerate(self.own1) if o == owner]
        out += [b for b, extra in self.more.items()
                if (owner in extra if type(extra) is list else extra == owner)]
        return sorted(out)

    # -- cache state --------------------------------------------------------
    def set_cached(self, b: int, key: bytes | None) -> None:
        if not self.cached[b]:
            self.cached[b] = 1
            if self.own0[b] is None:
                self._n_cached_free += 1
        if key is not None:
            self.hashes[b] = key

    def set_uncached(self, b: int) -> None:
        if self.cached[b]:
            self.cached[b] = 0
            if self.own0[b] is None:
                self._n_cached_free -= 1
        self.hashes[b] = None

    def cached_blocks(self) -> list[int]:
        """Every block with the cache flag (C-speed scan of the flags)."""
        out, find = [], self.cached.find
        i = find(1)
        while i >= 0:
            out.append(i)
            i = find(1, i + 1)
        return out

    # -- provenance ---------------------------------------------------------
    def note_acquire(self, b: int, owner: str, step: int, site: int) -> None:
        self.acq_owner[b] = owner
        self.acq_step[b] = step
        self.acq_site[b] = site

    def note_release(self, b: int, owner: str, step: int, site: int) -> None:
        self.rel_owner[b] = owner
        self.rel_step[b] = step
        self.rel_site[b] = site

    def describe(self, b: int) -> dict:
        """Token-free description of a block for a report record."""
        key = self.hashes[b]
        return {
            "block": b,
            "owners": self.owners(b),
            "state": self.state(b),
            "hash": key.hex()[:16] if key else None,
            "last_acquire": {
                "owner": self.acq_owner[b],
                "step": self.acq_step[b],
                "site": self.sites[self.acq_site[b]],
            },
            "last_release": {
                "owner": self.rel_owner[b],
                "step": self.rel_step[b],
                "site": self.sites[self.rel_site[b]],
            },
            **({"leases": list(self.leased[b])} if b in self.leased else {}),
        }

    def state(self, b: int) -> str:
        if self.own0[b] is not None:
            return "owned"
        return "cached_evictable" if self.cached[b] else "free"

    def stats(self) -> dict[str, int]:
        usable = self.num_blocks - len(self.null)
        held = self.held
        leaked = sum(held[r].n for r in self.ended if r in held)
        # O(non-request + ended owners), not O(owners): this runs every step
        others = sum(1 for o in self.nonrequest if o in held)
        others += sum(1 for o in self.ended if o in held and o not in self.nonrequest)
        requests = len(held) - others
        return {
            "live_owned": self.n_owned,
            "cached_evictable": self.n_cached_free,
            "free": usable - self.n_owned - self.n_cached_free,
            "leaked": leaked,
            "tracked_requests": requests,
        }
