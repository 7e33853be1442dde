"""The engine target: a fuzz program run on vLLM's real engine (in-process
``LLMEngine``, the generated tiny model, prefix caching on, a small KV
pool), stepped one engine step per ``step`` operation, with requests
aborted between steps and the prefix cache reset; the oracles are kvsan's
invariants and parity: every request that finished (not aborted) must have
produced the tokens an uncached reference engine produces for its prompt
alone (greedy).  Slower than the scheduler target (each step runs the
model); both engines boot once per process."""

from __future__ import annotations

import itertools

from .program import decode as _decode, prompt as _prompt
from .scheduler import Outcome, raised_in_vllm, vllm_site

#: the engine's pool: small enough for eviction and preemption
NUM_BLOCKS = 24
PARITY = "parity_mismatch"
LEAK = "engine_leak"


def unavailable() -> str | None:
    """Why the engine target cannot run here, or None."""
    try:
        from vllm.platforms import current_platform
    except Exception as e:  # noqa: BLE001
        return f"the engine target needs vLLM's engine: importing it failed ({e})"
    if current_platform.is_unspecified():
        return ("the engine target boots vLLM's engine, which needs a device vLLM detects "
                "(a GPU, or vLLM's CPU build); use --target scheduler here")
    return None


_ENGINES: dict = {}
_runs = itertools.count()


def _engines():
    if not _ENGINES:
        import os

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        from ..tinymodel import ensure_tiny_model
        from ..traffic import engine_kwargs

        model = ensure_tiny_model()
        kw = engine_kwargs(model, NUM_BLOCKS)
        kw.update(max_num_batched_tokens=64, max_num_seqs=4)
        _ENGINES["cached"] = LLM(**kw)
        ref = dict(kw, enable_prefix_caching=False, num_gpu_blocks_override=64)
        _ENGINES["reference"] = LLM(**ref)
        _ENGINES["ref_out"] = {}
    return _ENGINES


class EngineTarget:
    def __init__(self, spec: dict):
        self.spec = spec

    @staticmethod
    def decode(data: bytes) -> dict:
        return _decode(data, engine=True)

    def reference(self, tokens: list[int], max_tokens: int) -> list[int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        e = _engines()
        key = (tuple(tokens), max_tokens)
        if key not in e["ref_out"]:
            out = e["reference"].generate(
                [TokensPrompt(prompt_token_ids=list(tokens))],
                SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                use_tqdm=False)
            e["ref_out"][key] = list(out[0].outputs[0].token_ids)
        return e["ref_out"][key]

    def execute(self, program: dict, check_harm: bool = False) -> Outcome:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from ... import runtime as _rt

        llm = _engines()["cached"]
        engine = llm.llm_engine
        rt = _rt.get()
        if rt is not None:
            rt.clear()
            errors = rt.reporter.internal_errors
        out = Outcome()
        run = next(_runs)
        prompts: dict[str, tuple] = {}
        done: dict[str, list[int]] = {}
        aborted: set[str] = set()
        order: list[str] = []

        def step():
            out.steps += 1
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)

        try:
            llm.reset_prefix_cache()
            for op in program["ops"]:
                if op[0] == "add":
                    rid = f"f{run}-r{len(order)}"
                    toks = _prompt(op, len(order))
                    prompts[rid] = (toks, op[6])
                    engine.add_request(rid, TokensPrompt(prompt_token_ids=toks),
                                       SamplingParams(max_tokens=op[6], temperature=0.0,
                                                      ignore_eos=True))
                    order.append(rid)
                    out.requests += 1
                elif op[0] == "step":
                    step()
                elif op[0] == "steps":
                    for _ in range(op[1]):
                        step()
                elif op[0] == "abort":
                    live = [r for r in order if r not in done and r not in aborted]
                    if live:
                        rid = live[op[1] % len(live)]
                        engine.abort_request([rid])
                        aborted.add(rid)
                elif op[0] == "reset":
                    llm.reset_prefix_cache()
            for _ in range(2000):
                if not engine.has_unfinished_requests():
                    break
                step()
        except Exception as e:  # noqa: BLE001
            if not raised_in_vllm(e):
                raise
            out.error = (type(e).__name__, vllm_site(e.__traceback__), str(e)[:200])
        if out.error is None:
            for rid, toks in done.items():
                if rid in aborted:
                    continue
                ref = self.reference(*prompts[rid])
                if toks != ref:
                    first = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b),
                                 min(len(toks), len(ref)))
                    out.harm.append(f"{rid}: output differs from the uncached reference "
                                    f"from token {first} of {len(ref)}")
            pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
            if pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:
                out.harm.append(f"{pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()} "
                                f"blocks not free once every request ended")
        if rt is not None:
            out.violations = [{"kind": v.kind, "site": v.site or "?", "blocks": list(v.blocks),
                               "owners": list(v.owners), "actor": v.actor,
                               "message": v.message, "details": v.details}
                              for v in rt.violations()]
            # parity and the free count are oracles of their own here
            for h in out.harm:
                kind = PARITY if "reference" in h else LEAK
                out.violations.append({"kind": kind, "site": "engine output", "blocks": [],
                                       "owners": [], "actor": None, "message": h,
                                       "details": []})
            if rt.reporter.internal_errors != errors:
                out.internal = sorted(rt.reporter._error_sites) or ["?"]
            rt.clear()
        return out
