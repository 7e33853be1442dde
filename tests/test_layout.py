"""The package's layout holds what docs/design.md says it holds.

* the checks core (shadow table, checks, reports, owners snapshot, metrics)
  imports nothing from the engine adapter (``kvsan.hooks``), the harness
  or vLLM, so another engine is a new adapter, not a rewrite;
* vLLM is imported only by its adapter (``kvsan.hooks.vllm``) and by the
  harness, which drives the engine through its public API;
* no module of kvsan imports another that imports it back (an import
  cycle), read from the source, lazy imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "kvsan"

#: the engine-agnostic core
CORE = ("shadow", "journal", "kinds", "report", "reportsink", "reportfile", "completeness", "summary",
        "owners", "metrics", "config", "runtime", "exporter", "checks")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it, as absolute names."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # (a submodule, maybe)
    return out


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _is_core(name: str) -> bool:
    rest = name.split(".", 1)[1] if "." in name else ""
    return rest.split(".")[0] in CORE


def test_core_imports_no_adapter_harness_or_engine():
    bad = {}
    for name, path in _modules().items():
        if not _is_core(name):
            continue
        hits = sorted(m for m in _imports(path)
                      if m.split(".")[0] == "vllm" or m.startswith(("kvsan.hooks", "kvsan.harness",
                                                                    "kvsan.plugin")))
        if hits:
            bad[name] = hits
    assert bad == {}


def test_only_the_adapter_and_the_harness_import_vllm():
    bad = {name: sorted(m for m in _imports(path) if m.split(".")[0] == "vllm")
           for name, path in _modules().items()
           if not name.startswith(("kvsan.hooks.vllm", "kvsan.harness"))}
    assert {k: v for k, v in bad.items() if v} == {}


def test_no_import_cycles():
    mods = _modules()
    graph = {name: {m for m in _imports(path) if m in mods and m != name}
             for name, path in mods.items()}
    # a package's __init__ importing its own submodules is not a cycle of
    # two modules that need each other
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
    assert cycles == [], cycles
