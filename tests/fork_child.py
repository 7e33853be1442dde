"""The child process of ``tests/test_fork.py``: the tiny engine with its
processes *forked*, as ``vllm.LLM`` scripts on a GPU start them by default
(``VLLM_WORKER_MULTIPROC_METHOD=fork``): the front end forks the EngineCore,
which forks its worker (``distributed_executor_backend="mp"``).  vLLM's CPU
platform forces ``spawn`` in ``CpuPlatform.check_and_update_config``; this
launcher wraps that hook so the method is ``fork`` again right after it
(``get_mp_context`` reads the variable when each process is started).
kvsan is loaded by ``KVSAN=1`` in the front end only: vLLM does not call
the plugin again in a forked child.

Modes (the parent sets the ``KVSAN_*`` variables):

* ``touch`` (``KVSAN_INJECT=touch_without_ref``, ``KVSAN_INJECT_ONLY=BAD``):
  clean shared-prefix traffic (:mod:`kvsan.harness.traffic`), then BAD-B (a
  two-block prefix) is prefilled, BAD-A hits its prefix without taking a
  reference, BAD-A is cancelled (its free releases two blocks BAD-B still
  reads), and a new request C is prefilled.  B's block ids are read in the
  EngineCore through ``EngineCore.fork_test_blocks``, added here, in the
  front end, before the fork (a spawned EngineCore would not have it).
* ``scribble`` (``KVSAN_INJECT=scribble_sealed@rankN``): the traffic only,
  with ``tensor_parallel_size`` the third argument (default 1): the
  EngineCore forks one worker per rank.

Prints one ``KVSAN_FORK {json}`` line.

    KVSAN=1 KVSAN_REPORT=dir/ python tests/fork_child.py MODEL touch|scribble [TP]
"""

import json
import os
import sys

MARK = "KVSAN_FORK "


def force_fork() -> None:
    from vllm.platforms import cpu

    platform_hook = cpu.CpuPlatform.check_and_update_config  # (a bound classmethod)

    def check_and_update_config(cls, vllm_config):
        platform_hook(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _blocks_of(self, prefix: str) -> dict:
    """EngineCore utility (this test's): request id -> its block ids."""
    mgr = self.scheduler.kv_cache_manager
    return {rid: list(mgr.get_block_ids(rid)[0]) for rid in self.scheduler.requests
            if rid.startswith(prefix)}


def main(model: str, mode: str, tp: int = 1) -> None:
    force_fork()
    from vllm import LLM
    from vllm.v1.engine.core import EngineCore

    from kvsan.harness import traffic

    EngineCore.fork_test_blocks = _blocks_of
    llm = LLM(**traffic.engine_kwargs(model), distributed_executor_backend="mp",
              tensor_parallel_size=tp)
    res = traffic.run(llm, seed=1)
    out = {"finished": res.finished, "aborted": res.aborted, "cached_tokens": res.cached_tokens,
           "frontend": os.getpid()}
    resources = getattr(llm.llm_engine.engine_core, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    out["engine_pids"] = [p.pid for p in getattr(manager, "processes", ())]
    if mode == "touch":
        sys.path.insert(0, os.path.dirname(__file__))
        from abort_mode_child import add, step_until_output

        engine = llm.llm_engine
        client = engine.engine_core
        add(engine, "BAD-B", list(range(100, 110)))
        step_until_output(engine, "BAD-B")
        add(engine, "BAD-A", list(range(200, 210)))
        step_until_output(engine, "BAD-A")
        out["blocks"] = client.call_utility("fork_test_blocks", "BAD-")
        engine.abort_request(["BAD-A"])
        add(engine, "C", list(range(300, 340)), prefix=False)
        step_until_output(engine, "C")
    sys.stdout.write(MARK + json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
