"""Helpers shared by ``kvsan repro`` and ``kvsan stress``: one engine per
process (vLLM loads plugins once per process, and a fault must be injected
into the process whose engine it breaks), driven step by step through the
in-process ``LLMEngine`` so a cancel lands at a chosen moment, and an
uncached reference engine for the output comparison.

Everything here deals in token ids, block ids, hash digests and request ids;
nothing prints token text.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

MARK = "KVSAN_RESULT "


def write_marked(mark: str, obj) -> None:
    """A result line for the parent: ``mark`` and the JSON object in one
    write (a pipe write under 4 KiB is atomic; print() writes the text and
    the line end separately, and the engine's other processes and threads
    write to the same pipe)."""
    sys.stdout.write(mark + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def read_marked(line: str, mark: str) -> dict | None:
    """The JSON object after ``mark`` anywhere in ``line`` (another
    process's text may sit before or after it without a line break), or
    None."""
    at = line.find(mark)
    if at < 0:
        return None
    try:
        got = json.JSONDecoder().raw_decode(line[at + len(mark):])[0]
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


# ------------------------------------------------------------ engine set-up
def engine_kwargs(model: str, num_blocks: int, caching: bool, batch_tokens: int = 64,
                  dtype: str | None = None, max_model_len: int = 512) -> dict:
    from .traffic import engine_kwargs as base

    kw = base(model, num_blocks)
    kw.update(
        enable_prefix_caching=caching,
        max_num_batched_tokens=batch_tokens,
        max_model_len=max_model_len,
        # victims of preemption chosen by (priority, arrival): lets a run
        # choose which request C's pressure preempts
        scheduling_policy="priority",
    )
    if dtype:
        kw["dtype"] = dtype
    return kw


def use_batch_invariant(choice: str) -> bool:
    """vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``) exists for
    CUDA attention backends only; the CPU attention backend does not support
    it, so on CPU the comparison uses a tolerance instead."""
    if choice == "on":
        return True
    if choice == "off":
        return False
    return shutil.which("nvidia-smi") is not None


def child_env(kvsan: bool, report_dir: str | None = None, inject: str | None = None,
              batch_invariant: bool = False, audit_every: int = 1) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    for k in ("KVSAN", "KVSAN_INJECT", "KVSAN_REPORT", "KVSAN_MODE", "KVSAN_AUDIT_EVERY"):
        env.pop(k, None)
    if kvsan:
        env.update(KVSAN="1", KVSAN_MODE="log", KVSAN_LOG="0",
                   KVSAN_AUDIT_EVERY=str(audit_every))
        if report_dir:
            env["KVSAN_REPORT"] = report_dir.rstrip(os.sep) + os.sep
        if inject:
            env["KVSAN_INJECT"] = inject
    if batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    return env


def run_child(module: str, spec: dict, env: dict, log_path: str, timeout: float = 900,
              on_line=None, args: tuple = ()) -> tuple[int, dict]:
    """Run ``python -m module`` with ``spec`` as JSON on stdin; return the
    exit status and the result dict the child printed after :data:`MARK`.
    vLLM's own log goes to ``log_path``; ``on_line`` sees every other line."""
    result: dict = {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        try:
            for line in proc.stdout:
                got = read_marked(line, MARK)
                if got is not None:
                    result = got
                elif on_line is not None:
                    on_line(line.rstrip("\n"))
            rc = proc.wait(timeout=timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if not result:
        try:
            with open(log_path) as f:
                tail = f.read().strip().splitlines()[-3:]
        except OSError:
            tail = []
        result = {"error": " | ".join(tail) or f"exit {rc}"}
    return rc, result


def emit(result: dict) -> None:
    write_marked(MARK, result)


def read_spec() -> dict:
    return json.loads(sys.stdin.read())


def vocab_size(model: str) -> int:
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))
    except (OSError, ValueError, TypeError):
        return 512


# ------------------------------------------------------------- engine views
class EngineView:
    """The in-process engine's scheduler, pool and kvsan's checker."""

    def __init__(self, llm):
        self.llm = llm
        self.engine = llm.llm_engine
        self.core = self.engine.engine_core.engine_core  # InprocClient -> EngineCore
        self.sched = self.core.scheduler
        self.kvm = self.sched.kv_cache_manager
        self.pool = self.kvm.block_pool
        import kvsan

        self.rt = kvsan.current_runtime()
        self.ck = self.rt.checkers.get(self.pool) if self.rt is not None else None
        self.internal: dict[str, str] = {}  # external id -> internal id
        #: kvsan's step counter is per process; report steps of this engine
        self.step_base = self.rt.step if self.rt is not None else 0

    def add(self, rid: str, tokens: list[int], max_tokens: int, priority: int = 0,
            logprobs: int | None = None) -> str:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                logprobs=logprobs)
        iid = self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(tokens)), params,
                                      priority=priority)
        self.internal[rid] = iid if isinstance(iid, str) else self._find(rid)
        return self.internal[rid]

    def _find(self, rid: str) -> str:
        for iid in self.sched.requests:
            if iid.startswith(rid + "-"):
                return iid
        return rid

    def cancel(self, rids: list[str]) -> None:
        """A cancel between two steps (the client's abort reached the engine
        while it was idle between steps)."""
        self.engine.abort_request(rids)

    def cancel_in_flight(self, rids: list[str]) -> None:
        """A cancel that arrives while the next step executes: vLLM's
        EngineCore applies it after the forward pass and before
        ``update_from_output`` (``EngineCore.step``), the window where it
        races a natural finish or a preemption made by that step's schedule."""
        ids = self.engine.output_processor.abort_requests(rids, False)
        if ids:
            self.core.aborts_queue.put_nowait(ids)

    def block_ids(self, rid: str) -> list[int]:
        iid = self.internal.get(rid, rid)
        try:
            ids = self.kvm.get_block_ids(iid)
        except (KeyError, AttributeError):
            return []
        return list(ids[0]) if ids else []

    def digest(self, b: int) -> str | None:
        h = self.pool.blocks[b].block_hash
        if h is None:
            return None
        raw = bytes(h) if isinstance(h, (bytes, bytearray)) else repr(h).encode()
        return raw.hex()[:16]

    def kvsan_digest(self, b: int) -> str | None:
        """The hash digest kvsan's own table holds for block ``b``."""
        if self.ck is None:
            return None
        try:
            return self.ck.shadow.describe(b)["hash"]
        except Exception:  # noqa: BLE001 - diagnostics only
            return None

    def name(self, owner: str) -> str:
        """Internal request id -> the external name (token-free)."""
        for ext, iid in self.internal.items():
            if owner == iid:
                return ext
            for pre in ("cow:", "deferred:"):
                if owner == pre + iid:
                    return pre + ext
        return owner

    def owners(self, b: int) -> list[str]:
        if self.ck is None:
            return []
        return [self.name(o) for o in self.ck.shadow.owners(b)]

    def state(self, b: int) -> str:
        return self.ck.shadow.state(b) if self.ck is not None else "?"

    def num_free(self) -> int:
        return self.pool.get_num_free_blocks()

    def live(self, rid: str) -> bool:
        return self.internal.get(rid) in self.sched.requests

    def status(self, rid: str) -> str:
        req = self.sched.requests.get(self.internal.get(rid, ""))
        return getattr(getattr(req, "status", None), "name", "gone").lower()

    def computed(self, rid: str) -> int:
        req = self.sched.requests.get(self.internal.get(rid, ""))
        return req.num_computed_tokens if req is not None else -1

    def prompt_len(self, rid: str) -> int:
        req = self.sched.requests.get(self.internal.get(rid, ""))
        return req.num_prompt_tokens if req is not None else 0

    def movements(self) -> dict:
        return dict(self.ck.counters) if self.ck is not None else {}

    def violations(self) -> list[dict]:
        if self.rt is None:
            return []
        out = []
        for v in self.rt.violations():
            out.append({"kind": v.kind, "blocks": list(v.blocks),
                        "owners": [self.name(o) for o in v.owners],
                        "actor": self.name(v.actor) if v.actor else None,
                        "step": v.step - self.step_base, "site": v.site})
        return out


def outputs_of(out) -> dict:
    """Token ids and per-position {token: logprob} of a finished output."""
    o = out.outputs[0]
    lps = []
    for pos in (o.logprobs or []):
        lps.append({int(t): float(lp.logprob) for t, lp in pos.items()})
    return {"tokens": list(o.token_ids), "logprobs": lps,
            "cached": out.num_cached_tokens or 0, "finish": o.finish_reason}


def reference_outputs(model: str, prompts: dict[str, list[int]], max_tokens: dict[str, int],
                      logprobs: int, engine_kw: dict) -> dict:
    """Greedy outputs of ``prompts`` on an engine with prefix caching off."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kw)
    names = sorted(prompts)
    params = [SamplingParams(max_tokens=max_tokens[n], temperature=0.0, ignore_eos=True,
                             logprobs=logprobs) for n in names]
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[n]) for n in names], params,
                        use_tqdm=False)
    return {n: outputs_of(o) for n, o in zip(names, outs)}


# ------------------------------------------------------------------ parity
@dataclass
class Parity:
    verdict: str  # "match", "drift", "mismatch", "missing"
    compared: int = 0
    identical_tokens: int = 0
    max_drift: float = 0.0
    first_divergence: int | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict in ("match", "drift")

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "compared": self.compared,
                "identical_tokens": self.identical_tokens, "max_drift": self.max_drift,
                "first_divergence": self.first_divergence, "detail": self.detail}


def compare(got: dict | None, ref: dict | None, tol: float) -> Parity:
    """Compare a cached run's output with the uncached reference.

    * ``match``: the same token ids, every chosen token's logprob within
      ``tol`` of the reference (the numeric drift is reported as a number).
    * ``drift``: the outputs part at a position where the reference itself
      had a near tie (its two best logprobs within ``tol``), after agreeing
      within ``tol`` up to there: a benign numeric flip, not wrong KV.
    * ``mismatch``: a different token where the reference was not near a
      tie, or a logprob off by more than ``tol``: the request was served
      different KV content than the uncached computation.
    """
    if not got or not ref:
        return Parity("missing", detail="no output to compare")
    gt, rt_ = got["tokens"], ref["tokens"]
    glp, rlp = got.get("logprobs") or [], ref.get("logprobs") or []
    n = min(len(gt), len(rt_))
    drift = 0.0
    for i in range(n):
        r_pos = rlp[i] if i < len(rlp) else {}
        g_pos = glp[i] if i < len(glp) else {}
        if gt[i] != rt_[i]:
            ranked = sorted(r_pos.values(), reverse=True)
            margin = ranked[0] - ranked[1] if len(ranked) > 1 else float("inf")
            alt = r_pos.get(gt[i])
            near_tie = alt is not None and (r_pos.get(rt_[i], ranked[0]) - alt) <= tol
            if near_tie and drift <= tol:
                return Parity("drift", n, i, drift, i,
                              f"token {i}: near tie in the reference (margin {margin:.2e} "
                              f"<= tol {tol:g}); outputs part there")
            return Parity("mismatch", n, i, drift, i,
                          f"token {i}: different token id (reference margin {margin:.2e} > "
                          f"tol {tol:g})")
        if gt[i] in r_pos and gt[i] in g_pos:
            d = abs(r_pos[gt[i]] - g_pos[gt[i]])
            drift = max(drift, d)
            if d > tol:
                return Parity("mismatch", n, i, drift, i,
                              f"token {i}: same token, logprob differs by {d:.2e} > tol {tol:g}")
    if len(gt) != len(rt_):
        return Parity("mismatch", n, n, drift, n,
                      f"length {len(gt)} vs reference {len(rt_)}")
    return Parity("match", n, n, drift, None, "")
