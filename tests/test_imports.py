"""tessel's import graph has no circles and no import that runs back up the stage order.

The graph is read from the source with `ast`; nothing is imported. Every `import` and
`from ... import` counts, relative ones and those inside functions (a lazy import is still a
dependency: it runs when the function does). Imports under `if TYPE_CHECKING:` are left out:
they never run, and only give a type to an annotation.

The stage order is the architecture (docs/architecture.md), written below as `LAYERS` (lowest first). A
module may import from its own layer and the layers below it, never from a layer above; every
top-level module and package of `src/tessel` is in exactly one layer, so a new one has to be
placed before it can be imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tessel"

# lowest first: the architecture (docs/architecture.md), from the helpers every stage uses up to the entry
# points. A layer is a set of top-level packages and modules of `tessel` ("tessel" itself is
# the package's __init__: the public names, resolved on first use)
LAYERS: list[set[str]] = [
    # below every stage: the small helpers, and which part of a tensor a rank holds
    {
        "errors",
        "_version",
        "_torch",
        "atomic",
        "arguments",
        "dtypes",
        "forked",
        "units",
        "progress",
        "schedules",
        "sharding",
    },
    # the JSON inputs (cluster, policy, ...), and the log level read from them
    {"config", "log_levels"},
    # the generation loop over a package's gears: the build's check and the workers run it
    {"decoding"},
    {"capture"},
    {"plan"},
    {"lower"},
    {"package"},
    # reading a package: `tessel inspect`, the build's one-screen summary, its HTML page
    {"report", "summary", "plan_page"},
    {"checkpoint"},
    {"runtime"},
    # the serving engine and its HTTP server, over a Session's workers
    {"serving"},
    {"slices"},
    {"builder"},
    {"dataflow"},
    {"parallel"},
    {"demo"},
    {"cli", "tessel"},
    # the command line's reference page, made from its parser
    {"cli_reference"},
]


def _module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under `root` (a package directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of `tree`, at any depth, except those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """Module -> {module of the same top-level package it imports: line of the first such import}."""
    files = _module_files(root)

    def owner(name: str) -> str | None:
        """The module that `name` (a module, or a name defined in one) lives in."""
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    up = parts[: len(parts) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import sub` imports the module pkg.sub; `from mod import x` imports mod
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            for target in targets:
                found = owner(target) if target.split(".")[0] == root.name else None
                if found is not None and found != name:
                    edges.setdefault(found, node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one module (Tarjan's
    algorithm, iterative), each sorted; a module importing itself is not counted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return sorted(out)


def _top(module: str) -> str:
    """The top-level package or module `module` belongs to ("tessel" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward(graph: dict[str, dict[str, int]], layers: list[set[str]]) -> list[str]:
    """Each import from a lower layer's module into a higher layer's, described."""
    level = {name: i for i, layer in enumerate(layers) for name in layer}
    out = []
    for a, edges in sorted(graph.items()):
        for b, line in sorted(edges.items()):
            la, lb = level[_top(a)], level[_top(b)]
            if lb > la:
                out.append(
                    f"{a} (layer {la}: {_top(a)}) imports {b} (layer {lb}: {_top(b)}) at line {line}"
                )
    return out


def _describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    inside = set(component)
    edges = [
        f"    {a} -> {b} (line {line})"
        for a in component
        for b, line in sorted(graph[a].items())
        if b in inside
    ]
    return "  " + ", ".join(component) + ":\n" + "\n".join(edges)


def test_every_top_level_module_is_in_one_layer():
    names = [name for layer in LAYERS for name in layer]
    assert len(names) == len(set(names)), "a name is in two layers"
    present = {_top(m) for m in _module_files(SRC)}
    assert present - set(names) == set(), "place these in LAYERS (docs/architecture.md)"
    assert set(names) - present == set(), "LAYERS names what src/tessel does not have"


def test_no_import_circles():
    graph = import_graph(SRC)
    found = cycles(graph)
    assert not found, "modules that import each other, directly or round a circle:\n" + "\n".join(
        _describe(graph, c) for c in found
    )


def test_no_import_runs_back_up_the_stages():
    found = upward(import_graph(SRC), LAYERS)
    assert not found, "imports from a lower stage into a higher one:\n" + "\n".join(found)


# the checks themselves, on a small made-up package


@pytest.fixture
def pkg(tmp_path: Path) -> Path:
    root = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "base.py": "X = 1\n",
        "low/__init__.py": "",
        "low/a.py": "from .b import Y\n",
        "low/b.py": "def f():\n    from pkg.low import a\n    return a\nY = 2\n",
        "low/c.py": (
            "from typing import TYPE_CHECKING\n"
            "from pkg.base import X\n"
            "if TYPE_CHECKING:\n    from pkg.high import Z\n"
        ),
        "high.py": "import pkg.low.c\nfrom . import base\nZ = 3\n",
        "up.py": "from pkg.high import Z\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_graph_counts_relative_lazy_and_package_imports_but_not_type_checking(pkg):
    assert import_graph(pkg) == {
        "pkg": {},
        "pkg.base": {},
        "pkg.high": {"pkg.low.c": 1, "pkg.base": 2},
        "pkg.low": {},
        "pkg.low.a": {"pkg.low.b": 1},
        "pkg.low.b": {"pkg.low.a": 2},
        "pkg.low.c": {"pkg.base": 2},
        "pkg.up": {"pkg.high": 1},
    }


def test_a_circle_and_an_upward_import_are_found(pkg):
    graph = import_graph(pkg)
    assert cycles(graph) == [["pkg.low.a", "pkg.low.b"]]
    layers = [{"base"}, {"low"}, {"high"}, {"up", "pkg"}]
    assert upward(graph, layers) == []
    assert upward(graph, [{"base"}, {"low"}, {"high", "up", "pkg"}]) == []
    assert upward(graph, [{"base"}, {"low", "up"}, {"high", "pkg"}]) == [
        "pkg.up (layer 1: up) imports pkg.high (layer 2: high) at line 1"
    ]
