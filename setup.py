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
"""

from setuptools import Extension, setup

#: the C functions _frames and _shadowfast export to _hookfast (see the header)
CAPI = ["src/kvsan/_native/_capi.h"]
#: the in-line slot reads _shadowfast, _tokenlinks and _hookfast share
SLOTS = ["src/kvsan/_native/_slots.h"]

setup(
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
