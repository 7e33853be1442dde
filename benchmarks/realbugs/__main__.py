"""``python -m benchmarks.realbugs [--json PATH] [--releases auto|PY,...] [ID ...]``:
run the corpus on the installed vLLM (and, with ``--releases``, on other
releases' venvs), print the table, exit 0 only when every entry met its
expectation."""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.realbugs")
    ap.add_argument("ids", nargs="*", help="entry ids (default: all)")
    ap.add_argument("--json", metavar="PATH", help="also write one JSON line per entry run")
    ap.add_argument("--releases", metavar="auto|PY,...",
                    help="also run under these interpreters (each a venv with another vLLM "
                         "release and kvsan); auto: /work/venvs/vllm-*/bin/python "
                         "(KVSAN_VENVS)")
    ap.add_argument("--list", action="store_true", help="list the entries and exit")
    args = ap.parse_args(argv)

    from . import ENTRIES
    from .base import vllm_version
    from .runner import dump, run_entry, table

    unknown = [i for i in args.ids if i not in ENTRIES]
    if unknown:
        print(f"unknown entry id(s) {unknown}; known: {sorted(ENTRIES)}", file=sys.stderr)
        return 2
    if args.list:
        for e in ENTRIES.values():
            print(f"{e.id:28} {e.upstream:22} {e.level:9} {','.join(e.releases):24} {e.title}")
        return 0
    ids = args.ids or list(ENTRIES)
    t0 = time.perf_counter()
    ver = vllm_version()
    rows = []
    for i in ids:
        e = ENTRIES[i]
        if not e.applies_to(ver):
            continue
        why = e.runnable_here()
        if why:
            print(f"  {e.id:28} {ver}  skipped: {why}", file=sys.stderr, flush=True)
            continue
        row = run_entry(e)
        rows.append(row)
        print(f"  {row['id']:28} {row['release']}  {row['verdict']}  ({row['seconds']} s)",
              file=sys.stderr, flush=True)
    for py in _interpreters(args.releases):
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as tmp:
            cmd = [py, "-m", "benchmarks.realbugs", "--rows", tmp.name, *ids]
            subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                os.path.abspath(__file__)))), check=False)
            rows += [json.loads(line) for line in open(tmp.name) if line.strip()]
    print(table(rows))
    if args.json:
        if os.path.exists(args.json):
            os.remove(args.json)
        dump(rows, args.json)
    bad = [r for r in rows if not r["ok"]]
    counted = [r for r in rows if ENTRIES[r["id"]].counted]
    det = sum(r["detected"] for r in counted)
    nbugs = len({r["id"] for r in counted})
    print(f"\n{len(rows)} runs ({nbugs} bug{'' if nbugs == 1 else 's'}, "
          f"{sorted({r['release'] for r in rows})}): {det}/{len(counted)} detected, "
          f"{len(bad)} not as expected; {time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0


def _interpreters(spec: str | None) -> list[str]:
    if not spec:
        return []
    if spec == "auto":
        root = os.environ.get("KVSAN_VENVS", "/work/venvs")
        found = sorted(glob.glob(os.path.join(root, "vllm-*", "bin", "python")))
        return [p for p in found if os.path.realpath(p) != os.path.realpath(sys.executable)]
    return spec.split(",")


def rows_main(argv) -> int:
    """(internal) ``--rows PATH ID...``: run the entries that apply to this
    interpreter's vLLM and write every row, in full, to PATH."""
    from . import ENTRIES
    from .base import vllm_version
    from .runner import run_entry

    path, ids = argv[0], argv[1:] or list(ENTRIES)
    ver = vllm_version()
    with open(path, "w") as f:
        for i in ids:
            if ENTRIES[i].applies_to(ver) and not ENTRIES[i].runnable_here():
                row = run_entry(ENTRIES[i])
                print(f"  {row['id']:28} {row['release']}  {row['verdict']}  "
                      f"({row['seconds']} s)", file=sys.stderr, flush=True)
                f.write(json.dumps(row, default=str) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rows":
        sys.exit(rows_main(sys.argv[2:]))
    sys.exit(main())
