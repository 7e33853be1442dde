"""The start-up contract (issue 46): what every adapter relies on in vLLM is
declared as data and verified once at start, against the real vLLM
installed here.  A release without a hook target or with a hooked method's
parameters changed is named: ``KVSAN_STRICT=1`` refuses to start, log mode
writes one ``kvsan.contract`` event."""

import json
import os
import subprocess
import sys

import pytest

from kvsan.hooks import contract as _contract


def _all(v1=None):
    """Every adapter's contract, the worker side's as the adapter picks them
    for a vLLM with (or without) the V1 model runner (``v1`` None: the
    installed one)."""
    from kvsan.hooks.vllm import (allocator as vllm_allocator, identity as vllm_identity,
                                  owners as vllm_owners, quarantine as vllm_quarantine,
                                  weights as vllm_weights, worker as vllm_worker,
                                  worker_contracts)

    wanted, _ = worker_contracts(vllm_worker.has_v1_runner() if v1 is None else v1)
    return [vllm_allocator.CONTRACT, vllm_identity.CONTRACT, vllm_weights.CONTRACT,
            vllm_quarantine.CONTRACT, vllm_owners.CONTRACT, *(c for _, c in wanted)]


def test_real_vllm_passes_every_contract():
    got = _contract.check(_all())
    assert got.holds, got.mismatches
    names = {c.adapter for c in _all() if not c.optional}
    assert names <= set(got.ok)  # (worker-v2: checked, or said unchecked)
    assert "worker-v2" in got.ok or any(u.startswith("worker-v2") for u in got.unchecked)
    # modules imported: the start-up cost proper (best of 3: a collection of
    # the garbage vLLM's import left can land in any one run)
    assert min(_contract.check(_all()).ms for _ in range(3)) < 50


def test_every_hook_target_is_in_a_contract():
    """A target added to an adapter without its contract entry fails here."""
    from kvsan.hooks.vllm import allocator as vllm_allocator, identity as vllm_identity, weights as vllm_weights, worker as vllm_worker

    declared = {k.replace(":", ".") for c in _all(v1=True) for k in c.methods}
    targets = (vllm_allocator.targets() + vllm_allocator.shutdown_targets()
               + vllm_identity.targets() + vllm_weights.targets() + vllm_worker.targets()
               + vllm_worker.targets_v2())
    assert {t.name for t in targets} <= declared


def test_missing_target_and_changed_signature_are_named(monkeypatch):
    import vllm.v1.core.block_pool as bp

    monkeypatch.delattr(bp.BlockPool, "touch")

    def cache_full_blocks(self, req, blocks, num_full_blocks):  # (a "new release")
        pass

    monkeypatch.setattr(bp.BlockPool, "cache_full_blocks", cache_full_blocks)
    got = _contract.check(_all())
    text = "\n".join(got.mismatches)
    assert "vllm.v1.core.block_pool.BlockPool.touch missing" in text
    assert ("allocator: vllm.v1.core.block_pool.BlockPool.cache_full_blocks parameters "
            "changed: expected (request, blocks, num_cached_blocks, num_full_blocks, ...), "
            "found (req, blocks, num_full_blocks)") in text
    assert "identity: vllm.v1.core.block_pool.BlockPool.cache_full_blocks" in text
    assert any(c.startswith("allocator: the allocator checks") for c in got.checks_off)
    assert any(c.startswith("identity: ") for c in got.checks_off)


def test_missing_attribute_is_named():
    c = _contract.Contract("x", "the x check", attrs={
        "vllm.v1.core.kv_cache_utils:KVCacheBlock": ("block_id", "no_such_slot")})
    got = _contract.check([c])
    assert got.mismatches == ["x: vllm.v1.core.kv_cache_utils.KVCacheBlock lacks "
                              "attribute(s) no_such_slot"]
    assert got.checks_off == ["x: the x check"]


def test_optional_module_that_does_not_import_is_said_unchecked():
    c = _contract.Contract("v9", "the v9 check", optional=True,
                           methods={"vllm.no_such_module:Runner.step": ()})
    got = _contract.check([c])
    assert got.holds and got.unchecked and got.unchecked[0].startswith("v9: not checked")


_CHILD = r"""
import json, sys
import vllm.v1.core.block_pool as bp
from kvsan import plugin
from kvsan.config import Config, from_env
what = sys.argv[1]
if what in ("missing", "both"):
    del bp.BlockPool.touch
if what in ("changed", "both"):
    def cache_full_blocks(self, req, blocks, num_full_blocks):
        pass
    bp.BlockPool.cache_full_blocks = cache_full_blocks
try:
    plugin.install(Config(enabled=True, strict=True, log_events=False), role="engine")
    plugin.uninstall()
    print(json.dumps({"strict": None}))
except plugin.HookError as e:
    print(json.dumps({"strict": str(e)}))
rt = plugin.install(from_env({"KVSAN": "1", "KVSAN_REPORT": sys.argv[2]}), role="engine")
plugin.uninstall()
"""


def _child(what, tmp_path):
    report = tmp_path / "r.jsonl"
    out = subprocess.run([sys.executable, "-c", _CHILD, what, str(report)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    strict = json.loads(out.stdout.strip().splitlines()[-1])["strict"]
    events = [json.loads(line) for line in report.read_text().splitlines()]
    return strict, [e for e in events if e.get("event") in ("kvsan.contract", "kvsan.installed")]


@pytest.mark.parametrize("what", ["ok", "both"])
def test_install_strict_and_log_mode(what, tmp_path):
    strict, events = _child(what, tmp_path)
    installed = [e for e in events if e["event"] == "kvsan.installed"]
    contract = [e for e in events if e["event"] == "kvsan.contract"]
    assert len(installed) == 1
    if what == "ok":
        assert strict is None
        assert contract == [] and installed[0]["contract"]["ok"] is True
        return
    assert "KVSAN_STRICT=1 refuses to start" in strict
    assert "vllm.v1.core.block_pool.BlockPool.touch missing" in strict
    assert ("BlockPool.cache_full_blocks parameters changed: expected (request, blocks, "
            "num_cached_blocks, num_full_blocks, ...), found (req, blocks, num_full_blocks)"
            in strict)
    assert len(contract) == 1  # log mode: one event names them all
    ev = contract[0]
    assert ev["ok"] is False
    assert any("BlockPool.touch missing" in m for m in ev["mismatches"])
    assert any("cache_full_blocks parameters changed" in m for m in ev["mismatches"])
    assert any(c.startswith("allocator: ") for c in ev["checks_off"])
    assert any(c.startswith("identity: ") for c in ev["checks_off"])


# ------------------------------------------------ the releases kvsan supports
#: each supported release's answers to the contracts' questions, recorded
#: with that release installed (scripts/release_facts.py)
RELEASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_releases")

#: the support table (README) per vLLM release, as far as the recorded
#: answers decide it: "on" (every contract of the column holds), "absent"
#: (the release has no such part: vLLM 0.34 removed the V1 model runner)
SUPPORT = {
    "0.30": {"allocator": "on", "identity": "on", "worker-v1": "on", "worker-v2": "on"},
    "0.31": {"allocator": "on", "identity": "on", "worker-v1": "on", "worker-v2": "on"},
    "0.32": {"allocator": "on", "identity": "on", "worker-v1": "on", "worker-v2": "on"},
    "0.33": {"allocator": "on", "identity": "on", "worker-v1": "on", "worker-v2": "on"},
    "0.34": {"allocator": "on", "identity": "on", "worker-v1": "absent", "worker-v2": "on"},
}
#: the table's columns -> the adapters whose contracts they need
COLUMNS = {"allocator": ("allocator", "owners", "weights", "quarantine"),
           "identity": ("identity",), "worker-v1": ("worker-v1", "inputs"),
           "worker-v2": ("worker-v2",)}


def _recorded() -> list[str]:
    return sorted(f[:-len(".json")] for f in os.listdir(RELEASES) if f.endswith(".json"))


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _facts(version: str) -> dict:
    with open(os.path.join(RELEASES, f"{version}.json")) as f:
        return json.load(f)


def _has_v1(facts: dict) -> bool:
    """What ``worker.has_v1_runner`` says on that release: its V1 runner
    module is there (recorded as not found: it is not)."""
    from kvsan.hooks.vllm import worker as vllm_worker

    err = facts["modules"].get(vllm_worker._V1, "")
    return not err.startswith(f"ModuleNotFoundError: No module named '{vllm_worker._V1}'")


@pytest.mark.parametrize("version", _recorded())
def test_support_table_holds_on_each_recorded_release(version):
    """Today's contracts, as the adapter picks them for that release, against
    what the release offered when it was recorded: a contract change that a
    supported release does not meet fails here, without that release."""
    from kvsan.hooks.vllm import worker_contracts

    facts = _facts(version)
    assert facts["vllm"] == version
    v1 = _has_v1(facts)
    _, absent = worker_contracts(v1)
    got = _contract.check(_all(v1), facts=facts)
    state = {}
    for column, adapters in COLUMNS.items():
        if any(line.startswith(f"{a}:") for a in adapters for line in absent):
            state[column] = "absent"
        else:
            state[column] = "on" if set(adapters) <= set(got.ok) else "off"
    assert state == SUPPORT[_minor(version)], got.mismatches


def test_supported_releases_are_the_recorded_ones():
    from kvsan.hooks.vllm import SUPPORTED, supported

    assert set(SUPPORTED) == set(SUPPORT) == {_minor(v) for v in _recorded()}
    assert supported("0.32.0") and supported("0.34.1") and not supported("0.3")
    assert not supported("0.35.0") and not supported("0.29.0") and not supported(None)


def test_installed_release_matches_its_record():
    """The record of the installed release is what the recorder finds now
    (the recorder and the check read the same questions); the other
    releases are compared with theirs by ``scripts/release_facts.py
    --check`` run with their interpreter."""
    sys.path.insert(0, os.path.join(os.path.dirname(RELEASES), "..", "scripts"))
    try:
        import release_facts
    finally:
        sys.path.pop(0)
    live = json.loads(release_facts.dumps(release_facts.facts()))
    assert live["vllm"] in _recorded(), f"vLLM {live['vllm']} has no record: " \
        "scripts/release_facts.py writes it"
    assert live == _facts(live["vllm"])


def test_a_block_pool_is_matched_as_its_blocks_hold_it():
    """vLLM 0.34's ``KVCacheBlock.pool`` is one weak reference per pool, the
    releases before hold the pool itself: the allocator adapter matches a
    block to a pool by what that pool's own blocks hold, and keeps no pool
    alive for it."""
    import gc
    import weakref

    from kvsan.hooks.vllm.allocator import pool_of, pool_ref

    class Pool:
        pass

    class Block:
        def __init__(self, pool):
            self.pool = pool

    old = Pool()
    old.blocks = [Block(old), Block(old)]
    assert pool_ref(old) is old and pool_of(old.blocks[1], None) is old
    new = Pool()
    ref = weakref.ref(new)
    new.blocks = [Block(ref), Block(ref)]
    assert pool_ref(new) is ref and pool_of(new.blocks[1], None) is new
    assert pool_of(Block(None), old) is old  # (a block without one: the caller's)
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None
