"""The kvsan pytest gate (``pytest11`` entry point ``kvsan.pytest_plugin``),
run on inner pytest sessions (``pytester``, each in its own interpreter).

The violations are real: a double release on vLLM's real ``BlockPool`` /
``KVCacheManager``, made in a separate process started by the inner test
(as vLLM's EngineCore is) and in the inner pytest process itself.
"""

import os
import subprocess
import sys

import pytest

pytest_plugins = ["pytester"]

TESTS = os.path.dirname(os.path.abspath(__file__))

FAULT = f'''
import subprocess, sys
sys.path.insert(0, {TESTS!r})


def double_release():
    """Release one block twice on vLLM's real pool: kvsan reports
    double_release and refcount_underflow."""
    from vllm_objects import make_manager, make_request, schedule

    m = make_manager(12)
    a = make_request(list(range(40)), "A")
    schedule(m, a)
    b = m.get_blocks("A").blocks[0][0]
    m.block_pool.free_blocks([b, b])


def core_double_release(report=True):
    """The same bug fed to kvsan's engine-agnostic checker, in this process,
    reported through a kvsan runtime configured from the environment (the
    gate's KVSAN_REPORT) -- no vLLM import, so it is quick."""
    from kvsan import config, runtime
    from kvsan.checks import AllocatorChecker

    cfg = config.from_env() if report else config.Config(enabled=True, log_events=False)
    rt = runtime.Runtime(cfg, role="engine", metrics=False)
    runtime.set_runtime(rt)
    ck = AllocatorChecker(8, emit=rt.reporter.emit)
    ck.on_allocate([(1, 1)], "A", "fault.py:alloc:1")
    ck.on_release([(1, 1, False, 0, True)], "A", "fault.py:free:2")
    ck.on_release([(1, 0, True, -1, True)], "A", "fault.py:free_again:3")
    return rt


def in_subprocess(fault="double_release"):
    """A child process that loads kvsan the way vLLM's processes do
    (the general-plugin entry point, configured by the inherited environment)."""
    code = "import fault; fault." + fault + "()"
    if fault == "double_release":  # vLLM's real objects: load kvsan as vLLM does
        code = "import kvsan.plugin as p; p.register(); " + code
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
'''


@pytest.fixture
def inner(pytester):
    pytester.makepyfile(fault=FAULT)
    return pytester


def run(pytester, *args):
    # the pytest11 entry point loads the plugin in the child interpreter
    return pytester.runpytest_subprocess("-p", "no:cacheprovider",
                                         "-rA", *args, timeout=600)


def test_off_unless_asked_and_on_with_flag_or_ini(inner):
    inner.makepyfile(test_env="""
        import os

        def test_env():
            print("KVSAN=%s REPORT=%s" % (os.environ.get("KVSAN"), os.environ.get("KVSAN_REPORT")))
    """)
    off = run(inner, "-s")
    off.assert_outcomes(passed=1)
    assert "KVSAN=None REPORT=None" in off.stdout.str()
    assert "kvsan gate" not in off.stdout.str()

    on = run(inner, "-s", "--kvsan")
    on.assert_outcomes(passed=1)
    out = on.stdout.str()
    assert "KVSAN=1 REPORT=" in out and "kvsan gate: on" in out
    # no vLLM engine ran under kvsan: no violation proves nothing, the gate fails closed
    assert "kvsan gate: FAILED: incomplete report in " in out, out
    assert "empty report: no kvsan record at all" in out and "--kvsan-allow-empty" in out
    assert on.ret == 1
    allowed = run(inner, "-s", "--kvsan", "--kvsan-allow-empty")
    assert "kvsan gate: no unexpected violations" in allowed.stdout.str() and allowed.ret == 0

    inner.makeini("[pytest]\nkvsan = true\n")
    ini = run(inner, "-s", "--kvsan-allow-empty")
    assert "KVSAN=1 REPORT=" in ini.stdout.str() and ini.ret == 0


def test_any_violation_in_any_process_fails_the_session(inner):
    inner.makepyfile(test_gate="""
        import pytest
        import fault

        def test_clean():
            pass

        def test_engine_subprocess():
            fault.in_subprocess()

        @pytest.fixture
        def kvsan_here():
            # a kvsan runtime in this process that writes no report: the gate
            # reads its violations directly
            from kvsan import runtime

            rt = fault.core_double_release(report=False)
            assert rt.config.report is None
            yield rt
            runtime.set_runtime(None)

        def test_in_this_process(kvsan_here):
            assert [v.kind for v in kvsan_here.violations()] == [
                "double_release", "refcount_underflow"]
    """)
    res = run(inner, "--kvsan")
    res.assert_outcomes(passed=3)  # every test passes; the gate fails the session
    assert res.ret == 1
    out = res.stdout.str()
    assert "kvsan gate: FAILED: 6 unexpected violation(s) (0 expected)" in out, out
    res.stdout.fnmatch_lines([
        # a double free on vLLM's pool outside any request: four findings
        "*test_gate.py::test_engine_subprocess: invalid_release x1, refcount_mismatch x1, "
        "double_release x1, refcount_underflow x1",
        "*double_release in frontend:* step 0 at fault.py:double_release:*",
        "*test_gate.py::test_in_this_process: double_release x1, refcount_underflow x1",
        "*double_release in engine:* at fault.py:free_again:3: A released block 1 twice*",
        "*details: kvsan check *",
    ])
    assert "test_gate.py::test_clean:" not in out


def test_expected_violations_pass_and_missing_ones_fail_the_test(inner):
    inner.makepyfile(test_marks="""
        import pytest
        import fault

        @pytest.mark.kvsan_expect("double_release", "refcount_underflow", timeout=60)
        def test_expects_both():
            fault.in_subprocess("core_double_release")

        @pytest.mark.kvsan_expect("leaked_blocks", timeout=1)
        def test_expects_a_leak_that_never_happens():
            pass

        @pytest.mark.kvsan_expect("double_release", timeout=60)
        def test_expects_only_one_kind():
            fault.in_subprocess("core_double_release")
    """)
    res = run(inner, "--kvsan")
    res.assert_outcomes(passed=2, failed=1)
    out = res.stdout.str()
    res.stdout.fnmatch_lines([
        "*kvsan: expected violation(s) did not occur during this test: "
        "leaked_blocks (wanted >= 1, got 0)*",
    ])
    assert "FAILED test_marks.py::test_expects_a_leak_that_never_happens" in out
    # the kind nobody declared still fails the session, attributed to its test
    assert "kvsan gate: FAILED: 1 unexpected violation(s) (3 expected)" in out, out
    res.stdout.fnmatch_lines(["*test_marks.py::test_expects_only_one_kind: refcount_underflow x1"])


@pytest.mark.e2e  # (the inner test boots the engine)
def test_gate_fails_closed_on_a_real_engine_s_reports(inner, tmp_path):
    """A real engine run by a test under the gate (the spawned EngineCore and
    worker write to the session's reports) passes it; the same reports
    without the engine's closing records (as if it were killed before its
    idle audit) fail it, by the rule ``kvsan check`` applies."""
    from kvsan.harness.tinymodel import ensure_tiny_model

    inner.makepyfile(test_engine=f"""
        import os, subprocess, sys

        def test_engine():
            subprocess.run([sys.executable, "-m", "kvsan.harness.demo", {ensure_tiny_model()!r}, "1"],
                           env=dict(os.environ, KVSAN_LOG="0"), check=True, timeout=600)
    """)
    report = tmp_path / "engine-report"
    res = run(inner, "--kvsan", f"--kvsan-report={report}")
    res.assert_outcomes(passed=1)
    out = res.stdout.str()
    assert "kvsan gate: no unexpected violations (0 expected) from " in out, out
    assert "incomplete" not in out and res.ret == 0

    inner.makepyfile(test_engine=f"""
        import glob, json, os

        def test_engine_killed_before_its_audit():
            for f in glob.glob(os.path.join({str(report)!r}, "*.jsonl")):
                lines = [line for line in open(f) if json.loads(line).get("event")
                         not in ("kvsan.idle", "kvsan.shutdown")]
                with open(os.path.join(os.environ["KVSAN_REPORT"], os.path.basename(f)),
                          "w") as out:
                    out.writelines(lines)
    """)
    res = run(inner, "--kvsan")
    res.assert_outcomes(passed=1)
    out = res.stdout.str()
    assert res.ret == 1 and "kvsan gate: FAILED: incomplete report in " in out, out
    assert "took requests" in out and "never wrote its closing record" in out
    assert "--kvsan-allow-unclosed" in out
    assert run(inner, "--kvsan", "--kvsan-allow-unclosed").ret == 0


def test_ci_example_runs_the_suite_with_the_gate():
    import yaml

    root = os.path.dirname(TESTS)
    with open(os.path.join(root, "examples", "ci-gate.yml")) as f:
        job = yaml.safe_load(f)
    steps = [s.get("run", "") for j in job["jobs"].values() for s in j["steps"]]
    assert any("pytest --kvsan" in r for r in steps)
    assert any("kvsan check" in r for r in steps)


def test_records_kvsan_could_not_write_fail_the_gate(inner):
    """A report that says records were lost (``kvsan.records_lost``) or holds
    a torn record fails the gate, as ``kvsan check`` exits 2 on it: an
    engine's report otherwise complete (installed, pool, idle)."""
    inner.makepyfile(test_lost="""
        import json, os

        def test_an_engine_whose_disk_filled():
            d = os.environ["KVSAN_REPORT"]
            base = {"role": "engine", "pid": 4242, "engine": 0, "rank": 0, "schema": 1}
            recs = [dict(record="event", event="kvsan.installed", **base),
                    dict(record="event", event="kvsan.pool", **base),
                    dict(record="event", event="kvsan.busy", step=1, **base),
                    dict(record="event", event="kvsan.records_lost", lost=3,
                         by_reason={"disk_full": 3}, **base),
                    dict(record="event", event="kvsan.idle", step=9, records_lost=3, **base)]
            lines = [json.dumps(r, separators=(",", ":")) for r in recs]  # (as kvsan writes)
            lines.insert(3, lines[2][:25])  # a record the full disk cut off
            with open(os.path.join(d, "kvsan-engine-4242.jsonl"), "w") as f:
                f.write("\\n".join(lines) + "\\n")
    """)
    got = run(inner, "--kvsan")
    out = got.stdout.str()
    assert got.ret == 1, out
    assert "3 record(s) could not be written (3 disk_full" in out, out
    assert "1 torn record(s)" in out, out
    report = next(line.split("reports: ")[1].strip() for line in out.splitlines()
                  if "reports: " in line)
    check = subprocess.run([sys.executable, "-m", "kvsan.cli", "check", report],
                           capture_output=True, text=True)
    assert check.returncode == 2 and "3 record(s) could not be written" in check.stderr
