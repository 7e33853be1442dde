"""Ray on the real engine: vLLM's Ray executor (``distributed_executor_backend
="ray"``, its ``RayWorkerProc`` actors) with ``tensor_parallel_size=2`` on the
CPU build, through a test-only shim that gives vLLM's CPU platform a Ray
resource (``tests/ray_child.py`` says what it changes and why).  kvsan must
reach the Ray workers only through the variables vLLM copies to them, load
there as a worker, run its device checks on each rank's shard, and name the
rank in what it reports."""

import os
import subprocess
import sys

import pytest

from kvsan.harness.demo import _traffic_stats
from test_serve import free_port_block
from test_tensor_parallel import events, only_the_scribble

pytest.importorskip("ray")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHILD = os.path.join(os.path.dirname(__file__), "ray_child.py")


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    """One engine run on a local Ray cluster: clean shared-prefix traffic,
    and a scribble into a sealed block of rank 1's shard only
    (``scribble_sealed@rank1``), found in its step (``KVSAN_CHECKSUM=all``)."""
    from kvsan.harness.tinymodel import ensure_tiny_model

    report = tmp_path_factory.mktemp("ray")
    base = free_port_block((0, 1, 100, 101))  # front end, EngineCore, two workers
    env = dict(os.environ, KVSAN="1", KVSAN_LOG="0", KVSAN_REPORT=str(report) + os.sep,
               KVSAN_CHECKSUM="all", KVSAN_INJECT="scribble_sealed@rank1",
               KVSAN_METRICS_PORT=str(base), KVSAN_METRICS_ADDR="127.0.0.1",
               VLLM_CPU_OMP_THREADS_BIND="0|1")
    for var in ("KVSAN_INJECT_ONLY", "VLLM_ENABLE_V1_MULTIPROCESSING", "RAY_ADDRESS"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, CHILD, ensure_tiny_model()], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(report), _traffic_stats(proc.stdout), base


def test_kvsan_loads_in_each_ray_worker_as_a_worker(ray_run):
    report, stats, _ = ray_run
    assert stats["finished"] > 0 and stats["aborted"] > 0 and stats["cached_tokens"] > 0
    # the Ray cluster's own processes never saw KVSAN: what the workers have
    # came through vLLM's copy of the driver's variables
    assert stats["kvsan_inherited_by_ray"] is None
    got = sorted((r["role"], r["engine"]) for r in events(report, "kvsan.installed"))
    assert got == [("engine", 0), ("frontend", 0), ("worker", 0), ("worker", 0)]
    # each rank (confirmed from vLLM's parallel state) checks its own shard
    on = events(report, "kvsan.device_on")
    assert sorted((r["role"], r["rank"], r["write_guard"], r["input_tokens"]) for r in on) == [
        ("worker", 0, True, "recorded"), ("worker", 1, True, "recorded")]
    assert len({r["pid"] for r in on}) == 2 and {r["num_blocks"] for r in on} == {24}
    assert events(report, "kvsan.internal_error") == []


def test_a_scribble_on_ray_rank_1_is_reported_by_rank_1_only(ray_run):
    report, _, _ = ray_run
    only_the_scribble(report, "worker", engine=0, rank=1)


def test_each_ray_worker_serves_its_metrics_on_its_rank_s_port(ray_run):
    """A Ray worker's process name carries no rank: kvsan binds its exporter
    port (``KVSAN_METRICS_PORT`` + 100 + rank) once vLLM's parallel state
    has given the rank, so the two ranks never race for one port, and says
    so (``identity_pending`` at install, then one ``kvsan.identity``)."""
    report, _, base = ray_run
    ports = sorted((r["role"], r["rank"], r["port"]) for r in events(report, "kvsan.metrics"))
    assert ports == [("engine", 0, base + 1), ("frontend", 0, base),
                     ("worker", 0, base + 100), ("worker", 1, base + 101)], ports
    ident = sorted((r["role"], r["engine"], r["rank"]) for r in events(report, "kvsan.identity"))
    assert ident == [("worker", 0, 0), ("worker", 0, 1)]
    pending = sorted((r["role"], r.get("identity_pending", False))
                     for r in events(report, "kvsan.installed"))
    assert pending == [("engine", False), ("frontend", False), ("worker", True),
                       ("worker", True)]
    assert events(report, "kvsan.internal_error") == []


_ROLE_PROBE = r"""
import json, ray
from kvsan.hooks.vllm import processes

def role_of(name):
    cls = type(name, (), {"role": lambda self: (processes.role(), processes.ray_actor_class(),
                                                processes.identity_in_name(processes.role()))})
    return ray.get(ray.remote(num_cpus=0)(cls).remote().role.remote())

ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
try:
    got = {n: role_of(n) for n in ("RayWorkerWrapper", "RayWorkerProc", "EngineCoreActor",
                                   "DPMoEEngineCoreActor", "SomeUserActor")}
    got["driver"] = (processes.role(), processes.ray_actor_class(),
                     processes.identity_in_name(processes.role()))
finally:
    ray.shutdown()
print("ROLES " + json.dumps(got))
"""


def test_a_ray_actor_process_takes_its_role_from_the_actor_class():
    """Every vLLM Ray actor class kvsan knows maps to its role, in a real Ray
    actor process (named ``MainProcess``, as all of Ray's are); another
    actor, and the driver, stay ``frontend``."""
    import json

    proc = subprocess.run([sys.executable, "-c", _ROLE_PROBE], capture_output=True,
                          text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ROLES "))
    got = {k: tuple(v) for k, v in json.loads(line[6:]).items()}
    # (the third: whether the process name told the engine index and rank;
    # a Ray actor's waits for vLLM's parallel config)
    assert got == {"RayWorkerWrapper": ("worker", "RayWorkerWrapper", False),
                   "RayWorkerProc": ("worker", "RayWorkerProc", False),
                   "EngineCoreActor": ("engine", "EngineCoreActor", False),
                   "DPMoEEngineCoreActor": ("engine", "DPMoEEngineCoreActor", False),
                   "SomeUserActor": ("frontend", "SomeUserActor", True),
                   "driver": ("frontend", None, True)}
