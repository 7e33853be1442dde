# The two commands of the README.  Both do all set-up on a fresh machine.
.PHONY: demo test setup bench soak realbugs upstream-tests setup-3.12 test-3.12 test-3.12-fast

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

# both lanes: the whole suite on CPython 3.11 (.venv, vLLM's CPU build), then
# the CPython 3.12 lane's fast part (test-3.12-fast, below); the second runs
# even if the first fails, and either failing fails the target
test: setup
	@rc=0; .venv/bin/python -m pytest -q || rc=$$?; \
	$(MAKE) --no-print-directory test-3.12-fast || rc=$$((rc ? rc : 1)); \
	exit $$rc

# The CPython 3.12 lane (scripts/setup_lane.sh: .venv-3.12 with vLLM's CUDA
# build, whose scheduler side runs without a GPU; a ~3 min, 8.4 GB install):
# the core and the tests on vLLM's real pool, managers and scheduler, with
# the C modules that build there.  Tests that boot the engine skip
# (tests/conftest.py).  test-3.12 runs all of it; test-3.12-fast, which
# `make test` runs, the files below (under a minute, after a 3 min install
# on a fresh machine), so that `make test` stays near 20 minutes on 2 cores.
LANE_FAST = tests/test_core.py tests/test_layout.py tests/test_differential.py \
	tests/test_contract.py tests/test_labels.py tests/test_engine_faults.py \
	tests/test_scheduler_paths.py tests/test_async_scheduling.py \
	tests/test_hisparse.py tests/test_vllm_source_faults.py tests/test_quarantine.py \
	--deselect tests/test_contract.py::test_install_strict_and_log_mode
# (left to the 3.11 suite: test_config.py and the contract's install
# tests start a Python with vLLM per case, 20-60 s each with the CUDA build)

setup-3.12:
	./scripts/setup_lane.sh 3.12

test-3.12: setup-3.12
	.venv-3.12/bin/python -m pytest -q

test-3.12-fast: setup-3.12
	.venv-3.12/bin/python -m pytest -q $(LANE_FAST)

# kvsan's overhead, side by side (off / default / strict); about 15 minutes on
# 2 cores; writes benchmarks/results.md (method: docs/performance.md)
bench: setup
	.venv/bin/python -m benchmarks

# kvsan's memory over a long run (benchmarks/soak.py): 30 minutes of mixed
# traffic on the real engine (shared prefixes, cancels, preemption, LoRA,
# salts), log mode, a sample every 60 s, beside the same traffic without
# kvsan; holds when kvsan's share of the memory is flat after warm-up (<= 5%
# over the last 20 minutes) and nothing is reported (each process's own
# growth is reported too).  Table, record and PNG in .kvsan-cache/soak/
soak: setup
	.venv/bin/python -m benchmarks.soak --minutes 30 --side-by-side --out .kvsan-cache/soak

# the real-bug corpus (benchmarks/realbugs, docs/realbugs.md): upstream vLLM
# KV-cache bugs re-created on the installed release, each with its harm with
# kvsan off, kvsan's verdict and a control on the fixed code; also on the
# release venvs scripts/release_venv.sh built (KVSAN_VENVS); exit 1 when an
# entry does not meet its expectation
realbugs: setup
	.venv/bin/python -m benchmarks.realbugs --releases auto --json .realbugs.jsonl

# vLLM's own tests/v1/core from its pinned source archive, run without and with
# kvsan (KVSAN_MODE=raise) against an installed engine; prints and writes
# .upstream/<version>/summary.md (scripts/upstream_tests.py).  VLLM defaults to
# the version in .venv; for another release, UPSTREAM_PYTHON=<its venv's python>
VLLM ?=
upstream-tests:
	.venv/bin/python scripts/upstream_tests.py $(VLLM)
