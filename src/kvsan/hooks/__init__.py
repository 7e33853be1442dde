"""Engine adapters: the only code that knows an engine's class and method
names.  Each adapter translates the engine's calls into events for the
engine-agnostic checks in :mod:`kvsan.checks`.

Patching follows OpenTelemetry's instrumentations: a table of targets,
``instrument()`` wraps each with wrapt and reports which were missing,
``uninstrument()`` restores the originals.

A plain method is replaced by a plain-function trampoline that calls the
wrapper as ``wrapper(bound_original, instance, args, kwargs)`` (wrapt's
calling convention).  wrapt's own ``FunctionWrapper`` builds a bound proxy
object on every attribute access, about 2 µs per call on CPython 3.11: the
scheduler calls some hooked methods once per request per step, so that alone
was most of kvsan's overhead.  Other descriptors (classmethod, staticmethod)
still go through wrapt.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

import wrapt


@dataclass(frozen=True)
class Target:
    module: str
    qualname: str  # "Class.method"
    wrapper: Callable
    #: also patch subclasses that override the method (engine managers do)
    subclasses: bool = False
    #: optional ``original -> patched function`` for the hottest hooks: the
    #: patched function calls the original itself, with no generic wrapper
    #: call in between (``wrapper`` stays the fallback for other descriptors)
    direct: Callable | None = None

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


_patched: list[tuple[object, str, object]] = []


def _all_subclasses(cls):
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        for s in c.__subclasses__():
            if s not in out:
                out.append(s)
                todo.append(s)
    return out


def is_patched(fn) -> bool:
    """True for a method kvsan (or wrapt) has wrapped."""
    return isinstance(fn, wrapt.FunctionWrapper) or getattr(fn, "__kvsan_patched__", False)


def _trampoline(original, wrapper):
    get = original.__get__

    @functools.wraps(original)
    def patched(self, *args, **kwargs):
        return wrapper(get(self), self, args, kwargs)

    patched.__kvsan_patched__ = True
    return patched


#: the code object every trampoline runs (call-site lookups skip its frame)
TRAMPOLINE_CODE = _trampoline(lambda self: None, None).__code__


def _wrap(owner, attr: str, wrapper, direct=None) -> None:
    original = owner.__dict__[attr]
    if is_patched(original):
        return  # already ours (register() is idempotent)
    if type(original) is type(_trampoline):  # a plain function
        if direct is not None:
            patched = functools.wraps(original)(direct(original))
            patched.__kvsan_patched__ = True
        else:
            patched = _trampoline(original, wrapper)
        setattr(owner, attr, patched)
    else:
        wrapt.wrap_function_wrapper(owner, attr, wrapper)
    _patched.append((owner, attr, original))


def instrument(targets: list[Target]) -> tuple[list[str], list[str]]:
    """Patch every target; returns (installed, missing) names."""
    installed, missing = [], []
    for t in targets:
        try:
            mod = importlib.import_module(t.module)
            cls_name, attr = t.qualname.split(".")
            cls = getattr(mod, cls_name)
            if attr not in cls.__dict__:
                raise AttributeError(attr)
        except (ImportError, AttributeError) as e:
            missing.append(f"{t.name} ({type(e).__name__}: {e})")
            continue
        _wrap(cls, attr, t.wrapper, t.direct)
        if t.subclasses:
            for sub in _all_subclasses(cls):
                if attr in sub.__dict__:
                    _wrap(sub, attr, t.wrapper, t.direct)
        installed.append(t.name)
    return installed, missing


def uninstrument() -> None:
    """Restore every original method patched by :func:`instrument`."""
    while _patched:
        owner, attr, original = _patched.pop()
        setattr(owner, attr, original)


def bind_args(args: tuple, kwargs: dict, names: tuple[str, ...]) -> dict:
    """The leading parameters of a hooked call by name, whether vLLM passed
    them positionally or as keywords."""
    vals = dict(zip(names, args))
    vals.update({k: kwargs[k] for k in names if k in kwargs})
    return vals
