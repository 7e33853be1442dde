"""The worker side's native hooks on the real engine (in-process, V1 runner,
default settings: sampled checksums, no poison).  ``kvsan._native._hookfast``'s
STEP hook begins quiet steps (most decode steps) without the Python hook,
and its GUARD hook runs the write guard's common step; these tests show
that both are in use, that they report a fault injected in a quiet step
with its exact kind, block and owners, and that a run through them leaves
the device checker exactly as the Python hooks leave it."""

import os
import sys

import pytest

from kvsan.config import Config

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                                 reason="kvsan's C modules are built for CPython 3.11")]

BS = 32
PREFIX = [(11 * i) % 500 + 1 for i in range(2 * BS)]


@pytest.fixture(scope="module")
def engine(kvsan_rt):
    from vllm import LLM

    from kvsan.harness import traffic
    from kvsan.harness.tinymodel import ensure_tiny_model

    kvsan_rt.config = kvsan_rt.reporter.config = Config(enabled=True, log_events=False)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kw = traffic.engine_kwargs(ensure_tiny_model(), num_blocks=16)
    kw.update(max_num_batched_tokens=96, max_num_seqs=4, max_model_len=320)
    llm = LLM(**kw)
    yield llm
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)


@pytest.fixture
def eng(engine, rt):
    from kvsan import hooks

    assert hooks.HOOKFAST is not None, "kvsan._native._hookfast must be in use here"
    assert engine.reset_prefix_cache()
    rt.clear()
    return engine


def hook(attr):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvsan import hooks

    runner = mine()
    h = hooks.native_hook(getattr(type(runner), attr))
    assert h is not None, f"{type(runner).__name__}.{attr} has no native hook"
    assert issubclass(type(runner), GPUModelRunner)
    return h


def mine():
    from kvsan.hooks.vllm import worker as vllm_worker

    ref, dc = vllm_worker._LAST_CHECKER
    assert ref is not None and dc is not None
    return ref()


def device():
    from kvsan.hooks.vllm import worker as vllm_worker

    return vllm_worker._LAST_CHECKER[1]


def add(llm, rid, prompt, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), p)


def step(llm, n=1):
    for _ in range(n):
        llm.llm_engine.step()


def drain(llm):
    while llm.llm_engine.has_unfinished_requests():
        step(llm)


def block_ids(llm, rid):
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    full = next(r for r in sched.requests if r == rid or r.startswith(rid + "-"))
    return full, sched.kv_cache_manager.get_block_ids(full)[0]


def of(rt, kind):
    return [v for v in rt.violations() if v.kind == kind]


def _python_hooks_only(monkeypatch):
    """The worker's Python hooks for every step: the native hooks never get
    their state (they hand every call to the Python hook, whole)."""
    from kvsan.hooks.vllm import worker as vllm_worker

    monkeypatch.setattr(vllm_worker, "_hand_to_native", lambda rt, cls: None)
    for attr in ("execute_model", "_prepare_inputs"):
        hook(attr).state = None


def _seeded_run(llm, rt) -> dict:
    """The same traffic from the same start: what the device checker did."""
    from kvsan.harness import traffic
    from kvsan.hooks import flush_overhead

    assert llm.reset_prefix_cache()
    dc = device()
    dc._tick = 0  # the sampled batches fall on the same steps
    before = dict(dc.counters)
    flush_overhead()
    device_s = rt.device_s
    calls = {a: hook(a).calls for a in ("execute_model", "_prepare_inputs")}
    res = traffic.run(llm, seed=3, groups=3, per_group=3)
    flush_overhead()
    return {"outputs": res.outputs, "steps": res.steps, "tick": dc._tick,
            "counters": {k: v - before.get(k, 0) for k, v in dc.counters.items()},
            "sealed": len(dc.sealed), "violations": [v.kind for v in rt.violations()],
            "native": {a: hook(a).calls - n for a, n in calls.items()},
            "device_s": rt.device_s - device_s}


def test_native_steps_leave_the_checker_as_the_python_hooks_do(eng, rt, monkeypatch):
    step(eng)  # (the runner's checker exists)
    add(eng, "warm", PREFIX + [1], max_tokens=2)
    drain(eng)
    native = _seeded_run(eng, rt)
    _python_hooks_only(monkeypatch)
    python = _seeded_run(eng, rt)
    assert native["violations"] == python["violations"] == []
    # most steps were begun (and every step guarded) without the Python hooks
    assert native["native"]["execute_model"] > native["steps"] // 3
    assert native["native"]["_prepare_inputs"] > native["steps"] // 2
    assert python["native"] == {"execute_model": 0, "_prepare_inputs": 0}
    assert native["device_s"] > 0  # their own time reaches rt.device_s
    # (the rows swept besides those that changed follow the row checks,
    # which the Python hooks run at every step, the native ones at the steps
    # that changed the worker view or the batch's order)
    assert python["counters"].pop("rows_swept") >= native["counters"].pop("rows_swept") > 0
    for key in ("outputs", "steps", "tick", "counters", "sealed"):
        assert native[key] == python[key], key
    assert native["counters"]["verified"] > 0 and native["counters"]["guarded_tokens"] > 0


def test_write_into_a_sealed_shared_block_in_a_quiet_step(eng, rt):
    """A decode step with nothing for the worker view to apply is begun in
    C; the slot mapping its batch writes still goes through the guard."""
    import wrapt
    from vllm.v1.worker.block_table import BlockTable

    add(eng, "A", PREFIX + [11] * 5, max_tokens=40)
    step(eng, 2)
    add(eng, "B", PREFIX + [22] * 5, max_tokens=40)
    step(eng, 3)  # B hit the prefix and is decoding, as A is
    a_full, a_blocks = block_ids(eng, "A")
    b_full, b_blocks = block_ids(eng, "B")
    shared = a_blocks[0]
    assert b_blocks[0] == shared and shared in device().sealed
    begun, guarded = hook("execute_model").calls, hook("_prepare_inputs").calls
    fired = []

    def corrupt(wrapped, instance, args, kwargs):
        ret = wrapped(*args, **kwargs)
        if not fired:  # one bad slot: the batch's newest token written into `shared`
            n = int(args[2].shape[0]) if len(args) > 2 else int(kwargs["positions"].shape[0])
            sm = instance.slot_mapping.gpu
            sm[n - 1] = shared * BS + int(sm[n - 1]) % BS
            fired.append(True)
        return ret

    original = BlockTable.__dict__["compute_slot_mapping"]
    wrapt.wrap_function_wrapper(BlockTable, "compute_slot_mapping", corrupt)
    try:
        step(eng)
    finally:
        BlockTable.compute_slot_mapping = original
    assert hook("execute_model").calls == begun + 1  # a quiet step, begun in C
    assert hook("_prepare_inputs").calls == guarded + 1
    bad = of(rt, "overwrite_shared_block")
    assert len(bad) == 1 and bad[0].blocks == [shared]
    assert set(bad[0].owners) == {a_full, b_full}
    assert bad[0].actor in (a_full, b_full)
    assert "sealed" in bad[0].message
    drain(eng)


def test_a_row_added_back_in_a_quiet_step_is_checked(eng, rt, monkeypatch):
    """A running request the scheduler leaves out of a step (its token
    budget spent) leaves the runner's batch, and is added back from the
    runner's state when it is scheduled again: the rows change in steps
    that change nothing in the worker view (no new, finished or resumed
    request, no new block), which the STEP hook begins in C.  A row added
    back whose first entry lists another request's block has the request
    read that block's KV; it writes through its last entry only and ends
    before it needs a new block, so only a row check in that quiet step
    sees it."""
    from vllm.v1.worker.block_table import BlockTable

    sched = eng.llm_engine.engine_core.engine_core.scheduler
    budget = sched.max_num_scheduled_tokens
    add(eng, "A", PREFIX + [11] * 5, max_tokens=20)
    add(eng, "C", [(17 * i) % 460 + 5 for i in range(2 * BS + 3)], max_tokens=12)
    step(eng, 3)  # both prefilled, both decoding
    a_full, a_blocks = block_ids(eng, "A")
    c_full, c_blocks = block_ids(eng, "C")
    assert len(a_blocks) == len(c_blocks) == 3
    batch = mine().input_batch
    assert batch.req_ids[:batch.num_reqs] == [a_full, c_full]
    begun = hook("execute_model").calls
    sched.max_num_scheduled_tokens = 1  # one token, A's: C is left out
    try:
        step(eng)
    finally:
        sched.max_num_scheduled_tokens = budget
    assert batch.req_ids[:batch.num_reqs] == [a_full]
    original = BlockTable.add_row
    added = []

    def add_row(self, block_ids, row_idx):
        original(self, block_ids, row_idx)
        if list(block_ids) == c_blocks and not added:
            self.block_table.np[row_idx, 0] = a_blocks[0]
            added.append(row_idx)

    monkeypatch.setattr(BlockTable, "add_row", add_row)
    step(eng)  # C added back, its row's first entry A's block
    assert added and hook("execute_model").calls == begun + 2  # both steps begun in C
    assert block_ids(eng, "C")[1] == c_blocks
    drain(eng)
    bad = of(rt, "block_table_mismatch")
    assert [(v.kind, v.blocks, v.owners, v.actor) for v in rt.violations()] == [
        ("block_table_mismatch", [a_blocks[0]], [c_full], c_full)]
    assert bad[0].details == [{"request": c_full, "entry": 0, "table": a_blocks[0],
                               "given": c_blocks[0]}]


def test_a_row_rewritten_in_place_is_found_by_the_row_sweep(eng, rt):
    """A decoding request's block-table row rewritten in place (its first
    entry another request's block) while the request stays at its row and
    gets no block: no step changes anything the row check follows, and the
    request ends before it needs a new block.  The rows swept besides
    those that changed find it at the next row check (a request joining
    the batch), with its block, owner and entry."""
    from kvsan.checks.device import DeviceChecker

    add(eng, "A", PREFIX + [11] * 5, max_tokens=20)
    add(eng, "C", [(17 * i) % 460 + 5 for i in range(2 * BS + 3)], max_tokens=12)
    step(eng, 3)  # both prefilled, both decoding, in 3 blocks to their end
    a_full, a_blocks = block_ids(eng, "A")
    c_full, c_blocks = block_ids(eng, "C")
    batch = mine().input_batch
    assert batch.req_ids[:batch.num_reqs] == [a_full, c_full]
    batch.block_table.block_tables[0].block_table.np[1, 0] = a_blocks[0]  # C reads A's KV
    begun = hook("execute_model").calls
    step(eng)
    assert hook("execute_model").calls == begun + 1  # a quiet step, begun in C
    assert rt.violations() == []
    dc = device()
    dc._row_sweep = 1  # (the sweep's turn at C's row: 2 rows of 3 a check)
    assert DeviceChecker.ROW_SWEEP == 2
    add(eng, "D", [7] * 5, max_tokens=2)
    step(eng)  # D joins: the step is begun in Python, and its rows checked
    assert [(v.kind, v.blocks, v.owners, v.actor) for v in rt.violations()] == [
        ("block_table_mismatch", [a_blocks[0]], [c_full], c_full)]
    assert of(rt, "block_table_mismatch")[0].details == [
        {"request": c_full, "entry": 0, "table": a_blocks[0], "given": c_blocks[0]}]
    assert block_ids(eng, "C")[1] == c_blocks  # (no block since)
    drain(eng)
    assert len(rt.violations()) == 1  # reported once


def test_a_block_cached_under_other_tokens_in_a_quiet_step(eng, rt, monkeypatch):
    """The scheduler appends one sampled token other than the one the
    worker sampled and feeds (its copy of the request diverges from the
    worker's): the block that fills with it during decode is cached, in a
    quiet step begun in C, under tokens the worker did not compute its KV
    from.  The block's token links travel with that step's payload to the
    checker (the STEP hook hands them to ``will_seal``), and the block is
    reported when it is sealed; the blocks before are clean."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.update_from_output
    changed = []

    def update_from_output(self, scheduler_output, model_runner_output):
        for rid, i in model_runner_output.req_id_to_index.items():
            req = self.requests.get(rid)
            sampled = model_runner_output.sampled_token_ids[i]
            if req is not None and rid.startswith("A") and req.num_output_tokens == 3 \
                    and sampled and not changed:
                sampled = list(sampled)
                sampled[0] = sampled[0] % 499 + 1
                model_runner_output.sampled_token_ids[i] = sampled
                changed.append(len(req.prompt_token_ids) + 3)  # its position
        return original(self, scheduler_output, model_runner_output)

    monkeypatch.setattr(Scheduler, "update_from_output", update_from_output)
    add(eng, "A", PREFIX + [11] * 5, max_tokens=3 * BS - 69 + 2)  # fills block 2 in decode
    step(eng, 3)
    a_full, a_blocks = block_ids(eng, "A")
    begun = hook("execute_model").calls
    drain(eng)
    assert changed == [72] and hook("execute_model").calls - begun > 10
    bad = of(rt, "input_token_mismatch")
    assert [(v.kind, v.blocks, v.owners, v.actor) for v in rt.violations()] == [
        ("input_token_mismatch", [a_blocks[2]], [a_full], a_full)]
    assert bad[0].details[0]["against"] == "scheduler"
    assert bad[0].details[0]["first_position"] == 2 * BS


def test_sampled_checksums_in_quiet_steps_find_a_scribble(eng, rt):
    """Quiet steps keep the sampling tick: the sealed block a stray write
    changed is re-verified within one sweep of decode steps."""
    from kvsan.checks.device import DeviceChecker
    from kvsan.hooks.vllm.worker import _layers

    add(eng, "A", PREFIX + [11] * 5, max_tokens=60)
    step(eng, 2)
    _, a_blocks = block_ids(eng, "A")
    target = a_blocks[1]
    dc = device()
    assert target in dc.sealed and dc.checksum == "sample"
    begun = hook("execute_model").calls
    _layers(mine())[0][target].view(-1)[5] += 1.0  # a stray write, no allocator call
    step(eng, 3 * DeviceChecker.SAMPLE_BATCH_STEPS)
    assert hook("execute_model").calls - begun > DeviceChecker.SAMPLE_BATCH_STEPS
    bad = of(rt, "checksum_mismatch")
    assert [(v.blocks, v.details[0]["layers"], v.details[0]["check"]) for v in bad] == [
        ([target], [0], "sampled")]
    a_full, _ = block_ids(eng, "A")
    assert a_full in bad[0].owners
    drain(eng)


def test_bad_hook_state_is_refused(eng):
    import weakref

    h = hook("execute_model")
    with pytest.raises(TypeError, match="STEP hook"):
        h.state = (weakref.ref(mine()), [None, None], None)
    with pytest.raises(TypeError, match="GUARD hook"):
        hook("_prepare_inputs").state = (weakref.ref(mine()), [None, None], {})


def test_a_seal_left_and_the_sampled_batches_stay_in_c(eng, rt):
    """The step after one whose blocks were cached (left unsealed) and the
    steps whose sampled checksum batch is due are begun by the native STEP
    hook (it seals and samples through the Python calls it was handed),
    not sent to the Python hook whole; the batches still verify."""
    from kvsan.checks.device import DeviceChecker

    n = 2 * DeviceChecker.SAMPLE_BATCH_STEPS
    add(eng, "A", PREFIX + [11] * 5, max_tokens=n + 2)
    step(eng)  # the prompt: two full blocks cached, sealed when the next step begins
    dc = device()
    assert dc.pending_seal
    begun, verified = hook("execute_model").calls, dc.counters["verified"]
    step(eng, n)  # decode, no block filled or added (69 + 16 < 3 * BS)
    assert not dc.pending_seal and len(dc.sealed) >= 2
    assert hook("execute_model").calls - begun == n
    assert dc.counters["verified"] - verified >= 2  # two batches, each over the sealed blocks
    assert rt.violations() == []
    drain(eng)


def _finished_with_cached_prefix(llm, rid):
    """Request ``rid`` over PREFIX (two full blocks) run to its end: its
    prefix blocks stay cached in vLLM's free queue, held by nobody.
    Returns (its full id, its two prefix blocks)."""
    add(llm, rid, PREFIX + [11] * 5, max_tokens=4)
    step(llm, 2)
    full, blocks = block_ids(llm, rid)
    drain(llm)
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert all(pool.blocks[b].block_hash is not None and pool.blocks[b].ref_cnt == 0
               for b in blocks[:2])  # cached and free: servable as prefix hits
    return full, blocks[:2]


def test_a_scribble_on_a_cached_block_nobody_holds_is_found_by_the_scrub(eng, rt):
    """A's prefix blocks stay cached after A ends, held by nobody; a stray
    write changes one.  No request is served it and none evicts it (B's
    prompt shares nothing and the pool has room), yet the sampled scrub
    finds it on the batch's spare budget, naming A, who last held it."""
    from kvsan.checks.device import DeviceChecker
    from kvsan.hooks.vllm.worker import _layers

    a_full, prefix = _finished_with_cached_prefix(eng, "A")
    target = prefix[1]
    dc = device()
    _layers(mine())[0][target].view(-1)[9] += 1.0  # a stray write, no allocator call
    add(eng, "B", [(5 * i) % 400 + 1 for i in range(40)], max_tokens=40)
    step(eng, 2 * DeviceChecker.SAMPLE_BATCH_STEPS)
    assert target in dc.sealed and target not in dc.holders  # never evicted nor served
    bad = of(rt, "checksum_mismatch")
    assert [(v.blocks, v.owners, v.details[0]["layers"], v.details[0]["check"])
            for v in bad] == [([target], [a_full], [0], "sampled, held by nobody")]
    assert dc.counters["verified_unheld"] > 0
    drain(eng)


def test_a_scribble_on_a_cached_block_nobody_holds_is_found_when_it_is_evicted(eng, rt):
    """As above, but no sampled batch runs (the tick is held back) and C
    and D take every free block: A's prefix blocks are evicted and handed
    to D under pressure.  The scribble is found as vLLM evicts the block,
    before D's forward writes it, naming A; D's own new KV in the reused
    blocks is not reported."""
    from kvsan.hooks.vllm.worker import _layers

    a_full, prefix = _finished_with_cached_prefix(eng, "A")
    target = prefix[1]
    dc = device()
    _layers(mine())[1][target].view(-1)[3] += 1.0
    add(eng, "C", [(3 * i) % 400 + 1 for i in range(300)], max_tokens=30)
    add(eng, "D", [(7 * i) % 300 + 2 for i in range(150)], max_tokens=30)
    evicted = False
    while eng.llm_engine.has_unfinished_requests():
        dc._tick = 0  # no sampled batch: only the eviction can find it
        step(eng)
        evicted = evicted or target not in dc.sealed
        if evicted:
            break
    assert evicted and dc.counters["verified_evicted"] >= 1
    d_full, d_blocks = block_ids(eng, "D")
    assert target in d_blocks  # reused under pressure
    bad = of(rt, "checksum_mismatch")
    assert [(v.blocks, v.owners, v.details[0]["layers"], v.details[0]["check"])
            for v in bad] == [([target], [a_full], [1], "at eviction")]
    drain(eng)
    assert len(of(rt, "checksum_mismatch")) == 1 and len(rt.violations()) == 1


def test_clean_traffic_with_heavy_eviction_is_clean(eng, rt):
    """Seeded traffic on a 16-block pool: cached blocks are evicted and
    reused (LIFO off the free queue) all the time and requests end while
    others keep their prefixes; every evicted sealed block is verified
    before its reuse and the unheld ones are scrubbed, with no report."""
    from kvsan.harness import traffic

    dc = device()
    before = dict(dc.counters)
    res = traffic.run(eng, seed=7, groups=5, per_group=4)
    assert res.finished > 0
    assert rt.violations() == []
    assert dc.counters["verified_evicted"] - before["verified_evicted"] > 5
    assert dc.counters["verified_unheld"] - before["verified_unheld"] > 5
