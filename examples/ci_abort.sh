#!/usr/bin/env bash
# CI: stop at the first violation with a distinct exit code; the report that
# explains it is flushed before the process ends.  A run that ends without
# one must still prove kvsan ran in its engines to the end: `kvsan check`
# exits 2 when no engine process wrote to the report (KVSAN not reaching the
# engine, plugin not installed, wrong report path) or an engine died before
# its closing audit, so a clean exit here cannot pass by accident.
set -u
KVSAN=1 KVSAN_MODE=abort KVSAN_REPORT=kvsan-report/ python -m pytest tests/ "$@"
status=$?
if [ "$status" -eq 87 ]; then
  echo "kvsan found a KV-cache lifetime bug:"; kvsan check kvsan-report/
elif [ "$status" -eq 0 ]; then
  kvsan check kvsan-report/ || status=$?
fi
exit "$status"
