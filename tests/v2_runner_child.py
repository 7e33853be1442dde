"""vLLM's V2 model runner on CPU (``vllm/v1/worker/cpu/model_runner.py``),
one scenario per process (see test_v2_runner.py):
``python v2_runner_child.py NAME`` prints ``RESULT <json>``.

Test-only launcher.  vLLM 0.32 refuses the V2 runner without a Triton CPU
backend (vllm/config/vllm.py ``_validate_v2_model_runner``: "Model Runner
V2 requires Triton."), because vllm/triton_utils/importing.py sets
``HAS_TRITON = False`` when ``triton.backends`` has no ``"cpu"`` entry (the
registry has no triton-cpu).  Here Triton's interpreter
(``TRITON_INTERPRET=1``) runs the V2 runner's kernels (slot mappings, block
tables, input preparation, sampling) in NumPy instead, and a ``"cpu"``
entry whose driver is never active satisfies vLLM's check: vLLM picks it
only to count one driver, Triton's own driver selection never picks an
inactive one, and interpreted kernels never ask for a driver."""

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
sys.path.insert(0, os.path.dirname(__file__))

from test_device import add, block_ids, drain, step  # noqa: E402 - (no vllm import)

BS = 32
PREFIX = [(7 * i) % 500 + 1 for i in range(2 * BS)]


def shim_triton_cpu() -> None:
    """Before anything imports vllm.triton_utils."""
    import triton.backends as tb
    import triton.runtime.interpreter  # noqa: F401 - what runs the kernels
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class InterpreterOnly(DriverBase):
        @classmethod
        def is_active(cls):
            return False

        def get_current_target(self):
            raise RuntimeError("TRITON_INTERPRET=1: no compiled kernels")

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("TRITON_INTERPRET=1: no compiled kernels")

        def map_python_to_cpp_type(self, ty):
            raise RuntimeError("TRITON_INTERPRET=1: no compiled kernels")

    tb.backends.setdefault("cpu", tb.Backend(BaseBackend, InterpreterOnly))


def boot(num_blocks=24, **kw):
    from vllm import LLM

    from kvsan import plugin

    from kvsan.harness import traffic
    from kvsan.config import Config
    from kvsan.harness.tinymodel import ensure_tiny_model

    cfg = Config(enabled=True, log_events=False, checksum="all", poison=True)
    rt = plugin.install(cfg, role="engine")
    args = traffic.engine_kwargs(ensure_tiny_model(), num_blocks=num_blocks)
    args.update(kw)
    llm = LLM(**args)
    return rt, llm


def runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def facts(rt, llm) -> dict:
    from vllm.v1.worker.gpu import block_table

    from kvsan.hooks.vllm import worker as vllm_worker

    r = runner(llm)
    dc = vllm_worker._checkers.get(r)
    return {
        "runner": f"{type(r).__module__}.{type(r).__qualname__}",
        "runner_bases": [f"{c.__module__}.{c.__qualname__}" for c in type(r).__mro__[1:3]],
        "kernel": type(block_table._compute_slot_mappings_kernel).__name__,
        "counters": dc.counters if dc is not None else None,
        "hooks": [h for h in rt.hooks_installed if "worker.gpu.model_runner" in h],
        "violations": [{"kind": v.kind, "blocks": list(v.blocks), "owners": list(v.owners),
                        "actor": v.actor, "site": v.site, "message": v.message,
                        "details": v.details} for v in rt.violations()],
    }



def clean() -> dict:
    from kvsan.harness import traffic

    rt, llm = boot()
    res = traffic.run(llm, seed=3)
    out = facts(rt, llm)
    out.update(finished=res.finished, aborted=res.aborted, steps=res.steps,
               cached_tokens=res.cached_tokens)
    return out


def scribble() -> dict:
    """A stray write (no allocator call, no slot mapping) into a sealed
    prefix block, found when the next request is served that prefix."""
    from kvsan.hooks.vllm import worker as vllm_worker

    rt, llm = boot(num_blocks=12, max_num_batched_tokens=48, max_num_seqs=4, max_model_len=320)
    add(llm, "A", PREFIX + [11] * 5, max_tokens=40)
    step(llm, 3)  # A's prefill (two chunks) done: its prefix blocks sealed
    a_full, a_blocks = block_ids(llm, "A")
    target = a_blocks[1]
    dc = vllm_worker._checkers[runner(llm)]
    was_sealed = target in dc.sealed
    vllm_worker._layers(runner(llm))[1][target].add_(1.0)
    add(llm, "B", PREFIX + [22] * 5, max_tokens=4)
    step(llm)  # B is served the prefix: verified before its forward
    b_full, b_blocks = block_ids(llm, "B")
    out = facts(rt, llm)
    drain(llm)
    out.update(target=target, was_sealed=was_sealed, a=a_full, b=b_full,
               b_prefix=b_blocks[:2])
    return out


def slot_into_shared() -> dict:
    """The V2 runner's slot mappings (built by its Triton kernel) send one
    new token into a sealed prefix block two requests hold: the write guard
    on ``prepare_attn``'s result reports it before the forward."""
    import wrapt
    from vllm.v1.worker.gpu.block_table import BlockTables

    rt, llm = boot(num_blocks=12, max_num_batched_tokens=48, max_num_seqs=4, max_model_len=320)
    add(llm, "A", PREFIX + [11] * 5, max_tokens=40)
    step(llm, 3)
    add(llm, "B", PREFIX + [22] * 5, max_tokens=40)
    step(llm, 2)  # B hit the prefix and is decoding
    a_full, a_blocks = block_ids(llm, "A")
    b_full, b_blocks = block_ids(llm, "B")
    shared = a_blocks[0]
    fired = []

    def corrupt(wrapped, instance, args, kwargs):
        sm = wrapped(*args, **kwargs)
        if not fired:  # the batch's last token written into block `shared`
            qsl = args[1] if len(args) > 1 else kwargs["query_start_loc"]
            idx = args[0] if args else kwargs["idx_mapping"]
            n = int(qsl[int(idx.shape[0])])
            sm[0, n - 1] = shared * BS + int(sm[0, n - 1]) % BS
            fired.append(n)
        return sm

    original = BlockTables.__dict__["compute_slot_mappings"]
    wrapt.wrap_function_wrapper(BlockTables, "compute_slot_mappings", corrupt)
    try:
        step(llm)
    finally:
        BlockTables.compute_slot_mappings = original
    out = facts(rt, llm)
    out.update(shared=shared, shared_in_b=b_blocks[0] == shared, a=a_full, b=b_full,
               fired=fired)
    return out


if __name__ == "__main__":
    shim_triton_cpu()
    result = {"clean": clean, "scribble": scribble, "slot_into_shared": slot_into_shared}[sys.argv[1]]()
    print("RESULT " + json.dumps(result, default=str), flush=True)
