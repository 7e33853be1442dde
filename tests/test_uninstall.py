"""Uninstalling kvsan gives vLLM back as it was: after an install with every
part on (the allocator, identity and weights hooks, quarantine and pressure,
the worker's hooks on the V1 runner, the owners utility, a built-in fault),
traffic on the real Scheduler, and ``kvsan.plugin.uninstall()``, every
entry of every class and module of vLLM's is the same object as before the
install, and no post-import hook of kvsan's is left registered.  In a fresh
process: the rest of the suite keeps kvsan installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, types
import wrapt.importer as wi

import vllm.v1.core.block_pool, vllm.v1.core.sched.scheduler, vllm.v1.engine.core
import vllm.v1.worker.gpu_model_runner  # (the worker's hooks patch it at once)
from benchmarks.sched import make_scheduler

def snapshot():
    entries = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("vllm") or not isinstance(mod, types.ModuleType):
            continue
        for k, v in list(vars(mod).items()):
            entries[(name, k)] = v
            if isinstance(v, type) and v.__module__ == name:
                for a, w in list(vars(v).items()):
                    entries[(name, f"{k}.{a}")] = w
    return entries

def hooks_of_kvsan():
    out = []
    for module, hooks in (wi._post_import_hooks or {}).items():
        for h in hooks or ():
            fn = getattr(h, "__wrapped__", h)
            if "kvsan" in (getattr(fn, "__module__", "") or "") or "kvsan" in repr(fn):
                out.append(f"{module}: {fn!r}")
    return out

def traffic():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from benchmarks.sched import _hasher
    sched = make_scheduler(8, 40)
    for i in range(8):
        sched.add_request(Request(request_id=f"r{i}", prompt_token_ids=[1 + i % 3] * 40 + [i],
                                  sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
                                  pooling_params=None, block_hasher=_hasher()))
    for _ in range(12):
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[5] for _ in ids]))

traffic()  # (vLLM's own lazy state -- caches, late imports -- set before the snapshot)
before = snapshot()
hooks_before = hooks_of_kvsan()
from kvsan import plugin
from kvsan.config import Config
from kvsan.hooks.vllm import faults

rt = plugin.install(Config(enabled=True, log_events=False, quarantine=8, pressure=True),
                    role="engine")
faults.inject(sys.argv[1])
installed = snapshot()
patched = sorted(k[0] + "." + k[1] for k, v in installed.items()
                 if k in before and before[k] is not v)
traffic()
plugin.uninstall()
after = snapshot()
changed = sorted(k[0] + "." + k[1] for k in set(before) | set(after)
                 if k not in after or k not in before or after[k] is not before[k])
added = sorted(k[0] + "." + k[1] for k in set(after) - set(before))
print(json.dumps({"patched": patched, "changed": changed, "added": added,
                  "hooks_before": hooks_before, "hooks_after": hooks_of_kvsan()}))
"""


def test_uninstall_restores_every_patched_target():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    got = subprocess.run([sys.executable, "-c", CHILD, "double_unref_on_abort"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    res = json.loads(got.stdout.strip().splitlines()[-1])
    # the install did patch (else this test would pass with kvsan doing nothing)
    for target in ("vllm.v1.core.block_pool.BlockPool.touch",
                   "vllm.v1.core.sched.scheduler.Scheduler.schedule",
                   "vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model",
                   "vllm.v1.core.kv_cache_manager.KVCacheManager.free"):
        assert target in res["patched"], (target, res["patched"])
    assert res["changed"] == [], res["changed"]
    assert res["added"] == []
    assert res["hooks_before"] == [] and res["hooks_after"] == [], res["hooks_after"]
