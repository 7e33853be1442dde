"""The start-up contract (issue 46): what every adapter relies on in vLLM is
declared as data and verified once at start, against the real vLLM
installed here.  A release without a hook target or with a hooked method's
parameters changed is named: ``KVSAN_STRICT=1`` refuses to start, log mode
writes one ``kvsan.contract`` event."""

import json
import subprocess
import sys

import pytest

from kvsan.hooks import contract as _contract


def _all():
    from kvsan.hooks.vllm import (allocator as vllm_allocator, identity as vllm_identity, inputs as vllm_inputs, owners as vllm_owners,
                             quarantine as vllm_quarantine, weights as vllm_weights, worker as vllm_worker)

    return [vllm_allocator.CONTRACT, vllm_identity.CONTRACT, vllm_weights.CONTRACT,
            vllm_quarantine.CONTRACT, vllm_owners.CONTRACT, vllm_worker.CONTRACT,
            vllm_worker.CONTRACT_V2, vllm_inputs.CONTRACT]


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

    declared = {k.replace(":", ".") for c in _all() for k in c.methods}
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
