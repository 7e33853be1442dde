"""The reproducers of docs/findings (vLLM bugs ``kvsan fuzz`` found): each
runs on the installed vLLM with kvsan off, as the README there shows, and
exits 0 when the failure shows."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINDINGS = os.path.join(ROOT, "docs", "findings")


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(FINDINGS) if f.endswith(".py")))
def test_finding_reproduces(script):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
    p = subprocess.run([sys.executable, os.path.join("docs", "findings", script)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
