"""Build of kvsan's optional C speed-ups (everything else is in pyproject.toml).

``kvsan._native._frames`` reads the engine's call context from the interpreter's
frame stack (CPython 3.11: its internal frame records; 3.10, 3.12, 3.13: the
public frame API); ``kvsan._native._shadowfast`` applies clean allocator events to the shadow
table; ``kvsan._native._tokenlinks`` computes the identity audit's token chain;
``kvsan._native._devicefast`` runs the worker's write guard and checksums over host
memory; ``kvsan._native._hookfast`` runs the hottest BlockPool hooks without a Python
frame.
All use CPython's public C API but for _frames on 3.11, and build on CPython
3.10 to 3.13.  All are optional: where they cannot be built (no compiler,
another Python), kvsan runs its pure-Python paths, which give the same
results.

It also puts ``kvsan-startup.pth`` into site-packages, in a wheel and in an
editable install alike: its one line runs :func:`kvsan.startup.boot` at
interpreter start only when ``KVSAN`` is set or the program is vLLM's
``vllm`` script (see :mod:`kvsan.startup`).
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

PTH = "kvsan-startup.pth"
#: one line, run by ``site`` at every interpreter start: a dictionary
#: lookup and a string comparison unless KVSAN is set or this is `vllm`
PTH_LINE = ('import os, sys; ("KVSAN" in os.environ or os.path.basename('
            '(getattr(sys, "argv", None) or [""])[0]) == "vllm") '
            'and __import__("kvsan.startup").startup.boot()\n')


def _write_pth(directory):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, PTH), "w") as f:
        f.write(PTH_LINE)


class BuildPyWithPth(build_py):
    """The wheel's site-packages root gets the .pth beside the package."""

    def run(self):
        super().run()
        _write_pth(self.build_lib)

    def get_outputs(self, *args, **kwargs):
        return super().get_outputs(*args, **kwargs) + [os.path.join(self.build_lib, PTH)]


CMDCLASS = {"build_py": BuildPyWithPth}
try:  # the editable install (pip install -e): its wheel's root gets it too
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithPth(editable_wheel):
        def _run_build_commands(self, dist_name, unpacked_wheel, *args, **kwargs):
            out = super()._run_build_commands(dist_name, unpacked_wheel, *args, **kwargs)
            _write_pth(unpacked_wheel)
            return out

    CMDCLASS["editable_wheel"] = EditableWheelWithPth
except ImportError:  # (a setuptools without PEP 660 editable installs)
    pass

#: the C functions _frames and _shadowfast export to _hookfast (see the header)
CAPI = ["src/kvsan/_native/_capi.h"]
#: the in-line slot reads _shadowfast, _tokenlinks and _hookfast share
SLOTS = ["src/kvsan/_native/_slots.h"]

setup(
    cmdclass=CMDCLASS,
    ext_modules=[
        Extension("kvsan._native._frames", ["src/kvsan/_native/_frames.c"], depends=CAPI, optional=True),
        Extension("kvsan._native._shadowfast", ["src/kvsan/_native/_shadowfast.c"], depends=CAPI + SLOTS,
                  optional=True),
        Extension("kvsan._native._tokenlinks", ["src/kvsan/_native/_tokenlinks.c"], depends=SLOTS,
                  optional=True),
        Extension("kvsan._native._devicefast", ["src/kvsan/_native/_devicefast.c"], depends=SLOTS,
                  optional=True),
        Extension("kvsan._native._hookfast", ["src/kvsan/_native/_hookfast.c"], depends=CAPI + SLOTS,
                  optional=True),
    ],
)
