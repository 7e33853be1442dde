#!/usr/bin/env bash
# CI: stop at the first violation with a distinct exit code; the report that
# explains it is flushed before the process ends.
set -u
KVSAN=1 KVSAN_MODE=abort KVSAN_REPORT=kvsan-report/ python -m pytest tests/ "$@"
status=$?
if [ "$status" -eq 87 ]; then
  echo "kvsan found a KV-cache lifetime bug:"; kvsan check kvsan-report/
fi
exit "$status"
