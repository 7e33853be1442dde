"""The start-up contract: what each adapter relies on in vLLM, declared as
data by the adapter (its ``CONTRACT``), verified here once per process.

A contract names, per hooked method (``"module:Class.method"``), the
leading parameters (after ``self``) its wrapper reads by name or position
(``bind_args``, ``args[0] if args else kwargs[...]``), and per class
(``"module:Class"``) the attributes the adapter reads on its instances.
:func:`check` imports the modules (never instantiates an engine object) and
compares with ``inspect.signature`` and the class: its attributes, its
``__slots__`` / dataclass fields / annotations, and the attribute names the
class's own code stores or loads (``self.x = ...`` in ``__init__``; read
from the code objects, not by running them).  It runs at start-up only:
nothing per step.

A contract marked ``optional`` covers a module that may not import in a
build (the V2 model runner needs Triton): it is checked where it imports,
and the result says it was not checked where it does not.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from time import perf_counter
from types import CodeType, FunctionType


@dataclass(frozen=True)
class Contract:
    #: the adapter's name, as reports name it (``allocator``, ``worker-v1``)
    adapter: str
    #: what is off when this contract does not hold (the check it feeds)
    check: str
    #: ``"module:Class.method"`` -> the leading parameters (after ``self``)
    #: the adapter's wrapper reads, in order
    methods: dict = field(default_factory=dict)
    #: ``"module:Class"`` -> attributes the adapter reads on its instances
    attrs: dict = field(default_factory=dict)
    #: the modules may not import in this build: checked only where they do
    optional: bool = False


@dataclass
class Result:
    #: one line per mismatch: ``"<adapter>: <what>"``
    mismatches: list = field(default_factory=list)
    #: the checks that are off because of them (``"<adapter>: <check>"``)
    checks_off: list = field(default_factory=list)
    #: optional contracts not checked here (``"<adapter>: <why>"``)
    unchecked: list = field(default_factory=list)
    #: adapters whose contract was checked and holds
    ok: list = field(default_factory=list)
    ms: float = 0.0

    @property
    def holds(self) -> bool:
        return not self.mismatches

    def summary(self) -> dict:
        return {"ok": self.holds, "adapters": self.ok, "mismatches": self.mismatches,
                "checks_off": self.checks_off, "unchecked": self.unchecked,
                "ms": round(self.ms, 2)}


def _split(spec: str) -> tuple[str, str]:
    module, _, qual = spec.partition(":")
    return module, qual


def _resolve(module: str, qual: str):
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _params(fn) -> list[str] | None:
    """Parameter names of ``fn`` without the bound ``self`` (None: no
    signature)."""
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names[1:] if names and names[0] in ("self", "cls") else names


def _code_names(cls, memo: dict) -> set:
    """Attribute names the code of ``cls`` and its bases (vLLM's, not
    ``object``) stores or loads, nested functions included."""
    got = memo.get(cls)
    if got is not None:
        return got
    names: set = set()
    todo: list = []
    for klass in cls.__mro__:
        if klass is object:
            continue
        names.update(klass.__dict__)
        names.update(getattr(klass, "__annotations__", {}) or {})
        slots = klass.__dict__.get("__slots__", ())
        names.update((slots,) if isinstance(slots, str) else slots)
        for v in klass.__dict__.values():
            if isinstance(v, (staticmethod, classmethod)):
                v = v.__func__
            elif isinstance(v, property):
                v = v.fget
            v = inspect.unwrap(v) if callable(v) else v
            if isinstance(v, FunctionType):
                todo.append(v.__code__)
    while todo:
        code = todo.pop()
        names.update(code.co_names)
        todo.extend(c for c in code.co_consts if isinstance(c, CodeType))
    memo[cls] = names
    return names


def check_one(contract: Contract, result: Result, memo: dict | None = None) -> None:
    """Verify one adapter's contract, adding to ``result``."""
    memo = {} if memo is None else memo
    bad: list = []
    try:
        for spec, expected in contract.methods.items():
            module, qual = _split(spec)
            cls_name, _, attr = qual.rpartition(".")
            name = f"{module}.{qual}"
            try:
                cls = _resolve(module, cls_name)
            except AttributeError as e:
                bad.append(f"{name} missing ({e})")
                continue
            if attr not in cls.__dict__:
                bad.append(f"{name} missing (no method {attr!r} on {cls_name})")
                continue
            actual = _params(cls.__dict__[attr])
            if actual is None or tuple(actual[:len(expected)]) != tuple(expected):
                bad.append(f"{name} parameters changed: expected "
                           f"({', '.join(expected)}, ...), found ({', '.join(actual or ['?'])})")
        for spec, attrs in contract.attrs.items():
            module, qual = _split(spec)
            try:
                cls = _resolve(module, qual)
            except AttributeError as e:
                bad.append(f"{module}.{qual} missing ({e})")
                continue
            have = _code_names(cls, memo)
            lost = [a for a in attrs if a not in have]
            if lost:
                bad.append(f"{module}.{qual} lacks attribute(s) {', '.join(lost)}")
    except ImportError as e:
        if contract.optional:
            result.unchecked.append(f"{contract.adapter}: not checked, its module does "
                                    f"not import in this build ({type(e).__name__}: {e})")
            return
        bad.append(f"module does not import ({type(e).__name__}: {e})")
    except Exception as e:  # noqa: BLE001 - e.g. an optional module failing at import
        if contract.optional:
            result.unchecked.append(f"{contract.adapter}: not checked, its module does "
                                    f"not import in this build ({type(e).__name__}: {e})")
            return
        bad.append(f"could not be checked ({type(e).__name__}: {e})")
    if bad:
        result.mismatches.extend(f"{contract.adapter}: {b}" for b in bad)
        result.checks_off.append(f"{contract.adapter}: {contract.check}")
    else:
        result.ok.append(contract.adapter)


def check(contracts) -> Result:
    """Verify ``contracts`` (start-up only), timing the whole."""
    t0 = perf_counter()
    result, memo = Result(), {}
    for c in contracts:
        check_one(c, result, memo)
    result.ms = (perf_counter() - t0) * 1e3
    return result
