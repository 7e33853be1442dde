"""A KV connector written against vLLM's connector API (``KVConnectorBase_V1``)
for the scheduler-level entries: what a P/D or offloading connector's
scheduler side tells vLLM, scripted per request.  ``PLAN`` (class-level,
set by the entry before the scheduler is built): ``load`` maps a request id
to the tokens an *async* load brings (the request waits in
``WAITING_FOR_REMOTE_KVS`` until the entry reports it received);
``delay_free`` makes ``request_finished`` keep a finished request's blocks
until the entry reports it sent.  The worker-side methods do nothing (no
worker runs)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class StubConnector(KVConnectorBase_V1):
    PLAN: dict[str, Any] = {"load": {}, "delay_free": False}

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.loads_started: dict[str, list[int]] = {}
        self.finished: list[str] = []

    # ---------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = StubConnector.PLAN["load"].get(request.request_id, 0)
        if n and request.request_id not in self.loads_started:
            return max(0, n - num_computed_tokens), True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            self.loads_started[request.request_id] = list(blocks.get_block_ids()[0])

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return bool(StubConnector.PLAN["delay_free"] and block_ids), None

    # ------------------------------------------------------------- worker side
    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass
