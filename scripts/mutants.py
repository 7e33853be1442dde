"""Mutation campaign over vLLM's allocator-side source: which single-statement
faults in vLLM does kvsan report?

Every method of ``BlockPool``, the free queue, the KV cache managers and
coordinators, and the scheduler's release paths is parsed; each mutation
site (a statement deleted, a comparison negated, a boolean return flipped,
a ``not`` dropped, a ``reversed()`` dropped, an increment doubled) gives one
mutant: the method rebuilt from the changed source in its own module and put
on its class before kvsan hooks it.  Each mutant runs the scheduler
benchmark's workload (:class:`benchmarks.sched.Lane`: 16 requests over
shared prefixes, cancellations, a 64-block pool, 120 steps, then every
request aborted and kvsan's full audit) with kvsan on.  An oracle of our own
checks vLLM's state after every step (every block's ``ref_cnt`` against the
block tables that list it, the free list against the free count, every
cache-map entry against its block's key).  Outcomes:

- detected: kvsan reported something;
- crash: vLLM raised (the fault shows itself);
- GAP: kvsan silent while the oracle found vLLM's state broken;
- differs: kvsan and the oracle silent, the workload's counts differ
  (mostly scheduling and caching policy: fewer hits, other admissions);
- same: no difference seen (equivalent, or on a path the workload misses).

    .venv/bin/python scripts/mutants.py [default|strict] [Class.method] [--differs] [--each]
"""
import ast
import collections
import inspect
import json
import os
import signal
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm.v1.core import block_pool as bp_mod  # noqa: E402
from vllm.v1.core import kv_cache_coordinator as co_mod  # noqa: E402
from vllm.v1.core import kv_cache_manager as kvm_mod  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.core import single_type_kv_cache_manager as st_mod  # noqa: E402
from vllm.v1.core.sched import scheduler as sch_mod  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from benchmarks import sched as S  # noqa: E402
from kvsan.hooks.vllm import allocator as vllm_allocator  # noqa: E402

CLASSES = [
    (bp_mod, "BlockPool"), (kcu, "FreeKVCacheBlockQueue"), (kvm_mod, "KVCacheManager"),
    (st_mod, "SingleTypeKVCacheManager"), (st_mod, "FullAttentionManager"),
    (co_mod, "KVCacheCoordinator"), (co_mod, "UnitaryKVCacheCoordinator"),
    (sch_mod, "Scheduler"),
]
SCHED_METHODS = {"_free_request", "_free_blocks", "finish_requests", "_preempt_request",
                 "_update_after_schedule", "_make_cached_request_data", "schedule", "update_from_output",
                 "reset_prefix_cache", "_connector_finished"}

#: the classes of which only the methods in SCHED_METHODS are mutated
FILTERED = {"Scheduler"}

NEG = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE,
       ast.GtE: ast.Gt, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}


def sites(tree):
    """Yield (kind, node) mutation sites in a function tree, in walk order."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expr,)) and isinstance(node.value, ast.Call):
            yield ("del", node)
        elif isinstance(node, (ast.AugAssign, ast.Delete)):
            yield ("del", node)
        elif isinstance(node, ast.Assign) and any(isinstance(t, (ast.Attribute, ast.Subscript)) for t in node.targets):
            yield ("del", node)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in NEG:
            yield ("cmp", node)
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, bool):
            yield ("ret", node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield ("not", node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "reversed" and len(node.args) == 1:
            yield ("rev", node)
        if isinstance(node, ast.AugAssign) and isinstance(node.value, ast.Constant) and node.value.value == 1:
            yield ("inc2", node)


class Apply(ast.NodeTransformer):
    """Applies mutation ``kind`` at node ``target``."""

    def __init__(self, target, kind):
        self.target, self.kind = target, kind

    def visit(self, node):
        if node is self.target:
            k = self.kind
            if k == "del":
                return ast.copy_location(ast.Pass(), node)
            if k == "cmp":
                node.ops = [NEG[type(node.ops[0])]()]
                return node
            if k == "ret":
                node.value = ast.Constant(not node.value.value)
                return node
            if k == "not":
                return node.operand
            if k == "rev":
                return node.args[0]
            if k == "inc2":
                node.value = ast.Constant(2)
                return node
        return super().visit(node)


class FixSuper(ast.NodeTransformer):
    """``super()`` made explicit: a function rebuilt outside its class
    statement has no ``__class__`` cell."""

    def __init__(self, first):
        self.first = first

    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "super" and not node.args:
            node.args = [ast.Name("__mut_cls__", ast.Load()), ast.Name(self.first, ast.Load())]
        return node


def methods():
    """(class, name, class attribute, function, source) of each method."""
    for mod, cname in CLASSES:
        cls = getattr(mod, cname)
        for name, obj in list(vars(cls).items()):
            fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
            if isinstance(obj, property) or not inspect.isfunction(fn):
                continue
            if cname in FILTERED and name not in SCHED_METHODS:
                continue
            try:
                src = textwrap.dedent(inspect.getsource(fn))
            except (OSError, TypeError):
                continue
            yield cls, name, obj, fn, src


def build(cls, obj, fn, src, idx, find=sites, apply=Apply):
    """The method with its ``idx``-th mutation (of those ``find`` yields,
    made by the transformer ``apply``), and where it is."""
    tree = ast.parse(src)
    fdef = tree.body[0]
    kind, node = list(find(fdef))[idx]
    line = node.lineno + fn.__code__.co_firstlineno - 1
    apply(node, kind).visit(tree)
    if fdef.args.args:
        FixSuper(fdef.args.args[0].arg).visit(tree)
    ast.fix_missing_locations(tree)
    ns = dict(fn.__globals__)
    ns["__mut_cls__"] = cls
    code = compile(tree, inspect.getsourcefile(fn), "exec")
    exec(code, ns)
    new = ns[fdef.name]
    # decorators were re-applied by exec (staticmethod etc.)
    return new, f"{kind}@{line}"


def oracle(sched):
    """Independent checks of vLLM's own pool state."""
    bad = []
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool
    expect = collections.Counter()
    for mgr in kvm.coordinator.single_type_managers:
        for rid, blocks in mgr.req_to_blocks.items():
            for b in blocks:
                if not b.is_null:
                    expect[b.block_id] += 1
    free_ids = []
    queue = pool.free_block_queue
    cur = queue.fake_free_list_head.next_free_block
    while cur is not None and cur is not queue.fake_free_list_tail \
            and len(free_ids) <= len(pool.blocks) + 2:
        free_ids.append(cur.block_id)
        cur = cur.next_free_block
    if len(free_ids) != len(set(free_ids)):
        bad.append("free list has duplicates")
    fs = set(free_ids)
    for b in pool.blocks:
        if b.is_null:
            continue
        if b.ref_cnt != expect[b.block_id]:
            bad.append(f"block {b.block_id} ref {b.ref_cnt} != holders {expect[b.block_id]}")
        if (b.ref_cnt == 0) != (b.block_id in fs):
            bad.append(f"block {b.block_id} ref {b.ref_cnt} in free list {b.block_id in fs}")
    for key, val in pool.cached_block_hash_to_block._cache.items():
        for blk in (val.values() if isinstance(val, dict) else [val]):
            if blk.block_hash != key and key not in pool.cached_block_hashes_by_block.get(blk.block_id, ()):
                bad.append(f"stale cache entry -> block {blk.block_id}")
    if len(fs) != pool.free_block_queue.num_free_blocks:
        bad.append(f"free count {pool.free_block_queue.num_free_blocks} != list {len(fs)}")
    return bad[:5]


class Off:
    """A lane with kvsan off: :func:`benchmarks.sched._activate` unhooks."""
    rt = None


def scenario(setting, seed, steps=120):
    """The workload with kvsan on (``setting``), then every request aborted
    and the full audit; what kvsan and the oracle found."""
    lane = S.Lane(setting, 16, seed, 64)
    err = None
    bad = []
    try:
        for _ in range(steps):
            lane.step()
            if not bad:
                bad = oracle(lane.sched)
        # drain
        sched = lane.sched
        sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
        lane.cancel_at.clear()
        for _ in range(4):
            out = sched.schedule()
            sched.update_from_output(out, ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[]))
        if not bad:
            bad = oracle(sched)
        if lane.rt is not None:
            vllm_allocator.audit_scheduler(lane.rt, sched, "mut.final")
    except Exception as e:  # noqa: BLE001 - the mutant's own failure
        err = f"{type(e).__name__}: {str(e)[:120]}"
    kinds = collections.Counter(v.kind for v in lane.rt.violations()) if lane.rt is not None else {}
    fp = lane.fingerprint
    S._activate(Off())
    return dict(kinds=dict(kinds), err=err, fp=fp, oracle=bad)


def timeout(*_):
    raise TimeoutError("mutant timed out")


def main():
    argv = [a for a in sys.argv[1:] if not a.startswith("--")]
    setting = argv[0] if argv else "default"
    only = argv[1] if len(argv) > 1 else None
    rows = []
    signal.signal(signal.SIGALRM, timeout)
    base = scenario(setting, 1)
    print("unchanged vLLM:", json.dumps(base), flush=True)
    assert not base["kinds"] and not base["err"] and not base["oracle"], base
    for cls, name, obj, fn, src in list(methods()):
        if only and only not in f"{cls.__name__}.{name}":
            continue
        n = len(list(sites(ast.parse(src).body[0])))
        for i in range(n):
            try:
                new, where = build(cls, obj, fn, src, i)
            except Exception as e:
                print("BUILD-FAIL", cls.__name__, name, i, repr(e)[:100], flush=True)
                continue
            setattr(cls, name, new)
            signal.alarm(20)
            try:
                r = scenario(setting, 1)
            except Exception as e:
                r = dict(kinds={}, err=f"outer {type(e).__name__}: {str(e)[:100]}", fp=None, oracle=[])
                try:
                    S._activate(Off())
                except Exception:
                    pass
            finally:
                signal.alarm(0)
                setattr(cls, name, obj)
            r.update(m=f"{cls.__name__}.{name}", where=where, same=r["fp"] == base["fp"])
            rows.append(r)
            if "--each" in sys.argv:
                print("MUT", json.dumps(r, default=str), flush=True)

    summarize(rows, "--differs" in sys.argv)


def summarize(rows, differs=False):
    """Counts by outcome, the gaps, and (``differs``) the silent changes."""
    cat = collections.Counter()
    gaps, diff = [], []
    for r in rows:
        if r["kinds"]:
            c = "detected" + ("+crash" if r["err"] else "")
        elif r["err"]:
            c = "crash"
        elif r["oracle"]:
            c = "GAP"
            gaps.append(r)
        elif not r["same"]:
            c = "differs"
            diff.append(r)
        else:
            c = "same"
        cat[c] += 1
    print(f"{len(rows)} mutants:", dict(cat.most_common()))
    print("GAP (kvsan silent, vLLM's state broken):")
    for r in gaps:
        print("  ", r["m"], r["where"], r["oracle"][:2])
    if differs:
        print("differs (kvsan and the oracle silent, the workload's counts differ):")
        for r in diff:
            print("  ", r["m"], r["where"], r["fp"])


if __name__ == "__main__":
    main()
