"""kvsan's C modules compile without a single warning under ``-Wall -Wextra``
(``-Werror``), at the optimisation levels whose analyses differ (GCC's
``-Wmaybe-uninitialized`` fires at -O1 and -O2 on code -O3 inlines away),
with this interpreter's own flags and headers: a new warning fails the
suite.  Compiled to /dev/null, one level per case (a few seconds each)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from conftest import SPEEDUPS, SPEEDUPS_WHY

NATIVE = Path(__file__).resolve().parents[1] / "src" / "kvsan" / "_native"
SOURCES = sorted(NATIVE.glob("*.c"))
CC = shlex.split(sysconfig.get_config_var("CC") or "cc")
#: the interpreter's flags without its optimisation level (set per case) and
#: debug info (not needed to warn)
BASE = [f for f in shlex.split(sysconfig.get_config_var("CFLAGS") or "")
        if not f.startswith("-O") and f != "-g"]

pytestmark = [pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY),
              pytest.mark.skipif(shutil.which(CC[0]) is None, reason=f"no C compiler ({CC[0]})")]


def test_every_native_source_is_compiled_here():
    """The five modules, and nothing else at the package's top."""
    assert [p.stem for p in SOURCES] == ["_devicefast", "_frames", "_hookfast", "_shadowfast",
                                         "_tokenlinks"]


@pytest.mark.parametrize("level", ["-O1", "-O2", "-O3"])
def test_native_sources_compile_warning_free(level):
    include = sysconfig.get_paths()["include"]
    # (the five compilers run side by side: the same commands, on every core)
    procs = [(src, subprocess.Popen([*CC, *BASE, level, "-Wall", "-Wextra", "-Werror", "-fPIC",
                                     f"-I{include}", "-c", str(src), "-o", "/dev/null"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
             for src in SOURCES]
    failures = []
    for src, proc in procs:
        _, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            failures.append(f"{src.name}:\n{err.strip()}")
    assert not failures, "\n\n".join(failures)


def test_a_warning_fails_the_check(tmp_path):
    """The check above is not vacuous: the same command on a source with an
    unused variable fails."""
    bad = tmp_path / "bad.c"
    bad.write_text("int f(void) { int unused; return 0; }\n")
    got = subprocess.run([*CC, *BASE, "-O2", "-Wall", "-Wextra", "-Werror", "-c", str(bad),
                          "-o", "/dev/null"], capture_output=True, text=True, timeout=60)
    assert got.returncode != 0 and "unused" in got.stderr
