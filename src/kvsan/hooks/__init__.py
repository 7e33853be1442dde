"""Engine adapters: the only code that knows an engine's class and method
names.  Each adapter translates the engine's calls into events for the
engine-agnostic checks in :mod:`kvsan.checks`.

Patching follows OpenTelemetry's instrumentations: a table of targets,
``instrument()`` wraps each with wrapt and reports which were missing,
``uninstrument()`` restores the originals.
"""

from __future__ import annotations

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


def _wrap(owner, attr: str, wrapper) -> None:
    original = owner.__dict__[attr]
    if isinstance(original, wrapt.FunctionWrapper):
        return  # already ours (register() is idempotent)
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
        _wrap(cls, attr, t.wrapper)
        if t.subclasses:
            for sub in _all_subclasses(cls):
                if attr in sub.__dict__:
                    _wrap(sub, attr, t.wrapper)
        installed.append(t.name)
    return installed, missing


def uninstrument() -> None:
    """Restore every original method patched by :func:`instrument`."""
    while _patched:
        owner, attr, original = _patched.pop()
        setattr(owner, attr, original)
