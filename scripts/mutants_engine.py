"""Mutation campaign on the real engine: single-statement mutants of vLLM's
worker-side block tables (and, with ``--allocator``, of the allocator-side
methods :mod:`scripts.mutants` covers), each run on one in-process tiny
engine with kvsan on (``KVSAN=1``, device checks included) through the
seeded shared-prefix traffic of :mod:`kvsan.harness.traffic` (cancellations,
eviction and preemption in a 24-block pool).  The tokens of every request
that finished are compared with the same traffic on unchanged vLLM.

Outcomes: ``detected`` (kvsan reported something), ``crash`` (vLLM raised:
the fault shows itself; the engine is booted again), ``WRONG`` (kvsan silent
while some request's tokens differ: wrong bytes served with success; run
again on a freshly booted engine before it is counted, as an earlier
mutant can leave the engine changed), and ``same`` (kvsan silent, the
tokens as without the mutant).

    .venv/bin/python scripts/mutants_engine.py [Class.method] [--allocator] [--runner] [--inputs] [--hooked] [--each]

``--runner``: also the model runner's ``_update_states`` and the input
batch's row bookkeeping; ``--inputs``: the model runner's preparation of
a step's inputs (``_prepare_inputs``: input ids, positions, sequence
lengths, slot mappings); ``--hooked``: only the methods kvsan hooks.
"""

from __future__ import annotations

import collections
import functools
import gc
import json
import os
import signal
import sys

os.environ.setdefault("KVSAN", "1")
os.environ.setdefault("KVSAN_LOG", "0")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process: the mutants reach every side
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mutants  # noqa: E402  (the mutation sites and builder)
from vllm.v1.worker import block_table as bt_mod  # noqa: E402

WORKER_CLASSES = [(bt_mod, "BlockTable"), (bt_mod, "MultiGroupBlockTable")]
#: with ``--runner``: the model runner's per-step state update (which fills
#: the block tables from the scheduler's output) and the input batch's
#: bookkeeping of request rows
RUNNER_METHODS = {"_update_states", "add_request", "remove_request", "swap_states", "condense"}
#: with ``--inputs``: how the model runner prepares a step's inputs
INPUT_METHODS = {"_prepare_inputs", "_prepare_input_ids", "_get_cumsum_and_arange"}
#: mutants that take the process down where no alarm can stop them (vLLM
#: 0.32's CPU build): deleting ``query_start_loc.np[1:num_reqs + 1] =
#: cu_num_tokens`` leaves the CPU attention kernel looping, or freeing
#: twice, on the stale offsets
SKIPPED = {"GPUModelRunner._prepare_inputs del@2030"}


def boot():
    from vllm import LLM

    from kvsan.harness import traffic
    from kvsan.harness.tinymodel import ensure_tiny_model

    llm = LLM(**traffic.engine_kwargs(ensure_tiny_model()))
    traffic.run(llm, seed=1, groups=2, per_group=2)  # warm-up
    return llm


def run(llm):
    """The traffic once, on a fresh prefix cache: outputs and kvsan's kinds."""
    from kvsan import current_runtime
    from kvsan.harness import traffic

    rt = current_runtime()
    llm.reset_prefix_cache()
    rt.clear()
    res = traffic.run(llm, seed=0, groups=6, per_group=5)
    kinds = collections.Counter(v.kind for v in rt.violations())
    return res, dict(kinds)


@functools.cache
def kvsan_targets() -> tuple:
    """Every method kvsan hooks in an in-process engine."""
    from kvsan.hooks.vllm import allocator as vllm_allocator, identity as vllm_identity, worker as vllm_worker

    return tuple(t for mod in (vllm_allocator, vllm_identity, vllm_worker) for t in mod.targets())


def hooked(cls, name) -> list:
    """kvsan's targets on ``cls.name`` (unhooked while the method is swapped)."""
    qual = f"{cls.__name__}.{name}"
    return [t for t in kvsan_targets() if t.qualname == qual]


def swap(cls, name, new):
    from kvsan import hooks

    ts = hooked(cls, name)
    hooks.uninstrument(ts)
    setattr(cls, name, new)
    hooks.instrument(ts)


def methods(hooked_only: bool) -> list:
    """:func:`mutants.methods`, read with kvsan's hooks taken off (a hooked
    method's class attribute is kvsan's hook, not vLLM's function);
    ``hooked_only``: only the methods kvsan hooks."""
    from kvsan import hooks

    every = list(kvsan_targets())
    hooks.uninstrument(every)
    try:
        got = list(mutants.methods())
    finally:
        hooks.instrument(every)
    return [m for m in got if not hooked_only or hooked(m[0], m[1])]


def attempt(llm, ref, cls, name, obj, new):
    """The traffic with ``cls.name`` swapped for the mutant ``new``: (error
    or None, kvsan's kinds, requests whose tokens differ from ``ref``).
    After an error the caller boots the engine again (it may be left
    broken; the old one must be let go of first)."""
    swap(cls, name, new)
    err, kinds, wrong = None, {}, []
    signal.alarm(60)
    try:
        res, kinds = run(llm)
        wrong = [r for r, toks in res.outputs.items()
                 if r in ref.outputs and toks != ref.outputs[r]]
    except Exception as e:  # noqa: BLE001 - the mutant's own failure
        from kvsan import current_runtime

        err = f"{type(e).__name__}: {str(e)[:100]}"
        kinds = dict(collections.Counter(v.kind for v in current_runtime().violations()))
    finally:
        signal.alarm(0)
        swap(cls, name, obj)
    return err, kinds, wrong


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    only = args[0] if args else None
    classes = WORKER_CLASSES + (mutants.CLASSES if "--allocator" in sys.argv else [])
    if "--runner" in sys.argv or "--inputs" in sys.argv:
        from vllm.v1.worker import gpu_input_batch, gpu_model_runner

        classes += [(gpu_model_runner, "GPUModelRunner")]
        if "--runner" in sys.argv:
            classes += [(gpu_input_batch, "InputBatch")]
            mutants.SCHED_METHODS |= RUNNER_METHODS
        if "--inputs" in sys.argv:
            mutants.SCHED_METHODS |= INPUT_METHODS
        mutants.FILTERED.update({"GPUModelRunner", "InputBatch"})
    mutants.CLASSES[:] = classes
    signal.signal(signal.SIGALRM, mutants.timeout)
    llm = boot()
    ref, kinds = run(llm)
    again, kinds2 = run(llm)
    assert not kinds and not kinds2 and ref.outputs == again.outputs, (kinds, kinds2)
    print(f"unchanged vLLM: {ref.finished} finished, {ref.aborted} aborted, "
          f"{ref.cached_tokens} cached tokens, no violation, the same tokens twice", flush=True)
    rows = []
    for cls, name, obj, fn, src in methods("--hooked" in sys.argv):
        if only and only not in f"{cls.__name__}.{name}":
            continue
        n = len(list(mutants.sites(mutants.ast.parse(src).body[0])))
        for i in range(n):
            try:
                new, where = mutants.build(cls, obj, fn, src, i)
            except Exception as e:  # noqa: BLE001 - a mutant that does not compile
                print("not built:", cls.__name__, name, i, repr(e)[:100], flush=True)
                continue
            if f"{cls.__name__}.{name} {where}" in SKIPPED:
                print("skipped (takes the process down):", cls.__name__, name, where, flush=True)
                continue
            err, kinds, wrong = attempt(llm, ref, cls, name, obj, new)
            first = None
            if not kinds and not err and wrong:
                # once more on a freshly booted engine: an earlier mutant can
                # leave the engine changed (seen: 2 requests' tokens after a
                # run of mutants, none when the same mutant ran alone)
                first = len(wrong)
                del llm
                gc.collect()
                llm = boot()
                err, kinds, wrong = attempt(llm, ref, cls, name, obj, new)
            if err is not None:
                del llm
                gc.collect()
                llm = boot()
            outcome = ("detected" if kinds else "crash" if err else
                       "WRONG" if wrong else "same")
            r = dict(m=f"{cls.__name__}.{name}", where=where, outcome=outcome, kinds=kinds,
                     err=err, wrong=len(wrong))
            if first is not None:
                r["wrong_before_reboot"] = first
            rows.append(r)
            if "--each" in sys.argv or outcome == "WRONG" or first is not None:
                print("MUT", json.dumps(r), flush=True)
    print(f"{len(rows)} mutants:", dict(collections.Counter(r["outcome"] for r in rows)))


if __name__ == "__main__":
    main()
