"""Weights fingerprint: what tells the identity audit that the weights moved.

A prefix cache that survives a weight update serves KV computed with the old
weights (wrong tokens, HTTP 200).  Engines update weights under many names
and shapes (named RPCs, callables, worker extensions, an in-process
``load_weights``, sleep and wake-up), so kvsan does not trust names: it
fingerprints the parameters themselves and starts a new weights epoch when
the fingerprint moves.

Two strengths, both exact on the bits (no floating-point reduction, so the
same weights always give the same fingerprint and a fingerprint never moves
by itself):

* ``quick``: the bits of a fixed sample of :data:`SAMPLES` elements spread
  over each tensor (first and last included), with the tensors' names,
  shapes and dtypes.  A few small device operations per tensor: cheap enough
  to take whenever the engine turns from idle to busy.
* ``full``: ``quick`` plus, per tensor, the integer sum of every element's
  bits (wrapping int64).  One pass over the weights: taken after an RPC or a
  wake-up, where any partial update (a few rows of one tensor) must show.

Engine-agnostic: it takes ``(name, tensor)`` pairs; the adapter finds them.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

#: elements sampled per tensor by the quick fingerprint
SAMPLES = 64
_PERSON = b"kvsan-weights"

#: element size in bytes -> the signed integer dtype name of that width (the
#: bits of any element viewed as an integer)
_INT_OF_WIDTH = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}

#: (numel, device) -> the sample's index tensor (tensor sizes repeat: layers)
_index_memo: dict = {}


def _sample_index(torch, n: int, device):
    key = (n, str(device))
    idx = _index_memo.get(key)
    if idx is None:
        k = min(n, SAMPLES)
        idx = _index_memo[key] = torch.linspace(0, n - 1, k, device=device).round().long()
    return idx


def _bits(torch, flat):
    """``flat`` viewed as integers of the same width (None: a width kvsan
    cannot view, e.g. complex or sub-byte packed dtypes)."""
    name = _INT_OF_WIDTH.get(flat.element_size())
    if name is None:
        return None
    if flat.dtype == torch.bool:
        flat = flat.to(torch.int8)
    return flat.view(getattr(torch, name))


def fingerprint(named: Iterable[tuple[str, object]], full: bool) -> tuple[bytes, bytes | None]:
    """``(quick, full)`` digests of the tensors ``named`` yields (``full``
    None unless asked for).  Tensors on the ``meta`` device are skipped."""
    import torch

    quick_h = hashlib.blake2b(digest_size=16, person=_PERSON)
    parts, sums = [], []
    with torch.no_grad():
        for name, t in named:
            if t.device.type == "meta":
                continue
            quick_h.update(f"{name}|{tuple(t.shape)}|{t.dtype};".encode())
            flat = t.detach().reshape(-1)
            if flat.numel() == 0:
                continue
            bits = _bits(torch, flat)
            if bits is None:
                continue
            parts.append(bits.index_select(0, _sample_index(torch, bits.numel(), bits.device))
                         .to(torch.int64))
            if full:
                sums.append(bits.sum(dtype=torch.int64).reshape(1))
    quick_h.update(_host_bytes(torch, parts))
    quick = quick_h.digest()
    if not full:
        return quick, None
    full_h = hashlib.blake2b(quick, digest_size=16, person=_PERSON)
    full_h.update(_host_bytes(torch, sums))
    return quick, full_h.digest()


def _host_bytes(torch, parts: list) -> bytes:
    """The bytes of ``parts`` (int64 tensors), one copy to the host per
    device (not one per tensor: on a GPU each copy waits for the device)."""
    by_device: dict = {}
    for p in parts:
        by_device.setdefault(p.device, []).append(p)
    return b"".join(torch.cat(ps).cpu().numpy().tobytes() for ps in by_device.values())


class WeightsEpoch:
    """The weights epoch of one engine: bumped when a fingerprint of the
    weights differs from the last one of the same strength.

    ``bump`` is called with the reason; the first fingerprint only sets the
    baseline.  A ``None`` fingerprint (no model reachable) changes nothing."""

    def __init__(self, bump):
        self.bump = bump
        self.quick: bytes | None = None
        self.full: bytes | None = None
        self.taken = 0

    def observe(self, quick: bytes | None, full: bytes | None, why: str) -> bool:
        """Compare a fingerprint with the last; True when the epoch moved."""
        if quick is None:
            return False
        self.taken += 1
        moved = (self.quick is not None and quick != self.quick) or (
            full is not None and self.full is not None and full != self.full)
        self.quick = quick
        if full is not None:
            self.full = full
        elif moved:
            self.full = None  # (the last full one describes weights gone: rebaseline)
        if moved:
            self.bump(why)
        return moved
