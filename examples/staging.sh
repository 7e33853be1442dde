#!/usr/bin/env bash
# illustration: a staging server under kvsan (not run by the tests as a
# whole: tests/test_serve.py runs its `vllm serve` line with these
# variables, its /metrics and its `kvsan check`).  Report, keep serving,
# and gate on the report afterwards.  No code change in the serving stack.
#
#   MODEL=/models/my-model examples/staging.sh
set -euo pipefail
export KVSAN=1                       # switch kvsan on (loaded via vllm.general_plugins)
export KVSAN_MODE=log                # report and keep serving (never raises into vLLM)
export KVSAN_REPORT=/var/log/kvsan/  # one JSONL file per process (trailing slash)
# every process's kvsan_* counters on the server's /metrics (an empty directory)
export PROMETHEUS_MULTIPROC_DIR=/var/lib/kvsan-metrics
rm -rf "$PROMETHEUS_MULTIPROC_DIR" && mkdir -p "$PROMETHEUS_MULTIPROC_DIR"
vllm serve "${MODEL:?set MODEL}" --enable-prefix-caching &
server=$!
# ... drive staging traffic; Prometheus scrapes http://<host>:8000/metrics ...
kill "$server"; wait "$server" || true
# exit 1 on any violation, 2 on an unreadable or incomplete report (a server
# stopped in the middle of traffic: --allow-unclosed accepts that)
kvsan check /var/log/kvsan/
