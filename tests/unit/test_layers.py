"""The import graph is the architecture. The layers and the other contracts in pyproject.toml
hold (import-linter, through ``.ci/lint-imports``), and the modules of ddlcore import each other
without cycles, module by module and package by package: every ``import`` statement in the
source (also those inside functions and under ``TYPE_CHECKING``) is an edge, and neither graph
has a strongly connected component larger than one node. One exception: modules of one package
may name each other's types for annotations (under ``TYPE_CHECKING``), as a pair names its
context: that is not a dependency at run time, nor across layers."""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

from tests.harness import require

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Source folders and the packages they install as (pyproject.toml's package-dir).
SOURCES = {"ddlcore": "ddlcore", "transports": "ddlcore.transports", "kernels": "ddlcore.kernels"}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, package in SOURCES.items():
        # Compiled modules count as modules (``from pkg._native import f`` names them), with
        # no ddlcore imports of their own.
        for path in sorted([*(ROOT / folder).rglob("*.py"), *(ROOT / folder).rglob("*.pyx")]):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The ddlcore modules ``name`` imports (the closest module each statement names; the
    package ``ddlcore`` itself, which imports the public API, is left out)."""
    if path.suffix == ".pyx":
        return set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    targets: set[str] = set()
    for node in ast.walk(tree):
        named: list[str] = []
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            named = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        for target in named:
            while target and target not in known:
                target = target.rpartition(".")[0]
            sibling = target.rpartition(".")[0] == package
            if (
                target
                and target not in (name, "ddlcore")
                and not (sibling and id(node) in typing_only)
            ):
                targets.add(target)
    return targets


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for succ in edges:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_the_known_edges():
    edges = graph()
    assert "ddlcore.execution.paths.base" in edges["ddlcore.execution.checks"]
    assert "ddlcore.execution.hostcoll" in edges["ddlcore.execution.paths.base"]
    assert "ddlcore.transports.base" in edges["ddlcore.device"]  # a package-dir module


def test_annotations_among_siblings_are_not_edges():
    edges = graph()
    assert "ddlcore.transports.tcp.pair" in edges["ddlcore.transports.tcp.context"]
    assert "ddlcore.transports.tcp.context" not in edges["ddlcore.transports.tcp.pair"]


def test_no_import_cycles():
    found = [sorted(c) for c in cycles(graph())]
    assert not found, f"modules that import each other (directly or around a loop): {found}"


def packages(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph of ddlcore's top-level packages and modules (``ddlcore.job``,
    ``ddlcore.transports``, ``ddlcore.calls`` ...): an edge where any module of one imports any
    module of the other."""

    def top(name: str) -> str:
        return ".".join(name.split(".")[:2])

    found: dict[str, set[str]] = {}
    for name, targets in edges.items():
        found.setdefault(top(name), set()).update(top(t) for t in targets if top(t) != top(name))
    return found


def test_no_cycles_between_packages():
    found = [sorted(c) for c in cycles(packages(graph()))]
    assert not found, f"packages that import each other (directly or around a loop): {found}"


def test_the_import_contracts_hold():
    """pyproject.toml's [tool.importlinter] contracts (layers, independent transports, what the
    transports and kernels may import, no concrete transport above them), as CI checks them."""
    lint = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent))
    require(lint is not None, "import-linter is not installed (pip install -e '.[test]')")
    env = {"PATH": f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin"}
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "lint-imports")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout, done.stdout[-4000:]


def _declared_layers() -> list[str]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the test extra brings tomli there
        import tomli as tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    return layers


def test_every_package_sits_in_a_layer():
    declared = {
        name.strip() for layer in _declared_layers() for name in layer.replace("|", ":").split(":")
    }
    tops = {".".join(name.split(".")[:2]) for name in modules()} - {"ddlcore"}
    assert tops - declared == set(), f"in no layer of pyproject.toml: {sorted(tops - declared)}"


def test_the_architecture_table_names_the_declared_layers():
    """docs/ARCHITECTURE.md's layer table lists pyproject.toml's layers, in order."""
    table = []
    for line in (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines():
        cells = [c.strip() for c in line.replace("\\|", "\0").split("|")]
        if len(cells) > 3 and cells[2].startswith("`ddlcore."):
            table.append(cells[2].replace("\0", "|").replace("`", ""))
    assert table == _declared_layers()


def test_the_layer_drawing_is_current():
    """docs/layers.svg is what ``python docs/layers.py`` draws from pyproject.toml's layers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("draw_layers", ROOT / "docs" / "layers.py")
    assert spec is not None and spec.loader is not None
    draw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(draw)
    assert (ROOT / "docs" / "layers.svg").read_text() == draw.svg(), (
        "docs/layers.svg is stale: run python docs/layers.py"
    )
