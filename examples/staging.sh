#!/usr/bin/env bash
# Run a vLLM server under kvsan in staging: report, keep serving, and gate on
# the report afterwards.  No code change in the serving stack.
set -euo pipefail
export KVSAN=1                       # switch kvsan on (loaded via vllm.general_plugins)
export KVSAN_MODE=log                # report and keep serving (never raises into vLLM)
export KVSAN_REPORT=/var/log/kvsan/  # one JSONL file per process (trailing slash)
vllm serve "${MODEL:?set MODEL}" --enable-prefix-caching &
server=$!
# ... drive staging traffic ...
kill "$server"; wait "$server" || true
kvsan check /var/log/kvsan/          # exit 1 on any violation, 2 on an unreadable report
