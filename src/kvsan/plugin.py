"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` once in every process it starts (front end,
EngineCore, workers).  With ``KVSAN`` unset or ``0`` it returns before
importing anything heavy and patches nothing.
"""

from __future__ import annotations

import os
import sys

from . import config as _config
from . import runtime as _rt


#: whether :func:`install` ever ran in this process (a runtime removed on
#: purpose is not put back by :mod:`kvsan.hooks.vllm.bootstrap`)
_ever_pid: int | None = None


def ever_installed() -> bool:
    return _ever_pid == os.getpid()


class HookError(RuntimeError):
    """KVSAN_STRICT=1 and some hook targets are missing, an adapter's
    contract with vLLM does not hold (:mod:`kvsan.hooks.contract`), or the
    vLLM version is not supported."""


def install(cfg: _config.Config, role: str | None = None,
            forked_from: _rt.Runtime | None = None) -> _rt.Runtime:
    """Install kvsan in this process with an explicit config (idempotent).
    ``forked_from``: the parent's runtime, in a forked child
    (:func:`install_forked`)."""
    global _ever_pid
    rt = _rt.get()
    if rt is not None and rt.pid == os.getpid():
        return rt
    _ever_pid = os.getpid()
    from . import hooks
    from .hooks.vllm import INSTRUMENTOR, processes

    _rt.set_process_names(processes)
    _rt.set_fork_installer(install_forked)
    # (a forked child: the metric families are the parent's, re-labelled)
    inherited = forked_from.metrics if forked_from is not None else None
    rt = _rt.Runtime(cfg, role=role, metrics=inherited is None)
    if inherited is not None:
        rt.metrics = rt.reporter.metrics = inherited.forked(rt.role, rt.engine, rt.rank)
    _rt.set_runtime(rt)
    rt.native = hooks.use_native(cfg.native)
    if rt.metrics is not None:
        try:
            rt.metrics.set_mode(cfg.check_mode, cfg.sample or 1.0)
        except Exception:  # noqa: BLE001 - e.g. an unwritable multiprocess directory
            rt.reporter.internal_errors += 1
    done = INSTRUMENTOR.instrument(rt, cfg)
    # (hooks patched at once by a post-import hook, for a module already
    # imported, are kept)
    rt.hooks_installed = done.hooks + [g for g in rt.hooks_installed if g not in done.hooks]
    rt.hooks_missing = done.missing
    problems = done.problems()
    if problems and cfg.strict:
        INSTRUMENTOR.uninstrument()
        _rt.set_runtime(None)
        raise HookError("kvsan: KVSAN_STRICT=1 refuses to start: " + "; ".join(problems))
    contract = done.contract
    rt.reporter.event(
        "kvsan.installed",
        mode=cfg.mode,
        check_mode=cfg.check_mode,
        **({"sample_rate": cfg.sample} if cfg.sample else {}),
        native=rt.native,
        vllm=done.version,
        hooks=done.hooks,
        missing=problems,
        contract=contract.summary(),
        **({"forked_from": forked_from.pid} if forked_from is not None else {}),
        # (engine and rank not in the process's name: a kvsan.identity
        # record follows once vLLM's parallel config gives them)
        **({"identity_pending": True} if not rt.identity_known else {}),
    )
    if not contract.holds:  # one event: what is off, and which checks with it
        rt.reporter.event("kvsan.contract", ok=False, vllm=done.version,
                          mismatches=contract.mismatches, checks_off=contract.checks_off,
                          unchecked=contract.unchecked, ms=round(contract.ms, 2))
    return rt


def install_forked(parent: _rt.Runtime) -> _rt.Runtime | None:
    """kvsan in a forked child (``VLLM_WORKER_MULTIPROC_METHOD=fork``: the
    EngineCore forked from the front end, a worker from its EngineCore:
    multiprocessing's fork), called by :mod:`kvsan.runtime`'s fork handler
    once the child has its name.  vLLM does not call :func:`register` there (its
    "plugins loaded" flag is inherited), so this does what it does: install
    for the child's own role, engine and rank (the hooks the parent patched
    are inherited and kept, the child's own are added: a worker's device
    hooks at once, post-import hooks for modules imported later), with its
    own report file, metrics series, exporter, ``kvsan.installed`` record
    and fault.  Never raises (a fork handler's exception would be lost);
    ``KVSAN_STRICT=1`` ends the child as it would end a spawned one."""
    try:
        _drop_inherited_fault()
        rt = install(parent.config, forked_from=parent)
        _start_process(rt, forked=True)
        return rt
    except HookError as e:
        sys.stderr.write(f"{e}\n")
        sys.stderr.flush()
        os._exit(1)
    except Exception as e:  # noqa: BLE001 - never into the child's own code
        rt = _rt.get()
        if rt is not None:
            try:
                rt.reporter.internal_error("install after fork", e)
            except Exception:  # noqa: BLE001 - raise/abort modes re-raise; not here
                pass
        else:
            sys.stderr.write(f"kvsan: not installed in forked process {os.getpid()}: "
                             f"{type(e).__name__}: {e}\n")
        return rt


def _start_process(rt: _rt.Runtime, forked: bool = False) -> None:
    """What a process does once, after :func:`install`: its exporter and the
    fault ``KVSAN_INJECT`` names, if it applies to this role and rank."""
    from . import exporter

    exporter.start(rt)  # KVSAN_METRICS_PORT / PROMETHEUS_MULTIPROC_DIR
    if rt.config.mode == "abort":  # one exit status, in-process or not
        from .hooks.vllm import abort

        abort.install(rt)
    fault = os.environ.get("KVSAN_INJECT", "").strip()
    if not fault:
        return
    from .hooks.vllm import faults

    if faults.applies(fault, rt.role, rt.rank):  # (a worker fault: of this rank)
        if forked:
            faults._scribbled.clear()  # (once per process: this one)
        faults.inject(fault)  # (inherited from the parent: kept)
        rt.reporter.event("kvsan.fault_injected", fault=fault)


def _drop_inherited_fault() -> None:
    """In a forked child, before it imports anything: a worker fault the
    parent injected (its post-import patch, pending or made) that is not
    this child's (``@rankN`` of another rank) is removed, before the
    child's own hooks are patched over it."""
    fault = os.environ.get("KVSAN_INJECT", "").strip()
    if not fault:
        return
    from .hooks.vllm import faults

    role = _rt.detect_role()
    name, _ = faults.target(fault)
    if name in faults.WORKER_FAULTS and not faults.applies(fault, role,
                                                          _rt.detect_identity(role)[1]):
        faults.clear()


def uninstall() -> None:
    """Remove every patch and forget this process's state."""
    from .hooks.vllm import INSTRUMENTOR

    INSTRUMENTOR.uninstrument()
    rt = _rt.get()
    if rt is not None:
        rt.reporter.close()
    _rt.set_runtime(None)


def register() -> None:
    """vLLM entry point: read the environment, install when ``KVSAN=1``."""
    cfg = _config.from_env()
    if not cfg.enabled:
        return
    from .hooks.vllm import carry_env_to_ray, processes

    if processes.helper_process():  # (vLLM's model inspection: no KV cache there)
        return

    carry_env_to_ray()
    already = _rt.get() is not None and _rt.get().pid == os.getpid()
    rt = install(cfg)
    if not already:
        _start_process(rt)
