# The two commands of the README.  Both do all set-up on a fresh machine.
.PHONY: demo test setup bench upstream-tests

setup:
	./scripts/setup.sh

# main job: the deterministic reproduction (kvsan repro) on the real engine and
# the generated tiny model, five cancel moments, each compared with an
# uncached reference; then one moment again with a built-in fault that serves
# wrong bytes, which must fail (violations and a content mismatch)
demo: setup
	.venv/bin/kvsan repro
	@echo; echo "== the same experiment with the built-in fault touch_without_ref (must fail):"
	! .venv/bin/kvsan repro --inject touch_without_ref --moments during_b_decode

test: setup
	.venv/bin/python -m pytest -q

# kvsan's overhead, side by side (off / default / strict); about 15 minutes on
# 2 cores; writes benchmarks/results.md (method: docs/performance.md)
bench: setup
	.venv/bin/python -m benchmarks

# vLLM's own tests/v1/core from its pinned source archive, run without and with
# kvsan (KVSAN_MODE=raise) against an installed engine; prints and writes
# .upstream/<version>/summary.md (scripts/upstream_tests.py).  VLLM defaults to
# the version in .venv; for another release, UPSTREAM_PYTHON=<its venv's python>
VLLM ?=
upstream-tests:
	.venv/bin/python scripts/upstream_tests.py $(VLLM)
