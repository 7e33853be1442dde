"""The engine-agnostic core, fed events directly (no vLLM import)."""

import json
import time

import pytest

from kvsan import kinds
from kvsan.checks import AllocatorChecker
from kvsan.config import Config
from kvsan.report import JsonlSink, KVSanViolation, Reporter


def checker(n=8):
    out = []
    ck = AllocatorChecker(n, emit=out.append, null_blocks=(0,))
    return ck, out


def test_share_release_cycle_is_clean():
    ck, out = checker()
    ck.on_allocate([(1, 1), (2, 1)], "A", "s")
    ck.on_share([(1, 2, False)], "B", "s")
    ck.on_release([(2, 1, False, 0, True), (1, 2, False, 1, False)], "A", "s")
    ck.on_release([(1, 1, False, 0, True)], "B", "s")
    assert out == []
    assert ck.shadow.stats()["live_owned"] == 0


def test_free_with_live_owner_names_block_owner_and_provenance():
    ck, out = checker()
    ck.on_allocate([(3, 1)], "A", "alloc.py:f:1")
    ck.on_share([(3, 2, False)], "B", "touch.py:g:2")
    ck.on_release([(3, 1, False, 0, True)], "A", "free.py:h:3")  # engine lost a ref
    kinds_ = [v.kind for v in out]
    assert kinds.FREE_WITH_LIVE_OWNERS in kinds_
    v = next(v for v in out if v.kind == kinds.FREE_WITH_LIVE_OWNERS)
    assert v.blocks == [3] and v.owners == ["B"] and v.actor == "A"
    d = v.details[0]
    assert d["last_acquire"] == {"owner": "B", "step": 0, "site": "touch.py:g:2"}
    assert d["last_release"]["site"] == "free.py:h:3"


def test_null_block_is_ignored():
    ck, out = checker()
    ck.on_share([(0, 7, False)], "A", "s")
    ck.on_release([(0, 7, False, -3, False)], "A", "s")
    assert out == []


def test_leak_reported_once():
    ck, out = checker()
    ck.on_allocate([(1, 1), (2, 1)], "A", "s")
    ck.on_request_released("A", "finished_aborted", "s")
    ck.on_request_released("A", "finished_aborted", "s")
    assert [v.kind for v in out] == [kinds.LEAKED_BLOCKS]
    assert out[0].blocks == [1, 2] and out[0].owners == ["A"]
    assert ck.shadow.stats()["leaked"] == 2


def test_preempted_request_holding_blocks_is_a_leak_but_can_resume():
    ck, out = checker()
    ck.on_allocate([(1, 1)], "A", "s")
    ck.on_request_released("A", "preempted", "s", final=False)
    assert [v.kind for v in out] == [kinds.LEAKED_BLOCKS]
    assert "A" not in ck.shadow.ended


def test_delayed_free_grace():
    ck, out = checker()
    steps = [0]
    ck.step = lambda: steps[0]
    ck.on_allocate([(1, 1)], "A", "s")
    ck.on_request_pending_release("A")
    steps[0] = 5
    ck.sweep(grace_steps=10)
    assert out == []
    steps[0] = 20
    ck.sweep(grace_steps=10)
    assert [v.kind for v in out] == [kinds.LEAKED_BLOCKS]


def test_delayed_frees_are_swept_in_the_order_they_ended():
    """The sweep reads the pending requests oldest first and stops at the
    first still within its grace (it runs every step); each late one is a
    leak, the younger ones wait, and a drained one is not swept."""
    ck, out = checker()
    steps = [0]
    ck.step = lambda: steps[0]
    for rid, b in (("A", 1), ("B", 2), ("C", 3)):
        ck.on_allocate([(b, 1)], rid, "s")
    ck.on_request_pending_release("A")
    steps[0] = 8
    ck.on_request_pending_release("B")
    ck.on_request_pending_release("C")
    steps[0] = 15
    ck.sweep(grace_steps=10)
    assert [(v.kind, v.owners) for v in out] == [(kinds.LEAKED_BLOCKS, ["A"])]
    ck.on_release([(3, 0, False, 0, True)], "C", "s")
    ck.drain_pending({"B": object()}, "s")  # C's late free completed, B's not yet
    assert list(ck.pending_release) == ["B"] and len(out) == 1
    steps[0] = 30
    ck.sweep(grace_steps=10)
    assert [(v.kind, v.owners) for v in out] == [(kinds.LEAKED_BLOCKS, ["A"]),
                                                  (kinds.LEAKED_BLOCKS, ["B"])]


def test_audit_finds_orphans_and_unknown_owners():
    ck, out = checker(4)
    ck.on_allocate([(1, 1)], "A", "s")
    refs = [0, 1, 0, 0]
    linked = [False, False, True, False]  # block 3: neither free nor owned
    ck.audit(refs, linked, live_requests=set())
    got = {(v.kind, tuple(v.blocks), tuple(v.owners)) for v in out}
    assert (kinds.LEAKED_BLOCKS, (3,), ()) in got
    assert (kinds.LEAKED_BLOCKS, (1,), ("A",)) in got
    n = len(out)
    ck.audit(refs, linked, live_requests=set())
    assert len(out) == n  # audit findings are not repeated


def test_shadow_memory_is_arrays():
    ck, _ = checker(100_000)
    import sys

    sh = ck.shadow
    per_block = sum(sys.getsizeof(x) for x in (
        sh.own0, sh.own1, sh.cached, sh.acq_owner, sh.acq_step, sh.acq_site,
        sh.rel_owner, sh.rel_step, sh.rel_site)) / 100_000
    assert per_block <= 64


def test_reporter_modes_and_jsonl(tmp_path):
    path = tmp_path / "r.jsonl"
    rep = Reporter(Config(enabled=True, mode="raise", report=str(path), log_events=False), "engine")
    ck = AllocatorChecker(4, emit=rep.emit)
    ck.on_allocate([(1, 1)], "A", "s")
    with pytest.raises(KVSanViolation) as e:
        ck.on_release([(1, 1, False, 0, True), (1, 0, False, -1, False)], "A", "s")
    assert e.value.violation.kind == kinds.DOUBLE_RELEASE
    rec = json.loads(path.read_text().splitlines()[0])  # flushed before raising
    assert rec["record"] == "violation" and rec["kind"] == kinds.DOUBLE_RELEASE
    assert rec["blocks"] == [1] and rec["owners"] == ["A"]


def test_log_mode_counts_internal_errors_without_raising():
    rep = Reporter(Config(enabled=True, log_events=False), "engine")
    rep.internal_error("x", RuntimeError("boom"))
    assert rep.internal_errors == 1


def test_jsonl_directory_is_one_file_per_process(tmp_path):
    sink = JsonlSink(str(tmp_path) + "/", "engine")
    sink.write({"record": "event"})
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("kvsan-engine-")


def test_a_block_cached_and_evicted_in_one_step_is_not_sent_as_cached():
    """The step journal keeps no order between its cached and uncached
    lists; the shadow's cache flags at the end of the step tell which came
    last.  Cached then evicted (its request preempted in the step that
    cached it): not sent to the worker as cached, where it would be sealed
    while reused.  Evicted then cached again: sent."""
    from kvsan.hooks.vllm.allocator import still_cached

    ck, out = checker()
    ck.on_allocate([(3, 1), (4, 1)], "A", "s")
    ck.on_cached([(3, b"k3"), (4, b"k4")])
    ck.on_release([(3, 1, False, 0, True), (4, 1, False, 0, True)], "A", "s")
    ck.on_uncached([3])  # block 3 evicted within the same step
    assert still_cached([3, 4], ck.shadow.cached) == [4]
    ck.on_allocate([(3, 1)], "B", "s")
    ck.on_cached([(3, b"k3b")])  # evicted, reused and cached again
    assert still_cached([3, 4], ck.shadow.cached) == [3, 4] and out == []


def test_a_shared_block_keeps_its_second_owner_in_own1_and_a_third_without_a_list():
    """A block's second owner lives in ``own1`` (a prefix hit: no dict
    entry), its third in ``more`` as the owner itself, a list only from the
    fourth on, which goes back to the owner when a list is left with one (a
    list cost 64 bytes each); an owner that leaves has its place taken by
    the last of ``more``'s, else by the second."""
    from kvsan.shadow import ShadowTable

    sh = ShadowTable(4)
    for o in ("A", "B"):
        sh.add_owner(1, o)
    assert sh.own1[1] == "B" and sh.more == {} and sh.owners(1) == ["A", "B"]
    assert sh.extras(1) == ["B"] and sh.is_owner(1, "B") and not sh.is_owner(1, "C")
    sh.add_owner(1, "C")
    assert sh.more == {1: "C"} and sh.owners(1) == ["A", "B", "C"]
    sh.acquire([1], "D", 3, 0)
    assert sh.more == {1: ["C", "D"]} and sh.blocks_of("D") == [1] and sh.num_owners(1) == 4
    assert sh.remove_owner(1, "B") and sh.own1[1] == "D" and sh.more == {1: "C"}
    assert not sh.remove_owner(1, "B") and not sh.remove_owner(1, "E")
    assert sh.remove_owner(1, "A") and sh.own0[1] == "C" and sh.own1[1] == "D"
    assert sh.more == {} and sh.blocks_of("C") == [1]
    assert sh.remove_owner(1, "C") and sh.own0[1] == "D" and sh.own1[1] is None
    assert sh.remove_owner(1, "D") and sh.owners(1) == [] and len(sh.held) == 0


def test_call_sites_past_the_two_byte_ids_are_not_interned(monkeypatch):
    """Call-site ids are 2-byte array items: past the limit a site is
    recorded as unknown ("?") rather than wrapping onto another's id."""
    from kvsan import shadow

    monkeypatch.setattr(shadow, "MAX_SITES", 3)
    sh = shadow.ShadowTable(2)
    assert [sh.site_id(s) for s in ("a.py:f:1", "b.py:g:2", "c.py:h:3", "a.py:f:1")] == [1, 2, 0, 1]
    assert sh.sites == ["?", "a.py:f:1", "b.py:g:2"]
    sh.note_release(1, "A", 5, sh.site_id("c.py:h:3"))
    assert sh.describe(1)["last_release"] == {"owner": "A", "step": 5, "site": "?"}


def test_since_records_time_and_step():
    from kvsan.shadow import ShadowTable

    sh = ShadowTable(4)
    sh.clock = lambda: 12345678
    sh.add_owner(2, "A")
    t, step = sh.since_of("A")
    assert step == 12345678 and abs(time.monotonic() - t) < 60 and sh.since_of("B") is None


def _held_maps():
    from kvsan import hooks, shadow
    from kvsan.checks import native

    maps = [pytest.param(shadow.PyHeldMap, id="python")]
    fast = native.load("_shadowfast", hooks.SHADOWFAST_ABI)
    if fast is not None:
        maps.append(pytest.param(fast.HeldMap, id="native"))
    return maps


@pytest.mark.parametrize("make", _held_maps())
def test_held_map_keeps_one_entry_per_owner_and_forgets_it_at_zero(make):
    """``shadow.held`` (kvsan._native._shadowfast's C map, or its Python twin):
    an owner's first references stamp it (time, step), later ones add to
    it with the stamp unchanged, an equal but distinct str is the same
    owner, the last release forgets it; removed entries' slots are
    reused, so churn through many owners leaves only the live ones."""
    m = make()
    m.take("A", 3, 7)
    t = m["A"].when.real
    m.take("".join(["A"]), 2, 9)  # the same owner, another str object
    assert len(m) == 1 and m["A"].n == 5 and m["A"].when == complex(t, 7)
    assert abs(time.monotonic() - t) < 60
    assert m.drop("A", 4) == 1 and "A" in m and m.get("A").n == 1
    assert m.drop("A", 1) == 0 and "A" not in m and m.get("A") is None and len(m) == 0
    for i in range(5000):  # churn: each owner in and out, 100 alive at a time
        m.take(f"r{i}", 1, i)
        if i >= 100:
            assert m.drop(f"r{i - 100}", 1) == 0
    assert len(m) == 100 and sorted(m) == sorted(f"r{i}" for i in range(4900, 5000))
    assert sorted(m.keys()) == sorted(m) and dict(m.items())["r4999"].when.imag == 4999
    assert m.get(3, "none") == "none" and 3 not in m


@pytest.mark.parametrize("make", _held_maps())
def test_held_map_agrees_with_a_dict_through_growth_churn_and_shrinking(make):
    """Random takes and drops against a dict: every owner found with its
    count after each removal has moved other entries back (the C map
    keeps no removed-slot markers), through growth to 20,000 owners, the
    shrink of the mostly empty table and a second fill."""
    import random

    rng = random.Random(7)
    m, model = make(), {}

    def check(sample):
        assert len(m) == len(model)
        for o in sample:
            assert m.get(o) is None if o not in model else m[o].n == model[o]

    names = [f"req-{i}" for i in range(20_000)]
    for phase, (lo, hi) in enumerate([(0, 20_000), (0, 40), (5_000, 9_000)]):
        for o in names[lo:hi]:  # fill
            n = rng.randint(1, 3)
            m.take(o, n, phase)
            model[o] = model.get(o, 0) + n
        for i in range(30_000 if phase != 1 else 0):  # churn, dropping most
            o = rng.choice(names)
            if o in model and rng.random() < 0.75:
                n = rng.randint(1, model[o])
                assert m.drop(o, n) == model[o] - n
                model[o] -= n
                if not model[o]:
                    del model[o]
            else:
                m.take(o, 1, phase)
                model[o] = model.get(o, 0) + 1
            if i % 997 == 0:
                check(rng.sample(names, 200))
        for o in list(model)[: len(model) - 25]:  # down to 25 owners
            assert m.drop(o, model.pop(o)) == 0
        check(names)
        assert sorted(m) == sorted(model)


@pytest.mark.parametrize("make", _held_maps())
def test_held_map_names_a_bad_owner_and_an_unknown_release(make):
    m = make()
    with pytest.raises(TypeError, match="an owner is a str, not int"):
        m.take(3, 1, 0)
    with pytest.raises(KeyError, match="nobody"):
        m.drop("nobody", 1)
    with pytest.raises(KeyError):
        m["nobody"]
