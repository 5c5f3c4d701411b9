"""aiolocks' modules import downward only, in the layers the design names, and in no circle.

Read from the source with `ast`, so every import counts: at module level, under
`TYPE_CHECKING`, and inside functions. A new module must be given its layer here.
`python tests/test_layers.py` prints the modules by layer with what each imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "aiolocks"

# Bottom to top; a module's layer is its folder (the first part of its name relative to
# `aiolocks`, "" being the package itself), and it imports only from its own layer or a lower
# one. A private module lives in a layer folder, never directly under `aiolocks/`.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("foundations", frozenset({"_base", "_scripts"})),
    ("per-client runner", frozenset({"_transport"})),
    ("waiting and notification", frozenset({"_waiting"})),
    ("leases", frozenset({"_leases"})),
    ("engine", frozenset({"_engine"})),
    ("primitives", frozenset({"mutex", "semaphore", "rwlock", "registry", "multilock",
                              "election", "ratelimit"})),
    ("on top", frozenset({"integrations", "cli", "otel", "testing", "sync", "", "__main__"})),
)  # fmt: skip


def modules() -> dict[str, Path]:
    """Every module of the package, by its name relative to `aiolocks` ("" for itself)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The package's modules that module `name` imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _ours(alias.name, (), known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
                yield from _relative(target, node.names, known)
            elif node.module is not None:
                yield from _ours(node.module, node.names, known)


def _ours(module: str, names: list[ast.alias] | tuple[()], known: dict[str, Path]) -> Iterator[str]:
    if module == "aiolocks" or module.startswith("aiolocks."):
        yield from _relative(module.removeprefix("aiolocks").lstrip("."), names, known)


def _relative(
    target: str, names: list[ast.alias] | tuple[()], known: dict[str, Path]
) -> Iterator[str]:
    """`from target import names`: each name that is a submodule, else `target` itself."""
    whole = False
    for alias in names:
        sub = f"{target}.{alias.name}" if target else alias.name
        if sub in known:
            yield sub
        else:
            whole = True
    if (whole or not names) and target in known:
        yield target


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: {imported for imported in _imported(name, path, known) if imported != name}
        for name, path in known.items()
    }


def layer_of(name: str) -> int | None:
    """The layer of a module: the one that lists its folder (or the module, at the top)."""
    top = name.partition(".")[0]
    for index, (_, members) in enumerate(LAYERS):
        if top in members:
            return index
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _label(name: str) -> str:
    return f"aiolocks.{name}" if name else "aiolocks"


@pytest.mark.slow
def test_the_graph_is_read_from_every_kind_of_import() -> None:
    graph = import_graph()
    assert "_base._keys" in graph["_base._handle"]  # `from ._keys import ...`
    assert "cli" in graph["__main__"]  # `from .cli import main`: a name of the package
    assert "_base._errors" in graph["cli._connect"]  # `from .._base._errors import ...`
    assert "" in graph["otel._recorder"]  # `from .. import __version__`: the package itself
    assert "_base._telemetry" in graph["otel"]  # `from .._base import _telemetry`: a module


def test_no_private_module_outside_a_layer_folder() -> None:
    loose = sorted(
        path.name
        for path in PACKAGE.glob("*.py")
        if path.name.startswith("_") and path.name not in {"__init__.py", "__main__.py"}
    )
    assert not loose, f"move these into the folder of their layer: {loose}"


def test_every_layer_folder_says_what_it_holds() -> None:
    for _, members in LAYERS:
        for member in members:
            init = PACKAGE / member / "__init__.py"
            if member and init.exists():
                assert ast.get_docstring(ast.parse(init.read_text())), f"{init}: no docstring"


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(_label(name) for name in modules() if layer_of(name) is None)
    assert not unplaced, f"give these modules a layer in LAYERS: {unplaced}"


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "modules that import each other in a circle: " + "; ".join(
        ", ".join(_label(name) for name in component) for component in found
    )


def test_imports_go_downward() -> None:
    upward = []
    for name, imported in sorted(import_graph().items()):
        here = layer_of(name)
        for other in sorted(imported):
            there = layer_of(other)
            if here is not None and there is not None and there > here:
                upward.append(
                    f"{_label(name)} ({LAYERS[here][0]}) imports {_label(other)} "
                    f"({LAYERS[there][0]})"
                )
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def folder_graph() -> dict[str, set[str]]:
    """The import graph by folder: which layer folders (or top-level modules) each imports."""
    graph: dict[str, set[str]] = {}
    for name, imported in import_graph().items():
        here = name.partition(".")[0]
        graph.setdefault(here, set()).update(
            there for there in (other.partition(".")[0] for other in imported) if there != here
        )
    return graph


if __name__ == "__main__":
    graph = folder_graph()
    for number, (title, _) in enumerate(LAYERS):
        print(f"{number}. {title}")
        for name in sorted(name for name in graph if layer_of(name) == number):
            imported = ", ".join(sorted(other or "aiolocks" for other in graph[name]))
            print(f"   {_label(name)} -> {imported or '-'}")
