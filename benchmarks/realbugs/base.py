"""What one entry of the real-bug corpus is, and the tools entries share:
patching one of vLLM's functions (its fix reverted, or a fix applied to a
release that still carries the bug) around kvsan's hooks, and a record of
the faulty call that the runner compares kvsan's reports with."""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap
import types
from dataclasses import dataclass, field
from typing import Callable


def vllm_version() -> str:
    import vllm

    return vllm.__version__.split("+")[0]


def _vkey(ver: str) -> tuple[int, ...]:
    return tuple(int(p) for p in ver.split(".")[:3] if p.isdigit())



def _stall_steps() -> int:
    from kvsan.config import Config

    return Config().stall_steps


#: kvsan's default stall window (``KVSAN_STALL_STEPS``): a liveness entry's
#: report comes that many steps after the engine stopped making progress
STALL_STEPS = _stall_steps()

@dataclass
class Trial:
    """What one run of an entry's trigger saw.  ``harm``: what a user would
    see (None: nothing went wrong); ``fault_step``: kvsan's step counter at
    the faulty call (the driver's own count where kvsan is off);
    ``blocks``: the blocks the bug put at stake (kvsan must name one of
    them); ``owners``: the requests at stake."""

    harm: str | None = None
    fault_step: int | None = None
    blocks: list[int] = field(default_factory=list)
    owners: list[str] = field(default_factory=list)
    notes: dict = field(default_factory=dict)


class Run:
    """Handed to a trigger: whether kvsan is on, and where it says the
    faulty call happened (:meth:`fault`)."""

    def __init__(self, rt, buggy: bool):
        self.rt = rt
        self.buggy = buggy
        self.trial = Trial()
        self.driver_step = 0

    @property
    def step(self) -> int:
        return self.rt.step if self.rt is not None else self.driver_step

    def fault(self, blocks=(), owners=(), step: int | None = None) -> None:
        """The faulty call just happened (first call wins)."""
        if self.trial.fault_step is None:
            self.trial.fault_step = self.step if step is None else step
            self.trial.blocks = sorted(set(int(b) for b in blocks))
            self.trial.owners = list(owners)

    def harm(self, text: str) -> None:
        if self.trial.harm is None:
            self.trial.harm = text


@dataclass
class Entry:
    """One upstream bug.  ``releases``: the vLLM releases that shipped it;
    ``native``: those of them on which it is run unmodified (the others get
    ``revert``); ``revert`` (``patch(version)`` -> context manager) puts the
    bug back on a fixed release, ``fix`` (likewise) removes it from one that
    carries it, for the control; ``trigger(run)`` drives vLLM and says
    what happened.  ``expect``: ``"detected"``, or ``"missed"`` with
    ``miss_reason`` (the invariant that would catch it); ``"none"`` for the
    negative control, where kvsan must stay silent even on the buggy code."""

    id: str
    upstream: str
    title: str
    kind_class: str
    releases: list[str]
    level: str  # "scheduler" or "engine"
    expected_kinds: list[str]
    where: str
    revert_how: str  # "exact hunk" / "derived" / "present (unmodified)"
    harm_what: str
    trigger: Callable[[Run], None]
    native: list[str] = field(default_factory=list)
    revert: Callable | None = None  # (version) -> context manager
    fix: Callable | None = None  # (version) -> context manager
    #: releases whose Python code the revert applies to (default: all
    #: supported releases that do not carry the bug natively)
    revertable: list[str] | None = None
    expect: str = "detected"
    miss_reason: str = ""
    #: steps from the faulty call within which the report must come (1: at
    #: the call or the step after).  A stall is a fault of no single call:
    #: kvsan reports it after ``KVSAN_STALL_STEPS`` steps without progress,
    #: so a liveness entry allows that window (and says so)
    detect_within: int = 1
    counted: bool = True  # False: the negative control
    #: kvsan settings for the run with kvsan on (``Config`` fields), beside
    #: ``enabled``; documented settings only (docs/configuration.md)
    config: dict = field(default_factory=dict)

    def applies_to(self, vllm_version: str) -> bool:
        """Whether the bug can be run on that release: it ships the bug, or
        this entry's revert applies to its code."""
        v = vllm_version.split("+")[0]
        if v in self.native:
            return True
        if self.revert is None:
            return False
        return self.revertable is None or v in self.revertable

    def runnable_here(self) -> str | None:
        """Why this entry cannot run in this process (None: it can): an
        engine-level entry needs an engine that starts here (vLLM's CPU
        build; a CUDA build on a host without a GPU runs the scheduler
        side only)."""
        if self.level != "engine":
            return None
        from vllm.platforms import current_platform

        if current_platform.is_unspecified():
            return "the engine does not start here (no device vLLM detects)"
        return None

    def carries(self, vllm_version: str) -> bool:
        return vllm_version.split("+")[0] in self.native

    @contextlib.contextmanager
    def buggy(self):
        """The bug applied to the vLLM imported in this process (and undone
        on exit); nothing to do on a release that ships it."""
        ver = vllm_version()
        if ver in self.native:
            yield
            return
        if not self.applies_to(ver):
            raise RuntimeError(f"{self.id}: no revert for vLLM {ver} (runs on "
                               f"{sorted(set(self.native) | set(self.revertable or []))})")
        with self.revert(ver):
            yield

    @contextlib.contextmanager
    def fixed(self):
        """The fixed code: the release as shipped where it is fixed, else the
        entry's fix applied."""
        ver = vllm_version()
        if ver not in self.native:
            yield
            return
        if self.fix is None:
            raise RuntimeError(f"{self.id}: no fix to apply on vLLM {ver}")
        with self.fix(ver):
            yield


# ------------------------------------------------------------ patching vLLM
def _hook_targets(cls, name: str):
    """kvsan's hook targets on ``cls.name`` that are installed now."""
    from kvsan import hooks
    from kvsan.hooks.vllm import allocator

    qual = f"{cls.__name__}.{name}"
    out = []
    for t in allocator.targets():
        if t.qualname != qual:
            continue
        fn = cls.__dict__.get(name)
        wrapped = any(o is cls and a == name for o, a, _, _ in hooks._patched)
        code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
        owner = code is not None and id(code) in hooks.OWNER_FRAMES
        if wrapped or owner:
            out.append(t)
    return out


def _original(cls, name: str):
    """``cls.name`` as vLLM defines it (beneath kvsan's patches)."""
    from kvsan import hooks

    for o, a, original, _ in hooks._patched:
        if o is cls and a == name:
            return original
    return cls.__dict__[name]


@contextlib.contextmanager
def replaced(cls, name: str, new):
    """``cls.name`` replaced by ``new`` for the block; kvsan's hooks on it
    (if installed) are taken off and put back around the new function, so
    kvsan sees the patched method as it sees vLLM's own."""
    from kvsan import hooks

    targets = _hook_targets(cls, name)
    if targets:
        hooks.uninstrument(targets)
        for t in targets:
            if t.owner is not None:
                code = getattr(cls.__dict__[name], "__code__", None)
                if code is not None:
                    hooks.OWNER_FRAMES.pop(id(code), None)
                    hooks.OWNER_SLOTS.pop(id(code), None)
    old = cls.__dict__[name]
    setattr(cls, name, new)
    if targets:
        hooks.instrument(targets)
    try:
        yield
    finally:
        if targets:
            hooks.uninstrument(targets)
            code = getattr(new, "__code__", None)
            if code is not None:
                hooks.OWNER_FRAMES.pop(id(code), None)
                hooks.OWNER_SLOTS.pop(id(code), None)
        setattr(cls, name, old)
        if targets:
            hooks.instrument(targets)


def rebuilt(fn, edits: list[tuple[str, str]]):
    """``fn`` recompiled from its own source with each ``(old, new)`` text
    replaced (``old`` must occur exactly once): the pre-fix lines put back
    into vLLM's function as the release ships it."""
    src = inspect.getsource(fn)  # (as indented in its file: so are the edits)
    for old, new in edits:
        n = src.count(old)
        if n != 1:
            raise RuntimeError(f"{fn.__qualname__}: expected the text {old!r} once, "
                               f"found it {n} times: this release's code differs")
        src = src.replace(old, new)
    tree = ast.parse(textwrap.dedent(src))
    ns = dict(fn.__globals__)
    exec(compile(tree, inspect.getsourcefile(fn), "exec"), ns)
    built = ns[fn.__name__]
    # run in the module's own namespace (its other functions as patched now)
    new = types.FunctionType(built.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    return new


def resolve(path: str):
    """``"module:Class"`` -> the class (vLLM is imported only when an entry
    runs, not when the corpus is listed)."""
    import importlib

    mod, _, qual = path.partition(":")
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def source_revert(cls_path: str, name: str, edits):
    """A ``revert``/``fix`` (version -> context manager) that rebuilds
    ``Class.name`` from the release's source with ``edits`` (a list of
    ``(old, new)``, or a function of the version giving one)."""

    def patch(version):
        cls = resolve(cls_path)
        ed = edits(version) if callable(edits) else edits
        return replaced(cls, name, rebuilt(_original(cls, name), ed))

    return patch


@contextlib.contextmanager
def module_attr(module, name: str, new):
    old = getattr(module, name)
    setattr(module, name, new)
    try:
        yield
    finally:
        setattr(module, name, old)
