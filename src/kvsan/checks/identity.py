"""Cache identity audit: tell a bad cache key from a use-after-free.

kvsan computes its own identity of every cached block, independently of the
engine's hash function and extra-key encoding: a 64-bit chain over the token
prefix, and a domain-tagged BLAKE2b digest of each other input that changes the KV
(the LoRA adapter, by its files where they can be read; multimodal
identifiers and their offsets; cache_salt; prompt embeddings; weights
epoch).  The KV cache dtype is not a field: it is fixed for an engine's
pool, so two requests served from one pool never differ in it.  The
identity recorded when a block enters the cache (producer) is compared with
the identity of each request later served that block (consumer).  A
difference means the engine's cache key let two different inputs meet:
``cache_key_mismatch``, naming the fields that differ, digests only.

Chained per block (each block's digests extend its parent's), so a request
costs one digest per field per new full block, never one per token per hit.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Callable, Iterable, Sequence

from .. import kinds
from ..report import Violation
from . import native

FIELDS = ("tokens", "lora", "cache_salt", "multimodal", "prompt_embeds", "weights_epoch")
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


#: ``kvsan._native._tokenlinks.links`` (the token chain in C, same values) when in
#: use, else None
_links = None
#: ``kvsan._native._tokenlinks.extend_text`` (a text-only chain extended in one
#: call) when in use, else None
_extend_text = None
#: ``kvsan._native._tokenlinks.known_chain`` (a known text-only request's chain
#: looked up and extended in one call) when in use, else None
known_chain = None
#: ``kvsan._native._tokenlinks.reap`` (a chain's callback when its request goes, as
#: ``kvsan.hooks.vllm.identity._reap``) when in use, else None
reap = None
#: what a new chain keeps its token links in: ``kvsan._native._tokenlinks.Links``
#: (64-bit ints in one array) when in use, else ``list``
_new_links = list


def use_native(on: bool = True) -> bool:
    """Compute token links with ``kvsan._native._tokenlinks`` where it was built
    (the same values as the Python loop).  Returns whether it is in use."""
    global _links, _extend_text, known_chain, reap, _new_links
    mod = native.load("_tokenlinks", 9) if on else None
    _new_links = mod.Links if mod is not None else list
    _links = mod.links if mod is not None else None
    _extend_text = mod.extend_text if mod is not None else None
    known_chain = mod.known_chain if mod is not None else None
    reap = mod.reap if mod is not None else None
    return _links is not None


def _chain_step(tag: str, parent: bytes, part: bytes) -> bytes:
    return _EMPTY if not parent and not part else digest(tag, parent, part)


class _Unowned:
    """The owner of a chain made without one: never goes."""

    __slots__ = ("__weakref__",)


UNOWNED = _Unowned()


class RequestIdentity(weakref.ref):
    """The per-block identity chain of one request (consumer or producer).

    A chain is a weak reference to the object it describes (an engine's
    request; :data:`UNOWNED` if made without one), which an adapter that
    files chains by request id (``rid``) uses to learn that the request
    went, through the reference's callback.  One object per request: an
    entry of a chain and a weak reference of its own were two more objects
    per request for the garbage collector to track (its young collections
    run more often the more such objects are made).  A chain is equal only
    to itself (not, as weak references are, to another reference to the
    same object), and stays usable once its request went: producer records
    keep it.

    ``static``: the digests of the inputs that are the same for every block
    of the request (LoRA, cache_salt), one shared tuple per
    distinct combination, so most comparisons are an identity check.

    ``tok``: the token links, one per block, in a ``kvsan._native._tokenlinks.Links``
    (an array of 64-bit ints: no int object per block, and nothing for the
    garbage collector to track) where that module is in use, else a list.

    ``mm`` and ``emb`` start as :attr:`TEXT_ONLY`, shared by every chain
    whose request has neither multimodal input nor prompt embeddings (most
    requests); the first extension of any other request gives it chains of
    its own."""

    __slots__ = ("static", "tok", "mm", "emb", "rid")
    __hash__ = object.__hash__
    __eq__ = object.__eq__
    __ne__ = object.__ne__

    #: the ``mm`` and ``emb`` chains of every text-only request: one list of
    #: empty digests, padded to the longest such chain (a chain reads its
    #: first ``len(tok)`` items only).  Two lists of their own per request
    #: were a third of the audit's objects the garbage collector tracks (its
    #: young collections run more often the more of them there are) and
    #: 16 B per cached block.
    TEXT_ONLY: list[bytes] = []

    def __new__(cls, static: tuple[bytes, bytes], owner: object = UNOWNED,
                callback: Callable | None = None, rid: str | None = None):
        return super().__new__(cls, owner, callback)

    def __init__(self, static: tuple[bytes, bytes], owner: object = UNOWNED,
                 callback: Callable | None = None, rid: str | None = None):
        # kvsan._native._tokenlinks (new_identity) makes these without calling
        # __init__, setting the same five slots: keep the two in step
        super().__init__(owner, callback)
        self.static = static
        self.tok = _new_links()
        self.mm: list[bytes] = self.TEXT_ONLY
        self.emb: list[bytes] = self.TEXT_ONLY
        self.rid = rid

    def extend(self, upto: int, tokens: Sequence[int], bs: int,
               mm: Callable[[int], bytes] | None, emb: Callable[[int], bytes] | None) -> None:
        """Make sure blocks [0, upto) are computed, block ``k`` being
        ``tokens[k * bs:(k + 1) * bs]``.

        Token link: CPython's tuple hash over (parent link, block tokens),
        kept as a signed 64-bit int.  Deterministic for ints (no hash
        randomisation) and computed in C: a BLAKE2b link cost 4x more, and
        this runs for every cached block and every prefix hit; an accidental
        collision is a 2**-64 event.

        ``mm``/``emb`` None: the request has no multimodal input / prompt
        embeddings, and its chains are empty (``b""``) at no cost.  A chain
        stays empty until its first non-empty block, so a request whose
        images start later agrees with a text-only one on the blocks before."""
        tok = self.tok
        start = len(tok)
        if start >= upto:
            return
        text_only = mm is None and emb is None
        if text_only and _extend_text is not None and type(tokens) is list:
            _extend_text(tok, self.mm, self.emb, tokens, bs, upto)  # the same, in one C call
            return
        parent = tok[-1] if tok else 0
        links = _links
        if links is not None and type(tokens) is list:
            tok += links(tokens, bs, start, upto, parent)
        else:
            for k in range(start, upto):
                parent = hash((parent, tuple(tokens[k * bs:(k + 1) * bs])))
                tok.append(parent)
        if text_only:  # both chains stay empty: padded to length (maybe shared)
            for chain in (self.mm, self.emb):
                if len(chain) < upto:
                    chain += [_EMPTY] * (upto - len(chain))
            return
        if self.mm is self.TEXT_ONLY:  # not text only: chains of its own
            self.mm = self.TEXT_ONLY[:start]
        if self.emb is self.TEXT_ONLY:
            self.emb = self.TEXT_ONLY[:start]
        for chain, part, tag in ((self.mm, mm, "mm"), (self.emb, emb, "emb")):
            if part is None:
                chain.extend([_EMPTY] * (upto - start))
                continue
            for k in range(start, upto):
                chain.append(_chain_step(tag, chain[k - 1] if k else _EMPTY, part(k)))

    def fields(self, k: int, weights: bytes) -> tuple[bytes, ...]:
        """Block ``k``'s digests in :data:`FIELDS` order."""
        lora, salt = self.static
        tok = self.tok[k].to_bytes(8, "little", signed=True)
        return (tok, lora, salt, self.mm[k], self.emb[k], weights)

    def same(self, k: int, other: "RequestIdentity", i: int) -> bool:
        """Block ``k`` of this chain has the inputs of block ``i`` of ``other``
        (the weights epoch is compared by the caller)."""
        return (self.tok[k] == other.tok[i]
                and (self.static is other.static or self.static == other.static)
                and self.mm[k] == other.mm[i] and self.emb[k] == other.emb[i])


def token_link(parent: int, tokens: Sequence[int]) -> int:
    """A block's token link (:meth:`RequestIdentity.extend`) from the link
    of the block before it (0 for a request's first) and its tokens: what
    a worker, given the two links of a block its scheduler cached, checks
    the tokens it computed the block's KV from against."""
    return hash((parent, tuple(tokens)))


#: the producer records' per-block lists, in this order (see IdentityAudit.records)
RECORD_FIELDS = ("key", "producer", "chain", "index", "weights")


class IdentityAudit:
    """Producer identity per cached block, compared with each consumer's.

    A producer is recorded as a reference to its request's chain and the
    block's index in it (plus the weights digest of the moment): no per-block
    tuple is built when a block is cached, and the field digests are spelled
    out only for a report."""

    def __init__(self, emit: Callable[[Violation], None], step: Callable[[], int] = lambda: 0,
                 num_blocks: int = 0):
        self.emit = emit
        self.step = step
        #: the producer record of each block, as five per-block lists
        #: (:data:`RECORD_FIELDS`: engine cache key, producer, producer
        #: chain, index in it, weights digest when cached); a block without a
        #: record has key None.  A few references per block, made once for
        #: the pool: a tuple and a dict entry per cached block cost about
        #: 150 bytes (``python -m benchmarks.scale``).  A tuple of lists so
        #: the C paths (``kvsan._native._shadowfast``) read it without attribute
        #: lookups; a block beyond the lists grows them.
        self.records: tuple[list, list, list, list, list] = tuple(
            [None] * num_blocks if f != "index" else [0] * num_blocks for f in RECORD_FIELDS)
        self.checked = 0

    def links(self, blocks: Iterable[int]) -> list[tuple[int, int, int]]:
        """``(block, parent link, token link)`` of each of ``blocks`` whose
        producer is recorded: the tokens it was cached under, as the
        producer's chain has them (:func:`token_link`)."""
        keys, _, chains, index, _ = self.records
        n, got = len(keys), []
        for b in blocks:
            if 0 <= b < n and keys[b] is not None:
                tok, k = chains[b].tok, index[b]
                if k < len(tok):
                    got.append((b, tok[k - 1] if k else 0, tok[k]))
        return got

    def _grow(self, n: int) -> None:
        for f, lst in zip(RECORD_FIELDS, self.records):
            lst.extend([0 if f == "index" else None] * (n - len(lst)))

    def producer(self, block: int) -> tuple[bytes, str, RequestIdentity, int, bytes] | None:
        """Block ``block``'s producer record (key, producer, chain, index,
        weights digest), or None."""
        keys = self.records[0]
        if not 0 <= block < len(keys) or keys[block] is None:
            return None
        return tuple(lst[block] for lst in self.records)

    def on_cached(self, producer: str, ident: RequestIdentity, weights: bytes,
                  blocks: Iterable[tuple[int, int, bytes]]) -> None:
        """``producer`` cached ``blocks`` = (index in its chain, block, engine
        key); a block keeps its first producer while its key and the weights
        digest are unchanged (a block cached again under new weights holds
        the new producer's KV: a reset after a weight update leaves no stale
        record)."""
        keys, owners, chains, index, weights_of = self.records
        for k, block, key in blocks:
            if block < 0:
                continue  # not a block id (the C path declines it too)
            if block >= len(keys):
                self._grow(block + 1)
            known = keys[block]
            if known is None or known != key or not (weights_of[block] is weights
                                                     or weights_of[block] == weights):
                keys[block], owners[block], chains[block] = key, producer, ident
                index[block], weights_of[block] = k, weights

    def on_hits(self, consumer: str, ident: RequestIdentity, weights: bytes,
                blocks: Iterable[tuple[int, int, bytes | None]]) -> None:
        """``consumer`` was served ``blocks`` = (index in its chain, block,
        engine key) from the prefix cache."""
        keys, _, chains, index, weights_of = self.records
        n = len(keys)
        for i, block, key in blocks:
            known = keys[block] if 0 <= block < n else None
            if known is None or key is None or known != key:
                continue  # cached on a path kvsan did not see: nothing to compare
            self.checked += 1
            theirs = weights_of[block]
            if not ((theirs is weights or theirs == weights)
                    and chains[block].same(index[block], ident, i)):
                self.mismatch(block, key, consumer, ident, i, weights, self.producer(block))

    def mismatch(self, block, key, consumer, ident, i, weights, known) -> None:
        """Report that ``consumer`` (chain ``ident``, prefix block ``i``)
        was served ``block`` whose producer record ``known`` has other
        inputs (also called by an adapter that compared the records itself)."""
        _, producer, pident, k, pweights = known
        theirs, ours = pident.fields(k, pweights), ident.fields(i, weights)
        differ = [f for f, a, b in zip(FIELDS, theirs, ours) if a != b]
        self.emit(Violation(
            kind=kinds.CACHE_KEY_MISMATCH,
            message=(f"{consumer} was served block {block} (prefix block {i}) cached by "
                     f"{producer}, but their inputs differ in: {', '.join(differ)}"),
            blocks=[block], owners=sorted({consumer, producer}), actor=consumer,
            step=self.step(), site="identity",
            details=[{"block": block, "index": i, "fields": differ,
                      "engine_key": key.hex()[:16],
                      "producer": {f: d.hex()[:16] for f, d in zip(FIELDS, theirs)},
                      "consumer": {f: d.hex()[:16] for f, d in zip(FIELDS, ours)}}]))

