"""``kvsan stress`` as a user runs it: the installed ``kvsan`` command, its
arguments, progress lines, exit status and the PNG it writes (the soak
itself, its parity and its shrinking are tested in test_stress.py).  Each
run boots the engine (kvsan on, in-process in a child) and the uncached
reference, so the runs are kept small."""

import json
import os
import subprocess
import sys

import pytest

from kvsan.harness.tinymodel import ensure_tiny_model

pytestmark = pytest.mark.e2e

KVSAN = os.path.join(os.path.dirname(sys.executable), "kvsan")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model():
    return ensure_tiny_model()


def stress(model, tmp_path, *args, timeout=420):
    """``kvsan stress`` in a fresh process, progress on (not a terminal, so
    one line per tenth of the requests)."""
    env = dict(os.environ)
    for k in ("KVSAN", "KVSAN_INJECT", "KVSAN_REPORT", "KVSAN_MODE"):
        env.pop(k, None)
    return subprocess.run([KVSAN, "stress", "--model", model, "--workdir", str(tmp_path),
                           "--shrink-runs", "0", *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_clean_run_exits_0_and_writes_a_png(model, tmp_path):
    from PIL import Image

    png, summary = tmp_path / "plot.png", tmp_path / "summary.json"
    proc = stress(model, tmp_path, "--seed", "1", "--requests", "6", "--sample", "0.5",
                  "--plot", str(png), "--json", str(summary))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "kvsan stress: seed 1, 6 requests" in proc.stdout
    assert "violations by kind: none" in proc.stdout
    assert "kvsan stress: OK (seed 1)" in proc.stdout
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("[") and "requests" in ln]
    assert progress and all("/6" in ln and "violations 0" in ln for ln in progress), \
        proc.stderr[-2000:]
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(png) as img:
        img.verify()
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size == (720, 360)
    got = json.loads(summary.read_text())
    assert got["plot"] == str(png) and got["violations"] == {} and got["requests"] == 6
    assert got["parity"] and all(p["verdict"] == "match" for p in got["parity"].values())


def test_injected_fault_exits_nonzero(model, tmp_path):
    """The seeded trace of test_stress's fault soak: a cancelled request's
    release path frees a prefix block another request still reads.  With
    ``--sample 0`` no reference engine boots (it once did, and its empty
    answer failed the run with status 2 whatever kvsan found)."""
    proc = stress(model, tmp_path, "--seed", "1", "--requests", "14", "--sample", "0",
                  "--no-progress", "--inject", "double_unref_on_abort")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "injected fault 'double_unref_on_abort'" in proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if "violations by kind:" in ln)
    assert "free_with_live_owners" in line
    assert "kvsan stress: FAILED (seed 1)" in proc.stdout
    assert not [ln for ln in proc.stderr.splitlines() if ln.startswith("[")]  # --no-progress
    assert not (tmp_path / "reference.log").exists()
    assert (tmp_path / "stress.png").read_bytes()[:8] == PNG_SIGNATURE  # the default --plot


@pytest.mark.parametrize("args, named", [
    (["--requests", "many"], "argument --requests: invalid int value: 'many'"),
    (["--batch-invariant", "maybe"], "argument --batch-invariant: invalid choice: 'maybe'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_argument_exits_2_naming_it(args, named):
    proc = subprocess.run([KVSAN, "stress", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "usage: kvsan" in proc.stderr and named in proc.stderr, proc.stderr


def test_unknown_fault_exits_2_naming_the_accepted_ones(model, tmp_path):
    """Checked before any engine boots."""
    proc = stress(model, tmp_path, "--inject", "no_such_fault", timeout=60)
    assert proc.returncode == 2
    assert "--inject 'no_such_fault' is not a built-in fault" in proc.stderr
    assert "double_unref_on_abort" in proc.stderr
