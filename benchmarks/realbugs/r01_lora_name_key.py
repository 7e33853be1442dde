"""vLLM #30931 / #42125: the LoRA part of a block hash was the adapter's
name only, so a request for the same name at another adapter path (another
``lora_int_id``, or a runtime ``load_lora_adapter`` re-pointing the name) hits
KV computed with the other adapter.  Introduced by #27211; 0.31 keys LoRA by
``("lora", name, path)``."""

from .base import Entry, module_attr
from .drive import block_ids, manager, request, serve, tokens

PROMPT = tokens(1, 3 * 16 + 4)


def _pre_fix(request):  # 0.30.0's body (the exact lines of the 0.30 -> 0.31 hunk)
    if not request.lora_request:
        return []
    return [request.lora_request.lora_name]


def _post_fix(request):  # 0.31.0's body
    lora_request = request.lora_request
    if not lora_request:
        return []
    return [("lora", lora_request.lora_name, lora_request.lora_path)]


def _kcu():
    import vllm.v1.core.kv_cache_utils as kcu

    return kcu


def trigger(run):
    from vllm.lora.request import LoRARequest

    m = manager(24)
    a = request("A", PROMPT, lora_request=LoRARequest("tenant", 1, "/adapters/tenant-v1"))
    serve(m, a)
    b = request("B", PROMPT, lora_request=LoRARequest("tenant", 2, "/adapters/tenant-v2"))
    hit = serve(m, b)
    shared = sorted(set(block_ids(m, "A")) & set(block_ids(m, "B")))
    if hit:
        run.fault(shared, ["A", "B"])
        run.harm(f"B (adapter path tenant-v2) served {hit} prompt tokens of KV computed "
                 f"with tenant-v1 (blocks {shared})")


ENTRY = Entry(
    id="lora-name-key", upstream="#30931/#42125", title="LoRA block-hash identity is the name only",
    kind_class="bad cache key", releases=["0.30.0"], native=["0.30.0"], level="scheduler",
    expected_kinds=["cache_key_mismatch"],
    where="vllm/v1/core/kv_cache_utils.py::_gen_lora_extra_hash_keys",
    revert_how="exact hunk (0.30 body)",
    harm_what="prefix hit on KV computed with another adapter",
    trigger=trigger,
    revert=lambda v: module_attr(_kcu(), "_gen_lora_extra_hash_keys", _pre_fix),
    fix=lambda v: module_attr(_kcu(), "_gen_lora_extra_hash_keys", _post_fix),
)
