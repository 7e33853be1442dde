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


def owners_from_llm(llm) -> list:
    """``kvsan owners`` from a ``vllm.LLM``: one snapshot of who holds the
    KV blocks, taken inside its EngineCore between two steps."""
    from .hooks.vllm.owners import from_llm

    return from_llm(llm)


__all__ = [
    "ABORT_EXIT_CODE",
    "ALL_KINDS",
    "Config",
    "ConfigError",
    "KVSanViolation",
    "Violation",
    "current_runtime",
    "owners_from_llm",
    "__version__",
]
