"""kvsan's C speed-ups against their pure-Python references on hand-made
cases, without vLLM: runs on every CPython they are built for (3.10 to
3.13; ``make test`` runs it on 3.11, the other lanes where set up).

* the four modules import, available, of the ABI the Python side calls;
* ``kvsan._native._frames.context`` / ``site`` (the call-context reader) give what
  :func:`kvsan.hooks.call_context` / ``call_site`` give on the Python route
  (``sys._getframe``, ``f_locals``), for owner locals that are plain,
  captured by a closure, read through an attribute, unbound or not a str;
* a ``kvsan._native._shadowfast.Table`` over a hand-made slotted block leaves the
  shadow table, counters and violations as the Python
  :class:`kvsan.checks.allocator.AllocatorChecker` alone does;
* ``kvsan._native._tokenlinks.links`` gives :meth:`RequestIdentity.extend`'s
  Python links (``hash((parent, tuple(tokens)))``), small and big ints;
* :func:`kvsan.hooks.property_slot` decides in Python which property is a
  plain slot read, and ``_shadowfast`` reads only those as slots.
"""

from __future__ import annotations

import sys

import pytest

from conftest import SPEEDUPS, SPEEDUPS_WHY

pytestmark = pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)


@pytest.fixture
def native():
    from kvsan import hooks

    assert hooks.use_native(True)
    yield hooks
    hooks.use_native(True)


def test_modules_built_available_and_of_the_called_abi(native):
    from kvsan._native import _frames, _hookfast, _shadowfast, _tokenlinks
    from kvsan.checks import identity

    assert _frames.AVAILABLE and _frames.ABI == native.FRAMES_ABI
    assert _frames.ROUTE == ("internal" if sys.version_info[:2] == (3, 11) else "public")
    assert _shadowfast.AVAILABLE and _shadowfast.ABI == native.SHADOWFAST_ABI
    assert _hookfast.AVAILABLE and _hookfast.ABI == native.HOOKFAST_ABI
    assert _tokenlinks.AVAILABLE and identity.use_native(True)
    assert native.NATIVE is _frames and native.SHADOWFAST is _shadowfast
    assert native.HOOKFAST is _hookfast
    # _hookfast reaches the other two through their capsules
    direct = _hookfast.direct()
    assert direct["frames"] and direct["shadow"], direct


# ----------------------------------------------------------- call context
class _Req:
    def __init__(self, rid):
        self.request_id = rid


def _both(fn, *args):
    """fn(*args) on the native route, then on the Python route."""
    from kvsan import hooks

    got = fn(*args)
    native, hooks.NATIVE = hooks.NATIVE, None
    try:
        want = fn(*args)
    finally:
        hooks.NATIVE = native
    return got, want


def _engine_plain(request_id, ctx):
    return _both(_pool_call, ctx)


def _engine_attr(request, ctx):
    return _both(_pool_call, ctx)


def _engine_cell(request_id, ctx):
    def inner():
        return request_id  # (request_id is a cell of this frame)

    inner()
    return _both(_pool_call, ctx)


def _engine_unbound(ctx):
    if ctx is None:
        request_id = "never"  # noqa: F841 - unbound when the pool is called
    return _both(_pool_call, ctx)


def _engine_nested(request_id, ctx):
    return _helper(ctx)


def _helper(ctx):
    return _both(_pool_call, ctx)


def _pool_call(ctx):
    from kvsan import hooks

    return hooks.call_context(0, ctx), hooks.call_site(0)


@pytest.fixture
def owners(native):
    from kvsan import hooks

    for fn, spec in ((_engine_plain, ("request_id", None)), (_engine_attr, ("request", "request_id")),
                     (_engine_cell, ("request_id", None)), (_engine_unbound, ("request_id", None)),
                     (_engine_nested, ("request_id", None))):
        assert hooks._register_owner(fn, spec)
    yield hooks
    for fn in (_engine_plain, _engine_attr, _engine_cell, _engine_unbound, _engine_nested):
        hooks.OWNER_FRAMES.pop(id(fn.__code__), None)
        hooks.OWNER_SLOTS.pop(id(fn.__code__), None)
    hooks._owners_changed()


@pytest.mark.parametrize("case", ["plain", "attr", "cell", "unbound", "nested", "not-str",
                                  "ctx", "none"])
def test_call_context_as_the_python_route(owners, case):
    ctx = [("from-ctx", "why")] if case == "ctx" else []
    if case == "plain" or case == "ctx":
        got, want = _engine_plain("R1", ctx)
    elif case == "attr":
        got, want = _engine_attr(_Req("R2"), ctx)
    elif case == "cell":
        got, want = _engine_cell("R3", ctx)
    elif case == "unbound":
        got, want = _engine_unbound(ctx)
    elif case == "nested":
        got, want = _engine_nested("R4", ctx)
    elif case == "not-str":
        got, want = _engine_plain(17, ctx)
    else:
        got, want = _both(_pool_call, ctx)
    assert got == want
    (site, owner), _ = got
    expect = {"plain": "R1", "attr": "R2", "cell": "R3", "nested": "R4", "ctx": "from-ctx"}
    assert owner == expect.get(case)
    assert site.startswith("test_native_portable.py:") and ":None" not in site


def test_owner_frames_changed_after_a_read(owners):
    """The reader's cache in front of the owner slots follows a removal and
    a new registration (``owners_changed``)."""
    hooks = owners
    assert _engine_plain("R5", [])[0][0][1] == "R5"
    hooks.OWNER_SLOTS.pop(id(_engine_plain.__code__))
    hooks.OWNER_FRAMES.pop(id(_engine_plain.__code__))
    hooks._owners_changed()
    got, want = _engine_plain("R5", [])
    assert got == want and got[0][1] is None
    assert hooks._register_owner(_engine_plain, ("request_id", None))
    assert _engine_plain("R6", [])[0][0][1] == "R6"


def test_context_deeper_than_the_stack_is_none(native):
    assert native.NATIVE.context(10_000, []) is None


# ----------------------------------------------------------- shadow table
class Block:
    """A slotted block with vLLM's KVCacheBlock's fields."""

    __slots__ = ("block_id", "ref_cnt", "prev_free_block", "next_free_block", "is_null",
                 "pool", "_block_hash")

    def __init__(self, i):
        self.block_id, self.ref_cnt, self.is_null, self.pool = i, 0, i == 0, None
        self.prev_free_block = self.next_free_block = self._block_hash = None

    @property
    def block_hash(self):
        return self._block_hash


class _Engine:
    """Just enough of a pool to move reference counts and the free queue."""

    def __init__(self, n):
        self.blocks = [Block(i) for i in range(n)]
        for b in self.blocks[1:]:
            b.prev_free_block = self.blocks[0]  # (only "is it linked" is read)

    def take(self, ids):
        out = [self.blocks[i] for i in ids]
        for b in out:
            b.ref_cnt += 1
            b.prev_free_block = None
        return out

    def drop(self, ids):
        out = [self.blocks[i] for i in ids]
        for b in out:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                b.prev_free_block = self.blocks[0]
        return out


def _drive(fast: bool):
    """Seeded-by-hand traffic with one fault (a double free), through the
    native table where ``fast`` (falling back as the hooks do), else the
    Python checker."""
    from kvsan import hooks
    from kvsan.checks.allocator import AllocatorChecker

    seen = []
    ck = AllocatorChecker(12, emit=seen.append, step=lambda: 3, null_blocks=(0,))
    if fast:
        ck.use_fast(hooks.SHADOWFAST.Table(ck.shadow, ck._mismatched, ck.counters))
    eng = _Engine(12)

    def allocate(ids, owner, site="eng.py:allocate:1"):
        blocks = eng.take(ids)
        if ck.fast is None or ck.fast.allocate(blocks, owner, 3, site) is None:
            ck.on_allocate([(b.block_id, b.ref_cnt) for b in blocks], owner, site)

    def share(ids, owner, site="eng.py:touch:2"):
        blocks = eng.take(ids)
        if ck.fast is None or ck.fast.share(blocks, owner, 3, site) is None:
            ck.on_share([(b.block_id, b.ref_cnt, b.prev_free_block is not None)
                         for b in blocks], owner, site)

    def cache(ids, key=b"k"):
        blocks = [eng.blocks[i] for i in ids]
        for b in blocks:
            b._block_hash = key + bytes([b.block_id])
        if ck.fast is None or ck.fast.cache(blocks) is None:
            ck.on_cached([(b.block_id, b.block_hash) for b in blocks])

    def release(ids, owner, site="eng.py:free:3"):
        blocks = [eng.blocks[i] for i in ids]
        snap = ck.fast.snapshot(blocks, None) if ck.fast is not None else None
        pre = {b.block_id: (b.ref_cnt, b.prev_free_block is not None) for b in blocks}
        eng.drop(ids)
        if snap is not None and ck.fast.release(blocks, snap, owner, 3, site) is not None:
            return
        ck.on_release([(b.block_id, *pre[b.block_id], b.ref_cnt, b.prev_free_block is not None)
                       for b in blocks], owner, site)

    allocate([1, 2, 3], "r1")
    cache([1, 2])
    share([1, 2], "r2")
    allocate([4, 5], "r2")
    release([3, 2, 1], "r1")
    allocate([6], "r3")
    release([5, 4, 2, 1], "r2")
    share([1], "r3")
    release([1, 6], "r3")
    release([6], "r3")  # the fault: a double free
    return ck, seen


def _state(ck) -> dict:
    sh = ck.shadow
    n = sh.num_blocks
    return {
        "own0": list(sh.own0), "own1": list(sh.own1), "nown": list(sh.nown),
        "cached": bytes(sh.cached), "hashes": list(sh.hashes),
        "acq": [(sh.acq_owner[b], sh.acq_step[b], sh.sites[sh.acq_site[b]]) for b in range(n)],
        "rel": [(sh.rel_owner[b], sh.rel_step[b], sh.sites[sh.rel_site[b]]) for b in range(n)],
        "held": {o: h.n for o, h in sh.held.items()}, "ended": dict(sh.ended),
        "n_owned": sh.n_owned, "n_cached_free": sh.n_cached_free, "stats": sh.stats(),
        "counters": dict(ck.counters), "mismatched": sorted(ck._mismatched),
    }


def test_shadow_table_as_the_python_checker(native):
    from kvsan import hooks

    hooks.property_slot(Block, "block_hash")
    ck_c, seen_c = _drive(True)
    ck_py, seen_py = _drive(False)
    assert _state(ck_c) == _state(ck_py)
    kinds = [(v.kind, v.blocks, v.owners) for v in seen_py]
    assert [(v.kind, v.blocks, v.owners) for v in seen_c] == kinds
    assert kinds == [("double_release", [6], ["r3"]), ("refcount_underflow", [6], ["r3"])]


def test_property_read_as_a_slot_only_when_python_says_so(native):
    from kvsan._native import _shadowfast

    class Computed(Block):
        __slots__ = ()

        @property
        def block_hash(self):
            return None if self._block_hash is None else self._block_hash

    assert native.property_slot(Block, "block_hash") is Block._block_hash
    assert native.property_slot(Computed, "block_hash") is None
    assert native.property_slot(Block, "block_id") is None  # (not a property)
    fields = ["block_id", "ref_cnt", "prev_free_block", "is_null", "pool", "block_hash"]
    assert _shadowfast.slot_reads(Block(1)) == fields
    assert _shadowfast.slot_reads(Computed(2)) == fields[:-1]

    class Hidden(Block):  # the slot the getter reads hidden behind a property
        __slots__ = ()

        @property
        def _block_hash(self):
            return b"other"

    h = object.__new__(Hidden)  # (its __init__ cannot set _block_hash)
    assert _shadowfast.slot_reads(h) == fields[:-1] and h.block_hash == b"other"


# ----------------------------------------------------------- token links
@pytest.mark.parametrize("tokens", [
    list(range(64)),
    [-1, -2, 0, 1, 2**30 - 1, 2**30, -(2**30) + 1, -(2**30), 2**31 + 5, 2**62, -(2**63),
     2**64 + 3, 2**61 - 1, 2**61, -(2**61) + 1, 7, 8, 9],
])
@pytest.mark.parametrize("parent", [0, -1, 1, 2**61 - 2, -(2**63), 2**63 - 1])
def test_token_links_as_python(native, tokens, parent):
    from kvsan._native import _tokenlinks

    bs = 3
    upto = len(tokens) // bs
    want, p = [], parent
    for k in range(upto):
        p = hash((p, tuple(tokens[k * bs:(k + 1) * bs])))
        want.append(p)
    assert list(_tokenlinks.links(tokens, bs, 0, upto, parent)) == want


def test_identity_chain_as_python(native):
    from kvsan.checks import identity

    tokens = [3, 2**40, -5] * 20
    assert identity.use_native(True)
    a = identity.RequestIdentity((b"l", b"s"))
    a.extend(10, tokens, 4, None, None)
    identity.use_native(False)
    try:
        b = identity.RequestIdentity((b"l", b"s"))
        b.extend(10, tokens, 4, None, None)
    finally:
        identity.use_native(True)
    assert list(a.tok) == list(b.tok) and len(a.tok) == 10
    assert all(a.same(k, b, k) for k in range(10))
