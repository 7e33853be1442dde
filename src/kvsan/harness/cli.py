"""Argument parsing of ``kvsan repro`` and ``kvsan stress`` (kept apart from
cli.py so the heavy modules load only when a command runs)."""

from __future__ import annotations


def _common(p) -> None:
    p.add_argument("--model", help="model directory (default: the generated tiny Llama)")
    p.add_argument("--inject", help="run with one of kvsan's built-in faults: "
                                    "double_unref_on_abort, leak_on_abort, touch_without_ref, "
                                    "prompt_sent_wrong (default: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic (default: 0)")
    p.add_argument("--dtype", help="engine dtype (default float32; e.g. bfloat16 on a GPU)")
    p.add_argument("--tol", type=float, default=None,
                   help="logprob tolerance of the uncached comparison (default 1e-3, "
                        "or 1e-6 in batch-invariant mode)")
    p.add_argument("--batch-invariant", choices=("auto", "on", "off"), default="auto",
                   help="VLLM_BATCH_INVARIANT=1 for both engines (default: auto, on when "
                        "nvidia-smi exists; the CPU attention backend lacks it)")
    p.add_argument("--workdir", help="where reports and engine logs go (default: a temp dir)")


def cmd_repro(args) -> int:
    from .repro import main

    return main(args)


def cmd_stress(args) -> int:
    from .stress import main

    return main(args)


def cmd_fuzz(args) -> int:
    from .fuzz.campaign import main

    return main(args)


def add_commands(sub) -> None:
    r = sub.add_parser("repro", help="deterministic two-request reproduction (A shares a "
                                     "prefix with B, A cancelled at five moments, C's "
                                     "pressure, B compared with an uncached reference)")
    _common(r)
    r.add_argument("--moments", help="comma list (default: all five)")
    r.add_argument("--num-blocks", type=int, default=20, help="KV pool size (default 20)")
    r.add_argument("--json", help="also write the per-moment results (token-free) to this "
                                  "file (default: none)")
    r.set_defaults(func=cmd_repro)
    s = sub.add_parser("stress", help="seeded soak: overlapping prefixes, cancellations, "
                                      "timeouts, eviction and preemption under a small pool; "
                                      "invariants every step, sampled parity")
    _common(s)
    s.add_argument("--requests", type=int, default=120,
                   help="requests in the soak (default: 120)")
    s.add_argument("--num-blocks", type=int, default=24, help="KV pool size (default 24)")
    s.add_argument("--sample", type=float, default=0.25,
                   help="fraction of completed requests compared with the reference "
                        "(default: 0.25; 0 compares nothing)")
    s.add_argument("--shrink-runs", type=int, default=16,
                   help="at most this many replays to shrink a failing trace (default: 16)")
    s.add_argument("--plot", help="PNG path (default: <workdir>/stress.png)")
    s.add_argument("--no-progress", action="store_true",
                   help="no progress line on stderr (default: one, updated in place)")
    s.add_argument("--only", help="replay only these request ids of the seeded trace "
                                  "(what a failing run prints; default: all)")
    s.add_argument("--json", help="also write the summary (token-free) to this file "
                                  "(default: none)")
    s.set_defaults(func=cmd_stress)
    z = sub.add_parser("fuzz", help="coverage-guided search (Atheris) for KV-cache lifetime "
                                    "bugs; findings shrunk to reproducer scripts")
    z.add_argument("--target", choices=("scheduler", "engine"), required=True,
                   help="what the search drives: vLLM's scheduler alone, or the engine (required)")
    z.add_argument("--seconds", type=float, required=True,
                   help="length of the search (required)")
    z.add_argument("--seed", type=int, default=0, help="seed of the search (default: 0)")
    z.add_argument("--corpus", help="directory of the corpus, kept between runs (default: "
                                    "a temporary one)")
    z.add_argument("--json", help="one JSON line per finding in this file (default: none)")
    z.add_argument("--findings-dir", default="kvsan-fuzz-findings",
                   help="where reproducer scripts go (default ./kvsan-fuzz-findings)")
    z.add_argument("--inject", help="run with one of kvsan's built-in scheduler-side faults "
                                    "(default: none)")
    z.add_argument("--realbug", help="run with a benchmarks/realbugs entry switched on "
                                     "(default: none)")
    z.add_argument("--shrink-seconds", type=float, default=60.0,
                   help="time for shrinking all findings (default 60)")
    z.add_argument("--workdir", help="where the search's log goes (default: a temp dir)")
    z.set_defaults(func=cmd_fuzz)
