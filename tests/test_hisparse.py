"""HiSparse (vLLM 0.32's sparse-attention KV offload) on vLLM's real
``KVCacheManager``, built as vLLM's own tests build one: its residency
updates release a request's resident pages through
``BlockPool.unpin_blocks`` (the page stays readable until the pool hands it
out again), and its requests hold blocks of a second, host ``BlockPool``
that a fenced free hands back through the device pool's ``free_blocks``.
Both are legal: kvsan attributes the unpin to its request and keeps each
pool's blocks in that pool's table."""

import pytest

pytestmark = pytest.mark.engine

BS = 16


def make_request(rid, tokens):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=17)
    sp.update_from_generation_config({}, eos_token_id=100)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp,
                   pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256))


def hisparse_manager(num_blocks, host_num_blocks, max_in_flight_tokens=None):
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, HiSparseHotSpec,
                                            HiSparseResidentSpec, KVCacheConfig,
                                            KVCacheGroupRole, KVCacheGroupSpec)

    src = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(["source"], src, role=KVCacheGroupRole.HISPARSE_SOURCE,
                         host_resident=True),
        KVCacheGroupSpec(["indexer"], src, enable_kv_transfer=False,
                         role=KVCacheGroupRole.HISPARSE_INDEXER),
        KVCacheGroupSpec(["resident"], HiSparseResidentSpec(block_size=BS, page_size=BS * 4),
                         enable_kv_transfer=False),
        KVCacheGroupSpec(["hot"], HiSparseHotSpec(block_size=BS, page_size=BS * 4,
                                                  blocks_per_request=2),
                         enable_kv_transfer=False),
    ]
    cfg = KVCacheConfig(num_blocks=num_blocks, hisparse_host_num_blocks=host_num_blocks,
                        kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(cfg, max_model_len=128, scheduler_block_size=BS, hash_block_size=BS,
                          enable_caching=False, max_in_flight_tokens=max_in_flight_tokens)


def test_unpinned_pages_are_their_requests_releases_and_free_to_reuse(rt, monkeypatch):
    """A's resident pages, once their host copies are written back, are
    unpinned by the coordinator's residency update (the scheduler's
    connector runs it each step): the pool counts them free, and B is
    handed them.  kvsan files each unpin as A's release (no owner is left
    on the page) and B's allocation as a clean reuse."""
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    manager = hisparse_manager(32, 16, max_in_flight_tokens=32)
    coord = get_hisparse_coordinator(manager)
    pool = manager.block_pool
    shadow = rt.checkers[pool].shadow
    unpinned = []
    original = type(pool).unpin_blocks

    def spy(self, blocks, on_reuse):
        blocks = list(blocks)
        unpinned.extend((self, b.block_id) for b in blocks)
        return original(self, blocks, on_reuse)

    def step(req, n):
        assert manager.allocate_slots(req, n) is not None
        done = min(req.num_computed_tokens + n, req.num_tokens)
        coord.advance_scheduled([(req.request_id, done)])  # the connector, in schedule()
        cmd = coord.build_offload_command()
        if cmd is not None:  # the worker acks every spill
            counts = {t.transfer_id: 1 for t in cmd.page_transfers}
            coord.update_spills(counts, counts)
        req.num_computed_tokens = done
        manager.new_step_starts()

    a = make_request("A", list(range(5 * BS)))
    with monkeypatch.context() as m:  # (kvsan's hook stays under the spy)
        m.setattr(type(pool), "unpin_blocks", spy)
        step(a, a.num_tokens)
        for _ in range(2):
            a.append_output_token_ids(7)
            step(a, 1)
    assert unpinned, "no page was unpinned"
    assert all(p.blocks[x].ref_cnt == 0 for p, x in unpinned)
    assert all(rt.checkers[p].shadow.owners(x) == [] for p, x in unpinned)  # A's releases
    others = []
    while pool.get_num_free_blocks() and len(others) < 16:  # others take every free block
        b = make_request(f"B{len(others)}", [5 + len(others)] * BS)
        if manager.allocate_slots(b, b.num_tokens) is None:
            break
        others.append(b)
    # the pool hands the unpinned pages out last, and tells HiSparse then
    assert any(rt.checkers[p].shadow.owners(x) and rt.checkers[p].shadow.owners(x)[0]
               .startswith("B") for p, x in unpinned)
    manager.free(a)
    for b in others:
        manager.free(b)
    assert rt.violations() == [], [(v.kind, v.blocks, v.owners, v.site) for v in rt.violations()]
    assert shadow.stats()["live_owned"] == 0


def test_a_fenced_free_hands_host_blocks_back_to_the_host_pool(rt):
    """The scheduler's deferred free pops the request's blocks (device and
    host) and later frees them through the device pool, which routes the
    host ones to their own pool.  A host block may have the id of a device
    block: kvsan hands only the device pool's to ``deferred:<req>`` in the
    device pool's table (a host block goes to its own pool's, where kvsan
    keeps one) and counts only them as the drain's releases."""
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    manager = hisparse_manager(16, 16)
    host_pool = get_hisparse_coordinator(manager).get_host_block_pool()
    device = rt.checkers[manager.block_pool].shadow
    host_ck = rt.checkers.get(host_pool)  # (kvsan keeps a table for it where it hooked it)
    req = make_request("R", list(range(BS)))
    assert manager.allocate_slots(req, BS, delay_cache_blocks=True) is not None
    blocks = manager.pop_blocks_for_free(req)  # the step that writes them is in flight
    mine = [b.block_id for b in blocks if b.pool is not host_pool]
    theirs = [b.block_id for b in blocks if b.pool is host_pool]
    assert theirs and set(theirs) & set(mine), "no host block shares an id with a device one"
    assert all(device.owners(b) == ["deferred:R"] for b in mine)
    if host_ck is not None:
        assert all(host_ck.shadow.owners(b) == ["deferred:R"] for b in theirs)
    manager.block_pool.free_blocks(reversed(blocks))  # the fence passed: drained
    assert rt.violations() == [], [(v.kind, v.blocks, v.owners, v.site) for v in rt.violations()]
    assert device.stats()["live_owned"] == 0


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_spill_pins_are_the_transfer_s_even_under_a_request(rt, native):
    """A page spill pins the page's device block while the workers copy it
    and drops the pin once all have: the pin is the transfer's, not a
    request's.  vLLM 0.31 plans spills inside a request's block allocation
    (an owner frame is above the pin, none above its release); here the
    planning runs under A's owner scope the same way.  kvsan charges the pin
    to a ``pin:`` owner, so its release is clean (it read as A's pin and an
    ``invalid_release`` by nobody)."""
    from kvsan import hooks
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    hooks.use_native(native)
    try:
        manager = hisparse_manager(32, 16, max_in_flight_tokens=32)
        coord = get_hisparse_coordinator(manager)
        shadow = rt.checkers[manager.block_pool].shadow
        a = make_request("A", list(range(5 * BS)))
        assert manager.allocate_slots(a, a.num_tokens) is not None
        rt.owner_ctx.append(("A", "alloc"))  # (as vLLM 0.31's allocation path)
        try:
            coord.advance_scheduled([("A", a.num_tokens)])
        finally:
            rt.owner_ctx.pop()
        cmd = coord.build_offload_command()
        assert cmd is not None and cmd.page_transfers
        pinned = [b for t in cmd.page_transfers for b in t.resident_block_ids]
        assert pinned and all(
            sorted(o.split(":")[0] for o in shadow.owners(b)) == ["A", "pin"] for b in pinned)
        counts = {t.transfer_id: 1 for t in cmd.page_transfers}
        coord.update_spills(counts, counts)  # every worker copied: the pins drop
        assert all(shadow.owners(b) == ["A"] for b in pinned)
        manager.free(a)
        assert rt.violations() == [], [(v.kind, v.blocks, v.owners, v.site)
                                       for v in rt.violations()]
    finally:
        hooks.use_native(rt.config.native)
