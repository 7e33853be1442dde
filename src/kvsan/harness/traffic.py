"""Shared-prefix traffic with cancellations, driven step by step through
vLLM's ``LLMEngine`` so a cancel lands at a chosen moment (before a sharer's
first step, during its prefill, during its decode, at the natural finish).

Token ids only (the tiny model has no tokenizer); deterministic for a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

BLOCK_SIZE = 32


@dataclass
class TrafficResult:
    finished: int = 0
    aborted: int = 0
    steps: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)


def engine_kwargs(model: str, num_blocks: int = 24) -> dict:
    """A deliberately tiny pool: eviction, reuse and preemption happen."""
    return dict(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        num_gpu_blocks_override=num_blocks,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        gpu_memory_utilization=0.3,
        seed=0,
        # no graph compile: boots in seconds on CPU; kvsan hooks at step level
        enforce_eager=True,
    )


def run(llm, seed: int = 0, groups: int = 6, per_group: int = 5) -> TrafficResult:
    """Groups of requests share a 2- or 3-block prefix; some members are
    cancelled at different moments while the others keep reading it."""
    res = TrafficResult()
    for res in steps(llm, seed, groups, per_group):
        pass
    return res


def steps(llm, seed: int = 0, groups: int = 6, per_group: int = 5, prefix: str = ""):
    """:func:`run` one engine step at a time: yields the (growing) result
    after each step, so several engines can be driven in lockstep.  Request
    ids start with ``prefix`` (successive rounds on one engine keep them
    apart)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    engine = llm.llm_engine
    res = TrafficResult()
    live: dict[str, int] = {}  # request -> step at which to cancel it (-1: never)
    step = 0
    pending = []
    for g in range(groups):
        head = [rng.randrange(1, 500) for _ in range(BLOCK_SIZE * rng.choice((2, 3)))]
        for i in range(per_group):
            tail = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))]
            rid = f"{prefix}g{g}-r{i}"
            max_tokens = rng.choice((8, 32, 96))
            # cancel moments: never, before its first step, mid prefill/decode
            cancel = rng.choice((-1, -1, -1, 0, 1, 3, 8))
            pending.append((g * 3 + i, rid, head + tail, max_tokens, cancel))
    pending.sort()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_tokens, cancel = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
            live[rid] = -1 if cancel < 0 else step + cancel
        due = [r for r, at in live.items() if at >= 0 and at <= step]
        if due:
            engine.abort_request(due)
            for r in due:
                live.pop(r)
            res.aborted += len(due)
        for out in engine.step():
            if out.finished:
                live.pop(out.request_id, None)
                res.finished += 1
                res.outputs[out.request_id[len(prefix):]] = list(out.outputs[0].token_ids)
                res.cached_tokens += out.num_cached_tokens or 0
                res.prompt_tokens += len(out.prompt_token_ids or ())
        step += 1
        if step > 5000:
            raise RuntimeError("traffic did not drain")
        res.steps = step
        yield res
