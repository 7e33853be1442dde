"""The child process of ``tests/test_tensor_parallel.py``: the tiny engine
with ``tensor_parallel_size=2`` on the CPU build (front end, EngineCore and
two worker processes), kvsan loaded by ``KVSAN=1`` (the parent sets the
``KVSAN_*`` variables and ``VLLM_CPU_OMP_THREADS_BIND``), the shared-prefix
traffic with cancellations of :mod:`kvsan.traffic` under a tiny pool.
Prints one ``KVSAN_TRAFFIC {json}`` line (:func:`kvsan.demo._traffic_stats`).

    KVSAN=1 KVSAN_REPORT=dir/ VLLM_CPU_OMP_THREADS_BIND='0|1' \\
        python tests/tp_child.py MODEL
"""

import sys

from kvsan import traffic
from kvsan.demo import TRAFFIC_MARK
from kvsan.enginedrive import write_marked

if __name__ == "__main__":  # the CPU build spawns its processes
    from vllm import LLM

    llm = LLM(**traffic.engine_kwargs(sys.argv[1]), tensor_parallel_size=2)
    res = traffic.run(llm, seed=1)
    write_marked(TRAFFIC_MARK, {"finished": res.finished, "aborted": res.aborted,
                                "steps": res.steps, "cached_tokens": res.cached_tokens})
