"""The child process of ``tests/test_ray.py``: the tiny engine with vLLM's
Ray executor (``distributed_executor_backend="ray"``, two tensor-parallel
workers as Ray actors) on the CPU build, kvsan loaded by ``KVSAN=1``, the
shared-prefix traffic with cancellations of :mod:`kvsan.harness.traffic`.
Prints one ``KVSAN_TRAFFIC {json}`` line with the traffic's figures and what
a plain Ray task saw of ``KVSAN``.

    KVSAN=1 KVSAN_REPORT=dir/ python tests/ray_child.py MODEL

Test-only launcher.  vLLM 0.32 refuses Ray on its CPU platform: the
platform names no Ray resource (``CpuPlatform.ray_device_key`` is "", so
``RayWorkerProc.get_node_and_physical_gpu_ids`` raises "current platform
cpu does not support ray"), and a custom resource is not among Ray's
accelerator ids.  ``ray_cpu_shim/sitecustomize.py``, on every process's
path (this one, the EngineCore it spawns, and Ray's worker processes,
which inherit the local cluster's environment), gives the CPU platform a
custom Ray resource (``kvsan_cpu``, which this local cluster offers) and
the worker actors the one CPU device.  Nothing else of vLLM's Ray path is
changed.

The ``KVSAN_*`` variables are taken out of the environment while the local
Ray cluster starts, so its processes do not inherit them: kvsan reaches
the Ray workers only as it would on a real cluster, through the variables
vLLM's Ray executor copies to them (kvsan adds its own to vLLM's lists).
"""

import os
import sys

SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_cpu_shim")

if __name__ == "__main__":
    os.environ["RAY_ON_CPU_TEST_SHIM"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (SHIM, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, SHIM)
    import sitecustomize  # noqa: F401 - (this process started before PYTHONPATH named it)

    import ray

    kvsan_env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("KVSAN_")
                 or k == "KVSAN"}
    ray.init(num_cpus=2, resources={"kvsan_cpu": 2}, include_dashboard=False,
             log_to_driver=False)

    @ray.remote(num_cpus=0)
    def kvsan_in_ray_env():
        return os.environ.get("KVSAN")

    inherited = ray.get(kvsan_in_ray_env.remote())
    os.environ.update(kvsan_env)
    # the EngineCore joins this cluster, not another one left on the host
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address

    from kvsan.harness import traffic
    from kvsan.harness.demo import TRAFFIC_MARK
    from kvsan.harness.enginedrive import write_marked
    from vllm import LLM

    kwargs = traffic.engine_kwargs(sys.argv[1])
    kwargs.update(distributed_executor_backend="ray", tensor_parallel_size=2)
    llm = LLM(**kwargs)
    res = traffic.run(llm, seed=1)
    write_marked(TRAFFIC_MARK, {"finished": res.finished, "aborted": res.aborted,
                                "steps": res.steps, "cached_tokens": res.cached_tokens,
                                "kvsan_inherited_by_ray": inherited})
    del llm
    ray.shutdown()
