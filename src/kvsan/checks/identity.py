"""Cache identity audit: tell a bad cache key from a use-after-free.

kvsan computes its own identity of every cached block, independently of the
engine's hash function and extra-key encoding: a 64-bit chain over the token
prefix, and a domain-tagged BLAKE2b digest of each other input that changes the KV
(LoRA adapter with id, path and load epoch; multimodal identifiers and
their offsets; cache_salt; prompt embeddings; weights epoch; KV dtype).  The
identity recorded when a block enters the cache (producer) is compared with
the identity of each request later served that block (consumer).  A
difference means the engine's cache key let two different inputs meet:
``cache_key_mismatch``, naming the fields that differ, digests only.

Chained per block (each block's digests extend its parent's), so a request
costs one digest per field per new full block, never one per token per hit.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

from .. import kinds
from ..report import Violation

FIELDS = ("tokens", "lora", "cache_salt", "multimodal", "prompt_embeds",
          "weights_epoch", "kv_cache_dtype")
_PERSON = b"kvsan-ident-v1"
_EMPTY = b""


_BASE = hashlib.blake2b(digest_size=16, person=_PERSON)
#: one keyed, tag-prefixed hasher per tag, copied per digest (cheaper than
#: building a personalised BLAKE2b state each time)
_TAGGED: dict[str, "hashlib._Hash"] = {}


def digest(tag: str, *parts: bytes) -> bytes:
    base = _TAGGED.get(tag)
    if base is None:
        base = _TAGGED[tag] = _BASE.copy()
        base.update(tag.encode())
    h = base.copy()
    for p in parts:
        h.update(len(p).to_bytes(4, "little"))  # length-prefixed: no ambiguity
        h.update(p)
    return h.digest()


def text(value) -> bytes:
    return b"\x00" if value is None else repr(value).encode()


def _token_step(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Token chain link: CPython's tuple hash over (parent, block tokens),
    64 bits.  Deterministic for ints (no hash randomisation), computed in C
    (a BLAKE2b link cost 4x more and this runs for every cached block and
    every prefix hit); an accidental collision is a 2**-64 event."""
    return (hash((parent, tuple(tokens))) & _MASK64).to_bytes(8, "little")


_MASK64 = (1 << 64) - 1


def _chain_step(tag: str, parent: bytes, part: bytes) -> bytes:
    return _EMPTY if not parent and not part else digest(tag, parent, part)


class RequestIdentity:
    """The per-block identity chain of one request (consumer or producer)."""

    __slots__ = ("static", "tok", "mm", "emb")

    def __init__(self, lora: bytes, salt: bytes, weights: bytes, dtype: bytes):
        self.static = (lora, salt, weights, dtype)
        self.tok: list[bytes] = []
        self.mm: list[bytes] = []
        self.emb: list[bytes] = []

    def extend(self, upto: int, tokens: Callable[[int], Sequence[int]],
               mm: Callable[[int], bytes] | None, emb: Callable[[int], bytes] | None) -> None:
        """Make sure blocks [0, upto) are computed.  ``mm``/``emb`` None: the
        request has no multimodal input / prompt embeddings.  A chain stays
        empty (``b""``) until its first non-empty block, so a request whose
        images start later agrees with a text-only one on the blocks before."""
        tok, mms, embs = self.tok, self.mm, self.emb
        for k in range(len(tok), upto):
            tok.append(_token_step(tok[k - 1] if k else _EMPTY, tokens(k)))
            mms.append(_chain_step("mm", mms[k - 1] if k else _EMPTY, mm(k) if mm else _EMPTY))
            embs.append(_chain_step("emb", embs[k - 1] if k else _EMPTY,
                                    emb(k) if emb else _EMPTY))

    def fields(self, k: int) -> tuple[bytes, ...]:
        lora, salt, weights, dtype = self.static
        return (self.tok[k], lora, salt, self.mm[k], self.emb[k], weights, dtype)


class IdentityAudit:
    def __init__(self, emit: Callable[[Violation], None], step: Callable[[], int] = lambda: 0):
        self.emit = emit
        self.step = step
        #: block -> (engine cache key, producer, field digests)
        self.producers: dict[int, tuple[bytes, str, tuple[bytes, ...]]] = {}
        self.checked = 0

    def on_cached(self, block: int, key: bytes, producer: str, fields: tuple) -> None:
        known = self.producers.get(block)
        if known is None or known[0] != key:
            self.producers[block] = (key, producer, fields)

    def on_hit(self, block: int, key: bytes | None, consumer: str, fields: tuple,
               index: int) -> None:
        known = self.producers.get(block)
        if known is None or key is None or known[0] != key:
            return  # cached on a path kvsan did not see: nothing to compare
        self.checked += 1
        if known[2] == fields:
            return
        differ = [f for f, a, b in zip(FIELDS, known[2], fields) if a != b]
        self.emit(Violation(
            kind=kinds.CACHE_KEY_MISMATCH,
            message=(f"{consumer} was served block {block} (prefix block {index}) cached by "
                     f"{known[1]}, but their inputs differ in: {', '.join(differ)}"),
            blocks=[block], owners=sorted({consumer, known[1]}), actor=consumer,
            step=self.step(), site="identity",
            details=[{"block": block, "index": index, "fields": differ,
                      "engine_key": key.hex()[:16],
                      "producer": {f: d.hex()[:16] for f, d in zip(FIELDS, known[2])},
                      "consumer": {f: d.hex()[:16] for f, d in zip(FIELDS, fields)}}]))
