"""The real engine, in-process, on the generated tiny model (LoRA on), for
the engine-level entries: one engine per trial, built after kvsan is
switched on or off (kvsan follows the pools and workers built while it is
installed), and shut down at the end of the trial."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys

RANK = 8
BS = 32  # the CPU backend's block size


@contextlib.contextmanager
def lora_engine(num_blocks: int = 24):
    from vllm import LLM

    from kvsan.harness import traffic
    from kvsan.harness.tinymodel import ensure_tiny_model

    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kw = traffic.engine_kwargs(ensure_tiny_model(), num_blocks=num_blocks)
    kw.update(max_num_seqs=4, max_model_len=320, enable_lora=True, max_lora_rank=RANK,
              max_loras=2)
    llm = LLM(**kw)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        worker = sys.modules.get("kvsan.hooks.vllm.worker")
        if worker is not None:
            worker.forget_runner()
        del llm
        gc.collect()
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


def core(llm):
    return llm.llm_engine.engine_core.engine_core


def write_adapter(path: str, seed: int) -> str:
    """A rank-8 adapter on q_proj and v_proj of the tiny model, written by
    hand (no hub, no peft): what vLLM loads from a directory."""
    import torch
    from safetensors.torch import save_file

    from kvsan.harness.tinymodel import ensure_tiny_model

    with open(os.path.join(ensure_tiny_model(), "config.json")) as f:
        cfg = json.load(f)
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = hidden // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj, out in (("q_proj", hidden), ("v_proj", kv)):
            pre = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(RANK, hidden, generator=g) * 0.3
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.3
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": 16,
                   "target_modules": ["q_proj", "v_proj"], "bias": "none",
                   "base_model_name_or_path": "tiny"}, f)
    return path


def serve(llm, reqs, run=None, on_first_step=None):
    """Run ``reqs`` (``[(rid, prompt, lora)]``, added together) to the end,
    greedy, 3 tokens each.  Returns rid -> (tokens, logprobs, blocks at the
    first step)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)
    for rid, prompt, lora in reqs:
        llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), p,
                                   lora_request=lora)
    out, blocks, first = {}, {}, True
    while llm.llm_engine.has_unfinished_requests():
        for o in llm.llm_engine.step():
            if o.finished:
                c = o.outputs[0]
                lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [])]
                out[o.request_id] = (list(c.token_ids), lps)
        if run is not None:
            run.driver_step += 1
        if first:
            sched = core(llm).scheduler
            for rid, _, _ in reqs:
                full = next((r for r in sched.requests if r == rid or r.startswith(rid + "-")),
                            None)
                blocks[rid] = list(sched.kv_cache_manager.get_block_ids(full)[0]) if full else []
            if on_first_step is not None:
                on_first_step(blocks)
            first = False
    return {rid: (*out.get(rid, ([], [])), blocks.get(rid, [])) for rid, _, _ in reqs}


def differs(got, ref, tol: float = 1e-4) -> str | None:
    """How ``got`` (tokens, logprobs) differs from the reference, or None."""
    (gt, gl), (rt, rl) = got[:2], ref[:2]
    if gt != rt:
        return f"tokens {gt} vs {rt} uncached"
    d = max((abs(a - b) for a, b in zip(gl, rl)), default=0.0)
    return f"logprobs off by {d:.2e}" if d > tol else None
