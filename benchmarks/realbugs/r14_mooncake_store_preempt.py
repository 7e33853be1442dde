"""vLLM #52360 / #51637, fixed by #52372 ("Reference GPU blocks for
in-flight store jobs"): with the Mooncake store connector, preemption freed
a request's blocks in the same step while its async store job still read
them; the next allocation reused them, and the store persisted foreign KV
under the preempted request's content-addressed key ("persistent cache
poison").  Present fix in 0.30-0.34 (the per-job block reference in
``MooncakeStoreScheduler._reference_save_blocks``); the entry drops it
(derived: the two lines that take the reference).  vLLM's own
``MooncakeStoreConnector`` scheduler half, driven by the real ``Scheduler``
(its worker half needs the ``mooncake`` package and a store; the worker's
"job done" report is synthetic)."""

from .base import Entry, source_revert
from .drive import BLOCK, block_ids, output, request, tokens

CLS = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler:MooncakeStoreScheduler"


def _scheduler(num_blocks):
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, SchedulerConfig,
                             VllmConfig)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from .drive import _model_config, kv_config

    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048,
                         is_encoder_decoder=False, enable_chunked_prefill=True)
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    kt = KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role="kv_both",
                          kv_connector_extra_config={"enable_lookup": False,
                                                     "load_async": False})
    v = VllmConfig(scheduler_config=sc, model_config=_model_config(), cache_config=cc,
                   device_config=DeviceConfig(device="cpu"), kv_transfer_config=kt)
    cc.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=v, kv_cache_config=kv_config(num_blocks),
                     structured_output_manager=StructuredOutputManager(v), block_size=BLOCK,
                     log_stats=False)


def _jobs(so):
    meta = so.kv_connector_metadata
    return {r.store_job_id for r in getattr(meta, "requests", ()) if r.store_job_id is not None}


def trigger(run):
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        MooncakeStoreWorkerMetadata)

    sched = _scheduler(9)  # 8 usable blocks
    sched.add_request(request("A", tokens(140, 2 * BLOCK - 1), max_tokens=40))
    sched.add_request(request("B", tokens(141, 6 * BLOCK - 2), max_tokens=40))
    pending: dict[int, int] = {}  # store job -> steps until the worker reports it done
    b_blocks, preempted_at = [], None
    for _ in range(8):
        so = sched.schedule()
        run.driver_step += 1
        for job in _jobs(so):
            pending.setdefault(job, 4)  # the DMA takes a few steps
        if "B" in sched.requests and block_ids(sched, "B"):
            b_blocks = block_ids(sched, "B")
        if so.preempted_req_ids and "B" in so.preempted_req_ids and preempted_at is None:
            preempted_at = run.step
            a_new = set(block_ids(sched, "A")) & set(b_blocks)
            if pending and a_new:
                run.fault(sorted(a_new), ["B"])
                run.harm(f"B preempted with its store job in flight; A given B's blocks "
                         f"{sorted(a_new)}, which the job still reads")
        done = {j: 1 for j, left in pending.items() if left <= 1}
        pending = {j: left - 1 for j, left in pending.items() if left > 1}
        out = output(sched, so)
        if done:
            from vllm.v1.outputs import KVConnectorOutput

            out.kv_connector_output = KVConnectorOutput(
                kv_connector_worker_meta=MooncakeStoreWorkerMetadata(completed_saves=done))
        sched.update_from_output(so, out)
    run.trial.notes["preempted_at"] = preempted_at


ENTRY = Entry(
    id="mooncake-store-preempt", upstream="#52360/#51637 (fix #52372)",
    title="preemption frees blocks an async store job still reads",
    kind_class="use-after-free", releases=["<0.30 (pre-#52372)"], level="scheduler",
    expected_kinds=["free_with_live_owners", "reuse_with_live_owners"],
    where="vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/scheduler.py::"
          "MooncakeStoreScheduler._reference_save_blocks",
    revert_how="derived (the per-job block reference dropped)",
    harm_what="blocks a store job reads handed to another request",
    trigger=trigger, revertable=["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"],
    revert=source_revert(CLS, "_reference_save_blocks", [(
        "            self._pinned_saves[store_job_id] = (block_ids, self._num_workers)\n"
        "            pool.touch([pool.blocks[block_id] for block_id in block_ids])\n",
        "            pass  # (pre-#52372: no per-job GPU block reference)\n")]),
)
