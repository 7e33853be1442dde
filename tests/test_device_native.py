"""The device checker's three set-ups give the same results:
``kvsan._devicefast`` (C over host tables), host tables without it (numpy
and memoryview table writes; the guard and checksums as torch ops), and
tables on the device (every operation a torch op: the CUDA path, run here
on CPU).

Seeded random traffic with faults drives one checker per path through the
same calls; every violation, every table and every checksum must agree.
A test that passed with the C module broken would be worthless, so the C
module must be in use here (3.11, built with the package)."""

import random

import pytest
import torch

from kvsan.checks import device, native
from kvsan.checks.device import DeviceChecker

NB, BS = 24, 4


def _make(path: str, found: list, monkeypatch) -> DeviceChecker:
    monkeypatch.setattr(native, "DEVICEFAST", native.load("_devicefast", 1) if path == "c" else None)
    dc = DeviceChecker(NB, BS, emit=found.append, checksum="all", poison=True,
                       host_tables=path != "torch")
    assert (dc._fast is not None) == (path == "c")
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


def _run(seed: int, path: str, monkeypatch):
    rng = random.Random(seed)
    found: list = []
    dc = _make(path, found, monkeypatch)
    gen = torch.Generator().manual_seed(seed)
    layers = [torch.randn(NB, 2, BS, 3, generator=gen),
              torch.randn(NB, 2, BS, 3, generator=gen).to(torch.float16)]
    fresh_of: dict[str, list[int]] = {}
    live: list[str] = []
    nxt = 0
    for step in range(60):
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
            dc.uncache(rng.sample(range(NB), 3))
        if rng.random() < 0.03:
            dc.uncache_all()
        hits, fresh = dc.add_step(adds)
        if rng.random() < 0.2:
            dc.copy_fill([(rng.randrange(NB), rng.randrange(NB))])
        dc.will_seal(rng.sample(range(NB), rng.randrange(4)))
        dc.unpoison(layers, fresh)
        dc.poison(layers, rng.sample(range(NB), rng.randrange(3)))
        dc.note_hits(hits)
        dc.verify_step(layers, [b for _, b in hits])
        batch = list(dict.fromkeys(r for r, _, _ in adds))
        counts = [rng.randrange(0, 6) for _ in batch]
        dc.guard(_slots(rng, fresh_of, batch, counts, fault), batch, counts)
        dc.seal(layers)
        if fault and rng.random() < 0.5:  # a scribble into a block, between steps
            layers[rng.randrange(2)][rng.randrange(NB)].view(-1)[rng.randrange(24)] += 1
    return dc, found


def _state(dc: DeviceChecker) -> dict:
    return {"lut": dc.lut.tolist(), "fill": dc.fill.tolist(), "sealed_mask": dc.sealed_mask.tolist(),
            "sealed": dict(dc.sealed), "sums": dict(dc.sums), "pending": list(dc.pending_seal),
            "holders": {b: sorted(h) for b, h in dc.holders.items()},
            "counters": dict(dc.counters), "poisoned": sorted(dc.poisoned)}


def _violations(found: list) -> list:
    return [(v.kind, v.blocks, v.owners, v.actor, v.message) for v in found]


@pytest.mark.parametrize("seed", range(6))
def test_three_paths_agree_under_faults(seed, monkeypatch):
    runs = {p: _run(seed, p, monkeypatch) for p in ("c", "numpy", "torch")}
    ref_dc, ref_found = runs["torch"]
    assert {v.kind for v in ref_found} >= {"overwrite_shared_block"}  # the faults are seen
    for path in ("c", "numpy"):
        dc, found = runs[path]
        assert _violations(found) == _violations(ref_found), path
        assert _state(dc) == _state(ref_dc), path


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


def test_weights_are_odd_and_a_prefix_of_one_sequence():
    w = device.weights(3000)
    assert (w & 1 == 1).all()
    assert (device.weights(1500) == w[:1500]).all()
    assert len(set(w.tolist())) == 3000


def test_native_guard_rejects_bad_input():
    fast = native.load("_devicefast", 1)
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


def test_native_module_is_in_use_by_default():
    import sys

    if sys.version_info[:2] != (3, 11):
        pytest.skip("kvsan's C speed-ups are built for CPython 3.11")
    assert native.DEVICEFAST is not None
    assert DeviceChecker(NB, BS, emit=lambda v: None)._fast is native.DEVICEFAST
