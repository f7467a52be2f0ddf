"""engine/'s import structure (issue 46): no import cycles between its modules, and its packages
import one way, in LAYERS' order. Read from the source with `ast`, so every import counts: at
module level, inside functions, and under `if TYPE_CHECKING:`.

A package may import its own modules and those of packages in lower layers, never a package in
its own layer or above; packages in one layer are siblings that know nothing of each other (the
scheduler side and the worker side share only `engine.core`, the step's plain objects among it).
engine/__init__.py, the public facade (`from engine import LLM, SamplingParams`), sits above all.
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"

# lowest first
LAYERS = [
    ("core",),  # the plain data: config, sampling params, sequences, outputs, the step's objects
    ("kv", "sample"),  # KV-block bookkeeping; from logits to tokens
    ("sched", "worker"),  # what runs each step; tensors, the model and devices
    ("loop",),  # the step loop, the async engine, LLM, EngineArgs
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ENGINE.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = ("engine",) + path.relative_to(ENGINE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The engine modules (or packages) that `name` imports, anywhere in its file."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            found.update(subs)
            if len(subs) < len(node.names):  # a name defined in `base` itself
                found.add(base)
    out = set()
    for mod in found:
        while mod and mod not in MODULES:  # engine.x.Name -> engine.x
            mod = mod.rpartition(".")[0]
        if mod and mod != name and mod != "engine":
            out.add(mod)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _package(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def _find_cycle() -> list[str] | None:
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(GRAPH, WHITE)
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        color[v] = GREY
        stack.append(v)
        for w in sorted(GRAPH[v]):
            if color[w] == GREY:
                return stack[stack.index(w):] + [w]
            if color[w] == WHITE and (cycle := visit(w)):
                return cycle
        stack.pop()
        color[v] = BLACK
        return None

    for v in sorted(GRAPH):
        if color[v] == WHITE and (cycle := visit(v)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = _find_cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_lives_in_a_declared_package():
    stray = [n for n in MODULES if n != "engine" and _package(n) not in RANK]
    assert not stray, f"modules outside the packages of LAYERS: {stray}"
    for pkg in RANK:
        init = ENGINE / pkg / "__init__.py"
        assert init.is_file(), f"engine/{pkg}/ has no __init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"engine/{pkg}/__init__.py says not what it owns"


def test_packages_import_one_way():
    wrong = []
    for name, deps in GRAPH.items():
        if name == "engine":
            continue
        src = _package(name)
        for dep in deps:
            dst = _package(dep)
            if src in RANK and dst in RANK and dst != src and RANK[dst] >= RANK[src]:
                wrong.append(f"{name} -> {dep}")
    assert not wrong, "imports against the package order " + " < ".join("/".join(l) for l in LAYERS) + ":\n" + "\n".join(sorted(wrong))


def test_worker_never_imports_the_scheduler_or_the_block_manager():
    # NOTE: a tensor-parallel worker process must not load the scheduling stack, and the model
    # runner carries out block ids without knowing the block manager (docs/architecture.md); the
    # step's plain objects it needs live in engine.core.step.
    wrong = [f"{n} -> {d}" for n, ds in GRAPH.items() if _package(n) == "worker"
             for d in ds if _package(d) in ("sched", "kv")]
    assert not wrong, wrong


def test_the_graph_sees_imports_inside_functions_and_type_checking(tmp_path):
    # the reader itself: every kind of import below must count
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from engine.core.sequence import Sequence\n"
        "def f():\n    from engine.kv import block_manager\n"
        "import engine.core.outputs\n"
    )
    probe = tmp_path / "probe.py"
    probe.write_text(src)
    deps = _imports("engine.probe.x", probe)
    assert {"engine.core.sequence", "engine.kv.block_manager", "engine.core.outputs"} <= deps
