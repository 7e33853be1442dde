"""One rank of vLLM's external-launcher data parallelism
(``distributed_executor_backend="external_launcher"``,
``data_parallel_size=2``), started by ``torchrun`` (``tests/test_external_launcher.py``):
each process runs an in-process engine for its data-parallel rank.  The
rank given as argv[2] also gets ``KVSAN_INJECT=scribble_sealed`` (torchrun
starts every rank with the same environment).  Prints ``RESULT`` with the
tokens each request got."""

import json
import os
import sys


def main(model: str, faulty_rank: int) -> None:
    rank = int(os.environ["RANK"])
    if rank == faulty_rank:
        os.environ["KVSAN_INJECT"] = "scribble_sealed"
    from vllm import LLM, SamplingParams

    from kvsan.harness.traffic import engine_kwargs

    kw = dict(engine_kwargs(model, num_blocks=64), data_parallel_size=2,
              distributed_executor_backend="external_launcher")
    llm = LLM(**kw)
    # two prompts per rank over a shared 2-block prefix, long enough that a
    # block holding a prompt's end and its first outputs is sealed and read
    prefix = [5 + rank] * 64
    prompts = [{"prompt_token_ids": prefix + [100 + i] * 17} for i in range(2)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    print("RESULT", rank, json.dumps([len(o.outputs[0].token_ids) for o in outs]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
