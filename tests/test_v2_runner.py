"""kvsan's V2 hooks (``vllm_worker.targets_v2``) on vLLM's real V2 model
runner: the CPU one (``vllm.v1.worker.cpu.model_runner.CPUModelRunner``, a
``vllm.v1.worker.gpu.model_runner.GPUModelRunner``), its Triton kernels run
by Triton's interpreter (see v2_runner_child.py for the test-only shim).
One scenario per subprocess: the shim and the V2 runner's settings must not
leak into the other tests' in-process engines."""

import importlib.util
import inspect
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


def _interpreter_missing() -> str | None:
    try:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        import triton.runtime.interpreter  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any reason it cannot be imported
        return f"Triton's interpreter is not importable: {e!r}"
    return None


def scenario(name: str) -> dict:
    env = dict(os.environ)
    env.pop("KVSAN", None)  # the child installs kvsan itself, in strict device settings
    env.pop("KVSAN_INJECT", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "v2_runner_child.py"), name],
                          check=False, capture_output=True, text=True, timeout=900, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout[-2000:],
                                            proc.stderr[-4000:])
    out = json.loads(lines[-1][len("RESULT "):])
    # it was the V2 runner, its kernels interpreted, kvsan's V2 hooks on it
    assert out["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
    assert out["runner_bases"][0] == "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
    assert out["kernel"] == "InterpretedFunction"
    assert sorted(out["hooks"]) == sorted(f"{t.module}.{t.qualname}" for t in _targets())
    return out


def _targets():
    from kvsan.hooks.vllm import worker as vllm_worker

    return vllm_worker.targets_v2()


@pytest.mark.e2e
@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
def test_v2_clean_shared_prefix_traffic():
    out = scenario("clean")
    assert out["violations"] == []
    assert out["finished"] > 0 and out["aborted"] > 0 and out["cached_tokens"] > 0
    c = out["counters"]
    assert c is not None, "no device checker on the V2 runner"
    assert c["guarded_tokens"] > 0  # the write guard on prepare_attn's slot mappings
    assert c["sealed"] > 0 and c["verified"] > 0  # checksums at step end / prefix hits
    assert c["verified_evicted"] > 0  # cached blocks verified as vLLM reused them


@pytest.mark.e2e
@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
def test_v2_scribble_into_sealed_block_is_checksum_mismatch():
    out = scenario("scribble")
    assert out["was_sealed"]
    assert out["target"] in out["b_prefix"]  # B was served the scribbled block
    (bad,) = out["violations"]
    assert bad["kind"] == "checksum_mismatch"
    assert bad["blocks"] == [out["target"]]
    assert set(bad["owners"]) == {out["a"], out["b"]}
    assert bad["details"][0]["layers"] == [1]
    assert bad["details"][0]["check"] == "at prefix hit"


@pytest.mark.e2e
@pytest.mark.skipif(_interpreter_missing() is not None, reason=str(_interpreter_missing()))
def test_v2_slot_mapping_into_sealed_shared_block():
    out = scenario("slot_into_shared")
    assert out["shared_in_b"] and out["fired"]
    bad = [v for v in out["violations"] if v["kind"] == "overwrite_shared_block"]
    assert bad, out["violations"]
    assert bad[0]["blocks"] == [out["shared"]]
    assert set(bad[0]["owners"]) == {out["a"], out["b"]}
    assert bad[0]["actor"] in (out["a"], out["b"])  # the batch's last row wrote it
    assert "sealed" in bad[0]["message"]


def test_targets_v2_resolve_against_the_real_v2_runner():
    """Fast, no engine: each V2 target names a real method of vLLM's V2
    runner, and the arguments and results kvsan's wrappers read are there."""
    import importlib

    mod = importlib.import_module("vllm.v1.worker.gpu.model_runner")
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.input_batch import InputBatch

    for t in _targets():
        owner = mod
        for part in t.qualname.split("."):
            owner = getattr(owner, part)
        assert callable(owner), t.qualname
    runner = mod.GPUModelRunner
    assert issubclass(CPUModelRunner, runner)  # the CPU V2 runner inherits every hooked method
    for name in ("execute_model", "prepare_attn", "shutdown"):
        assert name not in vars(CPUModelRunner), name
    # _execute_model: args[0] or kwargs["scheduler_output"]
    params = list(inspect.signature(runner.execute_model).parameters)
    assert params[:2] == ["self", "scheduler_output"]
    # _prepare_attn_v2: args[0] or kwargs["input_batch"]; ret[1] the slot mappings
    sig = inspect.signature(runner.prepare_attn)
    assert list(sig.parameters) == ["self", "input_batch"]
    assert "tuple[tuple[torch.Tensor, ...], torch.Tensor]" in str(sig.return_annotation)
    fields = set(getattr(InputBatch, "__dataclass_fields__", {})) or set(
        inspect.get_annotations(InputBatch))
    assert {"req_ids", "num_reqs", "num_scheduled_tokens", "num_tokens"} <= fields
    assert list(inspect.signature(runner.shutdown).parameters) == ["self"]
