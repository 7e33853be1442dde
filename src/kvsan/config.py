"""Environment variables -> one frozen :class:`Config`, with errors that say
exactly which variable was wrong and what it accepts.

kvsan is switched on from the environment only (no code change in the
serving stack), so this module is the whole user interface of the switch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MODES = ("log", "raise", "abort")
#: Exit status of a process that kvsan ended in ``abort`` mode.  Distinct from
#: Python's 1 and from signals, so CI can tell "kvsan found a bug" apart.
ABORT_EXIT_CODE = 87

_BOOL = {"1": True, "0": False, "": False}


class ConfigError(ValueError):
    """A KVSAN_* variable holds a value kvsan does not accept."""


@dataclass(frozen=True)
class Config:
    enabled: bool = False
    mode: str = "log"
    report: str | None = None
    strict: bool = False
    #: full-table audit schedule: 0 = only when the engine goes idle,
    #: N > 0 = additionally every N scheduler steps.
    audit_every: int = 0
    #: steps a finished request may keep blocks on a legal delayed-free path
    #: (KV-connector transfer) before its blocks are reported as leaked.
    leak_grace_steps: int = 1000
    #: scheduler steps in a row that schedule nothing, with nothing pending
    #: outside the engine, after which requests holding blocks are reported
    #: as stranded (a stall; 0: off)
    stall_steps: int = 8
    #: emit structlog JSON lines on stderr (one per violation)
    log_events: bool = True
    #: device-side checksums of sealed blocks: "off", "all", or "sample"
    #: with ``checksum_sample`` sealed blocks that live requests hold
    #: re-verified per step (prefix hits are always verified unless off)
    checksum: str = "sample"
    checksum_sample: int = 4
    #: fill blocks that leave every owner (and evicted blocks) with NaN
    poison: bool = False
    #: keep released blocks out of reuse for N steps (0: off), or
    #: "pressure": released blocks are the first to be reused
    quarantine: int = 0
    pressure: bool = False
    #: use kvsan's C speed-ups where they were built (same results; 0 runs
    #: the pure-Python paths, e.g. to rule them out)
    native: bool = True
    #: production mode (``KVSAN_SAMPLE``): the share of requests that get
    #: every allocator check (0: staging mode, every request checked); the
    #: rest cost next to nothing, and the pool-wide invariants stay on
    sample: float = 0.0
    #: the sampling key's seed (``KVSAN_SAMPLE_SEED``; None: drawn at start)
    sample_seed: int | None = None

    @property
    def check_mode(self) -> str:
        """``production`` (sampled requests) or ``staging`` (every request)."""
        return "production" if self.sample else "staging"


def _flag(env, name: str) -> bool:
    raw = env.get(name, "").strip()
    if raw not in _BOOL:
        raise ConfigError(f"{name}={raw!r} is not accepted; use 1 (on) or 0 (off)")
    return _BOOL[raw]


def _int(env, name: str, default: int, minimum: int = 0) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(f"{name}={raw!r} is not accepted; use an integer >= {minimum}")
    return value


def check_report_path(path: str) -> None:
    """Fail early when the report destination cannot be written."""
    if path.endswith(os.sep) or os.path.isdir(path):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"KVSAN_REPORT={path!r}: cannot create report directory ({e.strerror}); "
                "accepted: a writable file path, or a directory (ending in '/') "
                "for one file per process"
            ) from None
        if not os.access(path, os.W_OK):
            raise ConfigError(f"KVSAN_REPORT={path!r}: directory is not writable")
        return
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ConfigError(
            f"KVSAN_REPORT={path!r}: cannot open for append ({e.strerror}); "
            "accepted: a writable file path, or a directory (ending in '/') "
            "for one file per process"
        ) from None


def _checksum(env) -> tuple[str, int]:
    raw = env.get("KVSAN_CHECKSUM", "").strip() or f"sample:{Config.checksum_sample}"
    if raw in ("off", "all"):
        return raw, 0
    if raw.startswith("sample:"):
        n = raw.split(":", 1)[1]
        if n.isdigit() and int(n) > 0:
            return "sample", int(n)
    raise ConfigError(
        f"KVSAN_CHECKSUM={raw!r} is not accepted; use off, all, or sample:N (N >= 1)"
    )


def _quarantine(env) -> tuple[int, bool]:
    raw = env.get("KVSAN_QUARANTINE", "").strip()
    if raw in ("", "0"):
        return 0, False
    if raw == "pressure":
        return 0, True
    if raw.isdigit():
        return int(raw), False
    raise ConfigError(
        f"KVSAN_QUARANTINE={raw!r} is not accepted; use 0, a number of steps N, or pressure"
    )


#: the rate ``KVSAN_SAMPLE=on`` means: one request in 64 (at 256 live
#: requests, four are watched at any time)
DEFAULT_SAMPLE = 1 / 64
_SAMPLE_ACCEPTS = ("on (the default rate, 1/64), a fraction 1/N, a decimal in (0, 1] "
                   "such as 0.02, or a percentage such as 2%; unset or 0 for staging "
                   "mode (every request checked)")


def _sample(env) -> float:
    raw = env.get("KVSAN_SAMPLE", "").strip()
    if raw in ("", "0", "off"):
        return 0.0
    if raw == "on":
        return DEFAULT_SAMPLE
    try:
        if raw.endswith("%"):
            rate = float(raw[:-1]) / 100
        elif "/" in raw:
            num, den = raw.split("/", 1)
            rate = int(num) / int(den)
        else:
            rate = float(raw)
    except (ValueError, ZeroDivisionError):
        rate = -1.0
    if not 0 < rate <= 1:  # (nan fails both)
        raise ConfigError(f"KVSAN_SAMPLE={raw!r} is not accepted; use {_SAMPLE_ACCEPTS}")
    return rate


def _seed(env) -> int | None:
    raw = env.get("KVSAN_SAMPLE_SEED", "").strip()
    return _int(env, "KVSAN_SAMPLE_SEED", 0) if raw else None


def from_env(env=None) -> Config:
    """Read the KVSAN_* variables.  Raises :class:`ConfigError` on any bad value."""
    env = os.environ if env is None else env
    enabled = _flag(env, "KVSAN")
    mode = env.get("KVSAN_MODE", "log").strip() or "log"
    if mode not in MODES:
        raise ConfigError(f"KVSAN_MODE={mode!r} is not accepted; use one of {', '.join(MODES)}")
    report = env.get("KVSAN_REPORT", "").strip() or None
    if enabled and report:
        check_report_path(report)
    checksum, sample = _checksum(env)
    quarantine, pressure = _quarantine(env)
    return Config(
        enabled=enabled,
        mode=mode,
        report=report,
        strict=_flag(env, "KVSAN_STRICT"),
        audit_every=_int(env, "KVSAN_AUDIT_EVERY", 0),
        leak_grace_steps=_int(env, "KVSAN_LEAK_GRACE_STEPS", 1000),
        stall_steps=_int(env, "KVSAN_STALL_STEPS", 8),
        log_events=_flag(env, "KVSAN_LOG") if env.get("KVSAN_LOG", "").strip() else True,
        checksum=checksum,
        checksum_sample=sample,
        poison=_flag(env, "KVSAN_POISON"),
        quarantine=quarantine,
        pressure=pressure,
        native=_flag(env, "KVSAN_NATIVE") if env.get("KVSAN_NATIVE", "").strip() else True,
        sample=_sample(env),
        sample_seed=_seed(env),
    )
