"""Fuzz programs: the fuzzer's bytes decoded into a configuration and a list
of operations, and back as JSON (a corpus entry, a finding, a reproducer all
hold the same program).

The decoder is total (every byte string is a valid program) and maps bytes
to operations locally (one operation reads the bytes after its opcode), so a
mutation of a few bytes changes a few operations: what a coverage-guided
engine needs to climb.  Every program is legal traffic for vLLM: requests
over a few token families (shared, nested and near-duplicate prefixes),
steps, aborts at any step, ``reset_prefix_cache``, adapter reloads; the
configuration picks the pool size, batch shape, async scheduling, draft
tokens, the KV-cache layout and a KV connector (kvsan's stub, or vLLM's
own Mooncake store connector).  Nothing in it names a
block: blocks are vLLM's to hand out.
"""

from __future__ import annotations

import json
import random

BLOCK = 16
#: token families prompts draw their prefixes from
FAMILIES = 3
FAMILY_LEN = 6 * BLOCK
#: at most this many operations per program
MAX_OPS = 96

LAYOUTS = ("full", "full", "sliding", "hybrid")


def _families() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(1, 450) for _ in range(FAMILY_LEN)] for _ in range(FAMILIES)]


FAMILY_TOKENS = _families()


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        b = self.data[self.pos]
        self.pos += 1
        return b


def decode(data: bytes, engine: bool = False) -> dict:
    """The program of ``data``.  ``engine``: for the engine target (no
    layout, draft tokens or connector choice: the engine's own)."""
    r = _Reader(data)
    cfg = {
        "blocks": 6 + r.byte() % 40,
        "seqs": (1, 2, 4, 8)[r.byte() % 4],
        "budget": (16, 32, 64, 256)[r.byte() % 4],
        "async": bool(r.byte() & 1),
        "caching": r.byte() % 4 != 0,
    }
    spec = (0, 0, 1, 3)[r.byte() % 4]
    layout = LAYOUTS[r.byte() % 4]
    # (the stub, vLLM's own Mooncake store connector (its scheduler half; a
    # synchronous, single-group one), or none)
    connector = {0: "stub", 2: "mooncake"}.get(r.byte() % 4, False)
    if engine:
        cfg.update(blocks=8 + cfg["blocks"], spec=0, layout="full", connector=False)
    else:
        # (an async scheduler's drafts come from the runner's output, not
        # update_draft_token_ids; a connector over several groups must
        # support them: the stub is a single-group one)
        if connector == "mooncake" and (cfg["async"] or layout != "full"):
            connector = False
        cfg.update(spec=0 if cfg["async"] else spec, layout=layout,
                   connector=connector if layout != "hybrid" else False)
    ops: list[list] = []
    while r.left() > 0 and len(ops) < MAX_OPS:
        code = r.byte() % 14
        if code in (0, 1, 2):
            # (block edges are where KV-cache code turns: a prompt ending on
            # one, one token short of one, or as long as a family's prefix)
            op = ["add", r.byte() % FAMILIES, r.byte() % 6, _edge(r.byte(), BLOCK)]
            b = r.byte()
            op.append(r.byte() % 96 if b % 4 == 0 else -1)          # near-duplicate position
            b = r.byte()
            op.append(0 if b % 2 == 0 else b % 24)                    # own tail
            op.append(1 + _edge(r.byte(), 16))                        # max_tokens
            b = r.byte()
            op.append(b % 3 if b % 4 == 3 else -1)                    # salt
            b = r.byte()
            op.append(b % 2 if b % 4 == 3 else -1)                    # adapter name
            b = r.byte()
            # connector: external blocks, async load, load fails, delayed free
            kv = ([b % 4, bool(b & 4), b & 24 == 24, bool(b & 32)]
                  if cfg["connector"] == "stub" else None)
            # a streaming-input session (resumable: it waits for its next
            # segment when it stops); the stub plans no transfer for one
            b = r.byte()
            resumable = b % 4 == 1
            if resumable and b & 4:
                # (a segment that stops on a block edge: its last sampled
                # token completes a block the next segment rewrites)
                op[6] = BLOCK - (op[2] * BLOCK + op[3] + op[5]) % BLOCK
            op.append(None if resumable else kv)
            op.append(resumable)
            ops.append(op)
        elif code in (3, 4, 5, 6):
            ops.append(["step", r.byte() % 4])  # draft tokens accepted
        elif code == 7:
            ops.append(["steps", 1 + r.byte() % 8])
        elif code in (8, 9):
            ops.append(["abort", r.byte()])
        elif code == 10:
            ops.append(["reset"])
        elif code == 11:
            ops.append(["reload", r.byte() % 2])
        else:
            # a session's next segment (or, final, its end): which session,
            # the segment's tokens (a family's prefix and a tail), max_tokens
            b = r.byte()
            ops.append(["update", r.byte(), r.byte() % FAMILIES, r.byte() % 4, r.byte() % 24,
                        1 + r.byte() % 16, b % 8 == 7])
    return {"config": cfg, "ops": ops}


def _edge(b: int, n: int) -> int:
    """A number below ``n`` from byte ``b``: 0 or ``n - 1`` a quarter of
    the time each, else any."""
    return (0, n - 1, b % n, b % n)[(b >> 6) & 3]


def segment(op: list, n: int) -> list[int]:
    """The tokens of ``update`` operation ``op`` (the ``n``-th operation of
    its program): a family's first blocks and a tail of its own."""
    _, _, fam, blocks, tail = op[:5]
    toks = list(FAMILY_TOKENS[fam][: blocks * BLOCK])
    toks += [(n * 173 + 11 * j) % 449 + 1 for j in range(tail)]
    return toks or [n % 449 + 1]


def continuation(fam: int, pos: int) -> int:
    """The token a synthetic model samples at position ``pos`` of a request
    over family ``fam``: the family's own next token (as a chat turn's answer
    reappears in the next turn's prompt), so later prompts hit blocks that
    hold sampled tokens."""
    if 0 <= fam < FAMILIES and pos < FAMILY_LEN:
        return FAMILY_TOKENS[fam][pos]
    return (pos * 7) % 449 + 1




def prompt(op: list, n: int) -> list[int]:
    """The prompt of ``add`` operation ``op``, the ``n``-th request: a
    family's first ``blocks`` blocks and ``partial`` tokens, one token
    changed (near duplicate) or not, and a tail of its own."""
    _, fam, blocks, partial, near, tail = op[:6]
    toks = list(FAMILY_TOKENS[fam][: blocks * BLOCK + partial])
    if near >= 0 and toks:
        i = near % len(toks)
        toks[i] = toks[i] % 449 + 1
    toks += [(n * 131 + 7 * j) % 449 + 1 for j in range(tail)]
    return toks or [n % 449 + 1]


def dumps(program: dict) -> str:
    return json.dumps(program, separators=(",", ":"))
