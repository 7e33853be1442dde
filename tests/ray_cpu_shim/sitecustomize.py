"""Test-only (``tests/ray_child.py``): vLLM's Ray executor on its CPU
platform.  Active only with ``RAY_ON_CPU_TEST_SHIM=1``; patches vLLM's
modules as they are imported, in every process that has this directory on
its path.  (The functions are module-level: Ray pickles the patched
actor class's methods by reference to this module.)"""

import os


def _ray_resource(mod):
    # the custom resource tests/ray_child.py's local cluster offers
    mod.CpuPlatform.ray_device_key = "kvsan_cpu"


def _cpu_device(self):
    # (Ray lists accelerator ids for accelerators only: the one CPU)
    import ray

    return ray.get_runtime_context().get_node_id(), [0]


def _worker_wrapper(mod):
    if getattr(mod, "RayWorkerWrapper", None) is not None:
        mod.RayWorkerWrapper.get_node_and_physical_gpu_ids = _cpu_device


def _worker_proc(mod):
    mod.RayWorkerProc.get_node_and_physical_gpu_ids = _cpu_device


if os.environ.get("RAY_ON_CPU_TEST_SHIM") == "1":
    import wrapt

    wrapt.register_post_import_hook(_ray_resource, "vllm.platforms.cpu")
    wrapt.register_post_import_hook(_worker_wrapper, "vllm.v1.executor.ray_utils")
    wrapt.register_post_import_hook(_worker_proc, "vllm.v1.executor.ray_executor_v2")
