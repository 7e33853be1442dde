"""Weight and adapter changes on the real engine (in-process, the tiny
model, LoRA on): a prefix hit on KV computed under other weights or another
adapter version is ``cache_key_mismatch`` naming the field; the same change
followed by ``reset_prefix_cache()``, a weight-neutral RPC and one adapter
under two names are clean.  kvsan learns of weight changes from the weights
themselves (``kvsan.hooks.vllm.weights``), whatever the RPC is called."""

import gc
import json
import os

import pytest
import torch

from conftest import core
from kvsan.config import Config

pytestmark = pytest.mark.e2e

BS = 32
PREFIX = [(5 * i) % 500 + 3 for i in range(2 * BS)]
RANK = 8


@pytest.fixture(scope="module")
def engine(kvsan_rt):
    from vllm import LLM

    from kvsan.harness import traffic
    from kvsan.harness.tinymodel import ensure_tiny_model

    kvsan_rt.config = kvsan_rt.reporter.config = Config(enabled=True, log_events=False)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kw = traffic.engine_kwargs(ensure_tiny_model(), num_blocks=24)
    kw.update(max_num_seqs=4, max_model_len=320, enable_lora=True, max_lora_rank=RANK,
              max_loras=2)
    llm = LLM(**kw)
    yield llm
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    llm.llm_engine.engine_core.shutdown()
    from kvsan.hooks.vllm import worker as vllm_worker

    vllm_worker.forget_runner()
    del llm
    gc.collect()


def model(llm):
    return core(llm).model_executor.driver_worker.worker.model_runner.get_model()


def run(llm, rid, prompt, lora=None):
    """Serve ``rid`` to the end; its internal id and its first two blocks."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    p = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), p,
                               lora_request=lora)
    llm.llm_engine.step()
    sched = core(llm).scheduler
    full = next(r for r in sched.requests if r == rid or r.startswith(rid + "-"))
    blocks = sched.kv_cache_manager.get_block_ids(full)[0][:2]
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    return full, blocks


def mismatches(rt):
    return [v for v in rt.violations() if v.kind == "cache_key_mismatch"]


def assert_stale_hit(rt, field, producer, consumer):
    """B was served A's two prefix blocks, each reported naming ``field``."""
    (a, a_blocks), (b, _) = producer, consumer
    bad = mismatches(rt)
    assert sorted(v.blocks[0] for v in bad) == sorted(a_blocks), bad
    for v in bad:
        assert v.details[0]["fields"] == [field]
        assert v.actor == b and v.owners == sorted({a, b})
    assert [v.kind for v in rt.violations()] == ["cache_key_mismatch"] * 2


def norm(m):
    """Layer 0's input norm: its weights scale what every layer's K and V
    are computed from.  (vLLM's CPU backend packs the linear layers'
    weights into oneDNN handles and empties their parameters: a norm and
    the embeddings are the weights a trainer can still change in place
    there.)"""
    return dict(m.named_parameters())["model.layers.0.input_layernorm.weight"]


def nudge(worker, scale):
    """A callable RPC: change one tensor's weights in place (what a
    trainer's weight sync does under whatever name it uses)."""
    m = worker.model_runner.get_model()
    with torch.no_grad():
        norm(m).mul_(scale)
    return True


def peek(worker):
    """A weight-neutral callable RPC."""
    return float(norm(worker.model_runner.get_model()).sum())


def test_weights_changed_by_a_callable_rpc_without_reset(eng, rt):
    a = run(eng, "A", PREFIX + [1])
    assert eng.collective_rpc(nudge, args=(1.5,)) == [True]
    b = run(eng, "B", PREFIX + [2])
    assert_stale_hit(rt, "weights_epoch", a, b)
    eng.collective_rpc(nudge, args=(1 / 1.5,))


def test_weights_changed_then_reset_is_clean(eng, rt):
    from kvsan.hooks.vllm import identity as vllm_identity

    run(eng, "A", PREFIX + [1])
    before = vllm_identity.weights_epoch()
    eng.collective_rpc(nudge, args=(0.5,))
    assert vllm_identity.weights_epoch() == before + 1
    assert eng.reset_prefix_cache()
    # the same blocks cached again under the new weights, then hit
    run(eng, "A2", PREFIX + [3])
    run(eng, "B", PREFIX + [2])
    assert rt.violations() == []
    eng.collective_rpc(nudge, args=(2.0,))


def test_weights_loaded_in_process_without_any_rpc(eng, rt):
    """``load_weights`` on the model object, no RPC: the quick fingerprint
    taken when the engine turns busy again sees it."""
    a = run(eng, "A", PREFIX + [1])
    m = model(eng)
    name = "model.layers.0.input_layernorm.weight"
    old = norm(m).detach().clone()
    new = torch.rand(old.shape, generator=torch.Generator().manual_seed(1)) + 0.5
    m.load_weights([(name, new)])  # vLLM's own loader, as a trainer's script calls it
    assert torch.equal(norm(m), new)
    b = run(eng, "B", PREFIX + [2])
    assert_stale_hit(rt, "weights_epoch", a, b)
    m.load_weights([(name, old)])


def test_weight_neutral_rpcs_start_no_epoch(eng, rt):
    from kvsan.hooks.vllm import identity as vllm_identity

    run(eng, "A", PREFIX + [1])
    before = vllm_identity.weights_epoch()
    eng.collective_rpc(peek)
    eng.collective_rpc("get_model")
    assert vllm_identity.weights_epoch() == before
    run(eng, "B", PREFIX + [2])
    assert rt.violations() == []
    assert next(iter(vllm_identity._audits.values())).checked > 0


# ------------------------------------------------------------------ LoRA
def write_adapter(path, seed):
    """A rank-8 adapter on q_proj and v_proj of the tiny model, by hand (no
    hub, no peft): what vLLM loads from a directory."""
    from safetensors.torch import save_file

    from kvsan.harness.tinymodel import ensure_tiny_model

    with open(os.path.join(ensure_tiny_model(), "config.json")) as f:
        cfg = json.load(f)
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = hidden // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj, out in (("q_proj", hidden), ("v_proj", kv)):
            pre = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(RANK, hidden, generator=g) * 0.1
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.1
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": 16,
                   "target_modules": ["q_proj", "v_proj"], "bias": "none",
                   "base_model_name_or_path": "tiny"}, f)
    return path


def test_adapter_reloaded_under_the_same_name_with_other_weights(eng, rt, tmp_path):
    """vLLM keys a LoRA by (name, path): new files at the same path, loaded
    again (same name, id and path; no ``add_lora``) share the old adapter's
    prefix KV."""
    from vllm.lora.request import LoRARequest

    path = write_adapter(str(tmp_path / "sql"), seed=1)
    a = run(eng, "A", PREFIX + [1], LoRARequest("sql", 1, path))
    assert eng.llm_engine.remove_lora(1)
    write_adapter(path, seed=2)  # retrained, written over the old files
    b = run(eng, "B", PREFIX + [2], LoRARequest("sql", 1, path))
    assert_stale_hit(rt, "lora", a, b)


@pytest.mark.parametrize("same_stat", [False, True], ids=["new_files", "same_size_and_mtime"])
def test_adapter_reloaded_in_place_with_other_weights(eng, rt, tmp_path, same_stat):
    """vLLM #42125's residue: an adapter loaded again in place
    (``load_inplace``, what ``/v1/load_lora_adapter`` with
    ``load_inplace=true`` sends) from its path rewritten with other weights
    keeps its name, id and path, so its key; the KV cached before the reload
    was computed with the old weights.  Files rewritten with their size and
    modification time kept are read again at the load all the same."""
    from vllm.lora.request import LoRARequest

    path = write_adapter(str(tmp_path / "sql"), seed=1)
    assert eng.llm_engine.add_lora(LoRARequest("sql", 21, path))
    a = run(eng, "A", PREFIX + [1], LoRARequest("sql", 21, path))
    files = os.path.join(path, "adapter_model.safetensors")
    st = os.stat(files)
    write_adapter(path, seed=2)  # retrained, written over the old files
    if same_stat:
        os.utime(files, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(files).st_size == st.st_size
    assert eng.llm_engine.add_lora(LoRARequest("sql", 21, path, load_inplace=True))
    b = run(eng, "B", PREFIX + [2], LoRARequest("sql", 21, path))
    assert_stale_hit(rt, "lora", a, b)


def test_adapter_files_rewritten_without_a_reload_are_clean(eng, rt, tmp_path):
    """Files rewritten under a loaded adapter change nothing the workers
    compute with until it is loaded again: a hit on its earlier KV is right."""
    from vllm.lora.request import LoRARequest

    path = write_adapter(str(tmp_path / "kept"), seed=4)
    run(eng, "A", PREFIX + [1], LoRARequest("kept", 22, path))
    write_adapter(path, seed=5)
    assert eng.llm_engine.add_lora(LoRARequest("kept", 22, path))  # loaded: kept as it is
    run(eng, "B", PREFIX + [2], LoRARequest("kept", 22, path))
    assert rt.violations() == []
    assert eng.llm_engine.remove_lora(22)


def test_one_adapter_under_two_names_or_ids_is_clean(eng, rt, tmp_path):
    from vllm.lora.request import LoRARequest

    path = write_adapter(str(tmp_path / "chat"), seed=3)
    run(eng, "A", PREFIX + [1], LoRARequest("chat", 3, path))
    run(eng, "B", PREFIX + [2], LoRARequest("chat", 4, path))  # another id: a prefix hit
    run(eng, "C", PREFIX + [3], LoRARequest("assistant", 5, path))  # another name: no hit
    assert rt.violations() == []


def test_a_wake_up_that_leaves_the_weights_asleep_costs_no_fingerprint(monkeypatch):
    """``wake_up(tags=["kv_cache"])`` (what ``release_kv_cache_memory``
    undoes) cannot change weights; a wake-up of the weights, or of
    everything, may."""
    from kvsan.hooks.vllm import weights as vllm_weights

    calls = []
    monkeypatch.setattr(vllm_weights, "_guarded", lambda why, inst, **kw: calls.append(why))
    for args, kwargs in (((), {"tags": ["kv_cache"]}), ((["scheduling"],), {}),
                         ((), {}), ((), {"tags": ["weights"]}), ((None,), {})):
        vllm_weights._wake_up(lambda *a, **k: True, object(), args, kwargs)
    assert calls == ["wake_up"] * 3


def test_an_executor_answer_that_is_not_one_per_rank_is_no_fingerprint():
    from kvsan.hooks.vllm.weights import _combine

    assert _combine(object()) == (None, None)
    assert _combine([(b"q", b"f"), None]) == (None, None)
    assert _combine([[b"q", None], (b"r", b"g")]) == (b"qr", None)
