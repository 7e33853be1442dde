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
