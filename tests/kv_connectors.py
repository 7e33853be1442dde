"""A KV connector for the real-engine connector tests: vLLM's own
``ExampleConnector`` (saves each request's KV to disk during the forward
pass and loads it back on a later prompt with the same prefix) whose save
completes asynchronously, as a network connector's send does (Nixl,
Mooncake): ``request_finished`` delays the free of a finished request's
blocks, and the worker reports the request in ``finished_sending`` a few
steps later, when the scheduler frees them.  vLLM 0.32's ExampleConnector
never delays a free on its own, so without this no CPU connector exercises
the delayed-free path."""

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

#: worker ``get_finished`` calls between a request's end and its report
SEND_STEPS = 2


class DelayedSendConnector(ExampleConnector):
    #: requests whose free the scheduler side delayed (the worker side, in
    #: the same process: the tests run the engine in-process, reports
    #: only these; a request it reports must be one the scheduler keeps)
    delayed: set[str] = set()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sending: dict[str, int] = {}  # worker side: rid -> calls left

    def request_finished(self, request, block_ids):
        _, params = super().request_finished(request, block_ids)
        if not block_ids:
            return False, params
        DelayedSendConnector.delayed.add(request.request_id)
        return True, params

    def get_finished(self, finished_req_ids):
        for rid in finished_req_ids:
            if rid in DelayedSendConnector.delayed:
                self._sending.setdefault(rid, SEND_STEPS)
        done = set()
        for rid in list(self._sending):
            self._sending[rid] -= 1
            if self._sending[rid] < 0:
                del self._sending[rid]
                done.add(rid)
        return (done or None), None


class ConsumerConnector(ExampleConnector):
    """The decode side of disaggregated prefill (``kv_role="kv_consumer"``):
    vLLM's ``ExampleConnector`` loading what a producer engine saved, which
    counts the loads its worker side runs (``loads``: requests, in this
    process).

    With ``stale`` set, it has a real connector bug: its scheduler side
    reuses the destination blocks of its previous load (a descriptor table
    keyed by something that outlived the request) for the next one, so the
    later request's KV lands in the blocks the earlier request was given
    and still reads, and the later request's own blocks are never written.
    ``fired`` then says which request's load went where, at which kvsan
    step."""

    loads = 0
    stale = False
    fired: dict | None = None
    _last: tuple[str, list[int]] | None = None

    def build_connector_meta(self, scheduler_output):
        planned = [nr for nr in scheduler_output.scheduled_new_reqs
                   if nr.req_id in self._requests_need_load]
        meta = super().build_connector_meta(scheduler_output)
        cls = ConsumerConnector
        loads = [r for r in meta.requests if not r.is_store]
        for nr, req in zip(planned, loads):  # (new requests' loads come first, in order)
            blocks = list(nr.block_ids[0])
            if cls.stale and cls.fired is None and cls._last is not None:
                from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ReqMeta

                from kvsan import current_runtime

                owner, stale = cls._last
                n = len(req.slot_mapping) // self._block_size
                moved = ReqMeta.make_meta(list(nr.prompt_token_ids), stale, self._block_size,
                                          False, req.mm_hashes)
                req.slot_mapping = moved.slot_mapping
                rt = current_runtime()
                cls.fired = {"request": nr.req_id, "into": stale[:n], "owner": owner,
                             "own": blocks[:n], "step": rt.step if rt is not None else None}
            cls._last = (nr.req_id, blocks)
        return meta

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        ConsumerConnector.loads += sum(not r.is_store for r in meta.requests)
        return super().start_load_kv(forward_context, **kwargs)
