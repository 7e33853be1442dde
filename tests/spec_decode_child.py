"""The child process of ``tests/test_spec_decode.py``: the tiny engine
in-process with n-gram speculative decoding (each step writes the KV of
draft tokens the sampler may then reject, and the next step writes those
slots again), kvsan loaded by ``KVSAN=1`` as a user runs it.

Clean shared-prefix traffic first, then the same traffic with one draft
token's slot redirected into a sealed block other live requests hold.
Prints one ``KVSAN_SPEC {json}`` line: what the clean phase found, what
kvsan checked, how many draft tokens were written, and the redirected
write (block, writer, the block's holders) with the reports after it.

    KVSAN=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python tests/spec_decode_child.py MODEL

With ``clean`` after the model (and vLLM's default multi-process mode):
the clean traffic only, nothing patched (the engine and its worker run in
another process); the line then gives the traffic's counts.
"""

import json
import sys

MARK = "KVSAN_SPEC "


def engine_kwargs(model: str) -> dict:
    from kvsan.harness import traffic

    kw = traffic.engine_kwargs(model)
    kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    return kw


def clean(model: str) -> None:
    """The clean traffic in vLLM's default multi-process mode."""
    from vllm import LLM

    from kvsan.harness import traffic

    llm = LLM(**engine_kwargs(model))
    res = traffic.run(llm, seed=0, groups=6, per_group=5)
    print(MARK + json.dumps({"finished": res.finished, "aborted": res.aborted,
                             "steps": res.steps, "cached_tokens": res.cached_tokens}), flush=True)


def main(model: str) -> None:
    import numpy as np
    from vllm import LLM
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvsan import current_runtime

    from kvsan.harness import traffic
    from kvsan.hooks.vllm import worker as vllm_worker

    seen = {"draft_steps": 0, "draft_tokens": 0, "rewritten": 0}
    last = {}  # request -> the last position it wrote
    fault = {"armed": False, "fired": None}
    original = GPUModelRunner._prepare_inputs

    def prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        """vLLM's ``_prepare_inputs``, patched before the engine boots (so
        kvsan's guard, installed at boot, wraps it and reads what it leaves):
        counts the step's draft tokens, and once armed redirects the slot of
        one request's last draft token into a sealed block it does not hold."""
        ret = original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        drafts = {r: len(t) for r, t in scheduler_output.scheduled_spec_decode_tokens.items() if t}
        if drafts:
            seen["draft_steps"] += 1
            seen["draft_tokens"] += sum(drafts.values())
        # slots written again: a rejected draft's, by the next step
        positions = self.positions.numpy()
        start = 0
        for rid, n in zip(self.input_batch.req_ids, num_scheduled_tokens.tolist()):
            if n:
                seen["rewritten"] += int((positions[start:start + n] <= last.get(rid, -1)).sum())
                last[rid] = int(positions[start + n - 1])
            start += n
        if fault["armed"] and fault["fired"] is None and drafts:
            dc = vllm_worker._checkers.get(self)
            batch = self.input_batch
            rids = batch.req_ids[:batch.num_reqs]
            ends = np.cumsum(num_scheduled_tokens[:batch.num_reqs])
            for i, rid in enumerate(rids):
                if not drafts.get(rid):
                    continue
                held = sorted(b for b in dc.sealed if dc.holders.get(b)
                              and rid not in dc.holders[b])
                if held:
                    block = held[0]
                    slots = batch.block_table.block_tables[0].slot_mapping.gpu
                    k = int(ends[i]) - 1  # the request's last token: a draft
                    slots[k] = block * dc.block_size + int(slots[k]) % dc.block_size
                    fault["fired"] = {"block": block, "writer": rid,
                                      "holders": sorted(dc.holders[block])}
                    break
        return ret

    GPUModelRunner._prepare_inputs = prepare_inputs
    llm = LLM(**engine_kwargs(model))
    rt = current_runtime()
    res = traffic.run(llm, seed=0, groups=6, per_group=5)
    (dc,) = list(vllm_worker._checkers.values())
    out = {"finished": res.finished, "aborted": res.aborted, "steps": res.steps,
           "cached_tokens": res.cached_tokens, **seen,
           "clean": [v.kind for v in rt.violations()],
           "counters": {k: dc.counters[k] for k in ("sealed", "verified", "guarded_tokens", "rows_checked")}}
    fault["armed"] = True
    traffic.run(llm, seed=1, groups=6, per_group=5)
    out["fired"] = fault["fired"]
    out["after"] = [{"kind": v.kind, "blocks": v.blocks, "owners": v.owners, "actor": v.actor}
                    for v in rt.violations()]
    print(MARK + json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[2:] == ["clean"]:
        clean(sys.argv[1])
    else:
        main(sys.argv[1])
