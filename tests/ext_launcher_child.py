"""One rank of a deployment vLLM's external launcher runs
(``distributed_executor_backend="external_launcher"``), started by
``torchrun`` (``tests/test_external_launcher.py``): each process runs an
in-process engine.  argv[2] ``dp``: ``data_parallel_size=2``, each process
one engine; the rank given as argv[3] also gets
``KVSAN_INJECT=scribble_sealed`` (torchrun starts every rank with the same
environment).  ``tp``: ``tensor_parallel_size=2``, the two processes one
engine's two ranks (the same requests on both).  Prints ``RESULT`` with the
tokens each request got."""

import json
import os
import sys


def main(model: str, mode: str, faulty_rank: int) -> None:
    rank = int(os.environ["RANK"])
    if mode == "dp" and rank == faulty_rank:
        os.environ["KVSAN_INJECT"] = "scribble_sealed"
    from vllm import LLM, SamplingParams

    from kvsan.harness.traffic import engine_kwargs

    kw = dict(engine_kwargs(model, num_blocks=64),
              distributed_executor_backend="external_launcher",
              **({"data_parallel_size": 2} if mode == "dp" else {"tensor_parallel_size": 2}))
    llm = LLM(**kw)
    # two prompts per rank over a shared 2-block prefix, long enough that a
    # block holding a prompt's end and its first outputs is sealed and read
    prefix = [5 + (rank if mode == "dp" else 0)] * 64
    prompts = [{"prompt_token_ids": prefix + [100 + i] * 17} for i in range(2)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    print("RESULT", rank, json.dumps([len(o.outputs[0].token_ids) for o in outs]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
