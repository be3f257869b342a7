"""The import rules of docs/architecture.md, read from the sources with ast (nothing is imported).

- Which package may import which: runtime none of the others; specdec and quant runtime only;
  distill runtime and specdec. The command line (specdec/cli.py and the `*command` modules it
  registers in COMMAND_MODULES) and recipes/ may import everything. Imports at module level and
  inside functions both count.
- No import cycle between modules at module level (imports inside functions and under
  `if TYPE_CHECKING:` do not run at import time and are left out; `from pkg import name` counts
  as an import of module pkg.name when that is a module).
- No module under specdec/drafters/ imports specdec.generate (the drafters propose; what times
  them calls generate from above).
- In distill, functions import no module of the packages (only optional or heavy third-party
  dependencies, which must not load when the CLI starts).

Each check is parametrized by package, so a failure names the package (and lists the modules and
lines) it comes from.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "specdec", "quant", "distill")
ALLOWED = {"runtime": set(), "specdec": {"runtime"}, "quant": {"runtime"}, "distill": {"runtime", "specdec"}}
CLI = "specdec.cli"


@dataclass(frozen=True)
class Import:
    """One import statement's target as seen from module `source`."""

    source: str
    target: str  # the module imported: the longest known module the statement names
    line: int
    module_level: bool  # runs when `source` is imported (not in a function, not under TYPE_CHECKING)

    def __str__(self) -> str:
        where = "module level" if self.module_level else "in a function or TYPE_CHECKING"
        return f"{self.source}:{self.line} imports {self.target} ({where})"


@cache
def modules() -> dict[str, Path]:
    """Every module of PACKAGES by dotted name (a package by its __init__.py)."""
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _known(name: str) -> str | None:
    """The longest prefix of dotted `name` that is a module of PACKAGES (None: another package's)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules():
            return ".".join(parts[:n])
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, module_level: bool):
    """(import node, whether it runs at import time) for every import under `node`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, module_level
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, False)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), False)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), module_level)
        else:
            yield from _walk(child, module_level)


@cache
def imports(source: str) -> tuple[Import, ...]:
    """The imports of module `source` whose targets are modules of PACKAGES."""
    path = modules()[source]
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    out = []
    for node, module_level in _walk(ast.parse(path.read_text(), str(path)), True):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name` imports module pkg.name when there is one
            names = [f"{base}.{alias.name}" if _known(f"{base}.{alias.name}") == f"{base}.{alias.name}" else base
                     for alias in node.names]
        for name in dict.fromkeys(names):
            target = _known(name)
            if target is not None and target != source:
                out.append(Import(source, target, node.lineno, module_level))
    return tuple(out)


def _command_modules() -> set[str]:
    """specdec/cli.py's COMMAND_MODULES that are command modules (`...command`), read by ast."""
    tree = ast.parse(modules()[CLI].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMMAND_MODULES" for t in node.targets):
            names = ast.literal_eval(node.value)
            return {n for n in names if n.rpartition(".")[2].endswith("command")}
    raise AssertionError("specdec/cli.py has no COMMAND_MODULES tuple")


def command_line() -> set[str]:
    """The modules that wire the packages together and may import all of them."""
    return {CLI} | _command_modules()


def _package(module: str) -> str:
    return module.partition(".")[0]


def test_the_sources_are_read():
    """The checks below are not vacuous: modules and their imports are found."""
    assert {"runtime", "specdec.cli", "quant", "distill.trainer"} <= set(modules())
    assert any(i.target == "distill.accel" and i.module_level for i in imports("distill.trainer"))
    assert any(i.target == "distill.data.features" for i in imports("distill.medusa.train"))
    assert "distill.command" in command_line()


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_only_what_the_architecture_allows(package):
    cli = command_line()
    bad = [str(i) for m in modules() if _package(m) == package and m not in cli for i in imports(m)
           if _package(i.target) != package and _package(i.target) not in ALLOWED[package]]
    assert not bad, (f"{package} may import {sorted(ALLOWED[package]) or 'no other package'} "
                     "(docs/architecture.md):\n" + "\n".join(bad))


def _module_graph() -> dict[str, list[Import]]:
    return {m: [i for i in imports(m) if i.module_level] for m in modules()}


def _cycles() -> list[list[Import]]:
    """One cycle (as its import edges) through every strongly connected component of the module-level
    import graph that has more than one module (Tarjan's algorithm, iteratively)."""
    graph = _module_graph()
    index, low, on_stack, stack, sccs = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            edge = next(edges, None)
            if edge is not None:
                nxt = edge.target
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    scc.add(m)
                    if m == node:
                        break
                if len(scc) > 1:
                    sccs.append(scc)
    return [_one_cycle(scc, graph) for scc in sccs]


def _one_cycle(scc: set[str], graph: dict[str, list[Import]]) -> list[Import]:
    """The import edges of one shortest cycle through the first module (by name) of `scc`."""
    start = min(scc)
    paths = {start: []}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for m in frontier:
            for edge in graph[m]:
                if edge.target == start:
                    return paths[m] + [edge]
                if edge.target in scc and edge.target not in paths:
                    paths[edge.target] = paths[m] + [edge]
                    nxt_frontier.append(edge.target)
        frontier = nxt_frontier
    raise AssertionError(f"no cycle through {start}")


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_between_modules_at_module_level(package):
    found = [c for c in _cycles() if any(_package(i.source) == package for i in c)]
    text = "\n\n".join(" ->\n".join(f"  {i.source}:{i.line} imports {i.target}" for i in c) for c in found)
    assert not found, f"{len(found)} import cycle(s) at module level through {package}:\n{text}"


def _uses_generate(module: str) -> list[str]:
    """Where `module` imports specdec.generate, or reads `specdec.generate` after `import specdec`."""
    found = [str(i) for i in imports(module) if i.target == "specdec.generate"]
    tree = ast.parse(modules()[module].read_text())
    bound = any(isinstance(n, ast.Import) and any(a.name == "specdec" and a.asname is None for a in n.names)
                for n in ast.walk(tree))
    if bound:
        found += [f"{module}:{n.lineno} reads specdec.generate" for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and n.attr == "generate" and isinstance(n.value, ast.Name)
                  and n.value.id == "specdec"]
    return found


def test_no_drafter_imports_generate():
    bad = [line for m in modules() if m.startswith("specdec.drafters.") or m == "specdec.drafters"
           for line in _uses_generate(m)]
    assert not bad, "modules under specdec/drafters/ use specdec.generate:\n" + "\n".join(bad)


def test_distill_imports_the_packages_at_module_level():
    """In distill a function imports only optional or heavy third-party dependencies (accelerate, peft,
    matplotlib), never a module of the packages."""
    bad = [str(i) for m in modules() if _package(m) == "distill" for i in imports(m) if not i.module_level]
    assert not bad, "function-level imports of the packages in distill:\n" + "\n".join(bad)
