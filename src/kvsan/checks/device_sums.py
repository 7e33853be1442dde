"""The device checker's checksums of many blocks across every layer in one
kernel launch (Triton), for caches in GPU memory.

The torch path gathers, multiplies and sums layer by layer: three or more
kernel launches per layer, about a hundred per call on a 32-layer model,
which is what a step's checksum work cost on an H200 (``python -m
benchmarks.cuda_device``), not the bytes read.  Here one program per
(block, layer) reads the block's row through a table of the layers' base
addresses and gives the same value as the torch path: the weighted sum,
modulo 2^64, of the row's 64-bit words with :func:`kvsan.checks.device.weights`.

Used only where every layer's rows are 64-bit words of one length, rows
contiguous; :class:`~kvsan.checks.device.DeviceChecker` checks the first
result against the torch path and keeps to that path if they differ or the
kernel cannot be built (no Triton, no GPU compiler).
"""

from __future__ import annotations

from typing import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the torch path
    triton = None

#: words each program reads per iteration
BLOCK = 1024

if triton is not None:
    @triton.jit
    def _block_sums(bases, row_words, blocks, weights, out, n_layers, n_words,
                    BLOCK: tl.constexpr):
        b = tl.program_id(0)
        layer = tl.program_id(1)
        base = tl.load(bases + layer).to(tl.pointer_type(tl.int64))
        row = base + tl.load(blocks + b) * tl.load(row_words + layer)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, n_words, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n_words
            acc += tl.load(row + offs, mask=m, other=0) * tl.load(weights + offs, mask=m, other=0)
        tl.store(out + b * n_layers + layer, tl.sum(acc, axis=0))


class LayerTable:
    """The layers' base addresses and row strides (in words) on their
    device, made once per list of cache tensors; ``n_words`` (each row's
    length in words) is None where the kernel does not apply to them."""

    def __init__(self, layers: Sequence[torch.Tensor]):
        self.layers = layers  # held: their addresses stay valid
        self.n_words = None
        if triton is None or not layers:
            return
        dev = layers[0].device
        row_bytes = {t[0].numel() * t.element_size() for t in layers} if len(layers[0]) else set()
        if len(row_bytes) != 1 or any(t.device != dev or not t[0].is_contiguous()
                                      or (t.stride(0) * t.element_size()) % 8
                                      or t.data_ptr() % 8 for t in layers):
            return
        (nbytes,) = row_bytes
        if nbytes % 8:
            return
        self.n_words = nbytes // 8
        self.bases = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64, device=dev)
        self.row_words = torch.tensor([t.stride(0) * t.element_size() // 8 for t in layers],
                                      dtype=torch.int64, device=dev)


def block_sums(table: LayerTable, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[len(idx), len(layers)]`` int64 checksums of blocks ``idx`` (int64,
    on the layers' device), ``weights`` the first ``table.n_words`` weights
    there."""
    n, n_layers = idx.numel(), len(table.layers)
    out = torch.empty((n, n_layers), dtype=torch.int64, device=idx.device)
    if n:
        _block_sums[(n, n_layers)](table.bases, table.row_words, idx, weights, out,
                                   n_layers, table.n_words, BLOCK=BLOCK)
    return out
