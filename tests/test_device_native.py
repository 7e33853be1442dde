"""The device checker's set-ups give the same results:
``kvsan._native._devicefast`` (C over host tables), host tables without it (numpy
and memoryview table writes; the guard and checksums as torch ops), the
guard deferred to the step's end (what a slot mapping in CUDA memory gets),
tables on the device (``host_tables=False``: every operation a torch op),
and the checksums' one-launch Triton kernel (run here by Triton's
interpreter; on a GPU by ``python -m benchmarks.cuda_device``).

Seeded random traffic with faults drives one checker per path through the
same calls; every violation, every table and every checksum must agree.
A test that passed with the C module broken would be worthless, so the C
module must be in use here (CPython 3.10 to 3.13, built with the package)."""

import random

import numpy as np
import pytest
import torch

from conftest import SPEEDUPS, SPEEDUPS_WHY
from kvsan.checks import device, native
from kvsan.checks.device import _INT_OF_SIZE, DeviceChecker

NB, BS = 24, 4


def _make(path: str, found: list, monkeypatch, device: str = "cpu",
          checksum: str = "all") -> DeviceChecker:
    """``device``: where the cache tensors live, and the "torch" path's
    tables (``benchmarks.cuda_device`` runs the paths on a GPU against the
    host paths)."""
    fast = native.load("_devicefast", native.DEVICEFAST_ABI)
    monkeypatch.setattr(native, "DEVICEFAST", fast if path in ("c", "deferred") else None)
    dc = DeviceChecker(NB, BS, emit=found.append, checksum=checksum, checksum_sample=1,
                       poison=True,
                       host_tables=path != "torch", device=device,
                       defer_guard=True if path == "deferred" else None,
                       defer_sums=True if path == "deferred" else None)
    assert (dc._fast is not None) == (path in ("c", "deferred"))
    assert (dc._np is None) == (path == "torch")
    return dc


def _slots(rng, dc_view: dict, batch: list, counts: list, fault: bool) -> torch.Tensor:
    """A slot mapping: each request writes its own fresh blocks, with
    padding; a fault writes into another request's or a sealed block, or
    past the pool."""
    out = []
    for rid, n in zip(batch, counts):
        own = dc_view.get(rid) or [0]
        for _ in range(n):
            b = rng.choice(own)
            if fault and rng.random() < 0.2:
                b = rng.randrange(NB + 1)  # anywhere, or past the pool
            out.append(b * BS + rng.randrange(BS))
    out += [-1] * rng.randrange(3)  # padding
    dtype = rng.choice([torch.int64, torch.int32])
    t = torch.tensor(out, dtype=dtype)
    if rng.random() < 0.3:  # a strided row, as V2's [groups, tokens] mapping
        t = torch.stack([t, t])[:, :].t()[:, 0]
    return t


def _run(seed: int, path: str, monkeypatch, device: str = "cpu", copied_reads: bool = False,
         checksum: str = "all"):
    """``copied_reads``: the read extents as tensors copied back at each
    guard (a GPU runner's, which stay on the device), not host arrays.
    Evicted blocks are verified (the cache tensors passed, as the worker
    adapter does)."""
    rng = random.Random(seed)
    found: list = []
    dc = _make(path, found, monkeypatch, device, checksum)
    now = [0]
    dc.step = lambda: now[0]
    gen = torch.Generator().manual_seed(seed)
    layers = [torch.randn(NB, 2, BS, 3, generator=gen),
              torch.randn(NB, 2, BS, 3, generator=gen).to(torch.float16)]
    layers = [t.to(dc.device) for t in layers]
    fresh_of: dict[str, list[int]] = {}
    live: list[str] = []
    nxt = 0
    # the engine's input tokens, refilled every step (the torch path's
    # tables are on the device: it records none)
    fed = np.zeros(64, dtype=np.int32 if seed % 2 else np.int64)
    assert dc.record_inputs(fed) == (path != "torch")
    tokens = random.Random(-seed)  # (its own: the traffic stays as it was)
    # what the engine's attention reads, refilled every step (every path
    # reads them on the host)
    seq_lens, positions = np.zeros(8, dtype=np.int32), np.zeros(64, dtype=np.int64)
    if copied_reads:  # (the same memory: the engine's refill below reaches them)
        dc.record_reads(torch.from_numpy(seq_lens), torch.from_numpy(positions), copied=True)
    else:
        dc.record_reads(seq_lens, positions)
    extents = random.Random(seed + 1000)
    for step in range(60):
        now[0] = step
        fault = rng.random() < 0.3
        # requests leave, then this step's block-table growth
        for rid in list(live):
            if rng.random() < 0.15:
                live.remove(rid)
                fresh_of.pop(rid, None)
                dc.drop_request(rid)
        adds = []
        for _ in range(rng.randrange(1, 4)):
            if live and rng.random() < 0.5:
                rid = rng.choice(live)
            else:
                rid, nxt = f"r{nxt}", nxt + 1
                live.append(rid)
            blocks = rng.sample(range(NB), rng.randrange(1, 4))
            n_hits = rng.randrange(len(blocks) + 1) if rid not in fresh_of else 0
            fresh_of.setdefault(rid, []).extend(blocks[n_hits:])
            adds.append((rid, blocks, n_hits))
        if rng.random() < 0.2:
            dc.uncache(rng.sample(range(NB), 3), layers)
        if rng.random() < 0.03:
            dc.uncache_all()
        hits, fresh = dc.add_step(adds, layers)
        if rng.random() < 0.2:
            dc.copy_fill([(rng.randrange(NB), rng.randrange(NB))])
        dc.will_seal(rng.sample(range(NB), rng.randrange(4)))
        dc.unpoison(layers, fresh)
        dc.poison(layers, rng.sample(range(NB), rng.randrange(3)))
        dc.note_hits(hits)
        dc.verify_step(layers, [b for _, b in hits])
        batch = list(dict.fromkeys(r for r, _, _ in adds))
        counts = [rng.randrange(0, 6) for _ in batch]
        fed[:] = [tokens.randrange(1000) for _ in range(len(fed))]
        _fill_reads(extents, counts, seq_lens, positions)
        dc.guard(_slots(rng, fresh_of, batch, counts, fault).to(dc.device), batch, counts)
        # the engine's next step refills them: a deferred guard checks its copies
        seq_lens[:], positions[:] = -7, -7
        dc.seal(layers)
        if fault and rng.random() < 0.5:  # a scribble into a block, between steps
            t = layers[rng.randrange(2)]  # its raw bits: the same change on every device
            t.view(_INT_OF_SIZE[t.element_size()])[rng.randrange(NB)].view(-1)[
                rng.randrange(24)] += 1
    dc.flush()
    return dc, found


def _fill_reads(rng, counts, seq_lens, positions) -> None:
    """A step's read extents: each request's tokens at consecutive
    positions from where it stands, its sequence length the last + 1; now
    and then one reads further or less far than it wrote."""
    at = 0
    for i, n in enumerate(counts):
        start = rng.randrange(3 * BS)
        positions[at:at + n] = np.arange(start, start + n)
        seq_lens[i] = start + n + (rng.choice([-2, -1, 1, 5]) if rng.random() < 0.1 else 0)
        at += n


def _state(dc: DeviceChecker) -> dict:
    return {"lut": dc.lut.tolist(), "fill": dc.fill.tolist(), "sealed_mask": dc.sealed_mask.tolist(),
            "sealed": dict(dc.sealed), "sums": dict(dc.sums), "pending": list(dc.pending_seal),
            "holders": {b: sorted(h) for b, h in dc.holders.items()},
            "counters": dict(dc.counters), "poisoned": sorted(dc.poisoned)}


def _violations(found: list) -> list:
    return [(v.kind, v.blocks, v.owners, v.actor, v.message) for v in found]


@pytest.mark.parametrize("checksum", ["all", "sample"])
@pytest.mark.parametrize("seed", range(6))
def test_every_path_agrees_under_faults(seed, checksum, monkeypatch):
    """C, numpy and torch tables, and the guard deferred to the step's end
    with the checksums taken up at the next seal or verification (what a
    cache in CUDA memory gets: the same reports, in another order, each with
    the step it was checked at).  ``sample`` (1 per step): the round robins
    of held and unheld blocks, and evicted blocks verified, the same way."""
    runs = {p: _run(seed, p, monkeypatch, checksum=checksum)
            for p in ("c", "numpy", "torch", "deferred")}
    ref_dc, ref_found = runs["torch"]
    assert ref_dc.counters["verified_evicted"] > 0  # (evicted sealed blocks were verified)
    # the faults are seen
    assert {v.kind for v in ref_found} >= {"overwrite_shared_block", "read_extent_mismatch"}
    for path in ("c", "numpy", "deferred"):
        dc, found = runs[path]
        if path == "deferred":
            assert sorted(_violations(found)) == sorted(_violations(ref_found))
            assert sorted((v.kind, v.step) for v in found) == \
                sorted((v.kind, v.step) for v in ref_found)
            assert dc._defer_sums and not ref_dc._defer_sums
        else:
            assert _violations(found) == _violations(ref_found), path
        assert _state(dc) == _state(ref_dc), path
    # the input tokens recorded per slot: the same on every host path (the
    # deferred guard's with the tokens of its own step, copied when deferred)
    fed = runs["numpy"][0].fed_tokens
    assert (fed != device.NOT_FED).sum() > 20
    for path in ("c", "deferred"):
        assert runs[path][0].fed_tokens.tolist() == fed.tolist(), path


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("path", ["deferred", "torch", "numpy"])
def test_read_extents_copied_from_a_device_agree_with_the_host_arrays(seed, path, monkeypatch):
    """A GPU runner's sequence lengths and positions stay on the device:
    the checker copies them back with the step's slot mapping (deferred:
    behind the queued work, checked at the step's end, after the engine
    has refilled its arrays; not deferred: read at once).  The same
    reports and tables as the host arrays read in place."""
    ref_dc, ref_found = _run(seed, path, monkeypatch)
    dc, found = _run(seed, path, monkeypatch, copied_reads=True)
    assert dc._reads is None and dc._reads_dev is not None
    assert "read_extent_mismatch" in {v.kind for v in ref_found}
    assert _violations(found) == _violations(ref_found)
    assert _state(dc) == _state(ref_dc)


def _decode_run(seed: int, one_call: bool, monkeypatch):
    """Decode-like steps (the same batch step after step, as an engine's
    persistent batch keeps it, in a slot mapping filled in place), with
    writes into another request's block now and then, the batch changing
    twice (the first time as a request leaves the worker view, the second
    as it comes back) and prefix hits served now and then, one of them on a
    block never written; the guard as the V1 hook makes it.  Returns
    (checker, violations, steps guard_step took)."""
    for got in _decode_steps(seed, one_call, monkeypatch):
        pass
    return got


def _decode_steps(seed: int, one_call: bool, monkeypatch):
    """:func:`_decode_run` a step at a time: yields (checker, violations,
    steps guard_step took so far) after each step."""
    rng = random.Random(seed)
    found: list = []
    dc = _make("c", found, monkeypatch)
    slots = torch.full((32,), -1, dtype=rng.choice([torch.int64, torch.int32]))
    fed = np.zeros(32, dtype=np.int32)
    dc.record_inputs(fed)
    tokens = random.Random(-seed)  # (its own: the traffic stays as it was)
    seq_lens, positions = np.zeros(8, dtype=np.int32), np.zeros(32, dtype=np.int64)
    dc.record_reads(seq_lens, positions)
    extents = random.Random(seed + 1000)
    own = {f"r{i}": [2 * i, 2 * i + 1] for i in range(4)}
    dc.add_step([(rid, blocks, 0) for rid, blocks in own.items()])
    batch = ["r0", "r1", "r2"]
    took = 0
    dc.fill[NB - 2] = BS  # a block written in full (as a copy fills one)
    for step in range(40):
        if step in (15, 30):  # a request leaves, another joins
            batch = batch[1:] + [f"r{(int(batch[-1][1:]) + 1) % 4}"]
        if step == 15:  # r0 leaves the worker view: no last batch now
            dc.drop_request("r0")
        if step == 30:  # r0 is back, with its int again
            dc.add_step([("r0", own["r0"], 0)])
        if step % 10 == 5:  # a prefix hit: written, or (once) never written
            dc.note_hits([(batch[0], NB - 1 if step == 25 else NB - 2)])
        counts = np.array([rng.randrange(1, 3) for _ in batch], dtype=np.int32)
        row = []
        for rid, n in zip(batch, counts):
            for _ in range(n):
                b = rng.choice(own[rid])
                if rng.random() < 0.1:  # another request's block
                    b = rng.randrange(8)
                row.append(b * BS + rng.randrange(BS))
        slots.fill_(-1)
        slots[:len(row)] = torch.tensor(row, dtype=slots.dtype)
        fed[:] = [tokens.randrange(1000) for _ in range(len(fed))]
        _fill_reads(extents, counts, seq_lens, positions)
        rids = list(batch) + [None]  # (vLLM's batch keeps spare rows)
        bad = dc._fast.guard_step(dc, slots, rids, len(batch), counts) if one_call else None
        if bad is None:
            dc.guard(slots, list(batch), counts.tolist())
        else:
            took += 1
            dc.guarded(bad)
        yield dc, found, took


@pytest.mark.parametrize("seed", range(3))
def test_the_guard_in_one_call_agrees_with_the_checker(seed, monkeypatch):
    """``_devicefast.guard_step`` (the V1 hook's write guard in one C call,
    for the common step) against DeviceChecker.guard: the same violations,
    tables and counts; it takes every step but the first (no last batch
    yet): a change of batch (every request of the new batch got its int
    when its blocks were added), a step after a request left the worker
    view (no last batch) and a step with prefix hits to check included.
    A hit on a block never written is left for ``guarded`` to report."""
    dc, found, took = _decode_run(seed, True, monkeypatch)
    ref_dc, ref_found, _ = _decode_run(seed, False, monkeypatch)
    assert {v.kind for v in ref_found} == {"overwrite_shared_block", "uninitialized_hit",
                                           "read_extent_mismatch"}
    assert [(v.kind, v.blocks, v.owners, v.actor) for v in found
            if v.kind == "uninitialized_hit"] == [("uninitialized_hit", [NB - 1], ["r1"], "r1")]
    assert _violations(found) == _violations(ref_found)
    assert _state(dc) == _state(ref_dc)
    assert dc.fed_tokens.tolist() == ref_dc.fed_tokens.tolist()
    assert (dc.fed_tokens != device.NOT_FED).sum() > 10
    assert not dc.step_hits and not ref_dc.step_hits
    assert took == 40 - 1, took


def test_the_guard_in_one_call_keeps_each_checkers_tables_apart(monkeypatch):
    """``guard_step`` holds the buffers of the last checker it guarded
    between steps: two checkers (two runners in one process) guarded in
    turn each get their own tables, counts and violations, as when each
    runs alone, though every step changes the checker."""
    last = None
    for last in zip(_decode_steps(0, True, monkeypatch), _decode_steps(1, True, monkeypatch)):
        pass
    for seed, (dc, found, took) in enumerate(last):
        ref_dc, ref_found, _ = _decode_run(seed, False, monkeypatch)
        assert ref_found and _violations(found) == _violations(ref_found)
        assert _state(dc) == _state(ref_dc)
        assert took == 40 - 1, took


def test_the_guard_lets_go_of_the_last_checkers_tables(monkeypatch):
    """What ``guard_step`` holds between steps keeps the last checker's
    tables alive until ``release_held`` (called when kvsan forgets a
    runner, at its shutdown): then nothing of kvsan's keeps them."""
    import gc
    import weakref

    dc, _found, took = _decode_run(0, True, monkeypatch)
    assert took
    fast, fill = dc._fast, weakref.ref(dc._np[1])
    del dc
    gc.collect()
    assert fill() is not None  # held by guard_step
    fast.release_held()
    gc.collect()
    assert fill() is None


def test_the_faults_cover_every_device_kind(monkeypatch):
    kinds = set()
    for seed in range(6):
        kinds |= {v.kind for v in _run(seed, "c", monkeypatch)[1]}
    assert kinds >= {"overwrite_shared_block", "checksum_mismatch", "reuse_with_live_owners",
                     "uninitialized_hit"}


def test_checksums_agree_on_every_word_size_and_layout(monkeypatch):
    """Rows of 8-, 4-, 2- and 1-byte words, rows longer than one weight
    period, and a layout whose rows are not contiguous (the C module
    declines it and the torch path answers)."""
    found: list = []
    c = _make("c", found, monkeypatch)
    t = _make("torch", found, monkeypatch)
    gen = torch.Generator().manual_seed(1)
    cases = [
        torch.randn(NB, 2, 3, 8, generator=gen),                       # 8-byte words
        torch.randn(NB, 3, 5, generator=gen).to(torch.float16),        # 2-byte words (30 B)
        torch.randn(NB, 2, 7, generator=gen).to(torch.bfloat16),       # no numpy dtype
        (torch.randn(NB, 7, generator=gen) * 50).to(torch.int8),       # 1-byte words
        torch.randn(NB, 3, generator=gen),                             # 4-byte words (12 B)
        torch.randn(NB, 2, 1500, generator=gen, dtype=torch.float64),  # 3 weight periods
        torch.randn(NB, 2, 6, generator=gen).transpose(1, 2),          # rows not contiguous
    ]
    blocks = [0, 5, 23, 5]
    assert c.checksums(cases, blocks) == t.checksums(cases, blocks)
    assert c._native_sums(cases, blocks) is None  # declined: the transposed layer
    assert c.checksums(cases[:6], blocks) == t.checksums(cases[:6], blocks)
    assert c._native_sums(cases[:6], blocks) is not None
    # one changed word changes the sum of that block and layer only
    before = c.checksums(cases[:6], blocks)
    cases[5][23].view(-1)[2999] += 1.0
    after = c.checksums(cases[:6], blocks)
    assert [[i for i, (x, y) in enumerate(zip(a, b)) if x != y] for a, b in zip(before, after)] \
        == [[], [], [5], []]


def test_vector_checksums_agree_with_the_scalar_loop():
    """The C checksums' vector levels (AVX2, AVX-512, as this CPU has them)
    give the scalar loop's sums: rows of 8-byte words of any length (a
    remainder after the last full vector, rows over several weight periods,
    a row shorter than one vector) and extreme values (the products wrap)."""
    from kvsan._native import _devicefast
    from kvsan.checks import device as dev

    rng = np.random.default_rng(3)
    lengths = (1, 3, 4, 7, 8, 9, 1027, 3 * dev.WEIGHT_PERIOD + 5)
    layers = [rng.integers(-2**63, 2**63 - 1, size=(6, n), dtype=np.int64, endpoint=True)
              for n in lengths]
    layers.append(np.full((6, 33), -2**63, dtype=np.int64))
    chunks = dev.chunk_multipliers(-(-max(lengths) * 8 // dev.WEIGHT_PERIOD) + 1)
    blocks = [0, 5, 2, 5]
    best = _devicefast.simd()
    try:
        sums = {}
        for level in range(best + 1):
            assert _devicefast.simd(level) == level
            sums[level] = _devicefast.checksums(layers, blocks, dev.PERIOD_WEIGHTS, chunks)
    finally:
        _devicefast.simd(best)
    assert all(v == sums[0] for v in sums.values())
    with pytest.raises(ValueError, match="simd level"):
        _devicefast.simd(3)


def test_weights_are_odd_and_a_prefix_of_one_sequence():
    w = device.weights(3000)
    assert (w & 1 == 1).all()
    assert (device.weights(1500) == w[:1500]).all()
    assert len(set(w.tolist())) == 3000


def test_native_guard_rejects_bad_input():
    fast = native.load("_devicefast", native.DEVICEFAST_ABI)
    dc = DeviceChecker(NB, BS, emit=lambda v: None)
    lut, fill, sealed = dc._np
    with pytest.raises(ValueError, match="tokens scheduled"):
        fast.guard(torch.tensor([1, 2]).numpy(), [0], [3], lut, fill, sealed, BS)
    with pytest.raises(ValueError, match="int64 or int32"):
        fast.guard(torch.tensor([1.0]).numpy(), [0], [1], lut, fill, sealed, BS)
    with pytest.raises(ValueError, match="differ in length"):
        fast.guard(torch.tensor([1]).numpy(), [0, 1], [1], lut, fill, sealed, BS)
    with pytest.raises(ValueError, match="block_size"):
        fast.guard(torch.tensor([1]).numpy(), [0], [1], lut, fill, sealed, 0)
    assert fill.sum() == 0  # nothing counted by a refused call


@pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)
def test_native_module_is_in_use_by_default(rt):
    assert rt.config.native  # (the default: installing kvsan switched it on)
    assert native.DEVICEFAST is not None
    assert DeviceChecker(NB, BS, emit=lambda v: None)._fast is native.DEVICEFAST


_ACCEL_SCRIPT = r"""
import os, sys, json
os.environ["TRITON_INTERPRET"] = "1"  # Triton's kernels run on CPU tensors
import torch
from kvsan.checks import device_sums, native
from kvsan.checks.device import _INT_OF_SIZE, DeviceChecker

native.use_devicefast(False)  # host memory: else the C module answers first
NB = 24
gen = torch.Generator().manual_seed(3)
big = torch.randn(NB, 2, 1500, generator=gen, dtype=torch.float64)
layers = [big[:, 0], big[:, 1],                                     # rows strided apart
          torch.randn(NB, 6000, generator=gen).to(torch.bfloat16)]  # the same row bytes
blocks = [0, 5, 23, 5, 7]
ref = DeviceChecker(NB, 4, emit=print, host_tables=False).checksums(layers, blocks)
out = {}
dc = DeviceChecker(NB, 4, emit=print, accel=True)
out["same"] = dc.checksums(layers, blocks) == ref and dc.checksums(layers, blocks[:2]) == ref[:2]
out["used"] = dc._accel is True and dc._accel_layers[1] is not None
odd = layers[:2] + [torch.randn(NB, 7, generator=gen)]  # rows of another length
dc2 = DeviceChecker(NB, 4, emit=print, accel=True)
out["odd_layout_torch_path"] = (dc2.checksums(odd, blocks) ==
                                DeviceChecker(NB, 4, emit=print, host_tables=False).checksums(odd, blocks)
                                and dc2._accel_layers[1] is None)
real = device_sums.block_sums
device_sums.block_sums = lambda t, idx, w: real(t, idx, w) + 1  # a broken kernel
dc3 = DeviceChecker(NB, 4, emit=print, accel=True)
out["broken_declined"] = dc3.checksums(layers, blocks) == ref and dc3._accel is False
out["why"] = dc3.accel_declined
print("RESULT " + json.dumps(out))
"""


def test_one_launch_checksums_match_the_torch_path(tmp_path):
    """The Triton kernel gives the torch path's checksums (rows strided
    apart, several dtypes of one row length); other layouts keep to the
    torch path; a kernel whose first result differs is declined for good,
    with its reason, and the answers stay right."""
    pytest.importorskip("triton")
    import json
    import subprocess
    import sys

    script = tmp_path / "accel.py"
    script.write_text(_ACCEL_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr
    got = json.loads(line[0][7:])
    assert got == {"same": True, "used": True, "odd_layout_torch_path": True,
                   "broken_declined": True, "why": "differed from the torch path"}


def test_poison_writes_the_same_nan_bits_on_every_device(monkeypatch):
    """Poison is written as raw bits (a float NaN converts to different
    bits on different devices, and checksums must not depend on that)."""
    found: list = []
    dc = _make("c", found, monkeypatch)
    layers = [torch.zeros(NB, 3, dtype=dt) for dt in
              (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8)]
    dc.poison(layers, [2, 0, 5])  # 0: the null block, never poisoned
    bits = [t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
            for t in layers]
    assert [b[2, 0].item() for b in bits] == [0x7E00, 0x7FC0, 0x7FC00000, 0x7FF8000000000000, 0xFF]
    assert all(b[5].eq(b[2]).all() and b[0].eq(0).all() for b in bits)
    assert all(t[2].isnan().all() for t in layers[:4])
    dc.unpoison(layers, [2])
    assert all(b[2].eq(0).all() and b[5].ne(0).all() for b in bits)


def test_deferred_checksums_are_reported_with_their_step_and_never_stale():
    """Checksums that come back asynchronously (a cache in CUDA memory;
    forced here): a result for an earlier sealing of a block that has since
    been evicted and sealed again is dropped, not taken as the block's
    checksum (that would be a false mismatch); a scribble is reported once
    the verification arrives, with the step it was checked at."""
    found: list = []
    now = [1]
    dc = DeviceChecker(NB, BS, emit=found.append, step=lambda: now[0], checksum="all",
                       defer_sums=True)
    layers = [torch.randn(NB, 2, BS, 3, generator=torch.Generator().manual_seed(0))]

    def write(rid, block):
        dc.add_step([(rid, [block], 0)])
        dc.guard(torch.arange(block * BS, (block + 1) * BS), [rid], [BS])
        layers[0][block].normal_()
        dc.will_seal([block])
        dc.seal(layers)

    write("a", 3)
    assert dc.pending_sums and 3 not in dc.sums  # on its way
    dc.uncache([3])  # evicted before the result was taken up
    dc.drop_request("a")
    now[0] = 2
    write("b", 3)  # reused and sealed again, with other bytes
    now[0] = 3
    dc.verify_step(layers)  # takes up both seals: only the second counts
    assert dc.sums[3] == dc.checksums(layers, [3])[0]
    dc.flush()
    assert found == []
    layers[0][3].view(-1)[5] += 1  # a scribble
    now[0] = 4
    dc.verify_step(layers)  # queued at step 4
    assert found == []
    now[0] = 5
    dc.seal(layers)  # taken up here
    assert [(v.kind, v.blocks, v.owners, v.step) for v in found] == \
        [("checksum_mismatch", [3], ["b"], 4)]
    assert found[0].details[0]["check"] == "every step"


def test_a_block_nobody_writes_in_the_view_is_not_sealed_from_a_stale_count():
    """A block cached for a request that was served it, not handed it fresh
    (as a KV connector's load looks to the worker: no slot mapping writes
    it), keeps the written-slot count of its previous use.  It must not be
    sealed from that count: the connector's bytes arrive afterwards, and
    every verification would then report a checksum mismatch."""
    found: list = []
    dc = DeviceChecker(NB, BS, emit=found.append, checksum="all")
    layers = [torch.randn(NB, 2, BS, 3, generator=torch.Generator().manual_seed(0))]
    dc.add_step([("a", [3], 0)])
    dc.guard(torch.arange(3 * BS, 4 * BS), ["a"], [BS])  # fully written by a
    dc.drop_request("a")
    dc.uncache([3])  # evicted and handed out again...
    dc.add_step([("b", [3], 1)])  # ...to b as already computed (a connector load)
    dc.will_seal([3])
    dc.seal(layers)
    assert 3 not in dc.pending_seal and 3 not in dc.sealed
    layers[0][3].normal_()  # the loaded bytes
    for _ in range(3):
        dc.verify_step(layers)
        dc.seal(layers)
    assert found == []


def test_pending_blocks_whose_producer_left_unfinished_are_dropped():
    """A cached block waits to be sealed only while its producer can still
    write it; one left partly written is dropped, not scanned every step."""
    dc = DeviceChecker(NB, BS, emit=lambda v: None, checksum="sample")
    layers = [torch.zeros(NB, 2, BS, 3)]
    dc.add_step([("a", [5, 6], 0)])
    dc.guard(torch.arange(5 * BS, 5 * BS + BS // 2), ["a"], [BS // 2])  # block 5 half written
    dc.will_seal([5, 6])
    dc.seal(layers)
    assert list(dc.pending_seal) == [5, 6] and not dc.sealed  # a can still write them
    dc.guard(torch.arange(6 * BS, 7 * BS), ["a"], [BS])
    dc.seal(layers)
    assert list(dc.pending_seal) == [5] and list(dc.sealed) == [6]
    dc.drop_request("a")  # finished, block 5 never completed
    dc.seal(layers)
    assert not dc.pending_seal and list(dc.sealed) == [6]


def _sealed_and_held(emit):
    """A ``sample:1`` checker (block size 1) whose blocks 1-24 are written,
    sealed and held by request r: (checker, layers, blocks)."""
    dc = DeviceChecker(32, 1, emit=emit, checksum="sample", checksum_sample=1)
    layers = [torch.zeros(32, 2)]
    blocks = list(range(1, 25))
    dc.add_step([("r", blocks, 0)])
    dc.guard(torch.arange(1, 25), ["r"], [24])
    dc.will_seal(blocks)
    dc.seal(layers)
    return dc, layers, blocks


def test_the_sampled_round_robin_visits_each_sealed_block_once_per_sweep(monkeypatch):
    """``sample:1`` over 24 sealed blocks: each batch of 8 takes the next 8
    of the round robin, so a sweep of three batches verifies every block
    once; blocks unsealed since leave it (an evicted block is not verified)
    and come back at its end when sealed again; so do blocks no live
    request holds, which come back when a prefix hit takes them up.
    Those go to the round robin of unheld blocks, which gets what the held
    blocks leave of each batch of 8, up to one block (an eighth)."""
    dc, layers, blocks = _sealed_and_held(lambda v: None)
    batches, unheld = [], []
    monkeypatch.setattr(dc, "verify", lambda layers, whys: (
        batches.append([b for b, w in whys.items() if w != "sampled, held by nobody"]),
        unheld.append([b for b, w in whys.items() if w == "sampled, held by nobody"])))

    def sweep(n):
        del batches[:], unheld[:]
        for _ in range(n * DeviceChecker.SAMPLE_BATCH_STEPS):
            dc.verify_step(layers)
        return batches

    assert sweep(3) == [blocks[:8], blocks[8:16], blocks[16:]]
    dc.uncache([2, 9])
    live = [b for b in blocks if b not in (2, 9)]
    assert sum(sweep(3), []) == live + live[:2]  # 22 blocks, 24 taken: it wraps round
    dc.drop_request("r")  # its blocks stay cached and sealed, held by nobody
    dc.add_step([("s", [2], 0)])
    dc.guard(torch.tensor([2]), ["s"], [1])
    dc.will_seal([2])
    dc.seal(layers)
    assert sweep(3) == [[2], [2], [2]]
    assert dc._in_sweep == {2}  # (the unheld ones left it as they were met)
    assert unheld == [[1], [3], [4]]  # 7 spare turns a batch, 1 of them taken
    dc.add_step([("t", [5, 6, 7], 2)])  # prefix hits on 5 and 6; 7 fresh
    assert sweep(1) == [[2, 5, 6]]
    # 5 and 6 held again, 7 evicted and handed out: they leave as they are met
    assert unheld == [[8]]
    dc.drop_request("s")
    assert sweep(1) == [[5, 6]]
    assert unheld == [[10]]
    # (2 joined at its end when s let go of it)
    assert list(dc._cold) == [*range(11, 25), 1, 3, 4, 8, 2, 10]


def test_a_block_verified_at_a_prefix_hit_passes_its_next_turn_in_the_round_robin(monkeypatch):
    """``sample:1`` over 24 sealed blocks held by one request: prefix hits
    on blocks 3 and 20 are verified in the step of the first sampled batch.
    Block 3's turn is in that batch and block 20's in the third: both pass
    without a second verification, the round robin still moves on by 8
    turns a batch, and the next sweep verifies every block again (a hit
    counts for one turn only).  A scribble on block 20 after its hit is
    found by that next sweep."""
    found: list = []
    dc, layers, blocks = _sealed_and_held(found.append)
    batches: list = []
    verify = dc.verify
    monkeypatch.setattr(dc, "verify", lambda layers, whys: (batches.append(dict(whys)),
                                                            verify(layers, whys)))
    every = DeviceChecker.SAMPLE_BATCH_STEPS
    for k in range(3 * every):
        dc.verify_step(layers, [3, 20] if k == every - 1 else ())
    hits = dict.fromkeys([3, 20], "at prefix hit")
    assert batches == [{**hits, **dict.fromkeys([1, 2, 4, 5, 6, 7, 8], "sampled")},
                       dict.fromkeys(blocks[8:16], "sampled"),
                       dict.fromkeys([17, 18, 19, 21, 22, 23, 24], "sampled")]
    layers[0][20, 1] += 1  # a scribble after block 20's hit
    del batches[:]
    for _ in range(3 * every):
        dc.verify_step(layers)
    assert [list(b) for b in batches] == [blocks[:8], blocks[8:16], blocks[16:]]
    assert [(v.kind, v.blocks, v.owners) for v in found] == \
        [("checksum_mismatch", [20], ["r"])]


def test_a_sampled_step_while_every_checksum_is_still_on_its_way():
    """``sample:N`` with the first sealings' checksums still being copied
    back from the device (no checksum taken up yet): the sampled step
    queues its verification behind them, and it is compared once they are
    taken up (sampling from the checksums taken up would divide by their
    number, zero, and count an internal error every 8 steps until the
    first copy arrived)."""

    class InFlight:  # a CUDA event whose copy has not completed
        done = False

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    found: list = []
    dc = DeviceChecker(NB, BS, emit=found.append, checksum="sample", checksum_sample=1,
                       defer_sums=True)
    layers = [torch.randn(NB, 2, BS, 3, generator=torch.Generator().manual_seed(0))]
    dc.add_step([("a", [3], 0)])
    dc.guard(torch.arange(3 * BS, 4 * BS), ["a"], [BS])
    dc.will_seal([3])
    dc.seal(layers)
    event = InFlight()
    dc.pending_sums[0][4] = event  # as from a CUDA device: not arrived
    for _ in range(2 * DeviceChecker.SAMPLE_BATCH_STEPS):
        dc.verify_step(layers)
    assert 3 in dc.sealed and 3 not in dc.sums and dc.counters["verified"] == 2
    layers[0][3].view(-1)[7] += 1  # a scribble, once the sealing's copy has arrived
    event.done = True
    dc.flush()
    assert dc.sums[3] != dc.checksums(layers, [3])[0]
    assert found == []  # the queued verifications were of the bytes as sealed
    for _ in range(DeviceChecker.SAMPLE_BATCH_STEPS):
        dc.verify_step(layers)
    dc.flush()
    assert [(v.kind, v.blocks, v.details[0]["check"]) for v in found] == \
        [("checksum_mismatch", [3], "sampled")]


def test_the_same_batch_after_requests_change_their_ints(monkeypatch):
    """The guard reuses the last batch's request ints while the batch is the
    same list of requests; two requests preempted and resumed in one step
    come back with each other's ints, and their writes to their own new
    blocks must not be taken for each other's."""
    found: list = []
    dc = _make("c", found, monkeypatch)
    slots = lambda *blocks: torch.tensor([b * BS + i for b in blocks for i in range(BS)])  # noqa: E731
    dc.add_step([("a", [1], 0), ("b", [2], 0)])
    dc.guard(slots(1, 2), ["a", "b"], [BS, BS])
    ints = dict(dc._rid_int)
    dc.drop_request("a")
    dc.drop_request("b")
    dc.add_step([("a", [4], 0), ("b", [3], 0)])  # resumed: new ints, swapped
    assert dc._rid_int == {"a": ints["b"], "b": ints["a"]}
    dc.guard(slots(4, 3), ["a", "b"], [BS, BS])
    assert found == []
    dc.guard(slots(3, 4), ["a", "b"], [BS, BS])  # now each writes the other's block
    assert sorted((v.kind, v.blocks, v.actor) for v in found) == \
        [("overwrite_shared_block", [3], "a"), ("overwrite_shared_block", [4], "b")]


def test_the_worker_view_follows_only_caches_it_understands():
    """Group 0 decides what the worker view follows.  Decoder attention
    (full, MLA, sliding window, chunked local, alone or in a uniform group)
    is followed; a hybrid model's Mamba / linear-attention group 0 has no
    slot mapping (the V1 guard would read zeros and report every write),
    and decode context parallelism splits a scheduler block over ranks:
    the device side is then off, with the reason, rather than reporting
    legal traffic."""
    from vllm.v1.kv_cache_interface import (
        CrossAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    from kvsan.hooks.vllm.worker import unfollowed

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8,
                               dtype=torch.float32, sliding_window=64)
    mamba = MambaSpec(block_size=16, shapes=((1,),), dtypes=(torch.float32,))

    def config(*specs):
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s)
                                              for i, s in enumerate(specs)])

    assert unfollowed(config(full)) is None
    assert unfollowed(config(window, full)) is None
    assert unfollowed(config(full, mamba)) is None  # group 0 is attention: followed
    assert unfollowed(config(UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs={"a": full, "b": full}))) is None
    assert unfollowed(config(mamba, full)) == "KV cache group 0 is MambaSpec"
    assert unfollowed(config(full), dcp_world_size=2) == "decode context parallel size 2"

    class PluginAttentionSpec(FullAttentionSpec):  # a subclass of full attention
        pass

    plugin = PluginAttentionSpec(block_size=16, num_kv_heads=1, head_size=8,
                                 dtype=torch.float32)
    assert unfollowed(config(plugin)) is None
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    assert unfollowed(config(cross, full)) == "KV cache group 0 is CrossAttentionSpec"


def test_a_runners_decode_context_parallel_size_is_read_from_its_config():
    """V1 keeps it as ``dcp_world_size``, V2 as ``dcp_size``; both keep the
    parallel config, which is read first."""
    import types

    from vllm.config import ParallelConfig

    from kvsan.hooks.vllm.worker import _dcp_size

    v2 = types.SimpleNamespace(parallel_config=ParallelConfig(), dcp_size=1)
    assert _dcp_size(v2) == 1
    v2.parallel_config.decode_context_parallel_size = 2
    assert _dcp_size(v2) == 2
    assert _dcp_size(types.SimpleNamespace(dcp_world_size=4)) == 4


def test_unknown_writers_counted_when_their_copy_arrives():
    """V2's adaptive speculative verification: the writes are counted
    without writers; on a device that waits for the slot mapping's copy
    (forced deferred here), so they are counted when the guard settles,
    never by a host sync in the step."""
    dc = DeviceChecker(NB, BS, emit=lambda v: None, defer_guard=True)
    dc.add_step([("a", [3], 0)])
    dc.count_writes(torch.arange(3 * BS, 4 * BS), BS)
    assert dc.pending_guard is not None and dc._read(1, [3]) == [0]
    dc.settle()
    assert dc.pending_guard is None and dc._read(1, [3]) == [BS]


def test_a_request_sent_again_mid_block_keeps_its_written_slots():
    """A request sent to the worker again (V2 sends a resumed one as new;
    a streaming session comes back) with a computed length inside a block:
    the slots of that block it wrote before count as written.  Counted from
    zero, the block never filled, and a later prefix hit on it was reported
    as uninitialized."""
    found: list = []
    dc = DeviceChecker(NB, BS, emit=found.append, checksum="sample")
    layers = [torch.zeros(NB, 2, BS, 3)]
    part = BS // 2 + 1
    dc.add_step([("s", [1, 2], 0)])
    dc.guard(torch.arange(1 * BS, 2 * BS + part), ["s"], [BS + part])  # block 1, part of 2
    dc.drop_request("s")  # sent again: dropped, then added with what it computed
    dc.add_step([("s", [1, 2, 3], 1, part)])
    dc.guard(torch.arange(2 * BS + part, 3 * BS), ["s"], [BS - part])  # the rest of block 2
    dc.will_seal([2])
    dc.seal(layers)
    assert 2 in dc.sealed
    hits, _ = dc.add_step([("t", [2, 4], 1)])  # t is served block 2 as a prefix hit
    dc.note_hits(hits)
    dc.guard(torch.arange(4 * BS, 4 * BS + 1), ["t"], [1])
    assert found == []


def test_a_gpu_runners_read_extents_are_copied_and_a_cpu_runners_read_in_place():
    """The adapter hands the checker the V1 runner's ``seq_lens`` and
    ``positions``: numpy views where they are in host memory (read in
    place, in C in the guard's common step), the tensors themselves where
    they are on a device (copied back with the slot mapping); neither
    where they are not int tensors."""
    from types import SimpleNamespace

    from kvsan.hooks.vllm import inputs as vllm_inputs

    class Runner:  # (the V1 runner as the adapter tells it: _prepare_inputs, token rows)
        def _prepare_inputs(self):
            pass

    runner = Runner()
    runner.input_batch = SimpleNamespace(token_ids_cpu=None)
    runner.seq_lens = torch.zeros(8, dtype=torch.int32, device="meta")  # (not host memory)
    runner.positions = torch.zeros(64, dtype=torch.int64, device="meta")
    dc = DeviceChecker(NB, BS, emit=[].append)
    assert vllm_inputs.record_reads(dc, runner)
    assert dc._reads is None
    assert dc._reads_dev[0] is runner.seq_lens and dc._reads_dev[1] is runner.positions
    runner.seq_lens, runner.positions = torch.zeros(8, dtype=torch.int32), torch.zeros(64)
    dc = DeviceChecker(NB, BS, emit=[].append)
    assert not vllm_inputs.record_reads(dc, runner)  # float positions
    assert dc._reads is None and dc._reads_dev is None
    runner.positions = torch.zeros(64, dtype=torch.int64)
    assert vllm_inputs.record_reads(dc, runner)
    assert dc._reads_dev is None and all(isinstance(a, np.ndarray) for a in dc._reads)
    assert np.shares_memory(dc._reads[1], runner.positions.numpy())


class _Batch:
    """What ``_devicefast.check_rows`` reads of vLLM's V1 input batch: its
    request ids by row (``None`` past the last) and their index."""

    def __init__(self, rids: list):
        self._req_ids = list(rids) + [None] * 2
        self.req_id_to_index = {r: i for i, r in enumerate(rids)}


def _rows_run(seed: int, fast) -> tuple:
    """Seeded decode traffic with moved, joined and left rows, and rows
    rewritten (an entry, a count) now and then: each step's row check by
    ``fast.check_rows`` where it takes it, else ``DeviceChecker.check_rows``
    (``fast`` None: always the method).  Returns the checker's row state
    after each step, its reports and how many checks C took and declined."""
    rng = random.Random(seed)
    found: list = []
    dc = DeviceChecker(64, BS, emit=found.append, checksum="off")
    dc.rows_on = True
    width, free, live, took, declined, states = 6, list(range(1, 64)), {}, 0, 0, []
    for _ in range(60):
        adds = []
        for rid in list(live):
            if rng.random() < 0.15:  # it ends
                dc.drop_request(rid)
                free += live.pop(rid)
            elif rng.random() < 0.3 and len(live[rid]) < width and free:
                live[rid].append(free.pop(0))
                adds.append((rid, [live[rid][-1]], 0))
        while len(live) < 5 and free:  # a request joins
            rid = f"r{rng.randrange(10**6)}"
            live[rid] = [free.pop(0)]
            adds.append((rid, [live[rid][0]], 0))
        dc.add_step(adds)
        order = list(live)
        if rng.random() < 0.5:
            rng.shuffle(order)  # rows moved
        rows = np.zeros((8, width), dtype=rng.choice([np.int32, np.int64]))
        counts = np.zeros(8, dtype=np.int32)
        for i, rid in enumerate(order):
            rows[i, :len(live[rid])] = live[rid]
            counts[i] = len(live[rid])
        if order and rng.random() < 0.1:  # a rewritten entry, or a row's count
            i = rng.randrange(len(order))
            if rng.random() < 0.5:
                rows[i, rng.randrange(counts[i])] = rng.randrange(1, 64)
            else:
                counts[i] += 1
        flat = memoryview(rows).cast("B").cast(rows.dtype.char)
        got = None if fast is None else fast.check_rows(dc, _Batch(order), flat, width,
                                                          memoryview(counts))
        if got is None:
            declined += fast is not None
            dc.check_rows(order, flat, width, memoryview(counts))
        else:
            took += 1
        states.append((sorted(dc.rows_due), list(dc._row_order), dc._row_sweep,
                       dict(dc.counters)))
    return states, found, took, declined


@pytest.mark.parametrize("seed", range(4))
def test_the_row_check_in_one_call_agrees_with_the_checker(seed):
    """``_devicefast.check_rows`` (the block-table row check of a step in one
    C call) against DeviceChecker.check_rows: the same reports, and the
    same row state after every step (rows due, the order last checked, the
    sweep's turn, the counts).  It takes the steps whose rows all match and
    leaves the others, unchanged, to the method."""
    fast = native.load("_devicefast", native.DEVICEFAST_ABI)
    assert fast is not None
    states, found, took, declined = _rows_run(seed, fast)
    ref, ref_found, _, _ = _rows_run(seed, None)
    assert found and {v.kind for v in found} == {"block_table_mismatch"}
    assert _violations(found) == _violations(ref_found)
    assert states == ref
    assert states[-1][3]["rows_swept"] > 0 and states[-1][3]["rows_checked"] > 0
    assert took > 40 and declined >= len(found), (took, declined)
