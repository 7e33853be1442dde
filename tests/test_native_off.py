"""``KVSAN_NATIVE=0`` means no native code anywhere: kvsan installed on
vLLM's real Scheduler and pool from the environment, traffic with shared
prefixes, cancellations and preemption, and a fault, all in a process that
never imports a module of ``kvsan._native``; the Python paths still report
the fault exactly (kind, blocks, owner)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SPEEDUPS, SPEEDUPS_WHY

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]

#: the child: installs kvsan from its environment, drives the real
#: Scheduler for ``steps`` steps, then frees a running request's blocks twice
CHILD = r"""
import json, os, random, sys

from kvsan import plugin
from kvsan.config import from_env

rt = plugin.install(from_env(os.environ), role="engine")

from benchmarks.sched import BLOCK, _hasher, make_scheduler
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

rng = random.Random(7)
sched = make_scheduler(16, 24)
prefixes = [[rng.randrange(1, 500) for _ in range(2 * BLOCK)] for _ in range(3)]
count = 0

def new():
    global count
    count += 1
    prompt = rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))]
    return Request(request_id=f"r{count}", prompt_token_ids=prompt, pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=rng.choice((8, 48)), ignore_eos=True),
                   block_hasher=_hasher())

for _ in range(20):
    sched.add_request(new())
preempted = 0
for step in range(int(sys.argv[1])):
    if step % 5 == 4:  # a cancellation
        sched.finish_requests([next(iter(sched.requests))], RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()
    preempted += len(out.preempted_req_ids or ())
    ids = list(out.num_scheduled_tokens)
    reqs = sched.requests
    sampled = [[7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]
    before = len(reqs)
    sched.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled))
    for _ in range(before - len(sched.requests) + (step % 5 == 4)):
        sched.add_request(new())
clean = [v.kind for v in rt.violations()]

# the fault: a running request's blocks freed twice as that request
rid = next(r for r in sched.running if r.num_computed_tokens)  # (a Request)
blocks = [b for b in sched.kv_cache_manager.coordinator.single_type_managers[0]
          .req_to_blocks[rid.request_id] if not b.is_null]
pool = sched.kv_cache_manager.block_pool
rt.owner_ctx.append((rid.request_id, "free"))
pool.free_blocks(list(blocks))
pool.free_blocks(list(blocks))
rt.owner_ctx.pop()

from kvsan import hooks, shadow
from kvsan.checks import identity, native

print(json.dumps({
    "native_modules": sorted(m for m in sys.modules if m.startswith("kvsan._native")),
    "native": [hooks.NATIVE is not None, hooks.SHADOWFAST is not None,
               hooks.HOOKFAST is not None, identity._links is not None,
               native.DEVICEFAST is not None, bool(rt.native)],
    "held_map": type(next(iter(rt.checkers.values())).shadow.held).__module__,
    "clean": clean, "preempted": preempted, "served": count,
    "fault": [[v.kind, v.blocks, v.owners] for v in rt.violations()
              if v.kind == "double_release"],
    "blocks": [b.block_id for b in blocks], "rid": rid.request_id,
    "errors": rt.reporter.internal_errors,
}))
"""


def _run(native: str, steps: int = 40) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
    env.update(KVSAN="1", KVSAN_NATIVE=native, KVSAN_LOG="0",
               VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    got = subprocess.run([sys.executable, "-c", CHILD, str(steps)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


def test_native_off_imports_no_native_code_and_still_detects():
    got = _run("0")
    assert got["native_modules"] == [], got["native_modules"]
    assert got["native"] == [False] * 6
    assert got["held_map"] == "kvsan.shadow"
    # real traffic ran: requests served, some preempted, none reported
    assert got["served"] > 20 and got["preempted"] > 0 and got["clean"] == []
    assert got["errors"] == 0
    assert got["fault"] and sorted(b for v in got["fault"] for b in v[1]) == sorted(got["blocks"])
    assert all(v[2] == [got["rid"]] for v in got["fault"]), got["fault"]


@pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)
def test_native_on_loads_it_the_same_child():
    """The same child with the C paths on: they are imported and in use
    (the test above would pass vacuously if the child never loaded them),
    and the fault is reported the same."""
    got = _run("1")
    assert "kvsan._native._shadowfast" in got["native_modules"]
    assert got["native"] == [True] * 6
    assert got["held_map"] == "kvsan._native._shadowfast"
    assert got["clean"] == [] and got["errors"] == 0
    assert sorted(b for v in got["fault"] for b in v[1]) == sorted(got["blocks"])
    assert all(v[2] == [got["rid"]] for v in got["fault"]), got["fault"]
