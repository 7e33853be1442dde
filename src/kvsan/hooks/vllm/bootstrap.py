"""kvsan where vLLM never loads its plugins: a program or a test that builds
vLLM's ``Scheduler``, ``KVCacheManager`` or ``BlockPool`` itself.

vLLM installs kvsan through ``load_general_plugins()``, which its engine
processes call before they build the KV cache.  With ``KVSAN`` on,
:mod:`kvsan.startup` calls :func:`guard` when one of the modules defining
those classes is imported; the class's ``__init__`` is wrapped so that the
first construction in a process where kvsan was never installed installs
it (:func:`kvsan.plugin.register`: the same config, report, exporter and
fault as a plugin load), records ``kvsan.bootstrap`` naming the class, and
then builds the object through kvsan's hooks.  Where kvsan is already
installed (every vLLM engine process), or was installed once and removed
on purpose, the wrapper only calls vLLM's ``__init__``.  If the install
fails, one line on stderr says that kvsan is off in this process and why.
"""

from __future__ import annotations

import functools
import os
import sys

#: module -> the classes built there
CLASSES = {
    "vllm.v1.core.block_pool": ("BlockPool",),
    "vllm.v1.core.kv_cache_manager": ("KVCacheManager",),
    "vllm.v1.core.sched.scheduler": ("Scheduler",),
}

_fired = False
_said = False

def guard(module) -> None:
    """Wrap the ``__init__`` of each of ``module``'s KV-cache classes
    (idempotent)."""
    for name in CLASSES.get(module.__name__, ()):
        cls = getattr(module, name, None)
        if cls is None:
            continue
        init = cls.__dict__.get("__init__")
        if init is None or getattr(init, "_kvsan_bootstrap", False):
            continue
        cls.__init__ = _wrap(cls, init)


def _wrap(cls, init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if not _fired and _needed():
            if _install(cls.__name__):
                now = cls.__init__  # kvsan's hooks, around this wrapper
                if now is not __init__:
                    return now(self, *args, **kwargs)
        return init(self, *args, **kwargs)

    __init__._kvsan_bootstrap = True
    return __init__


def _needed() -> bool:
    from ... import plugin, runtime

    return runtime.get() is None and not plugin.ever_installed()


def _install(what: str) -> bool:
    """Install kvsan in this process now; False (said once) if it could not."""
    global _fired, _said
    _fired = True
    from ... import config, plugin

    try:
        plugin.register()
    except (config.ConfigError, plugin.HookError):
        raise  # a bad setting or KVSAN_STRICT=1 stops the program, as in an engine
    except Exception as e:  # noqa: BLE001 - the program goes on without kvsan: say so
        if not _said:
            _said = True
            sys.stderr.write(f"kvsan: KVSAN is on but kvsan is NOT installed in process "
                             f"{os.getpid()} (building vLLM's {what}: {type(e).__name__}: "
                             f"{e}); nothing in this process is checked\n")
            sys.stderr.flush()
        return False
    from ... import runtime

    rt = runtime.get()
    if rt is None:
        return False
    rt.reporter.event("kvsan.bootstrap", built=what,
                      why="vLLM's general plugins were not loaded in this process")
    return True
