import contextlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def kvsan_rt():
    """kvsan installed in this process (log mode), as the plugin would."""
    from kvsan import plugin
    from kvsan.config import Config

    plugin.uninstall()
    rt = plugin.install(Config(enabled=True, log_events=False), role="engine")
    yield rt
    plugin.uninstall()


@pytest.fixture
def rt(kvsan_rt):
    kvsan_rt.clear()
    yield kvsan_rt
    from kvsan import faults

    faults.clear()


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
