"""The real-bug corpus: upstream vLLM KV-cache bugs re-created on the
installed release (the fix reverted at run time, or the release as shipped
where it still carries the bug), each with a deterministic trigger, the harm
it does with kvsan off, kvsan's verdict with kvsan on and a control on the
fixed code.  ``python -m benchmarks.realbugs [--json PATH] [ID ...]``;
docs/realbugs.md.

``ENTRIES``: id -> :class:`~benchmarks.realbugs.base.Entry` (``id``,
``upstream``, ``kind_class``, ``releases``, ``level``, ``expected_kinds``,
``buggy()``, ``fixed()``, ``applies_to(version)``)."""

from __future__ import annotations

import importlib

from .base import Entry

MODULES = [
    "r01_lora_name_key",
    "r02_lora_salt_collision",
    "r03_negative_block_count",
    "r04_async_consumer_free",
    "r05_delayed_free_idle",
    "r06_session_stale_hashes",
    "r07_swa_optimistic_free",
    "r08_abort_during_async_load",
    "r09_spec_async_load_deadlock",
    "r10_lora_inplace_reload",
    "r11_lora_request_identity",
    "r12_finished_zombie_rows",
    "r13_stranded_kv_holders",
    "r14_mooncake_store_preempt",
    "r15_abort_dual_completion",
    "n01_stale_partial_hash",
]

ENTRIES: dict[str, Entry] = {}
for _name in MODULES:
    _e = importlib.import_module(f"{__name__}.{_name}").ENTRY
    ENTRIES[_e.id] = _e

__all__ = ["ENTRIES", "Entry"]
