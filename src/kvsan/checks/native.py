"""Which of kvsan's optional C modules the checks use.

Kept apart from the checks themselves so that choosing (``KVSAN_NATIVE``,
:func:`kvsan.hooks.use_native`) imports nothing heavy: the device checks
import torch, and the allocator-side processes must not pay for it.
"""

from __future__ import annotations

import importlib

#: ``kvsan._native._devicefast`` (the device checker's write guard and checksums
#: over host memory in C, same results) when in use, else None.  Read when a
#: :class:`kvsan.checks.device.DeviceChecker` is made.  None until
#: :func:`use_devicefast` (:func:`kvsan.hooks.use_native`, which
#: ``kvsan.plugin.install`` calls) switches it on: importing switches nothing.
DEVICEFAST = None
#: the version of ``kvsan._native._devicefast``'s interface this code calls (its ``ABI``)
DEVICEFAST_ABI = 6


def load(name: str, abi: int):
    """``kvsan.<name>`` if it was built from this version of its source for
    this Python, else None."""
    try:
        mod = importlib.import_module(f"kvsan._native.{name}")
    except ImportError:
        return None
    if getattr(mod, "ABI", None) != abi or not getattr(mod, "AVAILABLE", 1):
        return None
    return mod


def use_devicefast(on: bool = True) -> bool:
    """Device checkers made from now on use ``kvsan._native._devicefast`` (``on``
    False: numpy and torch only).  Returns whether it is in use."""
    global DEVICEFAST
    DEVICEFAST = load("_devicefast", DEVICEFAST_ABI) if on else None
    return DEVICEFAST is not None
