"""``LoRARequest.__eq__``/``__hash__`` by name only (issue #30931's "option
2"; fixed in 0.34, whose docstring gives the reason: "A name loaded again at
runtime gets a new lora_int_id while requests for the old one may still be
running, and the engine needs both adapters active").  Two requests in one
batch with the same adapter name and different ids collapse into one entry
of the worker's set of active adapters: one of them runs without its own
adapter.  0.30-0.33 ship it; on 0.34 the entry reverts the exact hunk.  The
cache keys are right (name and path differ), so the KV is keyed correctly
but computed with the wrong adapter.  Real engine, tiny model, LoRA on."""

import contextlib
import os
import tempfile

from .base import Entry
from .engine import BS, differs, lora_engine, serve, write_adapter

P1 = [(7 * i) % 500 + 3 for i in range(BS + 5)]
P2 = [(11 * i) % 500 + 5 for i in range(BS + 5)]


def _by_name_eq(self, value):
    return isinstance(value, self.__class__) and self.lora_name == value.lora_name


def _by_name_hash(self):
    return hash(self.lora_name)


def _by_name_and_id_eq(self, value):
    return (isinstance(value, self.__class__) and self.lora_name == value.lora_name
            and self.lora_int_id == value.lora_int_id)


def _by_name_and_id_hash(self):
    return hash((self.lora_name, self.lora_int_id))


@contextlib.contextmanager
def _methods(eq, hash_):
    from vllm.lora.request import LoRARequest

    old = LoRARequest.__dict__["__eq__"], LoRARequest.__dict__["__hash__"]
    LoRARequest.__eq__, LoRARequest.__hash__ = eq, hash_
    try:
        yield
    finally:
        LoRARequest.__eq__, LoRARequest.__hash__ = old


def trigger(run):
    from vllm.lora.request import LoRARequest

    with tempfile.TemporaryDirectory() as tmp, lora_engine() as llm:
        old = LoRARequest("tenant", 31, write_adapter(os.path.join(tmp, "v1"), seed=7))
        new = LoRARequest("tenant", 32, write_adapter(os.path.join(tmp, "v2"), seed=8))
        try:
            got = serve(llm, [("X", P1, old), ("Y", P2, new)], run)  # one batch
        except (KeyError, RuntimeError, AssertionError) as e:  # the engine's step failed
            run.fault([], ["X", "Y"])
            run.harm(f"the step batching both versions of 'tenant' fails: "
                     f"{type(e).__name__}: {e}")
            return
        assert llm.reset_prefix_cache()
        ref_x = serve(llm, [("Xref", P1, old)])["Xref"]
        assert llm.reset_prefix_cache()
        ref_y = serve(llm, [("Yref", P2, new)])["Yref"]
        for rid, ref in (("X", ref_x), ("Y", ref_y)):
            why = differs(got[rid], ref)
            if why:
                run.fault(got[rid][2], [rid])
                run.harm(f"{rid} batched beside the other version of 'tenant': {why} "
                         f"(run alone)")


ENTRY = Entry(
    id="lora-request-identity", upstream="#30931 (option 2; fixed in 0.34)",
    title="LoRARequest equal by name: two adapter versions in one batch collapse",
    kind_class="identity (adapter conflation)",
    releases=["0.30.0", "0.31.0", "0.32.0", "0.33.0"],
    native=["0.30.0", "0.31.0", "0.32.0", "0.33.0"], level="engine",
    expected_kinds=["adapter_mismatch"],
    where="vllm/lora/request.py::LoRARequest.__eq__/__hash__",
    revert_how="exact hunk (0.33 methods)",
    harm_what="a request computed with another adapter than its own",
    trigger=trigger, revertable=["0.34.0"],
    revert=lambda v: _methods(_by_name_eq, _by_name_hash),
    fix=lambda v: _methods(_by_name_and_id_eq, _by_name_and_id_hash),
)
