"""Cache identity audit against vLLM's real KVCacheManager, BlockPool,
Requests and block hasher: each cache-key bug is injected into vLLM's hash
inputs, and kvsan must name the differing field; with correct keys it stays
silent, and a use-after-free is classified as corruption, not a key bug."""

import functools

import pytest

from conftest import SPEEDUPS, SPEEDUPS_WHY, kinds_of
from vllm_objects import BLOCK, make_manager

pytestmark = pytest.mark.engine

TOKENS = list(range(1, 3 * BLOCK + 5))


def request(rid, tokens=TOKENS, **kw):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from vllm_objects import _hasher

    return Request(request_id=rid, prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                   block_hasher=_hasher, **kw)


def lora(name, int_id, path="/adapters/x"):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, int_id, path)


def serve(m, r):
    computed, hit = m.get_computed_blocks(r)[:2]
    assert m.allocate_slots(r, r.num_tokens - hit, hit, computed) is not None
    r.num_computed_tokens = r.num_tokens
    return hit


def mismatches(rt):
    return [v for v in rt.violations() if v.kind == "cache_key_mismatch"]


def producer_then_consumer(a, b):
    m = make_manager(24)
    serve(m, a)
    hit = serve(m, b)
    return m, hit


@pytest.fixture
def kcu(monkeypatch):
    import vllm.v1.core.kv_cache_utils as kcu

    # rebuild hashes with the patched functions: they are module globals
    return kcu


@pytest.fixture(autouse=True, params=[True, False], ids=["native", "python"])
def native(request, rt):
    """Every scenario with kvsan's C paths (the default) and with the Python
    ones (KVSAN_NATIVE=0): both must find the same mismatches."""
    from kvsan import hooks

    hooks.use_native(request.param)
    yield request.param
    hooks.use_native(rt.config.native)


def fields_of(rt):
    return {tuple(v.details[0]["fields"]) for v in mismatches(rt)}


def test_lora_left_out_of_block_hash(rt, kcu, monkeypatch):
    monkeypatch.setattr(kcu, "_gen_lora_extra_hash_keys", lambda r: [])
    m, hit = producer_then_consumer(request("A", lora_request=lora("sql", 1, "/a/sql")),
                                    request("B", lora_request=lora("chat", 2, "/a/chat")))
    assert hit == 3 * BLOCK
    bad = mismatches(rt)
    assert len(bad) == 3 and fields_of(rt) == {("lora",)}
    assert bad[0].owners == ["A", "B"] and bad[0].actor == "B"
    assert bad[0].blocks == [m.get_block_ids("A")[0][0]]


def test_two_adapters_same_name_different_ids(rt):
    # vLLM keys LoRA by (name, path): a re-registered adapter under the same
    # name and path but another id shares the prefix
    m, hit = producer_then_consumer(request("A", lora_request=lora("sql", 1)),
                                    request("B", lora_request=lora("sql", 7)))
    assert hit == 3 * BLOCK
    assert fields_of(rt) == {("lora",)}


def adapter(path, content: bytes) -> str:
    """An adapter directory at ``path`` whose weights file holds ``content``."""
    import os

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(content)
    return str(path)


def add_lora(lr) -> None:
    """What ``EngineCore.add_lora`` does under kvsan once the workers took it."""
    from kvsan.hooks.vllm import identity as vllm_identity

    vllm_identity._add_lora(lambda *a, **k: True, None, (lr,), {})


def test_an_adapter_loaded_again_under_a_new_id_is_its_own_load(rt, tmp_path):
    """A name loaded again (a new id, its path rewritten meanwhile) while KV
    of the old load is cached: vLLM keys both by (name, path), so the new
    load is served the old one's KV.  Up to vLLM 0.33 the two LoRARequests
    are equal (by name): kvsan keys each load by name, id and path."""
    path = adapter(tmp_path / "sql", b"v1" * 64)
    a = request("A", lora_request=lora("sql", 31, path))
    m = make_manager(24)
    serve(m, a)
    adapter(tmp_path / "sql", b"v2" * 64)  # retrained in place, then loaded under a new id
    b = request("B", lora_request=lora("sql", 32, path))
    assert serve(m, b) == 3 * BLOCK
    bad = mismatches(rt)
    assert len(bad) == 3 and fields_of(rt) == {("lora",)}
    assert bad[0].blocks == [m.get_block_ids("A")[0][0]] and bad[0].actor == "B"


def test_files_rewritten_under_a_loaded_adapter_until_it_is_loaded_in_place(rt, tmp_path):
    """Rewritten files change nothing the workers compute with until the
    adapter is loaded again in place (``load_inplace``): a hit before that
    is right, one after it is served KV of the old weights."""
    from vllm.lora.request import LoRARequest

    path = adapter(tmp_path / "chat", b"v1" * 64)
    m = make_manager(32)
    serve(m, request("A", lora_request=lora("chat", 33, path)))
    adapter(tmp_path / "chat", b"v2" * 64)
    assert serve(m, request("B", lora_request=lora("chat", 33, path))) == 3 * BLOCK
    assert kinds_of(rt) == []
    add_lora(LoRARequest("chat", 33, path))  # already loaded: the workers keep it
    assert serve(m, request("C", lora_request=lora("chat", 33, path))) == 3 * BLOCK
    assert kinds_of(rt) == []
    add_lora(LoRARequest("chat", 33, path, load_inplace=True))
    assert serve(m, request("D", lora_request=lora("chat", 33, path))) == 3 * BLOCK
    assert len(mismatches(rt)) == 3 and fields_of(rt) == {("lora",)}
    assert {v.actor for v in mismatches(rt)} == {"D"}


def _tagged(kcu) -> bool:
    """Whether the installed vLLM tags the extra keys of its block hashes
    (``("cache_salt", salt)``, ``("lora", name, path)``): 0.31 on.  vLLM 0.30
    puts the bare salt and LoRA name in the key, without the adapter's path."""
    keys, _ = kcu.generate_block_hash_extra_keys(request("probe", cache_salt="s"), 0, BLOCK, 0)
    return bool(keys) and isinstance(keys[0], tuple) and keys[0][:1] == ("cache_salt",)


def test_lora_name_colliding_with_cache_salt(rt, kcu, monkeypatch):
    """Untagged extra keys: a LoRA named like another request's cache salt
    shares its first block.  Injected where vLLM tags its keys; vLLM 0.30's
    own keys are untagged, and kvsan reports the collision there as it is."""
    if not _tagged(kcu):
        m, hit = producer_then_consumer(request("A", lora_request=lora("tenant", 1)),
                                        request("B", cache_salt="tenant"))
        assert hit > 0
        assert fields_of(rt) == {("lora", "cache_salt")}
        return
    original = kcu.generate_block_hash_extra_keys

    def untagged(request, start, end, mm_idx):  # extra keys flattened without tags
        keys, nxt = original(request, start, end, mm_idx)
        if not keys:
            return keys, nxt
        return tuple(k[1] for k in keys), nxt

    monkeypatch.setattr(kcu, "generate_block_hash_extra_keys", untagged)
    monkeypatch.setattr(kcu, "_gen_lora_extra_hash_keys",
                        lambda r: [("lora", r.lora_request.lora_name)] if r.lora_request else [])
    m, hit = producer_then_consumer(request("A", lora_request=lora("tenant", 1)),
                                    request("B", cache_salt="tenant"))
    assert hit > 0
    assert fields_of(rt) == {("lora", "cache_salt")}


def test_cache_salt_left_out(rt, kcu, monkeypatch):
    original = kcu.generate_block_hash_extra_keys

    def no_salt(request, start, end, mm_idx):
        keys, nxt = original(request, start, end, mm_idx)
        # (the salt tagged, vLLM 0.31 on, or bare, 0.30)
        salt = request.cache_salt
        keys = tuple(k for k in keys or () if k not in (("cache_salt", salt), salt)) or None
        return keys, nxt

    monkeypatch.setattr(kcu, "generate_block_hash_extra_keys", no_salt)
    producer_then_consumer(request("A", cache_salt="tenant-a"),
                           request("B", cache_salt="tenant-b"))
    assert fields_of(rt) == {("cache_salt",)}


def _image_at(ident, offset):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                  mm_position=PlaceholderRange(offset=offset, length=8))]


def test_multimodal_identifiers_left_out(rt, kcu, monkeypatch):
    monkeypatch.setattr(kcu, "_gen_mm_extra_hash_keys", lambda r, s, e, i: ([], i))
    producer_then_consumer(request("A", mm_features=_image_at("img-cat", 4)),
                           request("B", mm_features=_image_at("img-dog", 4)))
    assert fields_of(rt) == {("multimodal",)}


def test_multimodal_position_left_out(rt, kcu, monkeypatch):
    """The same image at another place in the same placeholder tokens: a key
    with the identifier but not the offset (what vLLM's key had before it
    added the offset) shares a block whose KV differs."""
    original = kcu._gen_mm_extra_hash_keys

    def no_offset(request, start, end, mm_idx):
        keys, nxt = original(request, start, end, mm_idx)
        # the offset is last: ("mm", identifier, offset), (identifier, offset) in 0.30
        return [k[:-1] for k in keys], nxt

    monkeypatch.setattr(kcu, "_gen_mm_extra_hash_keys", no_offset)
    m, hit = producer_then_consumer(request("A", mm_features=_image_at("img-cat", 4)),
                                    request("B", mm_features=_image_at("img-cat", 6)))
    assert hit == 3 * BLOCK
    bad = mismatches(rt)
    assert fields_of(rt) == {("multimodal",)}
    assert bad[0].blocks == [m.get_block_ids("A")[0][0]]
    assert bad[0].owners == ["A", "B"] and bad[0].actor == "B"


def test_lora_path_left_out(rt, kcu, monkeypatch):
    """An adapter name re-pointed at other weights (same name and id, a new
    path): a key of the name alone hands the new adapter the old one's KV."""
    monkeypatch.setattr(kcu, "_gen_lora_extra_hash_keys",
                        lambda r: [("lora", r.lora_request.lora_name)] if r.lora_request else [])
    m, hit = producer_then_consumer(request("A", lora_request=lora("sql", 1, "/a/v1")),
                                    request("B", lora_request=lora("sql", 1, "/a/v2")))
    assert hit == 3 * BLOCK
    bad = mismatches(rt)
    assert len(bad) == 3 and fields_of(rt) == {("lora",)}
    assert bad[0].blocks == [m.get_block_ids("A")[0][0]] and bad[0].owners == ["A", "B"]


def embedded(rid, seed):
    """A request whose prompt is given as embeddings (seeded), as long as
    TOKENS: vLLM holds placeholder token ids for it."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from vllm_objects import _hasher

    embeds = torch.randn(len(TOKENS), 8, generator=torch.Generator().manual_seed(seed))
    return Request(request_id=rid, prompt_token_ids=None, prompt_embeds=embeds,
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                   block_hasher=_hasher)


def test_prompt_embeds_left_out(rt, kcu, monkeypatch):
    """Two prompts given as different embeddings hold the same placeholder
    token ids: without the embeddings' digest in the key they share KV."""
    monkeypatch.setattr(kcu, "_gen_prompt_embeds_extra_hash_keys", lambda r, s, e: [])
    m, hit = producer_then_consumer(embedded("A", 0), embedded("B", 1))
    assert hit == 3 * BLOCK
    bad = mismatches(rt)
    assert len(bad) == 3 and fields_of(rt) == {("prompt_embeds",)}
    assert bad[0].blocks == [m.get_block_ids("A")[0][0]] and bad[0].actor == "B"


def test_prompt_embeds_with_correct_keys_are_silent(rt):
    """The same embeddings share their prefix for real; other embeddings do
    not share at all (the unchanged key): nothing to report either way."""
    m = make_manager(32)
    hits = [serve(m, embedded(rid, seed)) for rid, seed in (("A", 0), ("B", 0), ("C", 1))]
    assert hits == [0, 3 * BLOCK, 0]
    assert kinds_of(rt) == []


def test_weights_updated_without_prefix_reset(rt):
    from kvsan.hooks.vllm import identity as vllm_identity

    m = make_manager(24)
    serve(m, request("A"))
    vllm_identity.bump_weights_epoch()  # what EngineCore.collective_rpc("update_weights") does
    serve(m, request("B", TOKENS[:-1] + [999]))
    assert fields_of(rt) == {("weights_epoch",)}


def test_different_tokens_forced_to_the_same_hash(rt, kcu, monkeypatch):
    original = kcu.hash_block_tokens
    monkeypatch.setattr(kcu, "hash_block_tokens",
                        lambda fn, parent, tokens, extra=None: original(fn, parent, (), extra))
    other = [t + 1000 for t in TOKENS]
    m, hit = producer_then_consumer(request("A"), request("B", other))
    assert hit == 3 * BLOCK
    assert fields_of(rt) == {("tokens",)}


def _c_chains_apply() -> bool:
    """Whether kvsan's C identity paths take this vLLM's requests: they read
    the token ids as a list, as vLLM 0.30 to 0.33 keep them; 0.34 keeps a
    ``TokenBuffer`` (an int32 array), which they leave to the Python paths
    (the same records, made in Python)."""
    return type(request("probe")._all_token_ids) is list


def test_a_producer_cached_over_several_calls(rt, kcu, monkeypatch, native):
    """A producer whose blocks are registered over two ``cache_full_blocks``
    calls (prompt, then decode): from its second call on, with the C paths
    on, the native hook makes the producer records itself (the Python
    observer runs once, for the request's first registration, which makes
    its chain).  A consumer served all three blocks through a bad key must
    be told about each, with the same fields either way."""
    if native and not _c_chains_apply():
        pytest.skip("the C identity paths leave this vLLM's token buffers to Python")
    from vllm.v1.core.block_pool import BlockPool

    from kvsan import hooks
    from kvsan.hooks.vllm import identity as vllm_identity

    original = kcu.hash_block_tokens
    monkeypatch.setattr(kcu, "hash_block_tokens",
                        lambda fn, parent, tokens, extra=None: original(fn, parent, (), extra))
    hook = hooks.native_hook(BlockPool.__dict__["cache_full_blocks"])
    calls = []
    if hook is not None:
        observer = hook.observer
        assert observer is vllm_identity._cached

        def counted(*args):
            calls.append(args[2].request_id)
            return observer(*args)
        monkeypatch.setattr(hook, "observer", counted)
    m = make_manager(24)
    a = request("A", TOKENS[:2 * BLOCK + 3])
    serve(m, a)
    for t in TOKENS[2 * BLOCK + 3:3 * BLOCK + 3]:  # decode fills a third block
        a.append_output_token_ids(t)
    assert m.allocate_slots(a, BLOCK) is not None
    a.num_computed_tokens = a.num_tokens
    assert len([b for b in m.get_block_ids("A")[0] if m.block_pool.blocks[b].block_hash]) == 3
    if hook is not None:
        assert calls == (["A"] if native else ["A", "A"])
    hit = serve(m, request("B", [t + 1000 for t in TOKENS]))
    assert hit == 3 * BLOCK
    bad = mismatches(rt)
    assert [v.blocks for v in bad] == [[b] for b in m.get_block_ids("A")[0][:3]]
    assert fields_of(rt) == {("tokens",)} and all(v.owners == ["A", "B"] for v in bad)
    assert [v.details[0]["index"] for v in bad] == [0, 1, 2]


def test_new_producers_recorded_natively(rt, native):
    """Once the Python observer has handed the native cache hook its state,
    a new text-only producer's chain is started and its records made in C
    (the Python observer does not run for it); with the C paths off the
    observer makes them.  The records are the producer's either way."""
    if native and not _c_chains_apply():
        pytest.skip("the C identity paths leave this vLLM's token buffers to Python")
    from vllm.v1.core.block_pool import BlockPool

    from kvsan import hooks
    from kvsan.hooks.vllm import identity as vllm_identity

    hook = hooks.native_hook(BlockPool.__dict__["cache_full_blocks"])
    if hook is None:
        pytest.skip("no native cache hook here")
    calls = []
    observer = hook.observer

    def counted(*args):
        calls.append(args[2].request_id)
        return observer(*args)
    hook.observer = counted
    try:
        m = make_manager(24)
        serve(m, request("P1", TOKENS[:2 * BLOCK + 1]))
        serve(m, request("P2", [t + 2000 for t in TOKENS[:2 * BLOCK + 1]]))
    finally:
        hook.observer = observer
    assert calls == (["P1"] if native else ["P1", "P2"])
    audit = vllm_identity._audit(rt, m.block_pool)
    for rid in ("P1", "P2"):
        assert [audit.producer(b)[1] for b in m.get_block_ids(rid)[0][:2]] == [rid, rid]
    assert kinds_of(rt) == []


def test_correct_keys_are_silent(rt):
    m = make_manager(32)
    reqs = [request("A", lora_request=lora("sql", 1)), request("B", lora_request=lora("chat", 2)),
            request("C", cache_salt="t1"), request("D", cache_salt="t2"),
            request("E"), request("F", TOKENS[:-1] + [7])]
    hits = [serve(m, r) for r in reqs]
    assert hits[-1] == 3 * BLOCK  # F shares E's prefix for real
    assert kinds_of(rt) == []


def test_use_after_free_is_corruption_not_a_key_bug(rt):
    from vllm.v1.request import RequestStatus

    m = make_manager(7)
    a, b = request("A"), request("B", TOKENS[:-1] + [7])
    serve(m, a)
    serve(m, b)
    shared = m.get_block_ids("A")[0][:3]
    for bid in shared:
        m.block_pool.blocks[bid].ref_cnt -= 1
    a.status = RequestStatus.FINISHED_ABORTED
    m.free(a)
    serve(m, request("C", list(range(600, 600 + 3 * BLOCK))))
    recs = [v.to_record() for v in rt.violations()]
    assert recs and not mismatches(rt)
    wrong = [r for r in recs if r["kind"] in ("free_with_live_owners", "reuse_with_live_owners")]
    assert wrong and all(r["class"] == "corruption" for r in wrong)


def test_text_only_chains_share_their_empty_digests():
    """The ``mm`` and ``emb`` chains of text-only requests are one shared
    list (``RequestIdentity.TEXT_ONLY``: two tracked lists and 16 B a block
    less per request); a request with multimodal input gets chains of its
    own at its first extension, and the shared one stays empty."""
    from kvsan.checks import identity

    shared = identity.RequestIdentity.TEXT_ONLY
    image = lambda k: b"img%d" % k  # noqa: E731
    a = identity.RequestIdentity((b"", b""))
    a.extend(3, list(range(64)), 16, None, None)
    b = identity.RequestIdentity((b"", b""))
    b.extend(2, list(range(64)), 16, image, None)
    assert a.mm is shared and a.emb is shared
    assert b.mm is not shared and b.emb is not shared
    assert all(b.mm) and b.emb == [b"", b""]
    assert len(shared) >= 3 and not any(shared)
    # the same tokens, with and without an image: not the same inputs
    assert a.same(1, a, 1) and not a.same(1, b, 1) and not b.same(1, a, 1)
    b.extend(4, list(range(64)), 16, image, None)
    assert len(b.tok) == len(b.mm) == len(b.emb) == 4 and not any(shared)


def test_native_token_links_equal_the_python_chain():
    """``kvsan._native._tokenlinks`` gives exactly ``hash((parent, tuple(block)))``,
    the Python chain, on edge values (ints past the hash modulus, negative
    ones, -1, a short last block, an empty range)."""
    import random

    from kvsan.checks import identity

    if not SPEEDUPS:
        pytest.skip(SPEEDUPS_WHY)
    from kvsan._native._tokenlinks import links

    rng = random.Random(7)
    edge = [0, -1, -2, 1, 2**61 - 1, 2**61, -2**61, 2**63, -2**63 - 5, 2**70]
    for _ in range(500):
        toks = [rng.choice(edge + [rng.randrange(-10**6, 10**6)])
                for _ in range(rng.randrange(0, 60))]
        bs, start = rng.randrange(1, 20), rng.randrange(0, 6)
        upto = start + rng.randrange(0, 6)
        parent = rng.choice([0, -1, -2, 2**61 - 2, 2**61 - 1, 2**61, -(2**61 - 1), -2**61,
                             -2**63, 2**63 - 1, rng.randrange(-2**63, 2**63)])
        want, p = [], parent
        for k in range(start, upto):
            p = hash((p, tuple(toks[k * bs:(k + 1) * bs])))
            want.append(p)
        assert links(toks, bs, start, upto, parent) == want
    # and through RequestIdentity (a text-only chain: extend_text in one C
    # call), the Python loop against the native calls, grown step by step
    for trial in range(50):
        toks = [rng.choice(edge + [rng.randrange(-10**6, 10**6)]) for _ in range(90)]
        bs = rng.randrange(1, 20)
        steps = sorted(rng.randrange(0, 12) for _ in range(4))
        chains = []
        for on in (True, False):
            identity.use_native(on)
            assert (identity._extend_text is not None) is on
            ident = identity.RequestIdentity((b"", b""))
            for upto in steps:
                ident.extend(upto, toks, bs, None, None)
            chains.append((ident.tok, ident.mm, ident.emb))
        identity.use_native(True)
        assert chains[0] == chains[1], (trial, steps)
        assert len(chains[0][0]) == steps[-1]
        # text only: mm and emb are the one list every text-only chain
        # shares, padded at least as far as this chain reads it
        shared = identity.RequestIdentity.TEXT_ONLY
        assert all(c[1] is shared and c[2] is shared for c in chains)
        assert len(shared) >= steps[-1] and not any(shared)
    from kvsan._native._tokenlinks import extend_text

    with pytest.raises(TypeError, match="extend_text"):
        extend_text((), [], [], [], 16, 1)
    with pytest.raises(ValueError, match="bs > 0"):
        extend_text([], [], [], [1, 2], 0, 1)

    class Unhashable:  # a token whose hash fails: all or nothing
        def __hash__(self):
            raise ArithmeticError("no hash")

    tok, mm, emb = [5], [b""], [b""]
    with pytest.raises(ArithmeticError):
        extend_text(tok, mm, emb, list(range(32)) + [Unhashable()], 16, 3)
    assert (tok, mm, emb) == ([5], [b""], [b""])
    from kvsan._native._tokenlinks import Links  # a chain's links as C keeps them: the same

    tok, mm, emb = Links([5]), [b""], [b""]
    with pytest.raises(ArithmeticError):
        extend_text(tok, mm, emb, list(range(32)) + [Unhashable()], 16, 3)
    assert (tok, mm, emb) == ([5], [b""], [b""]) and len(tok) == 1


def test_token_links_are_one_untracked_array_that_compares_with_lists(native):
    """With ``kvsan._native._tokenlinks`` in use a chain keeps its token links in a
    ``Links`` (64-bit ints in one array: no int object per block, nothing
    for the garbage collector to track), which behaves as the list the
    Python path keeps: a Links chain and a list chain of the same tokens
    are the same inputs, each way, and the C hit check tells a Links
    producer from a list consumer's tokens as the Python check does."""
    import gc

    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvsan import hooks
    from kvsan.checks import identity

    if not native:
        pytest.skip("a check of the C path")
    if not SPEEDUPS or hooks.SHADOWFAST is None:
        pytest.skip(SPEEDUPS_WHY)
    from kvsan._native._tokenlinks import Links

    toks = list(range(10_000, 10_000 + 6 * BLOCK))
    ident = identity.RequestIdentity((b"", b""))
    assert type(ident.tok) is Links and not gc.is_tracked(ident.tok)
    ident.extend(4, toks, BLOCK, None, None)  # in C
    identity.use_native(False)
    try:
        py = identity.RequestIdentity((b"", b""))
        py.extend(4, toks, BLOCK, None, None)
        ident.extend(6, toks, BLOCK, None, None)  # a Links extended by the Python loop
        py.extend(6, toks, BLOCK, None, None)
    finally:
        identity.use_native(True)
    assert type(py.tok) is list and ident.tok == py.tok and py.tok == ident.tok
    assert ident.same(5, py, 5) and py.same(5, ident, 5) and not ident.same(4, py, 5)
    assert ident.fields(5, b"w") == py.fields(5, b"w")

    # a list's interface, all or nothing
    links = Links([1, -2])
    links += [3]
    links.append(2**63 - 1)
    links.extend(Links([4]))
    assert list(links) == links.tolist() == [1, -2, 3, 2**63 - 1, 4]
    assert links[-1] == 4 and len(links) == 5 and links != [1, -2] and not Links()
    with pytest.raises(IndexError):
        links[5]
    with pytest.raises(TypeError, match="a link is an int"):
        links.extend([5, "x"])
    with pytest.raises(OverflowError):
        links.append(2**63)
    with pytest.raises(TypeError):
        hash(links)
    assert links == [1, -2, 3, 2**63 - 1, 4] and repr(links) == f"Links({links.tolist()})"

    # the hit check: Links against Links in line; a list chain on either
    # side is compared as lists (where C declines, the Python check runs)
    blocks = []
    for b in (1, 2):
        blk = KVCacheBlock(block_id=b)
        blk.set_block_hash(bytes([b]) * 32)
        blocks.append(blk)
    other = identity.RequestIdentity((b"", b""))
    other.extend(2, [t + 1 for t in toks], BLOCK, None, None)
    for producer in (ident, py):
        audit = identity.IdentityAudit(lambda v: None, num_blocks=4)
        assert hooks.SHADOWFAST.identity_record(audit.records, "P", producer, b"w", blocks,
                                                0, 2) is True
        for consumer, bad in ((ident, []), (py, []), (other, [1, 2])):
            got = hooks.SHADOWFAST.identity_hits(audit.records, consumer, b"w", blocks)
            if got is None:  # declined in C: the Python check
                seen = []
                audit.emit = lambda v: seen.extend(v.blocks)
                audit.on_hits("C", consumer, b"w", [(i, b.block_id, b.block_hash)
                                                    for i, b in enumerate(blocks)])
            else:  # an int: all matched
                seen = [] if type(got) is int else [b for _, b, _, _ in got[1]]
            assert seen == bad, (type(producer.tok), type(consumer.tok))


def test_known_chain_matches_the_python_chain():
    """``kvsan._native._tokenlinks.known_chain`` (the identity hooks' lookup of a
    known text-only request's chain) gives the chain the Python ``_chain``
    builds, and declines (None) what it must leave to Python: an unknown
    request, a new Request object under a known id, multimodal input."""

    if not SPEEDUPS:
        pytest.skip(SPEEDUPS_WHY)
    from kvsan._native._tokenlinks import known_chain
    from kvsan.checks import identity
    from kvsan.hooks.vllm import identity as vllm_identity

    chains = vllm_identity._chains
    r = request("kc-1", list(range(100)))
    assert known_chain(chains, r, BLOCK, 2) is None  # no chain yet
    got = []
    for on in (True, False):
        identity.use_native(on)
        chains.pop("kc-1", None)
        ident = vllm_identity._chain(r, BLOCK, 1)  # made by Python either way
        for upto in (2, 2, 4, 6):
            assert vllm_identity._chain(r, BLOCK, upto) is ident
        got.append((list(ident.tok), list(ident.mm), list(ident.emb)))
    identity.use_native(True)
    assert got[0] == got[1] and len(got[0][0]) == 6
    assert known_chain(chains, r, BLOCK, 3) is chains["kc-1"]
    assert known_chain(chains, request("kc-1", list(range(100))), BLOCK, 3) is None
    r.mm_features = [object()]  # multimodal input: the Python path's parts
    assert known_chain(chains, r, BLOCK, 7) is None
    assert known_chain(chains, r, BLOCK, 6) is chains["kc-1"]  # nothing to extend
    with pytest.raises(TypeError, match="known_chain"):
        known_chain([], r, BLOCK, 1)


def test_chains_started_in_c_equal_pythons_and_go_with_their_request(native):
    """A chain ``known_chain`` starts in C is the RequestIdentity Python
    would make (its slots, without running ``__init__``): a weak reference
    to its Request, filed under the request's id, that drops its entry when
    the Request goes (the C callback, bound to the chains dict); an entry a
    newer Request under the same id replaced stays.  One object per request
    (the garbage collector tracks no entry or reference of its own)."""
    if native and not _c_chains_apply():
        pytest.skip("the C identity paths leave this vLLM's token buffers to Python")
    import gc

    if not SPEEDUPS:
        pytest.skip(SPEEDUPS_WHY)
    if not native:
        pytest.skip("the C paths' chains (with KVSAN_NATIVE=0 the Python reaper is in use)")
    from kvsan._native._tokenlinks import known_chain
    from kvsan.checks.identity import RequestIdentity
    from kvsan.hooks.vllm import identity as vllm_identity

    chains = vllm_identity._chains
    make = vllm_identity._MAKE[0]
    r = request("kc-2", list(range(100)))
    ident = known_chain(chains, r, BLOCK, 3, make)
    assert type(ident) is RequestIdentity and chains["kc-2"] is ident and ident() is r
    py = RequestIdentity(make[1], r, make[2], "kc-2")
    py.extend(3, list(range(100)), BLOCK, None, None)
    assert ((ident.static, ident.tok, ident.mm, ident.emb, ident.rid)
            == (py.static, py.tok, py.mm, py.emb, py.rid))
    assert isinstance(make[2], functools.partial) and ident != py and ident == ident
    del r, py
    gc.collect()
    assert "kc-2" not in chains  # the Request went: so did its entry
    assert ident() is None and len(ident.tok) == 3  # (a record may still read it)
    old = request("kc-3", list(range(40)))
    known_chain(chains, old, BLOCK, 1, make)
    new = request("kc-3", list(range(40)))
    chains["kc-3"] = RequestIdentity(make[1], new, make[2], "kc-3")
    del old
    gc.collect()
    assert chains["kc-3"]() is new  # the newer Request's entry stays
    del new
    gc.collect()
    assert "kc-3" not in chains


def test_records_beyond_their_lists_are_made_in_python_and_grown(native):
    """The producer records are per-block lists sized for the pool.  A block
    beyond them (a caller that gave no pool size) is not dropped: the C path
    declines the call, Python records it and grows the lists, and a later
    hit on it is compared like any other (here: other tokens, a mismatch)."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvsan import hooks
    from kvsan.checks.identity import IdentityAudit, RequestIdentity

    found = []
    audit = IdentityAudit(found.append, num_blocks=4)
    static = (b"l" * 16, b"s" * 16)
    blocks = []
    for b in (1, 6):
        blk = KVCacheBlock(block_id=b)
        blk.set_block_hash(bytes([b]) * 32)
        blocks.append(blk)

    def chain(offset):
        ident = RequestIdentity(static)
        ident.extend(2, [t + offset for t in TOKENS[:2 * BLOCK]], BLOCK, None, None)
        return ident

    fast = hooks.SHADOWFAST
    producer, consumer = chain(0), chain(1000)
    if native:
        assert fast.identity_record(audit.records, "P", producer, b"w", blocks, 0, 2) is False
    audit.on_cached("P", producer, b"w", [(i, b.block_id, b.block_hash)
                                          for i, b in enumerate(blocks)])
    assert [len(lst) for lst in audit.records] == [7] * 5
    assert [audit.producer(b.block_id)[1:4:2] for b in blocks] == [("P", 0), ("P", 1)]
    if native:
        compared, mism = fast.identity_hits(audit.records, consumer, b"w", blocks)
        assert compared == 2 and [(i, b) for i, b, _, _ in mism] == [(0, 1), (1, 6)]
        for i, b, key, known in mism:
            audit.mismatch(b, key, "C", consumer, i, b"w", known)
    else:
        audit.on_hits("C", consumer, b"w", [(i, b.block_id, b.block_hash)
                                           for i, b in enumerate(blocks)])
    assert [(v.kind, v.blocks, v.owners, v.details[0]["fields"]) for v in found] == [
        ("cache_key_mismatch", [1], ["C", "P"], ["tokens"]),
        ("cache_key_mismatch", [6], ["C", "P"], ["tokens"])]


def test_hit_checks_read_chains_the_same_through_their_slots_or_getattr(native):
    """``identity_hits`` reads a chain's slots in line (kvsan/_native/_slots.h) for
    the type it resolved them for, and through getattr for anything else.
    The answers are the same for a RequestIdentity, for one whose class was
    modified since (its offsets resolved again), and for a look-alike object
    of another class: a static-digest mismatch and a token mismatch found,
    a matching chain passing."""

    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvsan import hooks
    from kvsan.checks.identity import IdentityAudit, RequestIdentity

    if not native:
        pytest.skip("a check of the C path (the Python one reads attributes)")
    if not SPEEDUPS or hooks.SHADOWFAST is None:
        pytest.skip(SPEEDUPS_WHY)
    fast = hooks.SHADOWFAST
    static, salted = (b"l" * 16, b"s" * 16), (b"l" * 16, b"t" * 16)
    blocks = []
    for b in (1, 2):
        blk = KVCacheBlock(block_id=b)
        blk.set_block_hash(bytes([b]) * 32)
        blocks.append(blk)

    def chain(st, offset=0):
        ident = RequestIdentity(st)
        ident.extend(2, [t + offset for t in TOKENS[:2 * BLOCK]], BLOCK, None, None)
        return ident

    class LookAlike:  # the same attributes, no slots: read through getattr
        def __init__(self, ident):
            self.static, self.tok, self.mm, self.emb = (ident.static, ident.tok, ident.mm,
                                                        ident.emb)

    audit = IdentityAudit(lambda v: None, num_blocks=4)
    assert fast.identity_record(audit.records, "P", chain(static), b"w", blocks, 0, 2) is True

    def verdicts(wrap):
        out = []
        for consumer in (chain(static), chain(salted), chain(static, 1000)):
            got = fast.identity_hits(audit.records, wrap(consumer), b"w", blocks)
            compared, mism = (got, []) if type(got) is int else got  # an int: all matched
            out.append((compared, [(i, b) for i, b, _, _ in mism]))
        return out

    want = [(2, []), (2, [(0, 1), (1, 2)]), (2, [(0, 1), (1, 2)])]
    assert verdicts(lambda c: c) == want
    RequestIdentity.kvsan_test_marker = 1  # the type modified: its version tag changes
    try:
        assert verdicts(lambda c: c) == want
    finally:
        del RequestIdentity.kvsan_test_marker
    assert verdicts(LookAlike) == want
    assert verdicts(lambda c: c) == want
