"""The child process of ``tests/test_tensor_parallel.py``: the tiny engine
with ``tensor_parallel_size=2`` on the CPU build (front end, EngineCore and
two worker processes), kvsan loaded by ``KVSAN=1`` (the parent sets the
``KVSAN_*`` variables and ``VLLM_CPU_OMP_THREADS_BIND``), the shared-prefix
traffic with cancellations of :mod:`kvsan.harness.traffic` under a tiny pool.
With ``pp`` after the model, ``pipeline_parallel_size=2`` (TP=1) instead
(``tests/test_pipeline_parallel.py``): each stage one layer of the tiny model.
Prints one ``KVSAN_TRAFFIC {json}`` line (:func:`kvsan.harness.demo._traffic_stats`).

    KVSAN=1 KVSAN_REPORT=dir/ VLLM_CPU_OMP_THREADS_BIND='0|1' \\
        python tests/tp_child.py MODEL [pp]
"""

import sys

from kvsan.harness import traffic
from kvsan.harness.demo import TRAFFIC_MARK
from kvsan.harness.enginedrive import write_marked

if __name__ == "__main__":  # the CPU build spawns its processes
    from vllm import LLM

    kwargs = traffic.engine_kwargs(sys.argv[1])
    if sys.argv[2:] == ["pp"]:
        # vLLM 0.32's CPU worker warms the model up (a dummy run) only when
        # it is compiled, and a later stage's runner makes its buffer for
        # the hidden states it receives in that dummy run only: eager
        # (compilation mode NONE), stage 1's first step fails an assert
        # (``self.intermediate_tensors is not None``).  Dynamo traced once,
        # with its eager backend: the warm-up runs, in seconds, no inductor.
        kwargs.update(pipeline_parallel_size=2, enforce_eager=False,
                      compilation_config={"mode": 2, "backend": "eager"})
    else:
        kwargs.update(tensor_parallel_size=2)
    llm = LLM(**kwargs)
    res = traffic.run(llm, seed=1)
    write_marked(TRAFFIC_MARK, {"finished": res.finished, "aborted": res.aborted,
                                "steps": res.steps, "cached_tokens": res.cached_tokens})
