"""Engine adapters: the only code that knows an engine's class and method
names.  Each adapter (one package per engine: :mod:`kvsan.hooks.vllm`)
translates the engine's calls into events for the engine-agnostic checks
in :mod:`kvsan.checks`; this module is the patching they share.

Patching follows OpenTelemetry's instrumentations: a table of targets,
``instrument()`` wraps each with wrapt and reports which were missing,
``uninstrument()`` restores the originals.

A plain method is replaced by a plain-function trampoline that calls the
wrapper as ``wrapper(bound_original, instance, args, kwargs)`` (wrapt's
calling convention).  wrapt's own ``FunctionWrapper`` builds a bound proxy
object on every attribute access, about 2 µs per call on CPython 3.11: the
scheduler calls some hooked methods once per request per step, so that alone
was most of kvsan's overhead.  Other descriptors (classmethod, staticmethod)
still go through wrapt.  Two adapters may hook one method (the allocator
and the identity audit both watch ``cache_full_blocks``): trampolines chain.

Methods that only name the request an allocator call is made for are not
wrapped at all: their code objects are registered as *owner frames*
(``Target.owner``) and read from the stack when a pool event happens.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
import weakref
from dataclasses import dataclass
from time import perf_counter as _perf_counter
from typing import Callable

import wrapt

from .. import runtime as _runtime
from ..report import KVSanViolation


@dataclass(frozen=True)
class Target:
    module: str
    qualname: str  # "Class.method"
    wrapper: Callable
    #: also patch subclasses that override the method (engine managers do)
    subclasses: bool = False
    #: ``(local name, attribute or None)``: instead of wrapping, register the
    #: method's code as an *owner frame*: an allocator call made below it is
    #: attributed to the request read from that local of its frame
    #: (``request_id``, or ``request`` and its ``request_id``).  Costs nothing
    #: on the engine's hot path: the stack is read only when an allocator
    #: event happens, not on every call of the method.
    owner: tuple[str, str | None] | None = None
    #: ``(kind, post)``: where ``kvsan._native._hookfast`` is in use, the method is
    #: replaced by its native ``Hook`` of that kind (``"ALLOCATE"``,
    #: ``"TOUCH"``, ``"RELEASE"``, ``"CACHE"``, ``"HITS"`` for the
    #: identity audit's hit check, ``"END"`` and ``"SKIP"`` on the scheduler,
    #: ``"STEP"`` and ``"GUARD"`` on the worker's runner), which runs ``wrapper`` (via a
    #: trampoline) for the calls it does not take and ``post`` (the
    #: wrapper's second half) for the events its clean path declines
    fast: tuple[str, Callable] | None = None

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


#: (class, attribute, original, wrapper), in patching order
_patched: list[tuple[object, str, object, object]] = []
#: id of the code object of an owner-scoped engine method -> (code object,
#: (local name, attribute)).  Keyed by id: hashing a code object hashes its
#: bytecode, on every frame looked at.
OWNER_FRAMES: dict = {}
#: the same methods for the native reader: id -> (code object, index of the
#: local in the frame's fast locals, attribute or None, local name).  Changed
#: only through :func:`_register_owner` and :func:`uninstrument`, which tell
#: the reader (its cache in front of this dict: ``owners_changed``).
OWNER_SLOTS: dict = {}


def _owners_changed() -> None:
    if NATIVE is not None:
        NATIVE.owners_changed()


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


def native_hook(fn):
    """``fn`` if it is a ``kvsan._native._hookfast.Hook``, else None."""
    return fn if type(fn) is _HOOK_TYPE else None


def _trampoline(original, wrapper):
    get = original.__get__

    @functools.wraps(original)
    def patched(self, *args, **kwargs):
        return wrapper(get(self), self, args, kwargs)

    patched.__kvsan_patched__ = True
    return patched


#: the code object every trampoline runs (call-site lookups skip its frame)
TRAMPOLINE_CODE = _trampoline(lambda self: None, None).__code__
#: hook frames live in this directory (call-site lookups skip them too)
HOOKS_DIR = __file__.rsplit("/", 1)[0] + "/"
#: but for the built-in faults (``KVSAN_INJECT``): they stand in for engine
#: bugs, so their frames are the engine's (a report names the fault's site)
ENGINE_FILE = HOOKS_DIR + "vllm/faults.py"


def _is_kvsan_code(code) -> bool:
    return code is TRAMPOLINE_CODE or (code.co_filename.startswith(HOOKS_DIR)
                                       and code.co_filename != ENGINE_FILE)


def engine_frame(frame):
    """The innermost frame at or above ``frame`` that is not kvsan's patching
    (trampolines and hook functions, possibly several hooks on one method)."""
    while frame is not None and _is_kvsan_code(frame.f_code):
        frame = frame.f_back
    return frame


def _hook_key(wrapper) -> tuple:
    """What identifies a hook across calls of an adapter's ``targets()``:
    wrappers made by a factory are new closures each time, but share their
    module and qualified name."""
    return (getattr(wrapper, "__module__", None), getattr(wrapper, "__qualname__", repr(wrapper)))


def _wrap(owner, attr: str, wrapper, fast=None) -> None:
    """Patch ``owner.attr`` with ``wrapper`` (idempotent per hook; two
    adapters may each wrap one method: the later patch is the outer one).
    ``fast``: see :attr:`Target.fast`."""
    key = _hook_key(wrapper)
    if any(o is owner and a == attr and _hook_key(w) == key for o, a, _, w in _patched):
        return  # already applied (instrument() is idempotent)
    original = owner.__dict__[attr]
    if type(original) is type(_trampoline) and fast is not None and HOOKFAST is not None:
        slow = _trampoline(original, wrapper)
        hook = HOOKFAST.Hook(getattr(HOOKFAST, fast[0]), original, slow, fast[1],
                             attr)
        functools.update_wrapper(hook, original)
        hook.__kvsan_patched__ = True
        setattr(owner, attr, hook)
    elif type(original) is type(_trampoline) or native_hook(original) is not None:
        # a plain function, our trampoline or our native hook
        setattr(owner, attr, _trampoline(original, wrapper))
    else:
        wrapt.wrap_function_wrapper(owner, attr, wrapper)
    _patched.append((owner, attr, original, wrapper))


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
        owners = [cls] + [s for s in (_all_subclasses(cls) if t.subclasses else ())
                          if attr in s.__dict__]
        for c in owners:
            if t.owner is None or not _register_owner(c.__dict__[attr], t.owner):
                _wrap(c, attr, t.wrapper, t.fast)
        if t.name not in installed:  # (a method may be both an owner frame and wrapped)
            installed.append(t.name)
    return installed, missing


def _register_owner(fn, spec) -> bool:
    """Register a plain function's code as an owner frame (False: not a
    plain function; the caller wraps it instead)."""
    fn = getattr(fn, "__wrapped__", fn) if is_patched(fn) else fn
    code = getattr(fn, "__code__", None)
    if code is None or spec[0] not in code.co_varnames:
        return False
    OWNER_FRAMES[id(code)] = (code, spec)
    OWNER_SLOTS[id(code)] = (code, code.co_varnames.index(spec[0]), spec[1], spec[0])
    _owners_changed()
    return True


#: how far above an allocator call an owner frame is looked for (vLLM's
#: managers call the pool directly or through one or two helpers)
OWNER_DEPTH = 8


def owner_from_frames(frame) -> str | None:
    """The request the innermost owner frame at or above ``frame`` acts for."""
    codes = OWNER_FRAMES
    for _ in range(OWNER_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        entry = codes.get(id(code))
        if entry is not None and entry[0] is code:
            spec = entry[1]
            value = frame.f_locals.get(spec[0])
            if spec[1] is not None:
                value = getattr(value, spec[1], None)
            return value if isinstance(value, str) else None
        frame = frame.f_back
    return None


#: (id of code, f_lasti) -> (code, 'file.py:function:line'): call sites are
#: formatted once per code position.  Keyed by id: hashing a code object
#: hashes its bytecode and constants, and ``f_lineno`` walks the line table;
#: both are slow in vLLM's long scheduler methods.
SITES: dict = {}


def site_text(code, lasti: int) -> str:
    """'file.py:function:line' of instruction offset ``lasti`` of ``code``,
    memoised in :data:`SITES` (shared by the Python and native readers)."""
    line = None
    for start, end, ln in code.co_lines():
        if start <= lasti < end:
            line = ln
            break
    text = f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}:{line}"
    SITES[(id(code), lasti)] = (code, text)
    return text


def site_of(frame) -> str:
    """The call site of ``frame``'s current position ('?' for None)."""
    if frame is None:
        return "?"
    code = frame.f_code
    entry = SITES.get((id(code), frame.f_lasti))
    if entry is not None and entry[0] is code:
        return entry[1]
    return site_text(code, frame.f_lasti)


#: the native call-context reader (``kvsan._native._frames``) when in use, else None
NATIVE = None
#: the native clean-event path over the shadow table (``kvsan._native._shadowfast``)
#: when in use, else None (checkers of pools made while it is set use it)
SHADOWFAST = None
#: the native hooks (``kvsan._native._hookfast``) when in use, else None (methods
#: patched while it is set get them; see :attr:`Target.fast`)
HOOKFAST = None
#: the version of ``kvsan._native._hookfast``'s interface this code calls (its ``ABI``)
HOOKFAST_ABI = 13
#: the versions of ``kvsan._native._frames``' and ``kvsan._native._shadowfast``'s interfaces
FRAMES_ABI = 2
SHADOWFAST_ABI = 12
#: ``kvsan._native._hookfast.Hook`` once the module was loaded (hooks made while it
#: was in use stay installed when it is switched off)
_HOOK_TYPE = None


def use_native(on: bool = True) -> bool:
    """Use kvsan's C speed-ups (built with the package, CPython 3.10 to 3.13):
    ``kvsan._native._frames`` to read call contexts, ``kvsan._native._shadowfast`` for
    clean allocator events, ``kvsan._native._hookfast`` for the hottest BlockPool
    hooks (methods patched from now on), ``kvsan._native._tokenlinks`` for the identity
    audit's token chain and ``kvsan._native._devicefast`` for the device checks
    on host memory.  ``on`` False (``KVSAN_NATIVE=0``), or where they are
    unavailable, the pure-Python (numpy / torch) paths run; both give the
    same results.  Returns whether all are in use.

    Importing kvsan switches nothing on: :func:`kvsan.plugin.install` calls
    this (``KVSAN_NATIVE``, on by default), and so does code that makes
    checkers without installing kvsan and wants the C paths (tests,
    benchmarks)."""
    global NATIVE, SHADOWFAST, HOOKFAST, _HOOK_TYPE
    from .. import shadow
    from ..checks import identity, native

    NATIVE = SHADOWFAST = None
    shadow.HeldMap, shadow.Hold = shadow.PyHeldMap, shadow.PyHold
    if HOOKFAST is not None:  # hooks already installed send every call to Python
        HOOKFAST.flush_overhead()
        HOOKFAST.enable(False)
        HOOKFAST = None
    checks = identity.use_native(on) & native.use_devicefast(on)  # both, always
    adapter = sys.modules.get("kvsan.hooks.vllm.identity")
    if adapter is not None:  # (imported before: its chains' reaper follows the switch)
        adapter._refresh_make()
    if not on:
        return False
    frames = native.load("_frames", FRAMES_ABI)
    if frames is not None:
        frames.configure(TRAMPOLINE_CODE, HOOKS_DIR, SITES, site_text, OWNER_SLOTS, OWNER_DEPTH,
                         ENGINE_FILE)
        NATIVE = frames
    SHADOWFAST = native.load("_shadowfast", SHADOWFAST_ABI)
    if SHADOWFAST is not None:  # (the shadow tables made from now on keep their map in C)
        shadow.HeldMap, shadow.Hold = SHADOWFAST.HeldMap, SHADOWFAST.Hold
        for prop, member in _PROPERTY_SLOTS.values():
            if member is not None:
                SHADOWFAST.property_slot(prop, member)
    hookfast = native.load("_hookfast", HOOKFAST_ABI)
    if hookfast is not None and NATIVE is not None and SHADOWFAST is not None:
        hookfast.configure(vars(_runtime), NATIVE.context, pool_checker, guard_failed)
        if hookfast.runtime_changed not in _runtime._WATCHERS:  # (it keeps _runtime)
            _runtime._WATCHERS.append(hookfast.runtime_changed)
        HOOKFAST, _HOOK_TYPE = hookfast, hookfast.Hook
    return NATIVE is not None and SHADOWFAST is not None and HOOKFAST is not None and checks


def native_in_use() -> bool:
    """Whether any of kvsan's C paths is in use in this process."""
    from ..checks import identity, native

    return any(m is not None for m in (NATIVE, SHADOWFAST, HOOKFAST, native.DEVICEFAST,
                                       identity._links))


#: (class, attribute name) -> (property, member descriptor or None): see
#: :func:`property_slot`
_PROPERTY_SLOTS: dict = {}

#: instructions ``dis`` may list around ``return self.<name>`` that do
#: nothing (RESUME from 3.11 on, inline CACHE entries, NOP, EXTENDED_ARG)
_GETTER_SKIP = frozenset({"RESUME", "NOP", "CACHE", "EXTENDED_ARG"})


def _slot_getter(prop) -> str | None:
    """The attribute name ``prop``'s getter only returns (its code is
    ``return self.<name>`` and nothing else), else None."""
    import dis

    fget = getattr(prop, "fget", None)
    code = getattr(fget, "__code__", None)
    if (type(fget) is not type(_trampoline) or code is None or code.co_argcount != 1
            or code.co_kwonlyargcount or code.co_posonlyargcount or fget.__closure__):
        return None
    ops = [(i.opname, i.argval) for i in dis.get_instructions(code)
           if i.opname not in _GETTER_SKIP]
    if (len(ops) == 3 and ops[0] == ("LOAD_FAST", code.co_varnames[0])
            and ops[1][0] == "LOAD_ATTR" and ops[2] == ("RETURN_VALUE", None)):
        return ops[1][1]
    return None


def property_slot(cls, name: str):
    """The member descriptor (a ``__slots__`` entry) that property ``name`` of
    ``cls`` only returns, else None; where there is one and
    ``kvsan._native._shadowfast`` is in use, it reads the property as that slot.

    vLLM's ``KVCacheBlock.block_hash`` is ``@property def block_hash(self):
    return self._block_hash`` over a slot: read through the property, every
    read runs a Python frame.  Decided here, in Python: the getter's
    instructions are ``return self.<slot>`` (read with ``dis``), the slot is
    a member descriptor of ``cls``, and on a probe instance (made with
    ``object.__new__``, the slot set to a sentinel) the property returns
    that sentinel.  Anything else keeps the property."""
    key = (cls, name)
    if key in _PROPERTY_SLOTS:
        return _PROPERTY_SLOTS[key][1]
    import inspect

    prop = inspect.getattr_static(cls, name, None)
    member = None
    if type(prop) is property:
        attr = _slot_getter(prop)
        cand = inspect.getattr_static(cls, attr, None) if attr is not None else None
        if type(cand) is types.MemberDescriptorType:
            try:
                probe = object.__new__(cls)
                sentinel = object()
                cand.__set__(probe, sentinel)
                if prop.fget(probe) is sentinel:
                    member = cand
            except Exception:  # noqa: BLE001 - not a plain slot: keep the property
                member = None
    _PROPERTY_SLOTS[key] = (prop, member)
    if member is not None and SHADOWFAST is not None:
        SHADOWFAST.property_slot(prop, member)
    return member


def flush_overhead() -> None:
    """Add the time kept in ``kvsan._native._hookfast`` to its runtime's
    ``overhead_s``: call before reading it."""
    if HOOKFAST is not None:
        HOOKFAST.flush_overhead()


#: one-entry cache in front of ``rt.checkers`` (a WeakKeyDictionary, whose
#: lookup is a Python-level call): [runtime, weak ref to pool, checker]
_LAST: list = [None, None, None]


def pool_checker(pool):
    """(running kvsan runtime or None, the checker of ``pool`` or None)."""
    rt = _runtime._runtime
    if rt is None:
        return None, None
    last = _LAST
    if last[0] is rt and last[1]() is pool:
        return rt, last[2]
    ck = rt.checkers.get(pool)
    if ck is not None:
        _LAST[:] = [rt, weakref.ref(pool), ck]
    return rt, ck


def guard_failed(rt, where: str, exc: BaseException) -> None:
    """The except branch of a hook's guard: a violation (raise / abort
    modes) propagates; kvsan's own failure is counted and logged, and raised
    only outside ``log`` mode (:meth:`kvsan.report.Reporter.internal_error`)."""
    if isinstance(exc, KVSanViolation):
        raise exc
    rt.reporter.internal_error(where, exc)


def guard(rt, where: str, fn, *args, device: bool = False):
    """Run a check and return its result (None if it failed); kvsan's own
    exceptions are counted, violations raised only in raise/abort modes (the
    reporter decides).  The time spent is added to ``rt.overhead_s``
    (``kvsan_overhead_seconds_total``), and with ``device`` (the worker
    side's checks) to ``rt.device_s`` too, so the two sides' costs can be
    told apart in one run.  (Every adapter's hooks use it.)"""
    t0 = _perf_counter()
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - report first, never mask
        guard_failed(rt, where, e)  # a violation (raise / abort modes) propagates
        return None
    finally:
        dt = _perf_counter() - t0
        rt.overhead_s += dt
        if device:
            rt.device_s += dt


def owner_here(rt) -> str | None:
    """The request a pool call made from the caller's stack acts for."""
    ctx = rt.owner_ctx
    return ctx[-1][0] if ctx else owner_from_frames(sys._getframe(1))


def call_context(depth: int, owner_ctx: list) -> tuple[str, str | None] | None:
    """(call site, owner) of the engine frame at or above the frame
    ``depth`` levels above the caller: the owner is the innermost entry of
    ``owner_ctx``, else read from the innermost owner frame.  None when the
    stack is shallower than ``depth``."""
    native = NATIVE
    if native is not None:
        return native.context(depth + 1, owner_ctx)
    try:
        f = engine_frame(sys._getframe(depth + 1))
    except ValueError:
        return None
    return site_of(f), (owner_ctx[-1][0] if owner_ctx else owner_from_frames(f))


def call_site(depth: int) -> str:
    """The call site of the engine frame at or above ``depth`` levels above
    the caller."""
    native = NATIVE
    if native is not None:
        return native.site(depth + 1)
    try:
        return site_of(engine_frame(sys._getframe(depth + 1)))
    except ValueError:
        return "?"


def request_on_stack(frame, request_id: str):
    """The engine's Request object ``request_id`` held in a ``request``
    local at or above ``frame`` (for hooks whose method gets only the id)."""
    for _ in range(OWNER_DEPTH):
        if frame is None:
            return None
        if "request" in frame.f_code.co_varnames:
            request = frame.f_locals.get("request")
            if getattr(request, "request_id", None) == request_id:
                return request
        frame = frame.f_back
    return None


def uninstrument(targets: list[Target] | None = None) -> None:
    """Restore the original methods patched by :func:`instrument` (only
    those of ``targets`` when given) and forget their owner frames."""
    if targets is None:
        OWNER_FRAMES.clear()
        OWNER_SLOTS.clear()
        _owners_changed()
        while _patched:
            owner, attr, original, _ = _patched.pop()
            setattr(owner, attr, original)
        return
    keys = {_hook_key(t.wrapper) for t in targets}
    for i in range(len(_patched) - 1, -1, -1):
        owner, attr, original, wrapper = _patched[i]
        if _hook_key(wrapper) in keys:
            setattr(owner, attr, original)
            del _patched[i]


#: (module name, hook) of every post-import hook kvsan registered and that
#: has not run yet: :func:`forget_import_hooks` removes them
_IMPORT_HOOKS: list = []


def when_imported(hook, module: str) -> None:
    """Call ``hook(module)`` when ``module`` is imported, at once if it is
    (wrapt's post-import hooks; the only way kvsan registers one, so that
    :func:`forget_import_hooks` can take them all back)."""
    if sys.modules.get(module) is None:
        _IMPORT_HOOKS.append((module, hook))
    wrapt.register_post_import_hook(hook, module)


def forget_import_hooks() -> None:
    """Remove every post-import hook :func:`when_imported` registered that
    has not run (wrapt has no call for it: its registry, under its lock)."""
    from wrapt import importer

    lock = getattr(importer, "_post_import_hooks_lock", None)
    registry = getattr(importer, "_post_import_hooks", None)
    if lock is None or not isinstance(registry, dict):
        _IMPORT_HOOKS.clear()
        return
    with lock:
        while _IMPORT_HOOKS:
            module, hook = _IMPORT_HOOKS.pop()
            pending = registry.get(module)
            if pending and hook in pending:
                pending.remove(hook)
                if not pending:
                    del registry[module]


def bind_args(args: tuple, kwargs: dict, names: tuple[str, ...]) -> dict:
    """The leading parameters of a hooked call by name, whether vLLM passed
    them positionally or as keywords (read-only: an all-keyword call, vLLM's
    usual one, gets its own ``kwargs`` back rather than a copy)."""
    if not args:
        return kwargs
    vals = dict(zip(names, args))
    vals.update({k: kwargs[k] for k in names if k in kwargs})
    return vals
