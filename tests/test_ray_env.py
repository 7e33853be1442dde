"""Ray: vLLM's legacy Ray executor and its data-parallel EngineCore actors
copy to the actors only the variables vLLM knows of and those matching the
prefixes/names in ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` /
``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY`` (vLLM issue 34383).  With ``KVSAN=1``
the plugin appends kvsan's to those lists, so a Ray worker never runs with
kvsan silently off.  Checked against vLLM's own copy-list function
(``vllm.ray.ray_env.get_env_vars_to_copy``), called as its Ray paths call
it; Ray itself is not needed."""

import json
import os
import subprocess
import sys

import pytest

_PROBE = r"""
import json, os
import kvsan.plugin as p
p.register()
from kvsan.hooks.vllm import carry_env_to_ray
again = carry_env_to_ray() if os.environ.get("KVSAN") == "1" else None  # idempotent
from vllm.ray.ray_env import get_env_vars_to_copy
# as RayDistributedExecutor / CoreEngineActorManager call it
from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS
names = get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS, destination="workers")
print("KVSAN-PROBE " + json.dumps({
    "copied": sorted(n for n in names if n in os.environ),
    "prefixes": os.environ.get("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"),
    "names": os.environ.get("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"),
    "again": again,
}))
"""


def _probe(**env):
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("KVSAN") and not k.startswith("VLLM_RAY_EXTRA_")}
    full.update(env, MYAPP_TOKEN="x", KVSAN_MODE="log", KVSAN_LOG="0",
                PROMETHEUS_MULTIPROC_DIR=env.get("PROMETHEUS_MULTIPROC_DIR", "/tmp"))
    out = subprocess.run([sys.executable, "-c", _PROBE], env=full, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("KVSAN-PROBE "))
    return json.loads(line.split(" ", 1)[1])


@pytest.fixture(scope="module")
def on_and_off(tmp_path_factory):
    rep = str(tmp_path_factory.mktemp("rayrep")) + "/"
    on = _probe(KVSAN="1", KVSAN_REPORT=rep, KVSAN_AUDIT_EVERY="3",
                VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY="MYAPP_",
                VLLM_RAY_EXTRA_ENV_VARS_TO_COPY="MY_ONE")
    off = _probe(VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY="MYAPP_")
    return on, off


def test_kvsan_vars_reach_ray_actors_when_on(on_and_off):
    on, _ = on_and_off
    for name in ("KVSAN", "KVSAN_REPORT", "KVSAN_MODE", "KVSAN_LOG", "KVSAN_AUDIT_EVERY",
                 "PROMETHEUS_MULTIPROC_DIR", "MYAPP_TOKEN"):
        assert name in on["copied"], (name, on["copied"])
    # the user's own entries kept, first; kvsan's appended once
    assert on["prefixes"] == "MYAPP_,KVSAN_"
    assert on["names"] == "MY_ONE,KVSAN,PROMETHEUS_MULTIPROC_DIR"
    assert on["again"] is True


def test_nothing_changes_when_off(on_and_off):
    _, off = on_and_off
    assert not [n for n in off["copied"] if n.startswith("KVSAN")], off["copied"]
    assert "PROMETHEUS_MULTIPROC_DIR" not in off["copied"]
    assert off["prefixes"] == "MYAPP_" and off["names"] is None
    assert "MYAPP_TOKEN" in off["copied"]


def test_append_csv_is_idempotent(monkeypatch):
    from kvsan.hooks.vllm import _append_csv

    monkeypatch.setenv("KVSAN_TEST_LIST", " A_, B_ ,")
    _append_csv("KVSAN_TEST_LIST", ("KVSAN_", "A_"))
    _append_csv("KVSAN_TEST_LIST", ("KVSAN_",))
    assert os.environ["KVSAN_TEST_LIST"] == "A_,B_,KVSAN_"
    monkeypatch.delenv("KVSAN_TEST_LIST")
    _append_csv("KVSAN_TEST_LIST", ("KVSAN_",))
    assert os.environ["KVSAN_TEST_LIST"] == "KVSAN_"
    monkeypatch.delenv("KVSAN_TEST_LIST")
