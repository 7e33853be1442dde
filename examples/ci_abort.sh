#!/usr/bin/env bash
# CI: stop at the first violation with one distinct exit status, 87, whatever
# the shape of the engine: an in-process engine's process ends with 87; in
# vLLM's multi-process mode the EngineCore (or worker) that found it ends
# with 87 and kvsan ends the front end (this pytest) with 87 too.  The
# report that explains it is flushed before each process ends.  A run that
# ends without one must still prove kvsan ran in its engines to the end:
# `kvsan check` exits 2 when no engine process wrote to the report (KVSAN
# not reaching the engine, plugin not installed, wrong report path) or an
# engine died before its closing audit, so a clean exit here cannot pass by
# accident.
#
#   examples/ci_abort.sh [pytest arguments]     (default: tests/)
set -u
report=${KVSAN_CI_REPORT:-kvsan-report}
KVSAN=1 KVSAN_MODE=abort KVSAN_REPORT="$report/" python -m pytest "${@:-tests/}"
status=$?
if [ "$status" -eq 87 ]; then
  echo "kvsan found a KV-cache lifetime bug:"; kvsan check "$report/"
elif [ "$status" -eq 0 ]; then
  kvsan check "$report/" || status=$?
fi
exit "$status"
