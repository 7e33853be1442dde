"""Device side on the real engine (in-process, V1 runner, CPU attention):
each fault is injected into the running engine and the exact kind, block and
owner asserted; clean traffic at the strictest settings gives zero."""

import os

import pytest

from conftest import core
from kvsan.config import Config

pytestmark = pytest.mark.e2e

PREFIX_BLOCKS = 2
BS = 32


@pytest.fixture(scope="module")
def engine(kvsan_rt):
    """One in-process engine: kvsan in strict device settings, a tiny pool and
    a small token budget so prefills are chunked."""
    from vllm import LLM

    from kvsan.harness import traffic
    from kvsan.harness.tinymodel import ensure_tiny_model

    strict = Config(enabled=True, log_events=False, checksum="all", poison=True)
    kvsan_rt.config = strict
    kvsan_rt.reporter.config = strict
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kw = traffic.engine_kwargs(ensure_tiny_model(), num_blocks=12)
    kw.update(max_num_batched_tokens=48, max_num_seqs=4, max_model_len=320)
    llm = LLM(**kw)
    yield llm
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    kvsan_rt.config = kvsan_rt.reporter.config = Config(enabled=True, log_events=False)


def runner():
    from kvsan.hooks.vllm import worker as vllm_worker

    (r,) = list(vllm_worker._checkers)
    return r


def device():
    from kvsan.hooks.vllm import worker as vllm_worker

    (dc,) = list(vllm_worker._checkers.values())
    return dc


def add(llm, rid, prompt, max_tokens, logprobs=None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                       logprobs=logprobs)
    llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), p)


def step(llm, n=1):
    out = {}
    for _ in range(n):
        for o in llm.llm_engine.step():
            out[o.request_id] = o
    return out


def drain(llm):
    out = {}
    while llm.llm_engine.has_unfinished_requests():
        out.update(step(llm))
    return out


def internal(rid):
    sched = core_ref[0].scheduler
    return next(r for r in sched.requests if r.startswith(rid + "-") or r == rid)


core_ref = []


def block_ids(llm, rid):
    sched = core(llm).scheduler
    full = next(r for r in sched.requests if r.split("-")[0] == rid or r.startswith(rid + "-"))
    return full, sched.kv_cache_manager.get_block_ids(full)[0]


def of(rt, kind, site=None):
    return [v for v in rt.violations() if v.kind == kind and (site is None or v.site == site)]


PREFIX = [(7 * i) % 500 + 1 for i in range(PREFIX_BLOCKS * BS)]


def test_clean_traffic_strictest_settings(eng, rt):
    from kvsan.harness import traffic

    res = traffic.run(eng, seed=3, groups=4, per_group=4)
    assert res.finished > 0
    assert rt.violations() == []
    dc = device()
    assert dc.counters["sealed"] > 0 and dc.counters["verified"] > 0
    assert dc.counters["guarded_tokens"] > 0
    from kvsan.hooks.vllm import identity as vllm_identity

    # the identity audit compared every prefix hit and found the keys right
    assert next(iter(vllm_identity._audits.values())).checked > 0


def test_clean_traffic_with_heavy_eviction_strictest_settings(eng, rt):
    """Seeded traffic on the 12-block pool at ``all`` + poison: cached
    blocks are evicted and handed out again (LIFO off the free queue) all
    the time, and each evicted sealed block is verified before the step
    that rewrites it (and before poison could touch it): legal reuse gives
    no report."""
    from kvsan.harness import traffic

    dc = device()
    before = dc.counters["verified_evicted"]
    res = traffic.run(eng, seed=11, groups=5, per_group=4)
    assert res.finished > 0
    assert rt.violations() == []
    assert dc.counters["verified_evicted"] - before > 5


def test_same_step_hit_on_a_block_being_written_is_legal(eng, rt):
    """B is served A's prefix block in the very step A's next prefill chunk
    writes it: vLLM writes a layer's KV for the whole batch before attention
    reads it, so this is legal and must not be flagged."""
    prefix = [(13 * i) % 490 + 1 for i in range(3 * BS)]
    add(eng, "A", prefix + [3], max_tokens=4)
    step(eng)  # chunk 1: tokens 0-47
    add(eng, "B", prefix + [4], max_tokens=4)
    out = drain(eng)
    assert len(out) == 2
    b = next(o for r, o in out.items() if r.startswith("B"))
    assert b.num_cached_tokens >= BS  # B really was served A's prefix
    assert rt.violations() == []
    assert device().counters["sealed"] > 0


def test_a_drafter_writing_after_the_forward_is_legal(eng, rt, monkeypatch):
    """vLLM 0.32 ends a step in ``sample_tokens``, after ``execute_model``
    returned None: a speculative drafter (EAGLE, MTP, a draft model) writes
    its own layers' KV for the step's slots there.  Stand-in: the last
    layer's rows of every block the step writes change between the two
    calls.  Sealed at the end of ``execute_model`` (as kvsan did), those
    blocks' checksums missed the drafter's bytes and every verification
    (``all``: every sealed block every step) reported a mismatch; sealed
    once ``sample_tokens`` has run (when the next step begins), nothing is
    reported, and a real scribble into a sealed block still is."""
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvsan.hooks.vllm import worker as vllm_worker

    hooked = GPUModelRunner.__dict__["sample_tokens"]
    drafted = []

    def drafter_then_sample(self, *args, **kwargs):
        state = self.execute_model_state
        if state is not None:
            n = state.scheduler_output.total_num_scheduled_tokens
            slots = self.input_batch.block_table.block_tables[0].slot_mapping.gpu[:n]
            blocks = sorted({int(s) // BS for s in slots.tolist() if s >= 0})
            last = vllm_worker._layers(self)[-1]
            with torch.no_grad():
                last[blocks] += 0.5
            drafted.extend(blocks)
        return hooked(self, *args, **kwargs)

    monkeypatch.setattr(GPUModelRunner, "sample_tokens", drafter_then_sample)
    add(eng, "A", PREFIX + [5], max_tokens=6)
    add(eng, "B", [(11 * i) % 480 + 2 for i in range(3 * BS)] + [6], max_tokens=6)
    out = drain(eng)
    assert len(out) == 2 and drafted
    dc = device()
    assert dc.counters["sealed"] >= 2 and dc.counters["verified"] > 0
    assert rt.violations() == []
    monkeypatch.setattr(GPUModelRunner, "sample_tokens", hooked)
    victim = sorted(dc.sealed)[0]
    with torch.no_grad():
        vllm_worker._layers(runner())[0][victim] += 1.0  # not a drafter: a scribble
    add(eng, "C", [9] * 5, max_tokens=2)
    drain(eng)
    assert [v.blocks for v in of(rt, "checksum_mismatch")][:1] == [[victim]]


def test_identity_audit_on_the_real_engine(eng, rt, monkeypatch):
    """cache_salt left out of vLLM's block hash, on the live engine: tenant B
    is served tenant A's prefix, and kvsan names the field."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm.v1.core.kv_cache_utils as kcu

    from kvsan.hooks.vllm import identity as vllm_identity

    original = kcu.generate_block_hash_extra_keys

    def no_salt(request, start, end, mm_idx):
        keys, nxt = original(request, start, end, mm_idx)
        return tuple(k for k in keys or () if k[0] != "cache_salt") or None, nxt

    monkeypatch.setattr(kcu, "generate_block_hash_extra_keys", no_salt)
    p = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    eng.llm_engine.add_request("A", TokensPrompt(prompt_token_ids=PREFIX + [5],
                                                 cache_salt="tenant-a"), p)
    step(eng, 3)
    eng.llm_engine.add_request("B", TokensPrompt(prompt_token_ids=PREFIX + [6],
                                                 cache_salt="tenant-b"), p)
    drain(eng)
    bad = of(rt, "cache_key_mismatch")
    assert len(bad) == PREFIX_BLOCKS
    assert all(v.details[0]["fields"] == ["cache_salt"] for v in bad)
    assert bad[0].actor.startswith("B") and any(o.startswith("A") for o in bad[0].owners)
    assert bad[0].to_record()["class"] == "bad_cache_key"
    audit = next(iter(vllm_identity._audits.values()))
    assert audit.checked >= PREFIX_BLOCKS


def test_scribble_into_sealed_block_is_checksum_mismatch(eng, rt):
    add(eng, "A", PREFIX + [11] * 5, max_tokens=40)
    step(eng, 3)  # A's prefill (two chunks) done, prefix blocks sealed
    _, a_blocks = block_ids(eng, "A")
    target = a_blocks[1]
    assert target in device().sealed
    from kvsan.hooks.vllm.worker import _layers

    _layers(runner())[1][target].add_(1.0)  # a stray write, no allocator call
    add(eng, "B", PREFIX + [22] * 5, max_tokens=4)
    step(eng)  # B is served the prefix: verified before its forward
    bad = of(rt, "checksum_mismatch")
    assert bad and bad[0].blocks == [target]
    assert bad[0].details[0]["layers"] == [1]
    b_full, _ = block_ids(eng, "B")
    assert b_full in bad[0].owners
    drain(eng)


def test_slot_mapping_into_sealed_shared_block(eng, rt):
    import wrapt
    from vllm.v1.worker.block_table import BlockTable

    add(eng, "A", PREFIX + [11] * 5, max_tokens=40)
    step(eng, 3)
    add(eng, "B", PREFIX + [22] * 5, max_tokens=40)
    step(eng, 2)  # B hit the prefix and is decoding
    a_full, a_blocks = block_ids(eng, "A")
    b_full, b_blocks = block_ids(eng, "B")
    shared = a_blocks[0]
    assert b_blocks[0] == shared
    fired = []

    def corrupt(wrapped, instance, args, kwargs):
        ret = wrapped(*args, **kwargs)
        if not fired:  # one bad slot: B's newest token written into block `shared`
            n = int(args[2].shape[0]) if len(args) > 2 else int(kwargs["positions"].shape[0])
            sm = instance.slot_mapping.gpu
            sm[n - 1] = shared * BS + int(sm[n - 1]) % BS
            fired.append(True)
        return ret

    from kvsan.hooks.vllm import faults

    original = BlockTable.__dict__["compute_slot_mapping"]
    wrapt.wrap_function_wrapper(BlockTable, "compute_slot_mapping", corrupt)
    try:
        step(eng)
    finally:
        BlockTable.compute_slot_mapping = original
    bad = of(rt, "overwrite_shared_block")
    assert bad and bad[0].blocks == [shared]
    assert set(bad[0].owners) == {a_full, b_full}
    assert bad[0].actor in (a_full, b_full)  # the batch's last row wrote it
    assert "sealed" in bad[0].message
    drain(eng)
    assert faults is not None


def test_hit_before_write_is_uninitialized_hit(eng, rt):
    """Eager registration (vLLM #37152 / #43569 shape): a chunked prefill
    registers the block its chunk ends inside as if it were full, the request
    is cancelled, and a later request is served the half-written block."""
    import wrapt
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    def eager(wrapped, instance, args, kwargs):
        ret = wrapped(*args, **kwargs)
        request, num_new = args[0], args[1]
        if ret is not None:
            end = request.num_computed_tokens + num_new
            instance.coordinator.cache_blocks(
                request, min(-(-end // BS) * BS, request.num_tokens))
        return ret

    prompt = [(5 * i) % 450 + 1 for i in range(4 * BS)] + [9]
    original = KVCacheManager.__dict__["allocate_slots"]
    wrapt.wrap_function_wrapper(KVCacheManager, "allocate_slots", eager)
    try:
        add(eng, "A", prompt, max_tokens=4)
        step(eng)  # first 48-token chunk: block 1 holds 16 of its 32 tokens
        _, a_blocks = block_ids(eng, "A")
        eng.llm_engine.abort_request(["A"])
        step(eng)
        add(eng, "B", prompt[:-1] + [8], max_tokens=2)
        step(eng, 2)
    finally:
        KVCacheManager.allocate_slots = original
    bad = of(rt, "uninitialized_hit")
    assert [v.blocks for v in bad] == [[a_blocks[1]]], [(v.kind, v.blocks) for v in rt.violations()]
    assert bad[0].owners[0].startswith("B") and "16 of its 32" in bad[0].message
    drain(eng)


def test_a_row_filled_with_other_tokens_is_input_token_mismatch(eng, rt, monkeypatch):
    """The input batch's row for a new request holds other tokens than the
    request's prompt (as when ``InputBatch.add_request`` does not copy the
    prompt: the mutation campaign's fault): the model computes the KV of the
    wrong tokens into blocks the scheduler caches under the right key.
    Each block sealed that way is reported, with its request."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    original = InputBatch.add_request

    def shifted(self, request, *args, **kwargs):
        ret = original(self, request, *args, **kwargs)
        row, n = self.req_id_to_index[request.req_id], len(request.prompt_token_ids)
        self.token_ids_cpu[row, :n] = self.token_ids_cpu[row, :n] % 499 + 1
        return ret

    monkeypatch.setattr(InputBatch, "add_request", shifted)
    add(eng, "A", PREFIX + [3] * 5, max_tokens=8)
    step(eng, 2)  # the prompt in two chunks fills blocks 0 and 1
    full, a_blocks = block_ids(eng, "A")
    step(eng)  # (a step's blocks are sealed when the next begins)
    monkeypatch.setattr(InputBatch, "add_request", original)
    bad = of(rt, "input_token_mismatch")
    assert [(v.blocks, v.owners, v.actor) for v in bad] == [
        ([a_blocks[0]], [full], full), ([a_blocks[1]], [full], full)]
    assert [v.details[0]["first_position"] for v in bad] == [0, BS]
    assert bad[0].details[0]["offsets"] == list(range(BS))
    assert f"{BS} of its positions, the first at 0" in bad[0].message
    drain(eng)


def test_a_row_condensed_without_its_tokens_is_input_token_mismatch(eng, rt, monkeypatch):
    """``InputBatch.condense`` moves a request to a row a finished one left
    but not its token ids: the request's next tokens are gathered from the
    old row's.  Its block sealed before the move is clean; the one it fills
    after is reported."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    original = InputBatch.condense

    def tokens_left_behind(self, *args, **kwargs):
        rows, saved = dict(self.req_id_to_index), self.token_ids_cpu.copy()
        ret = original(self, *args, **kwargs)
        for rid, row in self.req_id_to_index.items():
            if rows.get(rid, row) != row:
                self.token_ids_cpu[row] = saved[row]
        return ret

    monkeypatch.setattr(InputBatch, "condense", tokens_left_behind)
    add(eng, "A", [(3 * i) % 450 + 2 for i in range(10)], max_tokens=1)  # row 0, done first
    add(eng, "B", [(5 * i) % 450 + 1 for i in range(2 * BS - 3)], max_tokens=8)  # row 1
    step(eng)  # A's prompt and B's first 38 tokens; A finishes
    full, b_blocks = block_ids(eng, "B")
    step(eng, 5)  # A leaves, B moves to row 0, finishes its prompt, fills block 1
    monkeypatch.setattr(InputBatch, "condense", original)
    bad = of(rt, "input_token_mismatch")
    assert [(v.blocks, v.owners, v.actor) for v in bad] == [([b_blocks[1]], [full], full)]
    drain(eng)


def test_a_gather_that_leaves_stale_input_ids_is_input_token_mismatch(eng, rt, monkeypatch):
    """The runner's input batch row is right, but the step's input ids are
    not gathered from it: the buffer the model reads still holds the last
    step's tokens (the runner campaign's ``_prepare_inputs`` mutant that
    drops the gather; here the buffer is overwritten after it, where
    ``_prepare_input_ids`` copies it to the device).  The row agrees with
    the request, so only the tokens recorded per slot as the step wrote
    them show it: each block sealed from that prefill is reported."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._prepare_input_ids
    stale = {"on": True}

    def not_gathered(self, scheduler_output, num_reqs, total, *args, **kwargs):
        if stale["on"]:
            buf = self.input_ids.cpu[:total]
            buf.copy_(buf % 499 + 1)  # other tokens than the row's
        return original(self, scheduler_output, num_reqs, total, *args, **kwargs)

    monkeypatch.setattr(GPUModelRunner, "_prepare_input_ids", not_gathered)
    add(eng, "A", PREFIX + [3] * 5, max_tokens=8)
    step(eng, 2)  # the prompt in two chunks fills blocks 0 and 1
    stale["on"] = False
    full, a_blocks = block_ids(eng, "A")
    step(eng)  # (a step's blocks are sealed when the next begins)
    bad = of(rt, "input_token_mismatch")
    assert [(v.blocks, v.owners, v.actor) for v in bad] == [
        ([a_blocks[0]], [full], full), ([a_blocks[1]], [full], full)]
    assert bad[0].details[0]["offsets"] == list(range(BS))
    assert device().fed_block(a_blocks[0]) == [t % 499 + 1 for t in PREFIX[:BS]]
    drain(eng)


def test_a_worker_sent_other_prompt_tokens_is_input_token_mismatch(eng, rt, monkeypatch):
    """The worker's copy of a new request (``NewRequestData``, what the
    scheduler sends) holds one prompt token other than the scheduler's
    request: the worker fills its batch row and its request state from it,
    so the tokens it feeds agree with its state, but the block holding
    that token is cached under the scheduler's tokens.  The block's token
    links the scheduler ships with the step show it at sealing; the block
    before is clean."""
    from vllm.v1.core.sched.output import NewRequestData

    original = NewRequestData.from_request.__func__

    def from_request(cls, request, *args, **kwargs):
        data = original(cls, request, *args, **kwargs)
        if request.request_id.startswith("B"):
            tokens = list(data.prompt_token_ids)
            tokens[BS + 3] = tokens[BS + 3] % 499 + 1  # one token of the second block
            data.prompt_token_ids = tokens
        return data

    monkeypatch.setattr(NewRequestData, "from_request", classmethod(from_request))
    add(eng, "B", [(13 * i) % 470 + 2 for i in range(2 * BS + 5)], max_tokens=4)
    step(eng, 2)  # the prompt in two chunks fills blocks 0 and 1
    full, b_blocks = block_ids(eng, "B")
    step(eng)  # (a step's blocks are sealed when the next begins)
    drain(eng)
    bad = of(rt, "input_token_mismatch")
    assert [(v.kind, v.blocks, v.owners, v.actor) for v in rt.violations()] == [
        ("input_token_mismatch", [b_blocks[1]], [full], full)]
    assert bad[0].details[0]["against"] == "scheduler"
    assert bad[0].details[0]["first_position"] == BS
    assert "other tokens than the scheduler cached it under" in bad[0].message


def test_sequence_lengths_other_than_the_written_extent_are_read_extent_mismatch(
        eng, rt, monkeypatch):
    """Attention reads each request's KV up to the step's sequence length.
    Left a step behind (the ``--inputs`` campaign's mutants: ``seq_lens``
    not written, or made from stale scheduled counts), a request reads
    less than it wrote; made too long, it reads slots it never wrote.
    Every write is right, so only the read extent shows it: each step is
    reported with the request and the blocks between the two extents."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._prepare_input_ids
    fault = {"mode": "stale", "last": None}

    def misread(self, scheduler_output, num_reqs, total, *args, **kwargs):
        now = self.seq_lens[:num_reqs].clone()
        if fault["mode"] == "stale" and fault["last"] is not None:
            self.seq_lens[:len(fault["last"])] = fault["last"]  # the last step's
        elif fault["mode"] == "past":
            self.seq_lens[:num_reqs] += 3
        fault["last"] = now
        return original(self, scheduler_output, num_reqs, total, *args, **kwargs)

    monkeypatch.setattr(GPUModelRunner, "_prepare_input_ids", misread)
    add(eng, "A", PREFIX + [3] * 5, max_tokens=8)
    step(eng, 2)  # the prompt in two chunks (48 + 21); the second reads 48
    full, a_blocks = block_ids(eng, "A")
    fault["mode"] = "past"
    step(eng)  # its first decode (writes position 69) reads 73
    fault["mode"] = None
    step(eng)
    bad = of(rt, "read_extent_mismatch")
    assert [(v.blocks, v.owners, v.actor) for v in bad] == [
        (a_blocks[1:3], [full], full), ([a_blocks[2]], [full], full)], \
        [(v.kind, v.blocks, v.message) for v in rt.violations()]
    assert [(v.details[0]["read_extent"], v.details[0]["written_extent"]) for v in bad] == [
        (2 * BS - 16, 2 * BS + 5), (2 * BS + 9, 2 * BS + 6)]
    assert "leaving out the KV of its newest 21" in bad[0].message
    assert "the last 3 of which it never wrote" in bad[1].message
    drain(eng)


def test_a_prefix_hit_entry_listing_another_block_is_block_table_mismatch(eng, rt, monkeypatch):
    """B is served A's two prefix blocks as hits, but its worker row lists
    one of C's sealed blocks at entry 0: B's attention reads C's KV there.
    B writes nothing through that entry, so only the row check sees it:
    reported once, with the block B reads, B as owner and actor, and the
    entry's block on both sides."""
    from vllm.v1.worker.block_table import BlockTable

    other = [(11 * i) % 480 + 3 for i in range(PREFIX_BLOCKS * BS)]
    add(eng, "C", other + [4] * 3, max_tokens=12)
    add(eng, "A", PREFIX + [11] * 5, max_tokens=12)
    step(eng, 4)  # both prompts computed (48 tokens a step)
    _, c_blocks = block_ids(eng, "C")
    _, a_blocks = block_ids(eng, "A")
    wrong = c_blocks[0]
    original = BlockTable.add_row
    fired = []

    def add_row(self, ids, row_idx):
        if not fired and list(ids[:2]) == a_blocks[:2]:  # B's row: A's prefix hits
            ids = [wrong] + list(ids[1:])
            fired.append(row_idx)
        return original(self, ids, row_idx)

    monkeypatch.setattr(BlockTable, "add_row", add_row)
    add(eng, "B", PREFIX + [22] * 5, max_tokens=4)
    step(eng, 2)
    b_full, b_blocks = block_ids(eng, "B")
    assert fired and b_blocks[:2] == a_blocks[:2]
    drain(eng)
    bad = of(rt, "block_table_mismatch")
    assert [(v.blocks, v.owners, v.actor) for v in rt.violations()] == [([wrong], [b_full], b_full)]
    assert bad[0].details == [{"request": b_full, "entry": 0, "table": wrong,
                               "given": a_blocks[0]}]
    assert f"lists block {wrong} at entry 0 where it was given block {a_blocks[0]}" \
        in bad[0].message


def test_a_row_moved_without_its_first_entry_is_block_table_mismatch(eng, rt, monkeypatch):
    """When a request leaves, vLLM condenses the batch: the last row moves
    into the hole. A move that leaves the row's first entry behind has the
    moved request read whatever the hole's entry held (the null block once
    the leaver's row was cleared). The moved request's writes go through
    its last entry only, so only the row check sees it."""
    from vllm.v1.worker.block_table import BlockTable

    original = BlockTable.move_row
    moved = []

    def move_row(self, src, tgt):
        keep = int(self.block_table.np[tgt, 0])
        original(self, src, tgt)
        if not moved:
            self.block_table.np[tgt, 0] = keep
            moved.append(keep)

    add(eng, "A", PREFIX + [3] * 5, max_tokens=12)
    add(eng, "B", [(13 * i) % 470 + 2 for i in range(40)], max_tokens=1)
    add(eng, "C", [(17 * i) % 460 + 5 for i in range(2 * BS + 3)], max_tokens=12)
    monkeypatch.setattr(BlockTable, "move_row", move_row)
    step(eng, 4)  # B finishes after its first token; C's row moves into its hole
    c_full, c_blocks = block_ids(eng, "C")
    drain(eng)
    assert moved, "the batch was never condensed"
    bad = of(rt, "block_table_mismatch")
    assert [(v.blocks, v.owners, v.actor) for v in rt.violations()] == [
        ([moved[0]], [c_full], c_full)]
    assert bad[0].details == [{"request": c_full, "entry": 0, "table": moved[0],
                               "given": c_blocks[0]}]


def test_clean_traffic_has_its_sealed_blocks_checked_for_their_inputs(eng, rt, monkeypatch):
    """The check runs on this engine (V1 runner, no async scheduling) on
    the blocks sealed with their producer still in the worker view, and
    finds nothing in clean traffic (shared prefixes, cancellations,
    eviction and preemption)."""
    from kvsan.harness import traffic

    dc = device()
    assert dc.on_sealed is not None
    seen = []
    check = dc.on_sealed
    monkeypatch.setattr(dc, "on_sealed", lambda d, sealed: (seen.extend(sealed), check(d, sealed)))
    traffic.run(eng, seed=5, groups=3, per_group=3)
    assert len(seen) >= 6 and [v.kind for v in rt.violations()] == []


def test_a_blocks_request_tokens_span_prompt_and_output():
    """Where a block's positions cross from the prompt into the output the
    request's tokens are read from both; a block the request has not
    produced every token of yet has none to compare (None)."""
    from kvsan.hooks.vllm.inputs import request_tokens, token_digest

    prompt, output = [1, 2, 3, 4, 5], [6, 7, 8]
    assert request_tokens(prompt, output, 0, 4) == [1, 2, 3, 4]
    assert request_tokens(prompt, output, 4, 4) == [5, 6, 7, 8]
    assert request_tokens(prompt, output, 8, 4) is None
    assert request_tokens(prompt, [6], 4, 4) is None
    assert request_tokens([1, 2], [3, 4, 5, 6], 4, 2) == [5, 6]
    assert token_digest([1, 2]) != token_digest([2, 1]) and len(token_digest([1])) == 16


def _scenario(name):
    """Faults that corrupt the allocator's counts leave the engine unusable,
    so each runs in its own in-process engine, in a child process."""
    import subprocess
    import sys

    from kvsan.harness.enginedrive import read_marked

    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__),
                                                        "device_scenarios.py"), name],
                          capture_output=True, text=True, timeout=600)
    got = [r for r in map(lambda x: read_marked(x, "RESULT "), proc.stdout.splitlines()) if r]
    assert got, proc.stderr[-3000:]
    return got[-1]


def test_early_free_then_reuse_seen_from_the_device():
    r = _scenario("early_free_reuse")
    dev = [v for v in r["violations"] if v["kind"] == "reuse_with_live_owners"
           and v["site"] == "worker"]
    assert dev, r["violations"]
    assert all(v["owners"] == [r["b"]] for v in dev)
    assert {v["blocks"][0] for v in dev} <= set(r["b_prefix"])
    assert all(v["actor"].startswith("C") for v in dev)


def test_poisoned_early_free_shows_in_the_output():
    """A private block freed under its reader is NaN-filled: the stale read
    shows up as non-finite logprobs or a parity failure instead of passing by
    luck; without poisoning the same fault stays invisible in the output."""
    r = _scenario("poison")
    assert r["poisoned"] > 0
    assert r["tokens"] != r["ref_tokens"] or not all(r["finite"])
    fwl = [v for v in r["violations"] if v["kind"] == "free_with_live_owners"]
    assert fwl and fwl[0]["owners"] == [r["b"]]


def test_quarantine_keeps_a_premature_free_out_of_reuse():
    r = _scenario("quarantine")
    assert r["finished"] > 0 and r["clean_violations"] == []
    assert r["victim"] not in r["c_blocks"]  # C was not handed the freed block
    fwl = [v for v in r["violations"] if v["kind"] == "free_with_live_owners"]
    assert fwl and fwl[0]["blocks"] == [r["victim"]] and fwl[0]["owners"] == [r["b"]]
    assert not [v for v in r["violations"] if v["kind"] == "reuse_with_live_owners"]


def test_v2_prepare_attn_guard_adapter(kvsan_rt):
    """No GPU here: the V2 runner cannot run on CPU.  This drives kvsan's V2
    adapter with prepare_attn's documented output ([groups, tokens] slot
    mappings) and V2's InputBatch fields, against a real DeviceChecker, so a
    bad slot is caught the same way as on V1."""
    import types

    import torch

    from kvsan.checks.device import DeviceChecker
    from kvsan.hooks.vllm import worker as vllm_worker

    kvsan_rt.clear()
    dc = DeviceChecker(8, BS, emit=kvsan_rt.reporter.emit)
    dc.add_step([("P", [1, 2], 0), ("Q", [3], 0)])
    class Runner:  # stands for V2's GPUModelRunner (weak-referenced key)
        pass

    runner = Runner()
    vllm_worker._checkers[runner] = dc
    batch = types.SimpleNamespace(req_ids=["P", "Q"], num_reqs=2, num_tokens=3,
                                  num_scheduled_tokens=__import__("numpy").array([2, 1]))
    slots = torch.tensor([[1 * BS + 5, 2 * BS + 0, 1 * BS + 6, -1]])  # Q writes P's block 1
    vllm_worker._prepare_attn_v2(lambda b: (None, slots), runner, (batch,), {})
    bad = [v for v in kvsan_rt.violations() if v.kind == "overwrite_shared_block"]
    assert [(v.blocks, v.actor) for v in bad] == [([1], "Q")]
    # adaptive speculative verification: Q's draft trimmed on the device, the
    # tokens per request no longer add up to the slot mapping.  No writer per
    # token, so no ownership check, but the writes count: Q's block 3 fills
    # and is sealed, and R's hit on it is no uninitialized hit
    kvsan_rt.clear()
    batch = types.SimpleNamespace(req_ids=["P", "Q"], num_reqs=2, num_tokens=BS,
                                  num_scheduled_tokens=__import__("numpy").array([1, BS]))
    slots = torch.tensor([[3 * BS + i for i in range(BS)] + [-1]])
    vllm_worker._prepare_attn_v2(lambda b: (None, slots), runner, (batch,), {})
    dc.will_seal([3])
    dc.seal([torch.zeros(8, 2, BS, 3)])
    assert 3 in dc.sealed
    hits, _ = dc.add_step([("R", [3, 4], 1)])
    dc.note_hits(hits)
    dc.check_hits_written()
    assert kvsan_rt.violations() == []
    del vllm_worker._checkers[runner]


def test_runner_shutdown_reports_what_is_still_on_its_way(kvsan_rt):
    """On a GPU in log mode a step's guard and checksums come back after the
    step; the runner's shutdown hook checks them before vLLM releases the
    cache, so a scribble found by the last verification is reported (forced
    deferred here, on CPU tensors), and vLLM's shutdown still runs."""
    import torch

    from kvsan.checks.device import DeviceChecker
    from kvsan.hooks.vllm import worker as vllm_worker

    kvsan_rt.clear()
    dc = DeviceChecker(8, BS, emit=kvsan_rt.reporter.emit, checksum="all",
                       defer_guard=True, defer_sums=True)
    layers = [torch.randn(8, 2, BS, 3)]
    dc.add_step([("P", [1], 0)])
    dc.guard(torch.arange(BS, 2 * BS), ["P"], [BS])
    dc.will_seal([1])
    dc.seal(layers)  # the guard is checked here; the checksums are on their way
    dc.verify_step(layers)  # takes up the seal's sums, queues a verification
    layers[0][1].view(-1)[3] += 1  # (after the verification was queued)
    dc.verify_step(layers)  # queues one that sees the scribble
    assert dc.pending_sums and kvsan_rt.violations() == []

    class Runner:  # stands for the GPUModelRunner (a weak-referenced key)
        pass

    runner, ran = Runner(), []
    vllm_worker._checkers[runner] = dc
    vllm_worker._shutdown(lambda: ran.append(len(kvsan_rt.violations())), runner, (), {})
    del vllm_worker._checkers[runner]
    assert ran == [1]  # reported before vLLM's shutdown ran
    (v,) = kvsan_rt.violations()
    assert (v.kind, v.blocks, v.owners) == ("checksum_mismatch", [1], ["P"])
    assert not dc.pending_sums


def test_runner_shutdown_runs_after_a_raised_violation_and_keeps_nothing(kvsan_rt):
    """In raise mode a violation found at shutdown (here: the last step's
    deferred write guard, Q writing P's block) propagates, and vLLM's own
    shutdown still runs before it does; a step left unsealed is dropped
    with the runner, so nothing of kvsan's keeps its cache alive."""
    import weakref

    import torch

    from kvsan.checks.device import DeviceChecker
    from kvsan.config import Config
    from kvsan.hooks.vllm import worker as vllm_worker
    from kvsan.report import KVSanViolation

    kvsan_rt.clear()
    cfg = kvsan_rt.config
    kvsan_rt.config = kvsan_rt.reporter.config = Config(enabled=True, log_events=False,
                                                        mode="raise")
    try:
        dc = DeviceChecker(8, BS, emit=kvsan_rt.reporter.emit, defer_guard=True)
        dc.add_step([("P", [1], 0), ("Q", [2], 0)])
        dc.guard(torch.tensor([BS + 1]), ["Q"], [1])  # deferred: checked later

        class Runner:  # stands for the GPUModelRunner (a weak-referenced key)
            pass

        runner, ran = Runner(), []
        vllm_worker._checkers[runner] = dc
        vllm_worker._unsealed[id(runner)] = (weakref.ref(runner), dc, [])
        with pytest.raises(KVSanViolation):
            vllm_worker._shutdown(lambda: ran.append(True), runner, (), {})
        del vllm_worker._checkers[runner]
        assert ran == [True] and id(runner) not in vllm_worker._unsealed
        assert [v.kind for v in kvsan_rt.violations()] == ["overwrite_shared_block"]
    finally:
        kvsan_rt.config = kvsan_rt.reporter.config = cfg


def test_worker_request_interning_is_bounded_and_clears_producers():
    """The worker's request-id interning recycles ints: it grows with the
    requests live at once, not with every request ever seen, and a dropped
    request stops being the producer of its blocks."""
    from kvsan.checks.device import DeviceChecker

    dc = DeviceChecker(64, 16, emit=lambda v: None)
    for i in range(1000):
        rid = f"req-{i}"
        dc.add_step([(rid, [1 + i % 8, 9 + i % 8], 0)])
        assert int(dc.lut[1 + i % 8]) == dc._rid_int[rid]
        dc.drop_request(rid)
        assert int(dc.lut[1 + i % 8]) == -1 and int(dc.lut[9 + i % 8]) == -1
    assert len(dc._int_rid) == 1 and not dc._rid_int


def test_sampled_checksums_find_a_scribble_within_one_sweep():
    """``sample:N``: sealed blocks nobody hits are still re-verified, N per
    step on average in batches, so a scribble is found within one sweep."""
    import torch

    from kvsan.checks.device import DeviceChecker

    found = []
    dc = DeviceChecker(16, 4, emit=found.append, checksum="sample", checksum_sample=1)
    layers = [torch.zeros(16, 4, 2), torch.zeros(16, 4, 2)]  # block-major
    dc.add_step([("r", [1, 2, 3], 0)])
    dc.will_seal([1, 2, 3])
    dc.guard(torch.arange(4, 16), ["r"], [12])  # slots 4..15: blocks 1..3, all written
    dc.seal(layers)
    assert sorted(dc.sealed) == [1, 2, 3]
    layers[1][2, 1, 0] = 7.0  # scribble into layer 1 of block 2, between steps
    for _ in range(3 * DeviceChecker.SAMPLE_BATCH_STEPS):
        dc.verify_step(layers)
    assert [(v.kind, v.blocks, v.details[0]["layers"], v.details[0]["check"])
            for v in found] == [("checksum_mismatch", [2], [1], "sampled")]
