"""Smoke test: every benchmark script runs at a tiny size and produces its
table.  No timing asserts (figures come from ``python -m benchmarks``)."""

import os
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

pytestmark = pytest.mark.engine


def test_sched_lockstep_tiny():
    from benchmarks import sched
    from kvsan import current_runtime

    before = current_runtime()  # (another test module may have installed kvsan)
    res = sched.bench(sizes=(8,), steps=4, chunks=2, processes=1)  # one process per lane
    r = res[8]
    assert r["off_us"] > 0 and len(r["default"]) == 2 and len(r["strict"]) == 2
    assert len(r["production"]) == 2 and r["sampled"]["admitted"] > 0
    assert "| 8 |" in sched.markdown(res)
    assert current_runtime() is before  # the lanes install nothing here


def test_detection_tiny():
    """Detection under sampling: with every request sampled the fault is
    reported naming a sampled owner; with (almost) none sampled the same
    runs report it under no sampled owner; the pool-wide free count is
    checked whatever the rate."""
    from benchmarks import detection
    from kvsan import current_runtime

    before = current_runtime()
    only = ["touch_without_ref", "negative-block-count"]
    full = detection.bench(seeds=1, rate=1.0, requests=64, entry_seeds=2, only=only)
    none = detection.bench(seeds=1, rate=1e-12, requests=64, entry_seeds=2, only=only)
    [run] = full["faults"]["touch_without_ref"]
    assert run["detected_at"] is not None and run["sampled"] and run["kind"] == "free_with_live_owners"
    [run] = none["faults"]["touch_without_ref"]
    assert not run["sampled"]
    for res in (full, none):
        assert res["entries"]["negative-block-count"]["hits"] == 2
    text = detection.markdown(full)
    assert "| touch_without_ref | 1/1, 1.00 (" in text and "negative-block-count | 2/2" in text
    assert current_runtime() is before


def test_events_tiny():
    from benchmarks import events

    res = events.bench(num_blocks=128, k=2, batch=4, batches=4)
    assert set(events.EVENTS) <= set(res)
    assert "allocate" in events.markdown(res)


def test_hookcost_tiny(native_paths):
    from benchmarks import hookcost
    from kvsan import hooks

    trampoline = hooks._trampoline
    res = hookcost.bench(n=8, steps=6)
    rows = res["hooks"]
    # the native hooks time themselves; the Python trampolines are timed by
    # the benchmark's own trampoline, in the lane's process only.  Where the
    # native hooks are not built (another CPython), the trampolines take
    # every call.
    alloc = rows.get("get_new_blocks (native hook)" if native_paths
                     else "BlockPool.get_new_blocks")
    assert alloc is not None and alloc["calls_per_step"] > 0 and alloc["us_per_call"] > 0
    # schedule() and update_from_output(): the Python hook until the first
    # step hands the scheduler to the native hooks, then the native hooks
    for method in ("schedule", "update_from_output"):
        calls = [rows.get(k, {}).get("calls_per_step", 0)
                 for k in (f"Scheduler.{method}", f"{method} (native hook)")]
        assert sum(calls) == 1 and calls[1 if native_paths else 0] > 0, (method, calls)
    assert "timed in all" in hookcost.markdown(res)
    assert hooks._trampoline is trampoline  # this process is untouched


def test_scale_tiny():
    from benchmarks import scale

    res = scale.bench(sizes=(1_000,), ks=(8,))
    m, a = res["memory"][1_000], res["audit"][1_000]
    assert 0 < m["empty"] and 0 < m["owned"] and 0 < m["cached_shared"]
    # both parts of the audit were timed, and the best total is no better
    # than the best of each part (the minimum of sums >= the sum of minima)
    assert a["view_ms"] > 0 and a["check_ms"] > 0
    assert a["total_ms"] >= a["view_ms"] + a["check_ms"] - 1e-9
    assert a["total_median_ms"] >= a["total_ms"]
    assert "1,000" in scale.markdown(res)


def test_e2e_aggregation(monkeypatch):
    """The engine boots take minutes on 2 cores: the lanes are stubbed here
    (``python -m benchmarks --quick --only e2e`` runs them)."""
    from benchmarks import e2e, lanes

    slow = {"off": 1.0, "absent": 1.0, "default": 1.02, "strict": 1.2, "production": 1.005}

    def fake(spec):
        got = {}
        for lane in spec:  # "setting#process": the second default process 4% slower,
            s, p = lane.split("#")  # and the second batch's machine (#2, #3) 10%
            f = slow[s] * (1.04 if lane == "default#1" else 1.0) * (1.1 if int(p) >= 2 else 1.0)
            got[lane] = {"steps": [{"ns": int(1e6 * f), "round": r}
                                   for r in range(2) for _ in range(5)],
                         "summary": {"rounds": [{"tokens": 10, "steps": 5, "outputs": "same",
                                                 "kvsan_s": 0.0005, "device_s": 0.0001}] * 2,
                                     "violations": 0,
                                     "kvsan": s in ("default", "strict", "production")}}
        return got

    monkeypatch.setattr(lanes, "run", fake)
    res = e2e.bench(models={"m": "unused"}, rounds=2)  # two batches of two processes
    assert res["m"]["processes"] == 4 and res["m"]["batches"] == 2
    # the four processes of a setting pooled
    pooled = (2 + 2 * 1.1) / (1.02 * (1 + 1.04 + 2 * 1.1))
    assert res["m"]["default"]["throughput"] == pytest.approx([pooled, pooled])
    # each process against the off processes of its own batch
    assert res["m"]["default"]["processes"] == pytest.approx(
        [1 / 1.02, 1 / (1.02 * 1.04), 1 / 1.02, 1 / 1.02])
    assert res["m"]["absent"]["processes"] == pytest.approx([1.0] * 4)
    assert res["m"]["strict"]["throughput_all"] == pytest.approx(1 / 1.2)
    assert res["m"]["production"]["throughput_all"] == pytest.approx(1 / 1.005)
    # kvsan's own time in all processes against all processes' step time
    assert res["m"]["default"]["kvsan_share"] == pytest.approx(
        [4 * 0.0005 / (0.005 * 1.02 * (1 + 1.04 + 2 * 1.1))] * 2)
    assert "not loaded" in e2e.markdown(res)


def test_lanes_step_processes_in_turn_and_name_a_failed_lane():
    """The side-by-side driver for real, with trivial lanes: each steps
    until done and sends its summary; a lane that dies is named, with its
    error output."""
    from benchmarks import lanes

    code = ("from benchmarks import lanes\n"
            "it = iter([{'ns': 5}, {'ns': 7}, {'ns': 9, 'round': 1}])\n"
            "step = lambda: next(it, None)\n"
            "step.summary = lambda: {'done': True}\n"
            "lanes.serve(step)\n")
    got = lanes.run({"a": (code, {}), "b": (code, {"KVSAN": "1"})})
    assert got["a"] == got["b"] == {"steps": [{"ns": 5}, {"ns": 7}, {"ns": 9, "round": 1}],
                                    "summary": {"done": True}}
    broken = "from benchmarks import lanes\nraise SystemExit('lane setup failed')\n"
    with pytest.raises(RuntimeError, match="(?s)lane bad exited.*lane setup failed"):
        lanes.run({"ok": (code, {}), "bad": (broken, {})})


def test_cuda_device_host_tiny():
    """``benchmarks.cuda_device --host``: the serving traffic without a GPU."""
    from benchmarks import cuda_device

    res = cuda_device.host(steps=3, warm=2)
    assert set(res) == set(cuda_device.SETTINGS)
    for r in res.values():
        assert r["us_per_step_median"] > 0 and r["violations"] == 0
        assert {"add_step", "guard", "seal"} <= set(r["us_per_step_by_call"])


@pytest.mark.e2e  # (boots the engine)
def test_workercost_times_the_worker_side_on_the_engine():
    """``benchmarks.workercost`` for real, one round: the timed default lane
    against an off lane; the Python routes and the native hooks each
    report calls, and kvsan's worker-side time is there."""
    from benchmarks import workercost

    res = workercost.bench(rounds=1)
    rows = res["rows"]
    assert res["steps"] > 0 and res["device_us"] > 0
    for name in ("_begin", "DeviceChecker._sums_now", "_prepare_inputs (native hook)",
                 "execute_model (native hook)"):
        assert rows[name]["calls_per_step"] > 0 and rows[name]["us_per_call"] > 0, name
    assert "inclusive" in workercost.markdown(res)


def test_e2e_rounds_by_model(monkeypatch):
    """Without ``rounds``, each model runs its own (``MODEL_ROUNDS``: the
    tiny model twelve, a model not named there four)."""
    from benchmarks import e2e, lanes

    codes = []
    monkeypatch.setattr(lanes, "run", lambda spec: codes.extend(c for c, _ in spec.values()) or {})
    monkeypatch.setattr(e2e, "summarize", lambda got, rounds, per_batch=None: {
        "rounds": rounds, "default": None, "strict": None, "absent": None})
    res = e2e.bench(models={"tiny (2x256)": "t", "other": "o"})
    assert {name: e["rounds"] for name, e in res.items()} == {"tiny (2x256)": 12, "other": 4}
    assert all("serve_lane('t', 12," in c for c in codes if "'t'" in c)
    assert all("serve_lane('o', 4," in c for c in codes if "'o'" in c)


def test_aa_spread(monkeypatch):
    """``benchmarks.aa``: every split of the identical lanes into two
    halves, one half's throughput over the other's, and each lane against
    their mean (lanes stubbed: one of four 20% slower)."""
    from benchmarks import aa, lanes

    monkeypatch.setattr("kvsan.harness.tinymodel.ensure_tiny_model", lambda: "tiny")
    monkeypatch.setattr(lanes, "run", lambda spec: {
        lane: {"steps": [{"ns": int(1e6 * (1.2 if lane == "off#3" else 1.0)), "round": 0}]}
        for lane in spec})
    s = aa.spread(1, 4)
    assert s["each"] == pytest.approx([1.05, 1.05, 1.05, 1.05 / 1.2])
    assert (s["min"], s["max"]) == pytest.approx((1 / 1.1, 1.1))
    assert s["sd"] == pytest.approx(statistics.pstdev([1.1] * 3 + [1 / 1.1] * 3))


def _soak_rows(rss: list[int], violations: int = 0) -> list[dict]:
    return [{"t": 60.0 * i, "rss_kb": {11: kb, 12: 1000}, "served": 10 * i, "cancelled": i,
             "preempted": i, "tokens": 100 * i, "requests": 12 * i, "steps": 50 * i,
             "running": 4, "shadow_entries": 300, "recent_ends": 10 * i, "owners": 5, "sites": 9, "journal": 1,
             "identity": 5, "device": 40, "report_bytes": 4096, "violations": violations if i else 0,
             "own_errors": 0} for i, kb in enumerate(rss)]


def test_soak_verdict_table_and_plot(tmp_path):
    """``benchmarks.soak`` (``make soak``) judges its samples: memory flat
    after the first third of the run (every process within 5%), no
    violation; a growth or a violation fails it, naming which."""
    from benchmarks import soak

    flat = _soak_rows([900_000, 1_000_000, 1_010_000, 1_020_000, 1_040_000, 1_045_000])
    v = soak.verdict(flat)
    assert v["holds"], v
    assert v["window_s"] == [120.0, 300.0] and v["rss_growth"]["11"] == pytest.approx(1_045 / 1_010 - 1, abs=1e-4)
    grows = soak.verdict(_soak_rows([900_000, 1_000_000, 1_000_000, 1_060_000, 1_120_000]))
    assert not grows["holds"] and "pid 11: RSS grew" in grows["why"]
    dirty = soak.verdict(_soak_rows([1_000_000] * 4, violations=2))
    assert not dirty["holds"] and dirty["why"] == "2 violation(s)"
    assert not soak.verdict(_soak_rows([1_000_000] * 2))["holds"]  # too short to judge
    md = soak.table(flat)
    assert md.count("\n") == len(flat) + 1 and "| 5.0 | 1021 / 1 | 300 | 50 |" in md
    png = soak.plot(flat, str(tmp_path / "soak.png"), "t")
    assert png is None or os.path.getsize(png) > 1000


def test_soak_against_its_baseline():
    """With the same traffic run without kvsan (``--off``), kvsan's share of
    the memory is the difference at equal requests served: memory the
    engine grows by itself is in both runs and does not count."""
    from benchmarks import soak

    grows = [900_000, 1_000_000, 1_050_000, 1_100_000, 1_150_000]  # the engine's own growth
    base = _soak_rows(grows)
    on = _soak_rows([kb + 20_000 for kb in grows])  # kvsan: a flat 20 MB on top
    got = soak.against(on, base)
    assert got["holds"] and got["kvsan_growth_kb"] == 0, got
    assert not soak.verdict(on)["holds"]  # (the absolute rule alone fails here)
    leak = _soak_rows([kb + 20_000 + 30_000 * i for i, kb in enumerate(grows)])
    bad = soak.against(leak, base)
    assert not bad["holds"] and bad["kvsan_growth_kb"] == 2 * 30_000, bad  # (from 2 min on)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two cores")
def test_owners_poll_pins_the_engine_apart_from_the_front_end():
    """benchmarks.owners_poll's pinning on a real process tree: the
    processes named as vLLM names EngineCore and its worker go to the engine's
    cores with all their threads, the rest to the front end's."""
    import subprocess
    import time

    from benchmarks.owners_poll import parse_pin, pin_server

    assert parse_pin("0/1") == ({0}, {1}) and parse_pin("0-2/3,5") == ({0, 1, 2}, {3, 5})
    assert parse_pin("none") is None
    a, b = sorted(os.sched_getaffinity(0))[:2]
    child = ("import threading,time;open('/proc/self/comm','w').write('VLLM::Worker');"
             "threading.Thread(target=time.sleep,args=(60,),daemon=True).start();time.sleep(60)")
    front = subprocess.Popen([sys.executable, "-c", "import subprocess,sys,time;"
                              f"subprocess.Popen([sys.executable,'-c',{child!r}]);time.sleep(60)"])
    kids: list[str] = []
    try:
        for _ in range(100):
            kids = subprocess.run(["pgrep", "-P", str(front.pid)], capture_output=True,
                                  text=True).stdout.split()
            if kids and open(f"/proc/{kids[0]}/comm").read().strip() == "VLLM::Worker" \
                    and len(os.listdir(f"/proc/{kids[0]}/task")) == 2:
                break
            time.sleep(0.1)
        engine_pids, front_pids = pin_server(front.pid, {a}, {b})
        assert engine_pids == [int(kids[0])] and front_pids == [front.pid]
        for tid in os.listdir(f"/proc/{kids[0]}/task"):
            assert os.sched_getaffinity(int(tid)) == {a}
        assert os.sched_getaffinity(front.pid) == {b}
    finally:
        for kid in kids:
            os.kill(int(kid), 9)
        front.kill()
        front.wait()
