"""The package's import graph, read with ``ast`` (issue #22): the data plane has no import cycle and
imports none of the package inside a function, and no module imports another module's private name.

Every import counts, wherever it sits: at the top, under ``if TYPE_CHECKING:`` or inside a function
(where a cycle used to hide). The checks run first on small packages written by the test, each with
the fault it must find, so a checker that finds nothing cannot pass for a clean package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ft_assets

PACKAGE = Path(ft_assets.__file__).parent
DATA_PLANE = "ft_assets.data"


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str | None, ast.AST, bool]]:
    """(imported module, imported name or None, node, inside a function) for each import of a package module."""
    tree = ast.parse(path.read_text(), str(path))
    top = name.split(".")[0]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    inside = {id(node) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) for node in ast.walk(fn)}
    found = []
    for node in ast.walk(tree):
        local = id(node) in inside
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node, local) for alias in node.names if alias.name.split(".")[0] == top]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, (base, node.module)))
            if module.split(".")[0] != top:
                continue
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.append((submodule, None, node, local) if submodule in known else (module, alias.name, node, local))
    return found


def import_cycles(known: dict[str, Path], within: str) -> list[list[str]]:
    """The import cycles among the modules under ``within`` (each as the modules along it, first repeated last)."""
    inside = sorted(name for name in known if name == within or name.startswith(within + "."))
    graph = {name: sorted({target for target, _, _, _ in imports(name, known[name], known) if target in inside and target != name})
             for name in inside}  # fmt: skip
    cycles, state, stack = [], {}, []

    def visit(name: str) -> None:
        state[name] = "open"
        stack.append(name)
        for target in graph.get(name, []):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name)
    return cycles


def local_imports(known: dict[str, Path], within: str) -> list[str]:
    """``module:line`` of every import of the package inside a function of a module under ``within``."""
    found = {
        f"{name}:{node.lineno} imports {target}"
        for name, path in known.items()
        if name.startswith(within + ".")
        for target, _, node, local in imports(name, path, known)
        if local
    }
    return sorted(found)


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(known: dict[str, Path]) -> list[str]:
    """``module:line`` of every private name (``_name``, not ``__dunder__``) one module takes from another."""
    faults = []
    for name, path in known.items():
        found = imports(name, path, known)
        faults += [f"{name}:{node.lineno} imports {target}.{what}" for target, what, node, _ in found if what and is_private(what)]
        aliases = {}  # names bound to a package module in this one: `import a.b as c`, `from a import b`
        for target, what, node, _ in found:
            if what is None and target != name:
                for alias in node.names:
                    bound = alias.asname or (alias.name if isinstance(node, ast.ImportFrom) else None)
                    if bound and (target.endswith("." + alias.name) or target == alias.name):
                        aliases[bound] = target
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases and is_private(node.attr):
                faults.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return faults


FAULTS = [  # (files of a small package "pkg", what the checks must report)
    (
        "cycle through a function-local import",
        {"data/__init__.py": "", "data/a.py": "from pkg.data.b import f\n", "data/b.py": "def f():\n    from pkg.data import a\n"},
        {"cycles": [["pkg.data.a", "pkg.data.b", "pkg.data.a"]], "local": ["pkg.data.b:2 imports pkg.data.a"]},
    ),
    (
        "three-module cycle under TYPE_CHECKING",
        {
            "data/__init__.py": "",
            "data/a.py": "import pkg.data.b\n",
            "data/b.py": "from pkg.data.c import x\n",
            "data/c.py": "from typing import TYPE_CHECKING\nx = 1\nif TYPE_CHECKING:\n    from pkg.data.a import y\n",
        },
        {"cycles": [["pkg.data.a", "pkg.data.b", "pkg.data.c", "pkg.data.a"]]},
    ),
    (
        "private name, imported and used through a module",
        {
            "data/__init__.py": "",
            "data/a.py": "def _helper():\n    pass\n",
            "data/b.py": "from pkg.data.a import _helper\n",
            "c.py": "from pkg.data import a\n\n\ndef g():\n    return a._helper(), a.__name__\n",
        },
        {"private": ["pkg.c:5 uses pkg.data.a._helper", "pkg.data.b:1 imports pkg.data.a._helper"]},
    ),
    (
        "relative imports resolve like absolute ones",
        {"data/__init__.py": "", "data/a.py": "from .b import _x\n", "data/b.py": "from . import a\n_x = 1\n"},
        {"cycles": [["pkg.data.a", "pkg.data.b", "pkg.data.a"]], "private": ["pkg.data.a:1 imports pkg.data.b._x"]},
    ),
    (
        "clean: one direction, public names, third-party imports in functions",
        {"data/__init__.py": "", "data/a.py": "from pkg.data.b import helper\n", "data/b.py": "def helper():\n    import json\n"},
        {},
    ),
]


@pytest.mark.parametrize("files,expected", [case[1:] for case in FAULTS], ids=[case[0] for case in FAULTS])
def test_the_checks_find_each_fault(tmp_path, files, expected):
    root = tmp_path / "pkg"
    for relative, text in {"__init__.py": "", **files}.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    known = modules(root)
    assert import_cycles(known, "pkg.data") == expected.get("cycles", [])
    assert local_imports(known, "pkg.data") == expected.get("local", [])
    assert sorted(private_imports(known)) == expected.get("private", [])


def test_the_data_plane_has_no_import_cycle():
    known = modules(PACKAGE)
    edges = {(name, target) for name, path in known.items() if name.startswith(DATA_PLANE + ".")
             for target, _, _, _ in imports(name, path, known) if target.startswith(DATA_PLANE + ".")}  # fmt: skip
    assert len(edges) > 30, f"only {len(edges)} imports between data-plane modules were read: the graph is not being built"
    cycles = import_cycles(known, DATA_PLANE)
    assert not cycles, "import cycles (move the shared names to the module both can import):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_data_plane_imports_the_package_at_module_level_only():
    found = local_imports(modules(PACKAGE), DATA_PLANE)
    assert not found, "imports of the package inside functions (import at the top of the module):\n" + "\n".join(found)


def test_no_module_of_the_package_imports_a_private_name_of_another():
    found = private_imports(modules(PACKAGE))
    assert not found, "private names used across modules (make them public, or move them to their owner):\n" + "\n".join(found)
