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
    #: why kvsan's C paths are off in this process (the layouts they read,
    #: :mod:`kvsan.hooks.vllm.layouts`): the Python paths run the same checks
    native_off: list = field(default_factory=list)

    @property
    def holds(self) -> bool:
        return not self.mismatches

    def summary(self) -> dict:
        return {"ok": self.holds, "adapters": self.ok, "mismatches": self.mismatches,
                "checks_off": self.checks_off, "unchecked": self.unchecked,
                "ms": round(self.ms, 2),
                **({"native_off": self.native_off} if self.native_off else {})}


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
        # (from the class dict: reading ``klass.__annotations__`` would add an
        # empty one to a class that has none, changing vLLM's class)
        names.update(klass.__dict__.get("__annotations__", {}) or {})
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


class _Live:
    """The installed vLLM, read by importing its modules (never by
    instantiating an engine object)."""

    def __init__(self):
        self.memo: dict = {}

    def method(self, module: str, cls_name: str, attr: str):
        """The method's parameter names after ``self``, or why there are
        none (``"missing (...)"``, ``None``: no signature).  ImportError
        when the module does not import."""
        try:
            cls = _resolve(module, cls_name)
        except AttributeError as e:
            return f"missing ({e})"
        if attr not in cls.__dict__:
            return f"missing (no method {attr!r} on {cls_name})"
        return _params(cls.__dict__[attr])

    def attrs(self, module: str, qual: str, attrs):
        """The attributes of ``attrs`` the class lacks, or ``"missing (...)"``."""
        try:
            cls = _resolve(module, qual)
        except AttributeError as e:
            return f"missing ({e})"
        have = _code_names(cls, self.memo)
        return [a for a in attrs if a not in have]


class _Recorded:
    """A release's answers as :func:`record` wrote them (another vLLM than
    the installed one): the same questions, read from the record.  A
    question the record does not hold is a mismatch that says so."""

    def __init__(self, facts: dict):
        self.facts = facts

    def _imports(self, module: str) -> None:
        err = self.facts.get("modules", {}).get(module)
        if err is not None:
            raise ImportError(f"{err} (recorded)")

    def method(self, module: str, cls_name: str, attr: str):
        self._imports(module)
        got = self.facts.get("methods", {}).get(f"{module}:{cls_name}.{attr}", _UNRECORDED)
        if got is _UNRECORDED:
            return f"not recorded for vLLM {self.facts.get('vllm')} (record it again)"
        return got

    def attrs(self, module: str, qual: str, attrs):
        self._imports(module)
        got = self.facts.get("attrs", {}).get(f"{module}:{qual}", _UNRECORDED)
        if isinstance(got, str):
            return got
        if got is _UNRECORDED or any(a not in got["has"] and a not in got["lacks"]
                                     for a in attrs):
            return f"not recorded for vLLM {self.facts.get('vllm')} (record it again)"
        return [a for a in attrs if a not in got["has"]]


_UNRECORDED = object()


def check_one(contract: Contract, result: Result, memo: dict | None = None,
              source=None) -> None:
    """Verify one adapter's contract, adding to ``result`` (``source``: the
    installed vLLM, or a :class:`_Recorded` release)."""
    if source is None:
        source = _Live()
        if memo is not None:
            source.memo = memo
    bad: list = []
    try:
        for spec, expected in contract.methods.items():
            module, qual = _split(spec)
            cls_name, _, attr = qual.rpartition(".")
            name = f"{module}.{qual}"
            actual = source.method(module, cls_name, attr)
            if isinstance(actual, str):
                bad.append(f"{name} {actual}")
            elif actual is None or tuple(actual[:len(expected)]) != tuple(expected):
                bad.append(f"{name} parameters changed: expected "
                           f"({', '.join(expected)}, ...), found ({', '.join(actual or ['?'])})")
        for spec, attrs in contract.attrs.items():
            module, qual = _split(spec)
            lost = source.attrs(module, qual, attrs)
            if isinstance(lost, str):
                bad.append(f"{module}.{qual} {lost}")
            elif lost:
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


def check(contracts, facts: dict | None = None) -> Result:
    """Verify ``contracts`` (start-up only), timing the whole: against the
    installed vLLM, or against ``facts``, another release's answers as
    :func:`record` wrote them there."""
    t0 = perf_counter()
    result = Result()
    source = _Live() if facts is None else _Recorded(facts)
    for c in contracts:
        check_one(c, result, source=source)
    result.ms = (perf_counter() - t0) * 1e3
    return result


def record(contracts, version: str | None = None) -> dict:
    """The installed vLLM's answers to every question ``contracts`` ask (a
    method's parameters, a class's attributes, a module that does not
    import), as data: kept per release, they let :func:`check` verify the
    adapters' contracts against releases not installed here."""
    live, out = _Live(), {"vllm": version, "modules": {}, "methods": {}, "attrs": {}}

    def imports(module: str) -> bool:
        if module in out["modules"]:
            return False
        try:
            importlib.import_module(module)
            return True
        except Exception as e:  # noqa: BLE001 - recorded as the release's answer
            out["modules"][module] = f"{type(e).__name__}: {e}"
            return False

    for c in contracts:
        for spec in c.methods:
            module, qual = _split(spec)
            if imports(module):
                cls_name, _, attr = qual.rpartition(".")
                got = live.method(module, cls_name, attr)
                out["methods"][spec] = got if isinstance(got, (str, type(None))) else list(got)
        for spec, attrs in c.attrs.items():
            module, qual = _split(spec)
            if imports(module):
                lost = live.attrs(module, qual, attrs)
                if isinstance(lost, str):
                    out["attrs"][spec] = lost
                    continue
                have = out["attrs"].setdefault(spec, {"has": [], "lacks": []})
                for a in attrs:
                    key = "lacks" if a in lost else "has"
                    if a not in have[key]:
                        have[key].append(a)
    for have in out["attrs"].values():
        if isinstance(have, dict):
            have["has"].sort()
            have["lacks"].sort()
    return out
