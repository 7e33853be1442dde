"""Runs corpus entries: each one three times in this process on the
installed vLLM (the bug with kvsan off: the harm; the bug with kvsan on:
the verdict; the fixed code with kvsan on: the control), and says whether
it met its expectation."""

from __future__ import annotations

import contextlib
import json
import time
import traceback

from .base import Entry, Run, Trial, vllm_version


def _trial(entry: Entry, rt, buggy: bool) -> Trial:
    run = Run(rt, buggy)
    entry.trigger(run)
    return run.trial


def _install(settings: dict):
    from kvsan import plugin
    from kvsan.config import Config

    _off()
    return plugin.install(Config(enabled=True, log_events=False, **settings), role="engine")


def _off() -> None:
    """kvsan out of this process: its patches removed, no runtime (a runtime
    made by the runner is closed; one that was here before is kept aside)."""
    from kvsan import runtime as _rt
    from kvsan.hooks.vllm import INSTRUMENTOR

    rt = _rt.get()
    INSTRUMENTOR.uninstrument()
    if rt is not None and getattr(rt, "_realbugs", False):
        rt.reporter.close()
    _rt.set_runtime(None)


@contextlib.contextmanager
def kvsan_set_aside():
    """Runs the block with kvsan switched on and off by the runner, and
    puts back afterwards whatever kvsan this process had installed (a test
    session's runtime, an engine's)."""
    from kvsan import hooks
    from kvsan import runtime as _rt
    from kvsan.hooks.vllm import INSTRUMENTOR

    prev = _rt.get()
    try:
        yield
    finally:
        _off()
        if prev is not None:
            _rt.set_runtime(prev)
            prev.native = hooks.use_native(prev.config.native)
            INSTRUMENTOR.instrument(prev, prev.config)


def _violations(rt) -> list:
    return list(rt.violations())


def run_entry(entry: Entry) -> dict:
    """One entry on the installed release: a JSON-able result line."""
    ver = vllm_version()
    row = {"id": entry.id, "upstream": entry.upstream, "release": ver,
           "harm": None, "expected_kinds": list(entry.expected_kinds), "kinds": [],
           "block_named": False, "steps_to_detect": None, "detected": False,
           "control_violations": None, "control_harm": None, "expect": entry.expect,
           "how": "native" if entry.carries(ver) else entry.revert_how,
           "ok": False, "verdict": "", "error": None}
    t0 = time.perf_counter()
    try:
        with kvsan_set_aside():
            _off()
            with entry.buggy():
                off = _trial(entry, None, True)
            row["harm"] = off.harm
            rt = _install(entry.config)
            rt._realbugs = True
            with entry.buggy():
                on = _trial(entry, rt, True)
            got = _violations(rt)
            rt.clear()
            no_control = entry.carries(ver) and entry.fix is None
            if no_control:  # (the fix is not back-ported: the control runs on a fixed release)
                ctl, ctl_got = Trial(), []
            else:
                with entry.fixed():
                    ctl = _trial(entry, rt, False)
                ctl_got = _violations(rt)
            row["kvsan_errors"] = rt.reporter.internal_errors
    except Exception as e:  # noqa: BLE001 - one entry's failure is its row's
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc(limit=6)
        row["verdict"] = f"ERROR {row['error']}"
        row["seconds"] = round(time.perf_counter() - t0, 2)
        return row
    row["kinds"] = sorted({v.kind for v in got})
    row["control_violations"] = None if no_control else len(ctl_got)
    row["control_kinds"] = sorted({v.kind for v in ctl_got})
    row["control_harm"] = ctl.harm
    row["fault_step"] = on.fault_step
    row["fault_blocks"] = on.blocks
    want = [v for v in got if v.kind in entry.expected_kinds]
    named = [v for v in want if not on.blocks or set(v.blocks) & set(on.blocks)]
    row["block_named"] = bool(named)
    if named and on.fault_step is not None:
        first = min(named, key=lambda v: v.step)
        row["steps_to_detect"] = first.step - on.fault_step
        row["first"] = {"kind": first.kind, "blocks": first.blocks[:8], "owners": first.owners[:4],
                        "actor": first.actor, "step": first.step, "site": first.site}
    row["detected"] = bool(named) and row["steps_to_detect"] is not None \
        and 0 <= row["steps_to_detect"] <= entry.detect_within
    harm_ok = off.harm is not None and ctl.harm is None
    control_ok = not ctl_got
    if entry.expect == "none":  # the negative control: silent on the buggy code too
        row["ok"] = harm_ok and control_ok and not got
        row["verdict"] = "SILENT" if not got else "FALSE POSITIVE"
    elif row["detected"]:
        row["ok"] = harm_ok and control_ok
        row["verdict"] = "DETECTED" if entry.expect == "detected" else "DETECTED (expected a miss)"
    else:
        row["ok"] = harm_ok and control_ok and entry.expect == "missed"
        row["verdict"] = "MISSED" if entry.expect == "missed" else "NOT DETECTED"
    if off.harm is None:
        row["verdict"] += "; no harm without kvsan"
    if no_control:
        row["verdict"] += "; control on a fixed release"
    if ctl.harm is not None:
        row["verdict"] += "; harm on the fixed code"
    if ctl_got:
        row["verdict"] += f"; control reported {row['control_kinds']}"
    if row["kvsan_errors"]:
        row["ok"] = False
        row["verdict"] += f"; kvsan counted {row['kvsan_errors']} error(s) of its own"
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def table(rows: list[dict]) -> str:
    head = ("id", "upstream", "release", "how", "harm (kvsan off)", "kvsan kinds",
            "block", "steps", "control", "verdict")
    lines = [head]
    for r in rows:
        lines.append((r["id"], r["upstream"], r["release"], r["how"],
                      (r["harm"] or "-")[:60], ",".join(r["kinds"]) or "-",
                      "yes" if r["block_named"] else "no",
                      "-" if r["steps_to_detect"] is None else str(r["steps_to_detect"]),
                      "-" if r["control_violations"] is None else str(r["control_violations"]),
                      r["verdict"] + ("" if r["ok"] else "  <-- FAIL")))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip()
                     for line in lines)


def dump(rows: list[dict], path: str) -> None:
    keys = ("id", "upstream", "release", "harm", "expected_kinds", "kinds", "block_named",
            "steps_to_detect", "detected", "control_violations")
    with open(path, "a") as f:
        for r in rows:
            out = {k: r.get(k) for k in keys}
            out.update({k: r[k] for k in ("expect", "verdict", "ok", "how", "seconds", "error")
                        if k in r})
            f.write(json.dumps(out) + "\n")
