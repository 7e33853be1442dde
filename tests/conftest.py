import contextlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

#: kvsan's C speed-ups are written for (and built whole on) these CPythons:
#: ``kvsan._native._frames`` reads 3.11's frame records there, the public frame API
#: elsewhere (docs/design.md, Native modules)
SPEEDUPS = (sys.implementation.name == "cpython" and (3, 10) <= sys.version_info[:2] <= (3, 13))
SPEEDUPS_WHY = "kvsan's C speed-ups are built for CPython 3.10 to 3.13"


def engine_unavailable() -> str | None:
    """Why vLLM's engine cannot start in this environment, or None where it
    can.  The one place the suite decides it: tests that boot the engine
    (marked ``e2e``) skip with this reason.

    vLLM's CPU build, which runs the engine here, is published for CPython
    3.11 only; the lane of another CPython (scripts/setup_lane.sh) has the
    registry's CUDA build, whose scheduler side runs on a CPU host but whose
    engine needs a device vLLM can detect, and a host without a GPU has
    none.  vLLM's own answer (its current platform) is what is asked, not
    the Python version, so a CUDA build on a GPU host still runs them."""
    from vllm.platforms import current_platform

    if not current_platform.is_unspecified():
        return None
    import torch
    import vllm

    return ("the engine runs only on CPython 3.11's CPU build here: vLLM "
            f"{vllm.__version__} with torch {torch.__version__} on CPython "
            f"{sys.version_info.major}.{sys.version_info.minor} detects no device "
            "(no GPU, not vLLM's CPU build)")


def pytest_collection_modifyitems(config, items):
    booting = [item for item in items if item.get_closest_marker("e2e")]
    if not booting:  # (asking vLLM imports torch: only when it matters)
        return
    why = engine_unavailable()
    if why is not None:
        for item in booting:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session", autouse=True)
def native_paths():
    """kvsan's C paths in use (where built) from the start of the session,
    as in an engine with ``KVSAN=1``: importing kvsan switches nothing on,
    and the checks made in tests without installing kvsan would otherwise
    run only the Python paths, or not, depending on the order of tests.
    Its value: whether all of them are built and in use (CPython 3.10 to
    3.13), for tests that check what only the full set does."""
    from kvsan import hooks

    return hooks.use_native(True)


@pytest.fixture(scope="session")
def kvsan_rt():
    """kvsan installed in this process (log mode), as the plugin would."""
    from kvsan import plugin
    from kvsan.config import Config

    plugin.uninstall()
    rt = plugin.install(Config(enabled=True, log_events=False), role="engine")
    yield rt
    plugin.uninstall()


def _own_errors():
    from kvsan import runtime as _rt

    rt = _rt.get()
    return rt, (rt.reporter.internal_errors if rt is not None else 0)


@pytest.fixture(autouse=True)
def no_own_errors(request):
    """In ``log`` mode kvsan counts its own failures instead of raising them
    into the engine, so a check that breaks reads as a clean run.  A test
    during which this
    process's kvsan counted one fails, unless it declares that it makes one
    on purpose (``@pytest.mark.own_errors``)."""
    rt, before = _own_errors()
    yield
    now, after = _own_errors()
    if request.node.get_closest_marker("own_errors") or now is None:
        return
    if now is not rt:
        before = 0  # (a runtime made during the test: its count started at 0)
    if after != before:
        pytest.fail(f"kvsan counted {after - before} error(s) of its own during the test "
                    f"(sites: {sorted(now.reporter._error_sites)})", pytrace=False)


@pytest.fixture
def rt(kvsan_rt):
    kvsan_rt.clear()
    yield kvsan_rt
    from kvsan.hooks.vllm import faults

    faults.clear()


@pytest.fixture
def eng(engine, rt):
    """The requesting module's in-process engine (its ``engine`` fixture),
    its prefix cache reset and kvsan's records cleared."""
    assert engine.reset_prefix_cache()
    rt.clear()
    return engine


def core(llm):
    """The EngineCore of an in-process ``LLM``."""
    return llm.llm_engine.engine_core.engine_core


def kinds_of(rt):
    return [v.kind for v in rt.violations()]


def only(rt, kind):
    found = [v for v in rt.violations() if v.kind == kind]
    assert found, f"no {kind}; got {[(v.kind, v.blocks, v.owners) for v in rt.violations()]}"
    return found


@contextlib.contextmanager
def as_owner(rid):
    """Make allocator calls as request ``rid`` (what the manager hooks do)."""
    from kvsan import current_runtime

    current_runtime().owner_ctx.append((rid, "free"))
    try:
        yield
    finally:
        current_runtime().owner_ctx.pop()
