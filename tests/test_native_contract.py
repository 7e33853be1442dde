"""What kvsan's C modules read of vLLM is declared in the start-up contract
(:mod:`kvsan.hooks.vllm.layouts`): every vLLM attribute name in the C
sources is in a contract; a release that renames any one of them switches
the C paths off in that process with a record that names it; and with them
off, the Python paths still report a fault exactly (a real rename of
``Request._all_token_ids`` on vLLM's real Scheduler)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SPEEDUPS, SPEEDUPS_WHY

pytestmark = [pytest.mark.engine, pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)]

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "src" / "kvsan" / "_native"

#: names in the C sources that are not vLLM's: kvsan's own objects'
#: attributes and methods, the modules' own exports, format strings, CPU
#: features, and the Python / numpy / torch calls it makes
NOT_VLLM = frozenset("""
ABI ADMIT ADMIT_ALL ALLOCATE AVAILABLE B CACHE END FINISH GUARD HELD HITS HeldMap Hold Hook Links O PREEMPT RELEASE
ROUTE ROW_SWEEP SAMPLE_BATCH_STEPS SCHED SKIP STEP TEXT_ONLY TOUCH Table UPDATE _C_API __dict__
__sizeof__ _fast _fed _last_batch _may_defer _n_cached_free _n_owned _np _reads _rid_int
_row_order _row_sweep _runtime _site_ids _slots_view _tick _unhold _weakref acq_owner acq_site
acq_step all allocate allocated append audit_every avx2 busy avx512dq avx512f block_size cache cached
calls check_rows checked checksum checksums chunks config configure context counters
current_owner data_ptr every_step leased device_s direct drop dropped emb enable ended evicted extend extend_text
fast fill flush_overhead frames freed get guard guard_step guarded_tokens hashes held iOOOU
identity identity_hits identity_record idle_audited ids internal items journal keys kind
known_chain kvsan links lut metrics metrics_due mismatched mm more n nonrequest nown null
observe_seconds observed observer off original overhead_s own0 own1 owner_ctx owners_changed
pending_guard pending_release pending_seal pending_sums poison_on post preempted property_slot
public qli r read_pool reap ref rel_owner rel_site rel_step release release_held released
remove_blocks req_blocks reset rid rows rows_checked rows_due rows_on rows_swept
runtime_changed sealed seconds settle shadow share shared simd site site_id slot_reads slots
slow snapshot state static step step_hits sums take tok tolist tsc uncache uncached weights
when where will_seal num_blocks
""".split())
#: vLLM fields the C reads only where the release has them (absent: that
#: step goes to Python), so no release lacks them in a way that matters
OPTIONAL_READS = frozenset({"preempted_req_ids", "kv_cache_block_copies"})


def _c_names() -> set[str]:
    names: set[str] = set()
    for path in NATIVE.glob("*.[ch]"):
        src = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
        names |= set(re.findall(r'"([A-Za-z_][A-Za-z_0-9]*)"', src))
    return names


def _declared() -> set[str]:
    from kvsan.hooks.vllm import allocator, identity, layouts

    out: set[str] = set()
    for c in (*layouts.CONTRACTS, allocator.CONTRACT, identity.CONTRACT):
        for attrs in c.attrs.values():
            out |= set(attrs)
        for params in c.methods.values():  # (the hooked methods' parameters the C reads)
            out |= set(params)
    return out


def test_every_vllm_name_the_c_reads_is_declared():
    """A name added to the C without its contract entry fails here (or, if
    it is kvsan's own, is added to NOT_VLLM in review)."""
    undeclared = _c_names() - _declared() - NOT_VLLM - OPTIONAL_READS
    assert not undeclared, f"C reads of vLLM names no contract declares: {sorted(undeclared)}"
    assert not (NOT_VLLM & _declared() - {"num_blocks"})  # (the list holds no declared name)


def test_the_native_contracts_hold_on_this_vllm():
    from kvsan.hooks import contract
    from kvsan.hooks.vllm import layouts

    got = contract.check(layouts.CONTRACTS)
    assert got.holds and got.ok == ["native", "native-worker"], got.mismatches


#: the child: the installed vLLM's answers recorded, then for each declared
#: attribute a release without it: the C paths on, the gate run, and what
#: it returned, recorded and left in use
_EACH = r"""
import copy, json
from kvsan import hooks, plugin
from kvsan.config import Config
from kvsan.hooks import contract
from kvsan.hooks.vllm import layouts

rt = plugin.install(Config(enabled=True, log_events=False), role="engine")
events = []
rt.reporter.event = lambda name, **f: events.append((name, f))
facts = contract.record(layouts.CONTRACTS)
out = []
for c in layouts.CONTRACTS:
    for spec, attrs in c.attrs.items():
        for attr in attrs:
            renamed = copy.deepcopy(facts)
            have = renamed["attrs"][spec]
            have["has"].remove(attr)
            have["lacks"].append(attr)
            assert hooks.use_native(True)
            events.clear()
            lines = layouts.gate(rt, c, source=contract._Recorded(renamed))
            out.append({"spec": spec, "attr": attr, "lines": lines,
                        "events": [[n, f.get("mismatches")] for n, f in events],
                        "in_use": hooks.native_in_use(), "rt_native": rt.native})
# and the real one: nothing renamed, nothing switched off
assert hooks.use_native(True)
rt.native = True
kept = layouts.gate(rt, layouts.CONTRACT) + layouts.gate(rt, layouts.CONTRACT_WORKER)
print(json.dumps({"each": out, "kept": kept, "in_use": hooks.native_in_use()}))
"""


def _child(code: str, *args: str, env: dict | None = None) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
    e.update(VLLM_ENABLE_V1_MULTIPROCESSING="0",
             PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), **(env or {}))
    got = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=e,
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


def test_each_renamed_name_switches_the_c_paths_off_by_name():
    got = _child(_EACH)
    assert got["kept"] == [] and got["in_use"]
    from kvsan.hooks.vllm import layouts

    assert len(got["each"]) == sum(len(a) for c in layouts.CONTRACTS for a in c.attrs.values())
    for row in got["each"]:
        module, qual = row["spec"].split(":")
        line = f"{module}.{qual} lacks attribute(s) {row['attr']}"
        assert len(row["lines"]) == 1 and row["lines"][0].endswith(line), row
        assert row["events"] == [["kvsan.native_off", row["lines"]]], row
        assert row["in_use"] is False and row["rt_native"] is False, row


#: the child: vLLM's Request (and the Scheduler, which reads the same
#: field) loaded from their sources with ``_all_token_ids`` renamed -- a
#: release that renamed it -- then kvsan installed (C paths on by
#: default), traffic on the real Scheduler and a double free
_RENAMED = r"""
import importlib.abc, importlib.util, json, sys

OLD, NEW = "_all_token_ids", "_all_token_ids_renamed"
RENAMED = {"vllm.v1.request", "vllm.v1.core.sched.scheduler"}

class Renamer(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name not in RENAMED:
            return None
        sys.meta_path.remove(self)
        try:
            real = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        return importlib.util.spec_from_file_location(name, real.origin, loader=self)
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        src = open(module.__file__).read().replace(OLD, NEW)
        exec(compile(src, module.__file__, "exec"), module.__dict__)

sys.meta_path.insert(0, Renamer())
events = []
from kvsan import report
_event = report.Reporter.event
report.Reporter.event = lambda self, name, **f: (events.append([name, f]), _event(self, name, **f))[1]
exec(open(sys.argv[2]).read().split("# the fault:")[0].replace("int(sys.argv[1])", "30"))
import vllm.v1.request as vr
assert NEW in vr.Request.__init__.__code__.co_names and OLD not in vr.Request.__init__.__code__.co_names
rid = next(r for r in sched.running if r.num_computed_tokens)
blocks = [b for b in sched.kv_cache_manager.coordinator.single_type_managers[0]
          .req_to_blocks[rid.request_id] if not b.is_null]
pool = sched.kv_cache_manager.block_pool
rt.owner_ctx.append((rid.request_id, "free"))
pool.free_blocks(list(blocks))
pool.free_blocks(list(blocks))
rt.owner_ctx.pop()
from kvsan import hooks
print(json.dumps({
    "off": [f.get("mismatches") for n, f in events if n == "kvsan.native_off"],
    "in_use": hooks.native_in_use(), "rt_native": rt.native,
    "installed": [f.get("contract", {}).get("native_off") for n, f in events
                  if n == "kvsan.installed"],
    "native_modules_used": hooks.HOOKFAST is not None,
    "clean": clean, "served": count, "errors": rt.reporter.internal_errors,
    "fault": [[v.kind, v.blocks, v.owners] for v in rt.violations() if v.kind == "double_release"],
    "blocks": [b.block_id for b in blocks], "rid": rid.request_id,
}))
"""


def test_a_real_rename_turns_the_c_paths_off_and_python_still_detects(tmp_path):
    from test_native_off import CHILD

    child = tmp_path / "traffic.py"
    child.write_text(CHILD)
    got = _child(_RENAMED, "x", str(child), env={"KVSAN": "1", "KVSAN_LOG": "0"})
    line = "native: vllm.v1.request.Request lacks attribute(s) _all_token_ids"
    assert got["off"] == [[line]], got["off"]
    assert got["installed"] == [[line]]  # (and in the installed record's contract)
    assert got["in_use"] is False and got["rt_native"] is False
    assert got["served"] > 20 and got["clean"] == [] and got["errors"] == 0
    assert got["fault"] and sorted(b for v in got["fault"] for b in v[1]) == sorted(got["blocks"])
    assert all(v[2] == [got["rid"]] for v in got["fault"]), got["fault"]
