"""Poison: a block no request may read holds non-finite values.

Blocks that leave every owner uncached (or are evicted) are filled with NaN
(-1 for integers), as the same bits on every device, so that a poisoned
block's checksums do not depend on where it was poisoned; they are zeroed
again when handed out.  A stale reader then sees non-finite values instead
of passing by luck.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .checksums import _INT_OF_SIZE

#: poison as raw bits, written through an integer view: a float NaN is
#: converted to different bit patterns on different devices (CUDA's half
#: conversion gives 0x7FFF, the CPU's 0x7E00), and the checksums of a
#: poisoned block must not depend on where it was poisoned.  Quiet NaNs;
#: one-byte floats (fp8) 0x7F, a NaN in both e4m3fn and e5m2; other
#: dtypes: NaN, or -1 for integers (0xFF bytes: NaN for an fp8 cache kept
#: as uint8).
_POISON_BITS = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0, torch.float32: 0x7FC00000,
                torch.float64: 0x7FF8000000000000}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _POISON_BITS[getattr(torch, _name)] = 0x7F


class Poison:
    """NaN-fill of blocks nobody may read; zero-fill when handed out again."""

    __slots__ = ()

    def _init_poison(self) -> None:
        self.poisoned: set[int] = set()

    def poison(self, layers, blocks: Iterable[int]) -> None:
        # deliberately not filtered by the worker view: a block freed while a
        # request still reads it is exactly what poisoning must expose
        blocks = [b for b in dict.fromkeys(blocks) if b not in self.null]
        if not blocks or not layers:
            return
        idx = self._index(blocks)
        for t in layers:
            bits = _POISON_BITS.get(t.dtype)
            if bits is not None:  # the same NaN bits on every device
                t.view(_INT_OF_SIZE[t.element_size()]).index_fill_(0, idx, bits)
            else:
                t.index_fill_(0, idx, float("nan") if t.is_floating_point() else -1)
        self.poisoned.update(blocks)
        self.counters["poisoned"] += len(blocks)

    def unpoison(self, layers, blocks: Iterable[int]) -> None:
        blocks = [b for b in blocks if b in self.poisoned]
        if not blocks or not layers:
            return
        idx = self._index(blocks)
        for t in layers:
            t.index_fill_(0, idx, 0)
        self.poisoned.difference_update(blocks)
