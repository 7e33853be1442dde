"""vLLM #42125's residue (#48352, #45981; NeMo-RL #4018 and prime-rl #1650
are the weight-refit analogue): an adapter reloaded *in place*
(``load_inplace``, what ``/v1/load_lora_adapter`` with ``load_inplace=true``
sends) from its path rewritten with new weights keeps its name, id and
path, hence its block-hash key, so the next request is served prefix KV
computed with the old weights.  Present 0.30-0.34 (0.31's path fix does not
cover it); the control applies #48352's proposal (derived: the adapter
files' digest in the key).  Real engine, tiny model, LoRA on."""

import contextlib
import hashlib
import os
import tempfile

from .base import Entry, module_attr
from .engine import BS, differs, lora_engine, serve, write_adapter

ALL = ["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]
PREFIX = [(5 * i) % 500 + 3 for i in range(2 * BS)]


def _digest(path):
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        with open(os.path.join(path, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _fix(_version):
    import vllm.v1.core.kv_cache_utils as kcu

    orig = kcu._gen_lora_extra_hash_keys

    def keyed_by_content(request):
        keys = orig(request)
        lora = request.lora_request
        if lora and os.path.isdir(lora.lora_path):
            keys = keys + [("lora_identity", _digest(lora.lora_path))]
        return keys

    with module_attr(kcu, "_gen_lora_extra_hash_keys", keyed_by_content):
        yield


def trigger(run):
    from vllm.lora.request import LoRARequest

    with tempfile.TemporaryDirectory() as tmp, lora_engine() as llm:
        path = write_adapter(os.path.join(tmp, "sql"), seed=1)
        assert llm.llm_engine.add_lora(LoRARequest("sql", 21, path))
        a = serve(llm, [("A", PREFIX + [1], LoRARequest("sql", 21, path))], run)["A"]
        write_adapter(path, seed=2)  # retrained, written over the old files
        assert llm.llm_engine.add_lora(LoRARequest("sql", 21, path, load_inplace=True))

        def hit(blocks):
            shared = sorted(set(blocks["B"][:2]) & set(a[2][:2]))
            if shared:
                run.fault(shared, ["A", "B"])

        b = serve(llm, [("B", PREFIX + [2], LoRARequest("sql", 21, path))], run, hit)["B"]
        assert llm.reset_prefix_cache()
        ref = serve(llm, [("Bref", PREFIX + [2], LoRARequest("sql", 21, path))])["Bref"]
        why = differs(b, ref)
        if why:
            run.harm(f"B after the in-place reload: {why} (prefix KV of the old weights)")


ENTRY = Entry(
    id="lora-inplace-reload", upstream="#42125 residue (#48352)",
    title="adapter reloaded in place keeps its prefix-cache identity",
    kind_class="bad cache key (stale weights)", releases=ALL, native=ALL, level="engine",
    expected_kinds=["cache_key_mismatch"],
    where="vllm/v1/core/kv_cache_utils.py::_gen_lora_extra_hash_keys",
    revert_how="present (unmodified)",
    harm_what="output differs from the uncached reference",
    trigger=trigger, fix=_fix,
)
