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
tokens, the KV-cache layout and a KV connector.  Nothing in it names a
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
    }
    spec = (0, 0, 1, 3)[r.byte() % 4]
    layout = LAYOUTS[r.byte() % 4]
    connector = r.byte() % 4 == 0
    if engine:
        cfg.update(blocks=8 + cfg["blocks"], spec=0, layout="full", connector=False)
    else:
        # (an async scheduler's drafts come from the runner's output, not
        # update_draft_token_ids; a connector over several groups must
        # support them: the stub is a single-group one)
        cfg.update(spec=0 if cfg["async"] else spec, layout=layout,
                   connector=connector and layout == "full")
    ops: list[list] = []
    while r.left() > 0 and len(ops) < MAX_OPS:
        code = r.byte() % 12
        if code in (0, 1, 2):
            op = ["add", r.byte() % FAMILIES, r.byte() % 6, r.byte() % BLOCK]
            b = r.byte()
            op.append(r.byte() % 96 if b % 4 == 0 else -1)          # near-duplicate position
            op.append(r.byte() % 24)                                  # own tail
            op.append(1 + r.byte() % 16)                              # max_tokens
            b = r.byte()
            op.append(b % 3 if b % 4 == 3 else -1)                    # salt
            b = r.byte()
            op.append(b % 2 if b % 4 == 3 else -1)                    # adapter name
            b = r.byte()
            # connector: external blocks, async load, load fails, delayed free
            op.append([b % 4, bool(b & 4), b & 24 == 24, bool(b & 32)] if cfg["connector"] else None)
            ops.append(op)
        elif code in (3, 4, 5, 6):
            ops.append(["step", r.byte() % 4])  # draft tokens accepted
        elif code == 7:
            ops.append(["steps", 1 + r.byte() % 8])
        elif code in (8, 9):
            ops.append(["abort", r.byte()])
        elif code == 10:
            ops.append(["reset"])
        else:
            ops.append(["reload", r.byte() % 2])
    return {"config": cfg, "ops": ops}


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
