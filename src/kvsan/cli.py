"""The ``kvsan`` command."""

from __future__ import annotations

import argparse
import os
import sys

from . import completeness
from .reportfile import ReadStats, ReportError, iter_records
from .summary import Summary


#: the option that accepts each kind of incomplete report
CHECK_OPTIONS = {"empty": "--allow-empty", "unclosed": "--allow-unclosed"}


def cmd_check(args) -> int:
    """Exit 1 on any violation; else 2 unless the report is readable and
    complete (:mod:`kvsan.completeness`) and nothing was lost writing it, so
    that a run where kvsan never loaded, whose engine died before its audit,
    or whose disk failed kvsan, cannot pass as clean.  The report is
    streamed: any file, of any size, is read in bounded memory."""
    stats = ReadStats()
    found, gate = Summary(), completeness.Tracker()
    try:
        for rec in iter_records(args.report, stats):
            found.add(rec)
            gate.add(rec)
    except ReportError as e:
        print(f"kvsan check: {e}", file=sys.stderr)
        return 2
    n = found.print()
    missing = [(p.message, CHECK_OPTIONS.get(p.kind))
               for p in gate.problems(allow_empty=args.allow_empty,
                                      allow_unclosed=args.allow_unclosed)]
    missing += [(m, None) for m in stats.problems()]
    for message, hint in missing:
        print(f"kvsan check: {'also ' if n else ''}INCOMPLETE {args.report}: {message}"
              + (f" ({hint} accepts this)" if hint else ""), file=sys.stderr)
    if n:
        return 1  # (KVSAN_MODE=abort stops the engine at its first violation: no closing record)
    return 2 if missing else 0


def cmd_demo(args) -> int:
    from .harness.demo import main as demo_main

    return demo_main(args)


def cmd_owners(args) -> int:
    import json

    from . import owners

    try:
        doc = owners.fetch(args.url, timeout=args.timeout, api_key=args.api_key)
    except Exception as e:  # noqa: BLE001 - network/HTTP/JSON errors alike
        hint = ("the server was started with --api-key (or VLLM_API_KEY): pass the key with "
                "--api-key or VLLM_API_KEY" if getattr(e, "code", None) == 401 else
                "is the server running with KVSAN=1 and VLLM_PLUGINS=kvsan?")
        print(f"kvsan owners: cannot fetch {args.url}{owners.ROUTE}: {e} ({hint})",
              file=sys.stderr)
        return 2
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
        return 0
    orphans = owners.render(doc, limit=args.limit)
    return 1 if orphans and args.fail_on_orphans else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvsan", description="KV-cache sanitizer for vLLM. "
                                "Each command's options: kvsan COMMAND --help")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser(
        "check", help="summarize a JSONL report; exit 1 on any violation, 2 unless complete",
        description="Summarize a kvsan report. Exit 0 only when it is clean and complete; "
                    "1 on any violation; 2 when it is unreadable or incomplete: it has no "
                    "kvsan record from an engine process (the EngineCore, or a process "
                    "running the engine in-process) -- kvsan did not run -- or an engine "
                    "process that took requests (kvsan.busy) did not write its closing "
                    "record after them (kvsan.idle after the idle audit, or kvsan.shutdown "
                    "with no request in flight) -- it died, or was killed, before its "
                    "end-of-run audit -- or it never set up its KV cache pool (kvsan.pool: "
                    "it died while starting). Front ends and workers owe no closing record. "
                    "Violations come first: a report with both exits 1.")
    c.add_argument("report", help="report file, or directory of per-process reports "
                                  "(required)")
    c.add_argument("--allow-empty", action="store_true",
                   help="exit 0 on a report with no kvsan record at all (a job where no "
                        "engine was meant to run; the path must still exist; default: exit 2)")
    c.add_argument("--allow-unclosed", action="store_true",
                   help="accept engine processes without their closing record (a job "
                        "that kills its engine, or stops a server, in the middle of "
                        "traffic on purpose); a report must still hold an engine process "
                        "(default: exit 2)")
    c.set_defaults(func=cmd_check)
    d = sub.add_parser("demo", help="run shared-prefix traffic on the real engine, clean "
                                    "and with an injected fault, and show what kvsan finds")
    d.add_argument("--model", help="model directory (default: the generated tiny Llama)")
    d.add_argument("--inject", default="double_unref_on_abort",
                   help="built-in fault for the second run (default: double_unref_on_abort)")
    d.add_argument("--seed", type=int, default=0, help="seed of the traffic (default: 0)")
    d.add_argument("--in-process", action="store_true",
                   help="run the engine in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                        "(default: a spawned EngineCore)")
    d.add_argument("--workdir", help="where reports go (default: a temp dir)")
    d.set_defaults(func=cmd_demo)
    o = sub.add_parser("owners", help="who holds the KV blocks of a running `vllm serve` "
                                      "(GET /kvsan/owners; needs VLLM_PLUGINS=kvsan)")
    o.add_argument("url", nargs="?", default="http://127.0.0.1:8000",
                   help="the server's base URL (default http://127.0.0.1:8000)")
    o.add_argument("--json", action="store_true",
                   help="print the raw snapshot as JSON (default: a table)")
    o.add_argument("--limit", type=int, default=50,
                   help="owner rows to print, 0 for all (default: 50)")
    o.add_argument("--timeout", type=float, default=30.0,
                   help="seconds to wait for the server's answer (default: 30)")
    o.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or None,
                   help="the server's --api-key, sent as a Bearer token (default: "
                        "$VLLM_API_KEY, else none)")
    o.add_argument("--fail-on-orphans", action="store_true",
                   help="exit 1 if any orphan block (default: exit 0 after printing)")
    o.set_defaults(func=cmd_owners)
    from .harness.cli import add_commands  # repro, stress

    add_commands(sub)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
