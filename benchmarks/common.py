"""Shared helpers: kvsan settings, side-by-side rounds, statistics, tables."""

from __future__ import annotations

import os
import platform
import statistics
from contextlib import contextmanager

#: the three settings every benchmark compares
#:   off     - kvsan's hooks not installed (what KVSAN unset gives: register()
#:             returns before patching anything)
#:   default - KVSAN=1 with defaults (audit only when the engine goes idle)
#:   strict  - KVSAN=1 KVSAN_AUDIT_EVERY=1 (a full-table audit every step)
SETTINGS = ("off", "default", "strict")

ENV = {
    "off": {},
    "default": {"KVSAN": "1", "KVSAN_LOG": "0"},
    "strict": {"KVSAN": "1", "KVSAN_LOG": "0", "KVSAN_AUDIT_EVERY": "1"},
}


#: production mode (``KVSAN_SAMPLE=on``: one request in 64 checked, the
#: pool-wide invariants for all), run beside the others by the scheduler
#: and end-to-end benchmarks
PRODUCTION = "production"
ENV[PRODUCTION] = {"KVSAN": "1", "KVSAN_LOG": "0", "KVSAN_SAMPLE": "on"}


#: the scheduler benchmark also runs ``python``: default with KVSAN_NATIVE=0
#: (kvsan's C speed-ups off), to show what they save side by side
NATIVE_OFF = "python"


def config_for(setting: str):
    from kvsan.config import Config

    if setting == "off":
        return None
    if setting == PRODUCTION:
        from kvsan.config import DEFAULT_SAMPLE

        return Config(enabled=True, log_events=False, sample=DEFAULT_SAMPLE, sample_seed=0)
    return Config(enabled=True, log_events=False, audit_every=1 if setting == "strict" else 0,
                  native=setting != NATIVE_OFF)


@contextmanager
def kvsan_setting(setting: str):
    """Install kvsan in this process for ``setting`` (nothing for off)."""
    from kvsan import plugin

    plugin.uninstall()
    cfg = config_for(setting)
    if cfg is not None:
        plugin.install(cfg, role="engine")
    try:
        yield
    finally:
        plugin.uninstall()


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def spread(xs) -> str:
    """min-max of a list of ratios, as text."""
    if not xs:
        return "-"
    return f"{min(xs):.3f}-{max(xs):.3f}"


def ratio_cell(xs) -> str:
    return f"{median(xs):.3f}x ({spread(xs)})" if xs else "-"


def verdict(value: float, target: float, higher_is_better: bool = False) -> str:
    ok = value >= target if higher_is_better else value <= target
    return "met" if ok else "**missed**"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def native_hooks(*classes):
    """``(attribute, hook)`` for each of kvsan's native hooks
    (``kvsan._native._hookfast``) installed on ``classes``: each counts the calls it
    handled and kvsan's time in them (``calls``, ``seconds``)."""
    from kvsan.hooks import native_hook

    for cls in classes:
        for attr, fn in vars(cls).items():
            hook = native_hook(fn)
            if hook is not None:
                yield attr, hook


def table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)
