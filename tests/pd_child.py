"""One engine of a disaggregated-prefill pair, for ``tests/test_kv_disagg.py``,
in vLLM's default multi-process mode (the EngineCore in its own process,
kvsan loaded there through the plugin entry point by ``KVSAN=1``):

    KVSAN=1 KVSAN_REPORT=DIR/ python tests/pd_child.py MODEL STORE producer|consumer

``producer``: ``kv_role="kv_producer"``, vLLM's ``ExampleConnector``
saving each prompt's KV to the shared directory ``STORE``; a prefill only
(one token per prompt), as vLLM's disaggregated-prefill example runs it.
``consumer``: ``kv_role="kv_consumer"`` over the same directory, the same
prompts decoded further: their KV comes from the store.  Prints one
``KVSAN_PD {json}`` line: each request's ``num_cached_tokens`` and token
count.
"""

import json
import sys

MARK = "KVSAN_PD "
#: the prompts both engines serve: 98 tokens each, so ExampleConnector
#: stores and finds the first 96 (three 32-token blocks); two share their
#: first block, so the producer also serves a local prefix hit
PROMPTS = [[7] * 32 + [100 + i] * 64 + [5, 6] for i in range(2)] + \
          [[200 + i] * 96 + [5, 6] for i in range(3)]


def connector_config(role: str, store: str, connector: str = "ExampleConnector"):
    from vllm.config import KVTransferConfig

    kw = {"kv_connector": connector, "kv_role": role,
          "kv_connector_extra_config": {"shared_storage_path": store}}
    if connector != "ExampleConnector":
        kw["kv_connector_module_path"] = "kv_connectors"
    return KVTransferConfig(**kw)


def main(model: str, store: str, role: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvsan.harness import traffic

    producer = role == "producer"
    llm = LLM(**traffic.engine_kwargs(model, num_blocks=64),
              kv_transfer_config=connector_config("kv_producer" if producer else "kv_consumer",
                                                  store))
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                        SamplingParams(max_tokens=1 if producer else 8, ignore_eos=True),
                        use_tqdm=False)
    got = {"cached": [o.num_cached_tokens for o in outs],
           "tokens": [len(o.outputs[0].token_ids) for o in outs]}
    llm.llm_engine.engine_core.shutdown()
    print(MARK + json.dumps(got), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
