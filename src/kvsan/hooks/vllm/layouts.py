"""What kvsan's C modules (:mod:`kvsan._native`) read of vLLM, by name.

The C code reads vLLM's objects only by attribute name (a slot's offset is
looked up from its member descriptor by name, per type version; anything
else goes through ``PyObject_GetAttr``), and declines to its Python twin
when a read fails.  These contracts name every such attribute, private
ones included (``Request._all_token_ids``, ``InputBatch._req_ids``), so
that a release which renames one is found at start-up: :func:`gate` then
switches the C paths off in that process with one ``kvsan.native_off``
record naming what is missing, and the Python paths run the same checks.
tests/test_native_contract.py holds the list to the names in the C sources.

Parameters the C hooks read by name (``request``, ``blocks``,
``num_cached_blocks``, ...) are the hooked methods' parameters, already in
each adapter's ``CONTRACT``.
"""

from __future__ import annotations

from ..contract import Contract, Result, check_one

#: the scheduler side: _shadowfast (blocks), _tokenlinks (requests),
#: _hookfast's allocator, identity and scheduler hooks
CONTRACT = Contract(
    adapter="native",
    check="kvsan's C fast paths on the scheduler side (the Python paths run the same checks)",
    attrs={
        "vllm.v1.core.kv_cache_utils:KVCacheBlock":
            ("block_id", "ref_cnt", "prev_free_block", "is_null", "pool", "block_hash"),
        "vllm.v1.request:Request":
            ("request_id", "status", "_all_token_ids", "cache_salt", "lora_request",
             "mm_features", "prompt_embeds"),
        "vllm.v1.core.sched.scheduler:Scheduler": ("requests",),
        "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager":
            ("req_to_blocks", "kv_cache_group_id", "block_pool"),
        "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator": ("block_pool",),
        "vllm.v1.core.sched.output:SchedulerOutput": ("total_num_scheduled_tokens",),
    },
)

#: the V1 model runner's side: _hookfast's STEP and GUARD hooks and
#: _devicefast's row check (optional: vLLM 0.34 has no V1 runner, and
#: kvsan hooks none there)
CONTRACT_WORKER = Contract(
    adapter="native-worker",
    check="kvsan's C fast paths on the V1 model runner (the Python paths run the same checks)",
    optional=True,
    attrs={
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner": ("input_batch",),
        "vllm.v1.worker.gpu_input_batch:InputBatch":
            ("num_reqs", "req_ids", "_req_ids", "req_id_to_index", "block_table"),
        "vllm.v1.worker.block_table:MultiGroupBlockTable": ("block_tables",),
        "vllm.v1.worker.block_table:BlockTable": ("slot_mapping",),
        "vllm.v1.utils:CpuGpuBuffer": ("gpu",),
        "vllm.v1.core.sched.output:SchedulerOutput":
            ("finished_req_ids", "scheduled_new_reqs", "scheduled_cached_reqs"),
        "vllm.v1.core.sched.output:CachedRequestData": ("resumed_req_ids", "new_block_ids"),
    },
)

#: every contract here (tests, ``kvsan check``)
CONTRACTS = (CONTRACT, CONTRACT_WORKER)


def gate(rt, contract: Contract, source=None) -> list[str]:
    """Where kvsan's C paths are in use in this process and ``contract``
    does not hold against the installed vLLM (``source``: another
    release's recorded answers, :class:`kvsan.hooks.contract._Recorded`),
    switch them all off (:func:`kvsan.hooks.use_native`) and say so in one
    ``kvsan.native_off`` record: the lines naming what is missing, which it
    also returns.  Nothing to do (or nothing in use): []."""
    from ... import hooks

    if not hooks.native_in_use():
        return []
    result = Result()
    check_one(contract, result, source=source)
    if result.holds:
        return []
    hooks.use_native(False)
    rt.native = False
    rt.native_off = list(getattr(rt, "native_off", ())) + result.mismatches
    rt.reporter.event("kvsan.native_off", adapter=contract.adapter,
                      mismatches=result.mismatches,
                      paths="kvsan's C paths off in this process; the Python paths run "
                            "the same checks")
    return result.mismatches
