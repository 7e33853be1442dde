"""Production mode (``KVSAN_SAMPLE``) on vLLM's real ``Scheduler``: a fault
on a sampled request is reported with its exact kind, block, owners and
actor; the same fault on an unsampled request is not (and the engine's own
state shows the fault happened: the sampling decision is the only
difference); an unsampled request dropping a sampled request's reference is
caught; clean traffic (shared prefixes, aborts, preemption, eviction,
fenced frees, connector delays) stays at 0 violations."""

import contextlib

import pytest

from conftest import kinds_of, only
from test_scheduler_paths import PREFIX, model_output, request

pytestmark = pytest.mark.engine


@contextlib.contextmanager
def production(rate, native=True, report=None, seed=7):
    """kvsan in production mode in this process for the block's duration;
    the session's full-mode install put back after it."""
    from kvsan import hooks, plugin
    from kvsan import runtime as _rt
    from kvsan.config import Config
    from kvsan.hooks.vllm import INSTRUMENTOR

    old = _rt.get()
    INSTRUMENTOR.uninstrument()
    _rt.set_runtime(None)
    rt = plugin.install(Config(enabled=True, log_events=False, sample=rate, sample_seed=seed,
                               native=native, report=report), role="engine")
    rt.sampler.epoch_requests = 10 ** 9  # (one epoch: the ids picked below stay decided)
    try:
        yield rt
        # (this runtime's own failures: the session fixture watches the session's only)
        assert rt.reporter.internal_errors == 0, sorted(rt.reporter._error_sites)
    finally:
        plugin.uninstall()
        if old is not None:
            _rt.set_runtime(old)
            old.native = hooks.use_native(old.config.native)
            INSTRUMENTOR.instrument(old, old.config)
        else:
            hooks.use_native(True)


def pick(rt, sampled: bool, stem: str) -> str:
    """A request id the sampler decides ``sampled`` for (this epoch)."""
    for i in range(10000):
        rid = f"{stem}{i}"
        if rt.sampler.would_sample(rid) == sampled:
            return rid
    raise AssertionError("no such id")


def scheduler(n=8, blocks=64):
    from benchmarks.sched import make_scheduler

    return make_scheduler(n, blocks)


def steps(sched, k):
    for _ in range(k):
        out = sched.schedule()
        sched.update_from_output(out, model_output(sched, out))


def abort(sched, *rids):
    from vllm.v1.request import RequestStatus

    sched.finish_requests(list(rids), RequestStatus.FINISHED_ABORTED)


def tables(sched, rid):
    return [b.block_id for b in sched.kv_cache_manager.coordinator.single_type_managers[0]
            .req_to_blocks.get(rid, ())]


# ------------------------------------------------------------ faults
@pytest.mark.parametrize("native", [True, False], ids=["native", "KVSAN_NATIVE=0"])
@pytest.mark.parametrize("victim_sampled", [True, False], ids=["sampled", "unsampled"])
def test_double_unref_on_abort(native, victim_sampled):
    """A (never sampled) is aborted and its cancel path drops its prefix
    references twice: the blocks B still reads go back to the free queue.
    Reported, naming B and A, exactly when B is sampled."""
    from kvsan import hooks
    from kvsan.hooks.vllm import faults

    with production(0.5, native=native) as rt:
        if native and hooks.HOOKFAST is not None:  # admission: the native ADMIT_ALL route
            from vllm.v1.core.sched.scheduler import Scheduler

            hook = hooks.native_hook(Scheduler.__dict__["add_request"])
            assert hook.kind == hooks.HOOKFAST.ADMIT_ALL
        a = pick(rt, False, "A")
        b = pick(rt, victim_sampled, "B")
        faults.inject("double_unref_on_abort")
        try:
            sched = scheduler()
            sched.add_request(request(a, [900] * 5))
            sched.add_request(request(b, [901] * 5))
            steps(sched, 2)
            shared = tables(sched, b)[:3]
            assert shared == tables(sched, a)[:3]
            abort(sched, a)
        finally:
            faults.clear()
        pool = sched.kv_cache_manager.block_pool
        # the fault happened either way: B still lists blocks the pool holds free
        assert all(pool.blocks[x].ref_cnt == 0 for x in shared) and tables(sched, b)[:3] == shared
        if not victim_sampled:
            assert kinds_of(rt) == []
            return
        v = only(rt, "free_with_live_owners")
        assert sorted(x.blocks[0] for x in v) == sorted(shared)
        assert all(x.owners == [b] and x.actor == a for x in v)
        assert all("faults.py:_double_unref_on_abort" in x.site for x in v)
        assert v[0].details[0]["owners"][b]["site"]  # B's acquire, with its site


def test_unsampled_release_of_sampled_block():
    """An unsampled request's stray release (a reference it never held) of
    a block only a sampled request holds: caught at the release, with the
    engine's call site, naming the sampled owner."""
    with production(0.5) as rt:
        s = pick(rt, True, "S")
        u = pick(rt, False, "U")
        sched = scheduler()
        sched.add_request(request(s, [910] * 5))
        sched.add_request(request(u, list(range(1000, 1040))))
        steps(sched, 2)
        mine = tables(sched, s)[-1]
        pool = sched.kv_cache_manager.block_pool
        blk = pool.blocks[mine]
        assert type(blk).__name__ == "GuardedBlock"
        rt.owner_ctx.append((u, "free"))  # (the release made for U)
        try:
            pool.free_blocks([blk])
        finally:
            rt.owner_ctx.pop()
        v = only(rt, "free_with_live_owners")[0]
        assert v.blocks == [mine] and v.owners == [s] and v.actor == u
        assert v.site.startswith("test_production_mode.py:test_unsampled_release_of_sampled_block:")


def test_touch_without_ref_sampled_hitter():
    """A prefix hit that takes no reference (``touch_without_ref``): the
    hitting request is sampled, the first owner is not; when the first
    owner ends, its release frees what the hitter still reads."""
    from kvsan.hooks.vllm import faults

    with production(0.5) as rt:
        first = pick(rt, False, "F")
        hitter = pick(rt, True, "H")
        sched = scheduler()
        sched.add_request(request(first, [920] * 5))
        steps(sched, 2)
        faults.inject("touch_without_ref")
        try:
            sched.add_request(request(hitter, [921] * 5))
            steps(sched, 1)
        finally:
            faults.clear()
        shared = tables(sched, hitter)[:3]
        assert shared == tables(sched, first)[:3]
        abort(sched, first)
        v = only(rt, "free_with_live_owners")
        assert sorted(x.blocks[0] for x in v) == sorted(shared)
        assert all(x.owners == [hitter] and x.actor == first for x in v)


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "unsampled"])
def test_leak_on_abort(sampled):
    """The cancel path never returns the request's blocks: a sampled
    request's leak is named at its end; anyone's is found by the pool-wide
    audit when the scheduler goes idle."""
    from kvsan.hooks.vllm import faults

    with production(0.5) as rt:
        rid = pick(rt, sampled, "L")
        faults.inject("leak_on_abort")
        try:
            sched = scheduler()
            sched.add_request(request(rid, [930] * 5))
            steps(sched, 2)
            held = tables(sched, rid)
            abort(sched, rid)
        finally:
            faults.clear()
        v = only(rt, "leaked_blocks")
        idle = [x for x in v if x.site == "kvsan.idle"]
        assert idle and sorted(idle[0].blocks) == sorted(held)
        named = [x for x in v if x.owners == [rid]]
        if sampled:
            assert named and sorted(named[0].blocks) == sorted(held)
        else:
            assert not named and idle[0].owners == ["unsampled"]


# ------------------------------------------------------------ clean traffic
@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_clean_traffic(rate):
    """Shared prefixes, aborts, preemption and eviction (a pool of about 3
    blocks a request), sampled and unsampled requests sharing blocks: 0
    violations, and blocks were guarded and released all along."""
    import random

    from kvsan.hooks.vllm import sampled

    with production(rate) as rt:
        rng = random.Random(3)
        sched = scheduler(16, 40)
        groups = [[rng.randrange(1, 400) for _ in range(16 * rng.choice((2, 3)))]
                  for _ in range(4)]
        n = 0

        def add():
            nonlocal n
            from vllm.sampling_params import SamplingParams
            from vllm.v1.request import Request

            from benchmarks.sched import _hasher

            prompt = rng.choice(groups) + [rng.randrange(1, 400) for _ in range(rng.randrange(1, 30))]
            sched.add_request(Request(request_id=f"c{n}", prompt_token_ids=prompt,
                                      sampling_params=SamplingParams(max_tokens=rng.choice((8, 40, 64)),
                                                                     ignore_eos=True),
                                      pooling_params=None, block_hasher=_hasher()))
            n += 1

        for _ in range(20):
            add()
        preempted = 0
        for step in range(60):
            if step % 7 == 3 and sched.requests:
                abort(sched, rng.choice(sorted(sched.requests)))
            out = sched.schedule()
            preempted += len(out.preempted_req_ids or ())
            before = len(sched.requests)
            sched.update_from_output(out, model_output(sched, out))
            for _ in range(before - len(sched.requests) + (step % 7 == 3)):
                if n < 60:
                    add()
        while sched.requests:
            steps(sched, 1)
        w = next(iter(sampled.WATCHES.values()))
        st = w.ck.stats()
        assert kinds_of(rt) == []
        assert preempted > 0 and st["adopted"] > 20
        assert st["guarded"] == 0 and st["idle_audits"] >= 1
        assert 0 < st["sampled_requests"] <= n


def test_fenced_frees_and_connector_delays():
    """vLLM's fenced frees (aborts with their step in flight) and a KV
    connector's delayed frees, every request sampled: 0 violations."""
    from test_scheduler_paths import _connector_delayed, run
    from test_scheduler_paths import scheduler as fenced_scheduler

    with production(1.0) as rt:
        sched = fenced_scheduler()
        assert run(sched) > 0
        assert not sched.requests
        _connector_delayed(scheduler())
        assert kinds_of(rt) == []


# ------------------------------------------------------------ reporting
def test_installed_record_and_metrics(tmp_path):
    import json

    from prometheus_client import CollectorRegistry, generate_latest

    from kvsan.metrics import Metrics

    path = tmp_path / "r.jsonl"
    with production(1 / 64, report=str(path)):
        pass
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    inst = next(r for r in recs if r.get("event") == "kvsan.installed")
    assert inst["check_mode"] == "production" and inst["sample_rate"] == 1 / 64
    reg = CollectorRegistry()
    m = Metrics("engine", registry=reg)
    m.set_mode("production", 1 / 64)
    m.update_sampling(640, 10, 3)
    text = generate_latest(reg).decode()
    assert ('kvsan_mode_info{engine="0",mode="production",rank="0",role="engine",'
            'sample_rate="0.015625"} 1.0') in text
    assert 'kvsan_sampled_requests{engine="0",rank="0",role="engine"} 10.0' in text
    m.relabel(1, 0)  # (the mode follows the process's labels)
    text = generate_latest(reg).decode()
    assert 'kvsan_mode_info{engine="1",mode="production"' in text
    assert 'kvsan_mode_info{engine="0"' not in text


@pytest.mark.parametrize("raw,rate", [("on", 1 / 64), ("1/64", 1 / 64), ("0.02", 0.02),
                                      ("2%", 0.02), ("1", 1.0), ("", 0.0), ("0", 0.0)])
def test_sample_values(raw, rate):
    from kvsan.config import from_env

    cfg = from_env({"KVSAN": "1", "KVSAN_SAMPLE": raw})
    assert cfg.sample == pytest.approx(rate)
    assert cfg.check_mode == ("production" if rate else "staging")


@pytest.mark.parametrize("raw", ["2", "-0.1", "1/0", "often", "nan", "150%"])
def test_bad_sample_value(raw):
    from kvsan.config import ConfigError, from_env

    with pytest.raises(ConfigError, match=r"KVSAN_SAMPLE=.* is not accepted; use on \(the "
                                          r"default rate, 1/64\), a fraction 1/N"):
        from_env({"KVSAN": "1", "KVSAN_SAMPLE": raw})


def test_sampler_rotates():
    """The decision is a keyed hash of the request id, and the key moves
    every epoch: over epochs every id is sampled at the rate."""
    from kvsan.checks.sampled import Sampler

    s = Sampler(0.25, seed=1, epoch_requests=100)
    ids = [f"r{i}" for i in range(400)]
    share = sum(s.would_sample(r) for r in ids) / len(ids)
    assert 0.15 < share < 0.35
    by_epoch = [{r for r in ids if s.would_sample(r, e)} for e in range(8)]
    assert len({frozenset(x) for x in by_epoch}) == 8  # a new sample each epoch
    assert len(set().union(*by_epoch)) > 0.8 * len(ids)  # covering most ids
    decided = [s.admit(f"x{i}") for i in range(250)]
    assert s.epoch == 2 and any(decided)


def test_prefix_hit_without_reference_both_sampled():
    """``touch_without_ref`` with both requests sampled: the hitter is seen
    holding a block whose count covers one of its two sampled holders, at
    the scan that follows the step (before anyone frees it)."""
    from kvsan.hooks.vllm import faults, sampled

    with production(1.0) as rt:
        sched = scheduler()
        sched.add_request(request("F", [940] * 5))
        steps(sched, 2)
        faults.inject("touch_without_ref")
        try:
            sched.add_request(request("H", [941] * 5))
            steps(sched, 1)
        finally:
            faults.clear()
        shared = tables(sched, "H")[:3]
        v = only(rt, "free_with_live_owners")
        assert sorted(x.blocks[0] for x in v) == sorted(shared)
        assert all(x.owners == ["F", "H"] and x.actor == "H" for x in v)
        assert all(x.site == sampled.SCHEDULED for x in v)


def test_guard_budget():
    """A fixed budget of guarded blocks (KFENCE's pool): a request admitted
    while it is spent is not sampled, and says so in the counters."""
    from kvsan.checks.sampled import SampledChecker

    ck = SampledChecker(16, emit=lambda v: None, step=lambda: 0, holds=lambda o, b: True,
                        budget=2)
    assert ck.admit("a")
    ck.adopt(1, "a", "s")
    ck.adopt(2, "a", "s")
    assert not ck.admit("b") and ck.stats()["budget_full"] == 1
    assert "b" not in ck.live and ck.stats()["guarded"] == 2
