"""The adapters a worker step activates, checked against its requests'
own (:mod:`kvsan.checks.adapters`): vLLM's V1 runner side.

``LoRAModelRunnerMixin._set_active_loras(prompt_lora_mapping,
token_lora_mapping, lora_requests)`` is where a step's adapters are
activated: the mapping says which adapter id each request's sampled
tokens use, ``lora_requests`` what the LoRA manager activates.  The set is
built by vLLM's ``LoRARequest`` equality, so two versions of one name that
compare equal leave one of them out (issue #30931's "option 2", 0.30-0.33).
The check reads the ids, names and paths themselves, never that equality.
Called once per step with LoRA on (and for dummy runs, whose mapping and
adapters agree); a request count's work.
"""

from __future__ import annotations

from ... import runtime as _rt
from ...checks.adapters import adapter_findings
from .. import Target
from .. import guard as _guard

_MIXIN = "vllm.v1.worker.lora_model_runner_mixin"
SITE = "lora_model_runner_mixin.py:_set_active_loras"


def _set_active_loras(wrapped, instance, args, kwargs):
    rt = _rt._runtime
    if rt is not None:
        _guard(rt, "adapters", check_step, rt, instance,
               args[0] if args else kwargs.get("prompt_lora_mapping"),
               args[2] if len(args) > 2 else kwargs.get("lora_requests"))
    return wrapped(*args, **kwargs)


def _own(lr) -> tuple[str, str] | None:
    return None if lr is None else (lr.lora_name, lr.lora_path)


def check_step(rt, runner, mapping, lora_requests) -> None:
    if not mapping:
        return
    wanted = set(mapping)
    if wanted <= {0}:
        return
    batch = getattr(runner, "input_batch", None)
    rows = []
    if batch is not None:
        by_id = getattr(batch, "lora_id_to_lora_request", {}) or {}
        n = batch.num_reqs
        for rid, aid in zip(batch.req_ids[:n], batch.request_lora_mapping[:n].tolist()):
            if aid:
                rows.append((rid, aid, _own(by_id.get(aid))))
    active = [(lr.lora_int_id, lr.lora_name, lr.lora_path) for lr in lora_requests or ()]
    for v in adapter_findings(wanted, rows, active, rt.step, SITE):
        rt.reporter.emit(v)


def targets() -> list[Target]:
    return [Target(_MIXIN, "LoRAModelRunnerMixin._set_active_loras", _set_active_loras)]


#: what it reads of vLLM (part of the V1 runner's contract, worker.CONTRACT)
ATTRS = {
    "vllm.v1.worker.gpu_input_batch:InputBatch":
        ("req_ids", "num_reqs", "request_lora_mapping", "lora_id_to_lora_request"),
    "vllm.lora.request:LoRARequest": ("lora_int_id", "lora_name", "lora_path"),
}
