"""Destructive device-side scenarios, one per process (see test_device.py):
``python device_scenarios.py NAME`` prints ``RESULT <json>``."""

import math
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, os.path.dirname(__file__))

BS = 32
PREFIX = [(7 * i) % 500 + 1 for i in range(2 * BS)]


def boot(**cfg):
    from vllm import LLM

    from kvsan import plugin

    from kvsan.harness import traffic
    from kvsan.config import Config
    from kvsan.harness.tinymodel import ensure_tiny_model

    cfg = dict(enabled=True, log_events=False, checksum="all", poison=True, **cfg)
    rt = plugin.install(Config(**cfg), role="engine")
    kw = traffic.engine_kwargs(ensure_tiny_model(), num_blocks=12)
    kw.update(max_num_batched_tokens=48, max_num_seqs=4, max_model_len=320)
    return rt, LLM(**kw)


def early_free_reuse():
    from test_device import add, block_ids, step

    from kvsan.hooks.vllm import faults

    rt, eng = boot()
    faults.inject("double_unref_on_abort")  # A's cancel drops B's references too
    add(eng, "A", PREFIX + [11] * 5, max_tokens=60)
    step(eng, 3)
    add(eng, "B", PREFIX + [22] * 5, max_tokens=20)  # stays within 3 blocks
    step(eng, 3)
    b_full, b_blocks = block_ids(eng, "B")
    eng.llm_engine.abort_request(["A"])
    step(eng)
    # C takes every free block (10 of the 11): B's prefix blocks, at the LRU
    # tail of the free queue, are reused under pressure
    add(eng, "C", [(3 * i) % 400 + 1 for i in range(300)], max_tokens=1)
    try:
        step(eng, 8)
    except Exception:  # noqa: BLE001 - vLLM's own asserts may fire later
        pass
    return rt, {"b": b_full, "b_prefix": b_blocks[:2]}


def poison():
    from test_device import add, block_ids, core, drain, step

    from kvsan.hooks.vllm import worker as vllm_worker

    rt, eng = boot()
    prompt = [(11 * i) % 480 + 1 for i in range(BS + 20)]
    add(eng, "R", prompt, max_tokens=6, logprobs=1)
    ref = next(iter(drain(eng).values())).outputs[0]
    assert eng.reset_prefix_cache()
    rt.clear()
    add(eng, "B", prompt, max_tokens=6, logprobs=1)
    step(eng, 3)
    b_full, b_blocks = block_ids(eng, "B")
    pool = core(eng).scheduler.kv_cache_manager.block_pool
    pool.free_blocks([pool.blocks[b_blocks[-1]]])  # stray free of B's private tail
    out = next(iter(drain(eng).values())).outputs[0]
    finite = [math.isfinite(x.logprob) for d in out.logprobs for x in d.values()]
    (dc,) = vllm_worker._checkers.values()
    return rt, {"b": b_full, "tokens": list(out.token_ids), "ref_tokens": list(ref.token_ids),
                "finite": finite, "poisoned": dc.counters["poisoned"]}


def quarantine():
    """KVSAN_QUARANTINE=3: a block freed under its reader is not handed to the
    next allocation; clean traffic stays clean."""
    from test_device import add, block_ids, core, step

    from kvsan.harness import traffic

    rt, eng = boot(quarantine=3)
    res = traffic.run(eng, seed=5, groups=3, per_group=3)
    clean = [v.kind for v in rt.violations()]
    assert eng.reset_prefix_cache()
    rt.clear()
    add(eng, "B", [(11 * i) % 480 + 1 for i in range(BS + 20)], max_tokens=30)
    step(eng, 3)
    b_full, b_blocks = block_ids(eng, "B")
    pool = core(eng).scheduler.kv_cache_manager.block_pool
    victim = b_blocks[-1]
    pool.free_blocks([pool.blocks[victim]])  # stray free of B's private tail
    add(eng, "C", [(3 * i) % 400 + 1 for i in range(200)], max_tokens=1)
    step(eng, 2)
    _, c_blocks = block_ids(eng, "C")
    return rt, {"clean_violations": clean, "finished": res.finished, "victim": victim,
                "c_blocks": c_blocks, "b": b_full}


if __name__ == "__main__":
    rt, result = globals()[sys.argv[1]]()
    result["violations"] = [
        {"kind": v.kind, "blocks": v.blocks, "owners": v.owners, "actor": v.actor,
         "site": v.site} for v in rt.violations()]
    from kvsan.harness.enginedrive import write_marked

    write_marked("RESULT ", result)  # one write: vLLM's threads share stdout
