"""Which of vLLM's processes this is, from the names vLLM gives them.

vLLM names the processes it starts with ``multiprocessing``: an EngineCore
is ``EngineCore`` (``EngineCore_DPN`` for data-parallel engine N), a
worker ``VllmWorker-R`` (R its rank in its engine's executor: TP x PP; its
parent is its engine's EngineCore), an API server of several
``ApiServer_N``.  kvsan labels every record and metric with the role,
engine and rank read here (:func:`kvsan.runtime.set_process_names`); a
worker whose runner kvsan hooks confirms them from vLLM's parallel state.

Under Ray, vLLM's workers and data-parallel EngineCores are Ray actors:
their processes are Ray's, named ``MainProcess``.  There the role is read
from the class of the actor the process hosts (:data:`RAY_ACTORS`); the
rank from vLLM's parallel state, once the runner is hooked; an EngineCore's
engine index from its parallel config, once its scheduler is built.
"""

from __future__ import annotations

import multiprocessing
import re
import sys

#: vLLM's Ray actor classes, by the role of the process that hosts one:
#: the workers of its Ray executors (``ray_executor.RayWorkerWrapper``,
#: ``ray_executor_v2.RayWorkerProc``) and the EngineCores of its Ray
#: data-parallel launcher (``engine.core``)
RAY_ACTORS = {"RayWorkerWrapper": "worker", "RayWorkerProc": "worker",
              "EngineCoreActor": "engine", "DPMoEEngineCoreActor": "engine"}


def _trailing(pattern: str, name: str | None) -> int | None:
    m = re.fullmatch(pattern, name or "")
    return int(m.group(1)) if m else None


def role() -> str:
    """``engine``, ``worker`` or ``frontend``."""
    name = multiprocessing.current_process().name
    if name.startswith("VllmWorker") or name.startswith("Worker"):
        return "worker"
    if name.startswith("EngineCore"):
        return "engine"
    return RAY_ACTORS.get(ray_actor_class() or "", "frontend")


def ray_actor_class() -> str | None:
    """The class name of the Ray actor this process hosts; None outside
    one (or where Ray is not imported: only an actor process has it)."""
    ray = sys.modules.get("ray")
    if ray is None or not getattr(ray, "is_initialized", lambda: False)():
        return None
    try:
        ctx = ray.get_runtime_context()
        if ctx.get_actor_id() is None:
            return None
        # (no public accessor for the class: the handle's descriptor has it)
        return ctx.current_actor._ray_actor_creation_function_descriptor.class_name
    except Exception:  # noqa: BLE001 - a Ray without it: no Ray role
        return None


def identity_in_name(role: str) -> bool:
    """Whether :func:`identity` read this process's engine and rank from
    names vLLM gave (False in a Ray actor's process, which Ray names: the
    engine index and rank are known only from vLLM's parallel config,
    :func:`engine_index`, once the scheduler or the runner is built)."""
    return role == "frontend" or ray_actor_class() is None


def engine_index(parallel_config) -> int:
    """The data-parallel engine index of an EngineCore or worker from vLLM's
    parallel config: ``data_parallel_index`` where vLLM has it (its Ray
    data-parallel actors set it to their DP rank), else
    ``data_parallel_rank``."""
    engine = getattr(parallel_config, "data_parallel_index", None)
    if engine is None:
        engine = parallel_config.data_parallel_rank
    return int(engine)


def identity(role: str) -> tuple[int, int]:
    """``(engine, rank)``: 0 where a name carries none (the front end, an
    in-process engine)."""
    me = multiprocessing.current_process().name
    if role == "engine":
        return _trailing(r"EngineCore_DP(\d+)", me) or 0, 0
    if role == "worker":
        parent = multiprocessing.parent_process()
        engine = _trailing(r"EngineCore_DP(\d+)", parent.name if parent else None) or 0
        return engine, _trailing(r"(?:VllmWorker-|Worker_TP)(\d+)", me) or 0
    return 0, 0


def api_server(name: str | None = None) -> int | None:
    """N of an API server process ``ApiServer_N`` (vLLM starts several when
    ``api_server_count`` > 1, the default with data parallelism; the
    process that launched them stays ``MainProcess``); None otherwise."""
    if name is None:
        name = multiprocessing.current_process().name
    return _trailing(r"ApiServer_(\d+)", name)


#: vLLM's helper programs that load its plugins but build no KV cache and
#: serve nothing: its model-class inspection, run as ``python -m`` in a
#: subprocess of the front end.  kvsan stays out of them (an exporter there
#: would take the front end's ``KVSAN_METRICS_PORT`` port).
HELPER_MAINS = ("vllm.model_executor.models.registry",)


def helper_process() -> str | None:
    """The module this process runs as ``__main__`` if it is one of
    :data:`HELPER_MAINS`, else None."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    return name if name in HELPER_MAINS else None
