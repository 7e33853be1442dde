"""kvsan: a runtime sanitizer for the KV cache of vLLM.

Switch it on with ``KVSAN=1`` (vLLM loads it through ``vllm.general_plugins``);
see the README for the other variables.
"""

from .config import ABORT_EXIT_CODE, Config, ConfigError
from .kinds import ALL_KINDS
from .report import KVSanViolation, Violation

__version__ = "0.1.0"


def current_runtime():
    """This process's kvsan runtime, or None when kvsan is off."""
    from . import runtime as _rt

    return _rt.get()


__all__ = [
    "ABORT_EXIT_CODE",
    "ALL_KINDS",
    "Config",
    "ConfigError",
    "KVSanViolation",
    "Violation",
    "current_runtime",
    "__version__",
]
