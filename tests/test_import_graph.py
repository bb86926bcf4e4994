"""No import cycles between the modules of `mini_vllm`.

The graph is read from the source with `ast`, not from `sys.modules`: every
`import` / `from ... import` statement, at module level or inside a function
(a function-level import hides a cycle from the interpreter, it does not
remove it), except those under `if TYPE_CHECKING:`, which never run. Files
map to module names through pyproject.toml's package-dir table (`05_mini_vllm/`
is `mini_vllm`, `03_scheduler/` is `mini_vllm.scheduler`, ...), so a cycle
between the engine and a chapter is found too. `from pkg import name` is an
edge to `pkg.name` when that is a module, else to `pkg`. The implicit import
of a module's parent packages is not an edge: that one is never a cycle the
code chose.

A second test imports every module of the map, which checks that the map
names real, importable modules (a module that fails only when imported
first, because of a cycle, is what the graph test catches).

Run as a script (`python tests/test_import_graph.py`) to print the cycles.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """{package name: folder} from pyproject.toml's [tool.setuptools.package-dir]."""
    table = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in table.items()}


def module_files(dirs: dict[str, Path]) -> dict[str, Path]:
    """{module name: file} for every .py file under the mapped folders; the most
    specific mapping wins (03_scheduler/ is not read as mini_vllm.03_scheduler)."""
    mapped = {d.resolve() for d in dirs.values()}
    out: dict[str, Path] = {}
    for pkg, folder in dirs.items():
        for f in sorted(folder.rglob("*.py")):
            rel = f.relative_to(folder)
            if any((folder / p).resolve() in mapped for p in rel.parents if str(p) != "."):
                continue  # inside another mapped folder
            if any(part.startswith(".") or part == "__pycache__" or "-" in part for part in rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([pkg, *parts])] = f
    return out


def _type_checking_only(node: ast.AST) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """(Import / ImportFrom node, enclosing function or None) for every import,
    skipping `if TYPE_CHECKING:` bodies."""
    stack = [(tree, None)]
    while stack:
        node, scope = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, scope
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scope = node.name if scope is None else f"{scope}.{node.name}"
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                stack.extend((c, scope) for c in child.orelse)  # the else branch does run
                continue
            stack.append((child, scope))


def _known(name: str, modules) -> str | None:
    """`name` or its longest prefix that is a module of the map."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(modules: dict[str, Path], where: dict | None = None) -> dict[str, set[str]]:
    """{module: modules it imports}; `where`, if given, gets {(a, b): line and
    function of the first import of b in a} for the failure message."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node, scope in _imports(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else base)
            for t in targets:
                k = _known(t, modules)
                if k is not None and k != mod:
                    graph[mod].add(k)
                    if where is not None:
                        site = f"line {node.lineno}" + (f", in {scope}()" if scope else ", module level")
                        where.setdefault((mod, k), site)
    return graph


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module: the
    modules that lie on a common cycle (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, sccs, counter = {}, {}, set(), [], [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        sccs.append(set(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sccs


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path a -> ... -> a) per component of `components`."""
    return [_cycle_in(graph, comp) for comp in components(graph)]


def _cycle_in(graph, comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


# Cycles accepted on purpose, each with its reason; the test fails if one of them
# grows or disappears (then drop it here), and on any other cycle.
KNOWN_CYCLES: dict[frozenset, str] = {}


def describe(graph: dict, comp: set[str], where: dict) -> str:
    """The component's modules, then one of its cycles with the line of each import."""
    cycle = _cycle_in(graph, comp)
    return f"  {{{', '.join(sorted(comp))}}}, e.g.\n    " + " -> ".join(cycle) + "\n" + "\n".join(
        f"      {a} imports {b} ({where.get((a, b), '?')})" for a, b in zip(cycle, cycle[1:]))


def cycle_report(root: Path = ROOT) -> tuple[dict, list[set[str]], dict]:
    """(graph, cyclic components, {(a, b): where a imports b})."""
    where: dict = {}
    graph = import_graph(module_files(package_dirs(root)), where)
    return graph, components(graph), where


def test_no_import_cycles():
    modules = module_files(package_dirs())
    assert "mini_vllm.engine.llm_engine" in modules and "mini_vllm.scheduler.scheduler" in modules, \
        "the module map misses the engine or a chapter: check pyproject.toml's package-dir"
    graph, comps, where = cycle_report()
    new = [c for c in comps if frozenset(c) not in KNOWN_CYCLES]
    assert not new, "import cycles (module-level or inside functions):\n" + \
        "\n".join(describe(graph, c, where) for c in new)
    gone = [sorted(k) for k in KNOWN_CYCLES if k not in {frozenset(c) for c in comps}]
    assert not gone, f"a known cycle is gone or changed; update KNOWN_CYCLES: {gone}"


def test_find_cycles_reports_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]], "the checker must find a -> b -> c -> a"
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_every_mapped_module_imports():
    """Each module of the map imports, in one fresh interpreter (the map names real modules)."""
    names = sorted(m for m in module_files(package_dirs()) if not m.endswith("__main__"))
    program = Path(__file__).resolve().parent / "programs" / "import_all.py"
    r = subprocess.run([sys.executable, str(program), *names], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"modules that do not import:\n{r.stdout}{r.stderr[-2000:]}"


if __name__ == "__main__":
    g, found, sites = cycle_report()
    for c in found:
        print(describe(g, c, sites))
        if frozenset(c) in KNOWN_CYCLES:
            print("    known:", KNOWN_CYCLES[frozenset(c)])
    print(f"{len(found)} cyclic component(s)" if found else "no import cycles")
    sys.exit(1 if any(frozenset(c) not in KNOWN_CYCLES for c in found) else 0)
