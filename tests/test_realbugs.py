"""The real-bug corpus (benchmarks/realbugs, docs/realbugs.md): its fast
scheduler-level entries run through the corpus's own runner on the
installed vLLM, each with its harm shown with kvsan off, kvsan's verdict
(kind, block, steps to detect) and its control on the fixed code; and the
interface other tools use to switch a bug on (``ENTRIES``, ``buggy()``)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.engine


def run(entry_id):
    from benchmarks.realbugs import ENTRIES
    from benchmarks.realbugs.runner import run_entry

    row = run_entry(ENTRIES[entry_id])
    assert row["error"] is None, row.get("traceback")
    return row


@pytest.mark.parametrize("entry_id, kind, owners", [
    ("lora-name-key", "cache_key_mismatch", None),
    ("lora-salt-collision", "cache_key_mismatch", None),
    ("session-stale-hashes", "cache_key_mismatch", None),
    ("negative-block-count", "free_queue_corruption", None),
    # transfers held as leases: the free names the transfer it breaks
    ("abort-during-async-load", "free_with_live_owners", ["load:L"]),
    ("abort-dual-completion", "free_with_live_owners", ["send:R"]),
    ("mooncake-store-preempt", "free_with_live_owners", ["store:1"]),  # (B's job)
    # liveness: the engine stops with a delayed free pending; a stall
    ("delayed-free-idle", "leaked_blocks", ["P0"]),
    ("stranded-kv-holders", "leaked_blocks", ["D"]),
    ("spec-async-load-deadlock", "leaked_blocks", ["A", "B"]),
])
def test_a_real_bug_is_caught_where_it_happens_and_its_fix_is_clean(entry_id, kind, owners):
    from benchmarks.realbugs import ENTRIES

    row = run(entry_id)
    assert row["harm"]  # the bug did its harm with kvsan off
    assert row["detected"] and row["block_named"] and kind in row["kinds"]
    assert 0 <= row["steps_to_detect"] <= ENTRIES[entry_id].detect_within
    if owners is not None:
        assert row["first"]["kind"] == kind and row["first"]["owners"] == owners, row["first"]
    assert row["control_violations"] == 0 and row["control_harm"] is None
    assert row["kvsan_errors"] == 0 and row["ok"], row["verdict"]


def test_the_negative_control_is_silent_on_the_buggy_code():
    row = run("stale-partial-hash")
    assert row["harm"] and row["kinds"] == [] and row["control_violations"] == 0
    assert row["ok"], row["verdict"]


def test_the_runner_records_a_miss_with_its_reason():
    """No entry is a miss today; the runner's path for one still works: an
    entry whose bug kvsan does not see (the negative control's trigger,
    declared as an expected miss) is MISSED, as expected, with its harm."""
    from dataclasses import replace

    from benchmarks.realbugs import ENTRIES
    from benchmarks.realbugs.runner import run_entry

    assert not [e.id for e in ENTRIES.values() if e.expect == "missed"]
    miss = replace(ENTRIES["stale-partial-hash"], expect="missed", counted=True,
                   miss_reason="(a test entry)")
    row = run_entry(miss)
    assert row["harm"] and not row["detected"] and row["control_violations"] == 0
    assert row["ok"] and row["verdict"] == "MISSED"


def test_the_session_runtime_is_back_after_the_runner(kvsan_rt):
    from kvsan import runtime as _rt

    run("lora-name-key")
    assert _rt.get() is kvsan_rt


def test_the_interface_switches_a_bug_on_and_restores_vllm():
    from vllm.v1.core.sched.scheduler import Scheduler

    from benchmarks.realbugs import ENTRIES
    from benchmarks.realbugs.base import vllm_version

    for e in ENTRIES.values():
        assert e.level in ("scheduler", "engine") and e.upstream and e.releases
        assert e.kind_class and isinstance(e.expected_kinds, list)
        assert e.expect in ("detected", "missed", "none")
        assert e.expect != "missed" or e.miss_reason
    e = ENTRIES["async-consumer-free"]
    assert e.applies_to(vllm_version()) and not e.carries(vllm_version())
    before = Scheduler.__dict__["_request_blocks_can_be_freed"]
    with e.buggy():
        assert Scheduler.__dict__["_request_blocks_can_be_freed"] is not before
    assert Scheduler.__dict__["_request_blocks_can_be_freed"] is before


def test_the_command_refuses_an_unknown_entry(capsys):
    from benchmarks.realbugs.__main__ import main

    assert main(["no-such-bug"]) == 2
    assert "unknown entry id(s) ['no-such-bug']; known:" in capsys.readouterr().err


def test_the_command_writes_one_json_line_per_entry(tmp_path, capsys):
    """``python -m benchmarks.realbugs --json PATH ID`` as docs/realbugs.md
    shows it (its ``main``, in this process): the table on stdout, one JSON
    line per entry, exit 0."""
    import json

    from benchmarks.realbugs.__main__ import main

    out = tmp_path / "rows.jsonl"
    assert main(["--json", str(out), "negative-block-count"]) == 0
    printed = capsys.readouterr().out
    assert "negative-block-count" in printed and "1/1 detected" in printed
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert {"id", "upstream", "release", "harm", "expected_kinds", "kinds", "block_named",
            "steps_to_detect", "detected", "control_violations"} <= set(row)
    assert row["detected"] and row["control_violations"] == 0


def test_the_command_lists_the_entries(capsys):
    from benchmarks.realbugs import ENTRIES
    from benchmarks.realbugs.__main__ import main

    assert main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(ENTRIES)
    assert sum(e.counted for e in ENTRIES.values()) >= 15
