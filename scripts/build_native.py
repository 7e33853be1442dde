"""Build kvsan's C speed-ups in place, guided by a profile of their hot paths.

    .venv/bin/python scripts/build_native.py           # what scripts/setup.sh runs
    .venv/bin/python scripts/build_native.py --plain   # the ordinary -O3 build

Why: the cost of kvsan's native hooks follows the code they run through
more than the instructions they execute (callgrind: about one first-level
instruction-cache miss per 19 instructions in kvsan's modules, against one
per 51 in the interpreter around them).  A profile-guided build lays the
hot paths out together and the error paths apart; ``benchmarks.lanes``
compares it with the plain build side by side (docs/performance.md).

How: GCC builds the modules instrumented (``-fprofile-generate``), a short
training run (below: the scheduler benchmark's workload at 16, 64 and 256
requests in default and strict mode, and the per-event benchmark's
``BlockPool`` calls; about 30 s) writes the profile, and GCC builds them
again from it (``-fprofile-use``; ``-fprofile-partial-training`` keeps the
paths the training did not run -- the worker side's, the slow routes --
optimised as in the plain build).  The profile changes the code's layout
and inlining, never what it computes.

Anything that fails (another compiler, a GCC without these flags, the
training run) leaves the plain build, which is what ``setup.py`` makes on
its own; the C modules are optional either way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("_frames", "_shadowfast", "_tokenlinks", "_devicefast", "_hookfast")

#: the training run: the hot paths as the benchmarks drive them (the lanes'
#: own code, in this one process)
TRAIN = """
from benchmarks.events import PoolLane
from benchmarks.sched import Lane

for n in (16, 64, 256):
    for setting, steps in (("default", 240), ("strict", 120)):
        lane = Lane(setting, n, 0, 3 * n + 16)
        for _ in range(steps):
            lane.step()
        if lane.rt.violations():
            raise SystemExit("violations on clean traffic: %r" % lane.rt.violations())
pool = PoolLane("default", 4096, 4, 64)
for _ in range(60):
    pool.run_batch()
"""


def _build(cflags: str = "", ldflags: str = "") -> None:
    """``setup.py build_ext --inplace --force`` with these flags added to
    Python's own: setuptools replaces its CFLAGS (``-O3`` among them) with
    the environment's where that is set."""
    env = dict(os.environ)
    if cflags:
        env["CFLAGS"] = f"{sysconfig.get_config_var('CFLAGS') or ''} {cflags}".strip()
    if ldflags:
        env["LDFLAGS"] = f"{env.get('LDFLAGS', '')} {ldflags}".strip()
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--force"],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)


def _run(code: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
    # (ROOT/src first: the modules just built are the ones trained and checked,
    # also where kvsan is installed from another checkout)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _loads() -> None:
    """The built modules import and are the ones kvsan uses."""
    _run("import kvsan.hooks as h\n"
         + "".join(f"import kvsan._native.{m}\n" for m in MODULES)
         + "assert h.use_native(True), 'the native paths did not load'\n")


def build_pgo() -> None:
    profile = Path(tempfile.mkdtemp(prefix="kvsan-pgo-"))
    try:
        _build(f"-fprofile-generate -fprofile-update=single -fprofile-dir={profile}",
               "-fprofile-generate")
        _run(TRAIN)
        if not any(profile.iterdir()):
            raise RuntimeError("the training run wrote no profile")
        _build(f"-fprofile-use -fprofile-partial-training -fprofile-dir={profile} "
               "-Wno-missing-profile")
        _loads()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def main(argv: list[str]) -> int:
    if "--plain" not in argv:
        try:
            build_pgo()
            print("build_native: profile-guided build of kvsan's C modules", file=sys.stderr)
            return 0
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", None)
            detail = detail.decode(errors="replace").strip().splitlines()[-1:] if detail else []
            print(f"build_native: profile-guided build failed ({e}{': ' if detail else ''}"
                  f"{''.join(detail)}); building them plain", file=sys.stderr)
    _build()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
