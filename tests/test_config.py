"""The switch and its configuration: bad values fail at start, naming the
variable and what it accepts; KVSAN unset patches nothing."""

import subprocess
import sys

import pytest

from kvsan.config import ConfigError, from_env


@pytest.mark.parametrize("env,needle", [
    ({"KVSAN": "yes"}, "KVSAN='yes'"),
    ({"KVSAN": "1", "KVSAN_MODE": "panic"}, "KVSAN_MODE='panic' is not accepted; use one of log, raise, abort"),
    ({"KVSAN": "1", "KVSAN_STRICT": "2"}, "KVSAN_STRICT"),
    ({"KVSAN": "1", "KVSAN_AUDIT_EVERY": "-3"}, "KVSAN_AUDIT_EVERY"),
    ({"KVSAN": "1", "KVSAN_REPORT": "/proc/nope/report.jsonl"}, "KVSAN_REPORT"),
    ({"KVSAN": "1", "KVSAN_NATIVE": "fast"}, "KVSAN_NATIVE='fast' is not accepted; use 1 (on) or 0 (off)"),
])
def test_bad_values_name_the_variable(env, needle):
    with pytest.raises(ConfigError) as e:
        from_env(env)
    assert needle in str(e.value)


def test_defaults():
    cfg = from_env({})
    assert not cfg.enabled and cfg.mode == "log" and cfg.report is None and cfg.native
    assert not from_env({"KVSAN_NATIVE": "0"}).native


def _run(code, **env):
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True)


def test_off_patches_nothing():
    code = (
        "import kvsan.plugin as p; p.register();"
        "from vllm.v1.core.block_pool import BlockPool; from kvsan.hooks import is_patched;"
        "print(is_patched(BlockPool.__dict__['free_blocks']))"
    )
    assert _run(code).stdout.strip().endswith("False")
    assert _run(code, KVSAN="0").stdout.strip().endswith("False")
    # (that the same probe says True with KVSAN=1: test_register_is_idempotent)


def test_register_is_idempotent():
    """With KVSAN=1, ``register()`` twice patches once: the method is
    patched (the probe of test_off_patches_nothing is not vacuous) and its
    wrapper wraps vLLM's own function, not a second wrapper.  (One child
    for both: each start imports vLLM.)"""
    code = (
        "import kvsan.plugin as p; p.register(); p.register();"
        "from vllm.v1.core.block_pool import BlockPool; from kvsan.hooks import is_patched;"
        "f = BlockPool.__dict__['free_blocks'];"
        "print(is_patched(f), type(f.__wrapped__).__name__)"
    )
    out = _run(code, KVSAN="1", KVSAN_LOG="0")
    assert out.stdout.strip().splitlines()[-1] == "True function", out.stderr[-1000:]


def test_invalid_env_fails_vllm_start():
    out = _run("import kvsan.plugin as p; p.register()", KVSAN="1", KVSAN_MODE="loud")
    assert out.returncode != 0 and "KVSAN_MODE='loud'" in out.stderr


def test_strict_refuses_missing_hooks():
    code = (
        "import vllm.v1.core.block_pool as bp; del bp.BlockPool.touch;"
        "import kvsan.plugin as p; p.register()"
    )
    out = _run(code, KVSAN="1", KVSAN_STRICT="1", KVSAN_LOG="0")
    assert out.returncode != 0
    assert "KVSAN_STRICT=1 refuses to start" in out.stderr
    assert "vllm.v1.core.block_pool.BlockPool.touch" in out.stderr
    # without strict: runs, and the installed event names the missing hook
    out = _run(code, KVSAN="1")
    assert out.returncode == 0
    assert "BlockPool.touch" in out.stderr and "missing" in out.stderr
