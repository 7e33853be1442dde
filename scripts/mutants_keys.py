"""Mutation campaign over vLLM's cache key: which single-statement faults in
the block hash does kvsan's identity audit report?

The functions that make a block's cache key in vLLM 0.32
(``kv_cache_utils``: the per-request block hasher, the token hash, the
extra keys for LoRA, multimodal inputs, cache_salt and prompt embeddings)
are parsed; each mutation site gives one mutant, rebuilt from the changed
source in its module (the hasher is made again from it).  Mutations are
those of ``scripts/mutants.py`` and, since a cache key is an expression more
than a sequence of statements, a ``+`` that drops one of its operands, a
call argument or tuple element that becomes None, a conditional expression that always takes
its ``else``, and a slice that loses its start.

Each mutant serves pairs of requests through vLLM's real ``KVCacheManager``
(the producer's prompt computed, then the consumer's served its prefix
hits), with kvsan on: pairs whose inputs differ in one field (tokens, LoRA
adapter, LoRA path, cache_salt, an image's identifier, an image's position,
prompt embeddings; with the field absent on one side too) and pairs that
are the same.  An oracle of our own compares the raw inputs of producer and
consumer for the prefix each hit covers.  Outcomes per mutant:

- detected: kvsan reported a ``cache_key_mismatch`` in a pair where the
  oracle saw a wrong hit;
- GAP: a wrong hit, kvsan silent;
- FALSE ALARM: kvsan reported in a pair where every hit was right;
- crash: vLLM raised;
- differs: no wrong hit, fewer right hits than unchanged vLLM (a key that
  is too specific costs hits, not correctness);
- same: no difference seen.

    .venv/bin/python scripts/mutants_keys.py [function] [--each]
"""
import ast
import collections
import inspect
import json
import os
import resource
import signal
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

import torch  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402

import mutants as M  # noqa: E402  (scripts/mutants.py: its sites and how it applies them)
from kvsan import plugin  # noqa: E402
from kvsan.config import Config  # noqa: E402
from vllm_objects import BLOCK, _hash, make_manager  # noqa: E402

FUNCTIONS = ["get_request_block_hasher", "generate_block_hash_extra_keys", "hash_block_tokens",
             "_gen_mm_extra_hash_keys", "_gen_lora_extra_hash_keys",
             "_gen_prompt_embeds_extra_hash_keys"]

TOKENS = list(range(1, 4 * BLOCK + 5))  # four full blocks and a partial one
HIDDEN = 8


def sites(tree):
    """scripts/mutants.py's sites, and the expression-level ones a key needs."""
    yield from M.sites(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            yield ("left", node)
            yield ("right", node)
        if isinstance(node, ast.Call):
            for i, a in enumerate(node.args):
                if isinstance(a, (ast.Name, ast.Attribute)):
                    yield (f"none{i}", node)
        if isinstance(node, ast.Tuple) and isinstance(node.ctx, ast.Load):
            for i, e in enumerate(node.elts):
                if isinstance(e, (ast.Name, ast.Attribute)):
                    yield (f"elt{i}", node)
        if isinstance(node, ast.IfExp):
            yield ("else", node)
        if isinstance(node, ast.Slice) and node.lower is not None:
            yield ("from0", node)


class Apply(M.Apply):
    def visit(self, node):
        if node is self.target:
            k = self.kind
            if k == "left":
                return node.left
            if k == "right":
                return node.right
            if k.startswith("none"):
                node.args[int(k[4:])] = ast.Constant(None)
                return node
            if k.startswith("elt"):
                node.elts[int(k[3:])] = ast.Constant(None)
                return node
            if k == "else":
                return node.orelse
            if k == "from0":
                node.lower = None
                return node
            return super().visit(node)
        return ast.NodeTransformer.visit(self, node)


def source(fn):
    return textwrap.dedent(inspect.getsource(fn))


# ------------------------------------------------------------- the pairs
def lora(name, int_id, path):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, int_id, path)


def image(ident, offset):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                  mm_position=PlaceholderRange(offset=offset, length=8))]


def embeds(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(TOKENS), HIDDEN, generator=g)


def _other_tokens():
    t = list(TOKENS)
    t[2 * BLOCK + 3] += 1000  # the third block differs
    return t


def _embeds_late(seed):
    e = embeds(0)
    e[3 * BLOCK + 1] = embeds(seed)[0]  # the fourth block differs
    return e


#: name -> (producer's fields, consumer's fields); each a dict of Request
#: keyword arguments (``tokens`` for the prompt)
PAIRS = {
    "same": ({}, {}),
    "same lora": ({"lora_request": ("sql", 1, "/a/sql")}, {"lora_request": ("sql", 1, "/a/sql")}),
    "same salt": ({"cache_salt": "t1"}, {"cache_salt": "t1"}),
    "same image": ({"mm_features": ("cat", 4)}, {"mm_features": ("cat", 4)}),
    "same embeds": ({"prompt_embeds": 0}, {"prompt_embeds": 0}),
    "tokens": ({}, {"tokens": "other"}),
    "lora": ({"lora_request": ("sql", 1, "/a/sql")}, {"lora_request": ("chat", 2, "/a/chat")}),
    "lora path": ({"lora_request": ("sql", 1, "/a/v1")}, {"lora_request": ("sql", 1, "/a/v2")}),
    "lora vs base": ({"lora_request": ("sql", 1, "/a/sql")}, {}),
    "salt": ({"cache_salt": "t1"}, {"cache_salt": "t2"}),
    "salt vs none": ({"cache_salt": "t1"}, {}),
    "image": ({"mm_features": ("cat", 4)}, {"mm_features": ("dog", 4)}),
    "image late": ({"mm_features": ("cat", 2 * BLOCK + 4)}, {"mm_features": ("dog", 2 * BLOCK + 4)}),
    "image position": ({"mm_features": ("cat", 4)}, {"mm_features": ("cat", 6)}),
    "image vs none": ({"mm_features": ("cat", 4)}, {}),
    "embeds": ({"prompt_embeds": 0}, {"prompt_embeds": 1}),
    "embeds late": ({"prompt_embeds": 0}, {"prompt_embeds": "late"}),
}


def make(rid, fields, hasher):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    kw = {}
    tokens = _other_tokens() if fields.get("tokens") == "other" else list(TOKENS)
    if "lora_request" in fields:
        kw["lora_request"] = lora(*fields["lora_request"])
    if "cache_salt" in fields:
        kw["cache_salt"] = fields["cache_salt"]
    if "mm_features" in fields:
        kw["mm_features"] = image(*fields["mm_features"])
    if "prompt_embeds" in fields:
        e = fields["prompt_embeds"]
        kw["prompt_embeds"] = _embeds_late(7) if e == "late" else embeds(e)
        tokens = [0] * len(TOKENS)  # (what vLLM holds for a prompt given as embeddings)
    return Request(request_id=rid, prompt_token_ids=None if "prompt_embeds" in kw else tokens,
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                   block_hasher=hasher, **kw), tokens


def inputs_upto(req, tokens, n):
    """The raw inputs that decide the KV of a request's first ``n`` tokens."""
    lr = req.lora_request
    mm = [(f.identifier, f.mm_position.offset, f.mm_position.length)
          for f in (req.mm_features or ()) if f.mm_position.offset < n]
    pe = None if req.prompt_embeds is None else req.prompt_embeds[:n].tolist()
    return (tuple(tokens[:n]), None if lr is None else (lr.lora_name, lr.lora_int_id, lr.lora_path),
            req.cache_salt, tuple(mm), pe)


def serve(m, r):
    computed, hit = m.get_computed_blocks(r)[:2]
    assert m.allocate_slots(r, r.num_tokens - hit, hit, computed) is not None
    r.num_computed_tokens = r.num_tokens
    return hit


def run_pair(rt, name, hasher):
    """(hit tokens, wrong hit, kvsan's mismatch kinds) for one pair."""
    pa, pb = PAIRS[name]
    rt.clear()
    m = make_manager(24)
    a, ta = make("A", pa, hasher)
    b, tb = make("B", pb, hasher)
    serve(m, a)
    hit = serve(m, b)
    wrong = hit > 0 and inputs_upto(a, ta, hit) != inputs_upto(b, tb, hit)
    found = sorted({(v.kind, tuple(v.details[0].get("fields", ())) if v.details else ())
                    for v in rt.violations()})
    return hit, wrong, found


def scenario(rt, hasher):
    out = {}
    for name in PAIRS:
        signal.alarm(2)  # (a pair takes milliseconds; a mutant may loop for ever)
        try:
            out[name] = run_pair(rt, name, hasher)
        except Exception as e:  # noqa: BLE001 - the mutant's own failure
            out[name] = ("crash", f"{type(e).__name__}: {str(e)[:100]}")
        finally:
            signal.alarm(0)
    return out


def classify(res, base):
    crashed = [n for n, r in res.items() if r[0] == "crash"]
    gaps = [n for n, r in res.items() if r[0] != "crash" and r[1] and not r[2]]
    found = [n for n, r in res.items() if r[0] != "crash" and r[1] and r[2]]
    false = [n for n, r in res.items() if r[0] != "crash" and not r[1] and r[2]]
    if gaps:
        return "GAP", gaps
    if false:
        return "FALSE ALARM", false
    if found:
        return "detected", found
    if crashed:
        return "crash", crashed
    fewer = [n for n, r in res.items() if r[0] != base[n][0]]
    return ("differs", fewer) if fewer else ("same", [])


def timeout(*_):
    raise TimeoutError("mutant timed out")


def main():
    argv = [a for a in sys.argv[1:] if not a.startswith("--")]
    only = argv[0] if argv else None
    plugin.uninstall()
    rt = plugin.install(Config(enabled=True, log_events=False), role="engine")
    signal.signal(signal.SIGALRM, timeout)
    # a mutant that loops appending fails with MemoryError, not the OOM killer
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    base = scenario(rt, kcu.get_request_block_hasher(BLOCK, _hash))
    print("unchanged vLLM:", json.dumps(base), flush=True)
    assert all(r[0] != "crash" and not r[1] and not r[2] for r in base.values()), base
    assert all(base[n][0] > 0 for n in PAIRS if n.startswith("same")), base
    cat, rows = collections.Counter(), []
    for fname in FUNCTIONS:
        if only and only != fname:
            continue
        orig = getattr(kcu, fname)
        src = source(orig)
        for i in range(len(list(sites(ast.parse(src).body[0])))):
            try:
                new, where = M.build(kcu, None, orig, src, i, sites, Apply)
            except Exception as e:  # noqa: BLE001
                print("BUILD-FAIL", fname, i, repr(e)[:100], flush=True)
                continue
            setattr(kcu, fname, new)
            try:
                res = scenario(rt, kcu.get_request_block_hasher(BLOCK, _hash))
            finally:
                setattr(kcu, fname, orig)
            c, names = classify(res, base)
            cat[c] += 1
            row = dict(m=fname, where=where, outcome=c, pairs=names,
                       kinds=sorted({k for r in res.values() if r[0] != "crash" for k in r[2]}))
            rows.append(row)
            if "--each" in sys.argv or c in ("GAP", "FALSE ALARM"):
                print("MUT", json.dumps(row, default=str), flush=True)
    plugin.uninstall()
    print(f"{len(rows)} mutants:", dict(cat.most_common()))


if __name__ == "__main__":
    main()
