"""A KV connector stub for the scheduler target, written against vLLM's
connector API (``KVConnectorBase_V1``'s scheduler side): what each request
finds in the external cache, whether its load is asynchronous, whether the
load fails and whether its free is delayed (a send still in flight) is the
fuzz program's choice (:data:`PLAN`); the worker side is the target's
synthetic output (``finished_recving``, ``finished_sending``,
``invalid_block_ids``)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

BLOCK = 16

#: request id -> [external blocks, async load, load fails, delayed free]
PLAN: dict[str, list] = {}


class FuzzConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        #: request id -> external tokens the scheduler allocated for
        self.allocated: dict[str, int] = {}
        #: requests whose external copy is gone (a failed load)
        self.lost: set[str] = set()
        #: asynchronous loads started, and frees delayed, that the worker
        #: side has not reported yet
        self.loading: set[str] = set()
        self.delayed: set[str] = set()
        #: request id -> its local hit when the connector was asked
        self.starts: dict[str, int] = {}

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        plan = PLAN.get(request.request_id)
        if not plan or request.request_id in self.lost:
            return 0, False
        self.starts[request.request_id] = num_computed_tokens
        ext = min(plan[0] * BLOCK, request.num_prompt_tokens - 1)
        n = max(0, ext - num_computed_tokens)
        return n, bool(plan[1]) and n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            rid = request.request_id
            self.allocated[rid] = num_external_tokens
            if PLAN[rid][1]:
                self.loading.add(rid)

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        # (a send may be delayed while the request's own load is pending: a
        # kv_both connector that both receives and sends for one request;
        # vLLM 0.30-0.34 free its blocks on the first of the two reports,
        # #46240)
        rid = request.request_id
        plan = PLAN.get(rid)
        delay = bool(plan and plan[3] and any(block_ids))
        if delay:
            self.delayed.add(rid)
        return delay, None

    # worker side: never called (the target is the worker)
    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass
