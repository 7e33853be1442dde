"""vLLM #44701: a block hash's extra keys were untagged strings, so a LoRA
adapter named like another tenant's ``cache_salt`` shares that tenant's
first block (confirmed on an A100 in the issue).  0.31 tags every extra key
(``("lora", name, path)``, ``("cache_salt", salt)``, ``("mm", ...)``)."""

import contextlib

from .base import Entry, module_attr, rebuilt
from .drive import block_ids, manager, request, serve, tokens
from .r01_lora_name_key import _kcu, _pre_fix as _lora_pre_fix

PROMPT = tokens(2, 3 * 16 + 4)


@contextlib.contextmanager
def _revert(_version):
    kcu = _kcu()
    untagged = rebuilt(kcu.generate_block_hash_extra_keys, [
        ('[("cache_salt", request.cache_salt)]', "[request.cache_salt]")])
    with module_attr(kcu, "_gen_lora_extra_hash_keys", _lora_pre_fix), \
            module_attr(kcu, "generate_block_hash_extra_keys", untagged):
        yield


@contextlib.contextmanager
def _fix(_version):
    from .r01_lora_name_key import _post_fix

    kcu = _kcu()
    tagged = rebuilt(kcu.generate_block_hash_extra_keys, [
        ("[request.cache_salt] if", '[("cache_salt", request.cache_salt)] if')])
    with module_attr(kcu, "_gen_lora_extra_hash_keys", _post_fix), \
            module_attr(kcu, "generate_block_hash_extra_keys", tagged):
        yield


def trigger(run):
    from vllm.lora.request import LoRARequest

    m = manager(24)
    a = request("A", PROMPT, lora_request=LoRARequest("COLLIDE", 1, "/adapters/collide"))
    serve(m, a)
    b = request("B", PROMPT, cache_salt="COLLIDE")
    hit = serve(m, b)
    shared = sorted(set(block_ids(m, "A")) & set(block_ids(m, "B")))
    if hit:
        run.fault(shared, ["A", "B"])
        run.harm(f"B (no adapter, cache_salt COLLIDE) served {hit} tokens of KV computed "
                 f"with adapter COLLIDE (blocks {shared})")


ENTRY = Entry(
    id="lora-salt-collision", upstream="#44701", title="untagged extra keys: LoRA name = cache_salt",
    kind_class="bad cache key", releases=["0.30.0"], native=["0.30.0"], level="scheduler",
    expected_kinds=["cache_key_mismatch"],
    where="vllm/v1/core/kv_cache_utils.py::generate_block_hash_extra_keys",
    revert_how="exact hunks (0.30 lines: untagged salt, name-only LoRA key)",
    harm_what="a base-model tenant's hit on KV computed with an adapter",
    trigger=trigger, revert=_revert, fix=_fix,
)
