"""The package's import graph, read with ``ast`` (issues #22, #31): no import cycle anywhere in the package,
no import that runs back up the planes, the data plane imports none of the package inside a function, no
module imports another module's private name, and the data and control planes load without torch.

The planes, and the one direction imports run (``ALLOWED``)::

    core  <-  data  <-  training  <-  delivery
                            ^
                            '------  control
    cli and definitions.py on top (they call every plane)

- core: the package's top-level modules (``layout``, ``storage``, ``manifests``, ``refs``, ``shards``,
  ``materialize``, ``rewards``, ``portable``, ``generation``, ...) and ``ft_assets.objectives``, which
  names its pieces in the planes as ``module:name`` and imports none of them. Core imports no plane.
- ``ft_assets.targets`` (the GPU targets a training run's worker goes to) is part of the training plane.
- data imports core; training imports data and core; delivery imports training, data and core; control
  (the planner, the cost model, the sensors) imports training, data and core, never delivery.

Every import counts, wherever it sits: at the top, under ``if TYPE_CHECKING:`` or inside a function
(where a cycle used to hide). The checks run first on small packages written by the test, each with
the fault it must find, so a checker that finds nothing cannot pass for a clean package.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ft_assets

PACKAGE = Path(ft_assets.__file__).parent
DATA_PLANE = "ft_assets.data"
PLANES = ("data", "training", "delivery", "control", "cli")  # a subpackage each; every other module is core
PART_OF = {"targets": "training", "providers": "training"}  # beside the training plane: the GPU targets, the providers
ALLOWED = {  # plane -> the planes its modules may import (its own included)
    "core": {"core"},
    "data": {"core", "data"},
    "training": {"core", "data", "training"},
    "delivery": {"core", "data", "training", "delivery"},
    "control": {"core", "data", "training", "control"},
    "cli": {"core", "data", "training", "delivery", "control", "cli"},
}
TORCH_FREE = ("data", "control")  # planes that load without torch: the CPU pool and the always-on control host


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
    inside = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
    }
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
                found.append(
                    (submodule, None, node, local) if submodule in known else (module, alias.name, node, local)
                )
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


def plane_of(module: str) -> str:
    """The plane a module belongs to: its subpackage under ``PLANES``, ``cli`` for ``definitions`` (it assembles
    every plane), else ``core``."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in PART_OF:
        return PART_OF[parts[1]]
    if len(parts) > 1 and parts[1] in PLANES:
        return parts[1]
    return "cli" if parts[1:] == ["definitions"] else "core"


def upward_imports(known: dict[str, Path]) -> list[str]:
    """``module:line imports target`` for every import of a plane its module may not import (``ALLOWED``)."""
    found = {
        f"{name}:{node.lineno} imports {target} ({plane_of(name)} -> {plane_of(target)})"
        for name, path in known.items()
        for target, _, node, _ in imports(name, path, known)
        if plane_of(target) not in ALLOWED[plane_of(name)]
    }
    return sorted(found)


def loading(names: list[str], heavy: str, path: Path) -> list[str]:
    """The first of ``names`` (imported in that order, in a fresh interpreter with ``path`` first on the path)
    after which module ``heavy`` is loaded, or nothing: what makes an import of the plane load it."""
    probe = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"    if {heavy!r} in sys.modules:\n"
        "        print(json.dumps([name])); break\n"
        "else:\n"
        "    print(json.dumps([]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


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
        faults += [
            f"{name}:{node.lineno} imports {target}.{what}"
            for target, what, node, _ in found
            if what and is_private(what)
        ]
        aliases = {}  # names bound to a package module in this one: `import a.b as c`, `from a import b`
        for target, what, node, _ in found:
            if what is None and target != name:
                for alias in node.names:
                    bound = alias.asname or (alias.name if isinstance(node, ast.ImportFrom) else None)
                    if bound and (target.endswith("." + alias.name) or target == alias.name):
                        aliases[bound] = target
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and is_private(node.attr)
            ):
                faults.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return faults


FAULTS = [  # (files of a small package "pkg", what the checks must report)
    (
        "cycle through a function-local import",
        {
            "data/__init__.py": "",
            "data/a.py": "from pkg.data.b import f\n",
            "data/b.py": "def f():\n    from pkg.data import a\n",
        },
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
            "cli/__init__.py": "",
            "cli/c.py": "from pkg.data import a\n\n\ndef g():\n    return a._helper(), a.__name__\n",
        },
        {"private": ["pkg.cli.c:5 uses pkg.data.a._helper", "pkg.data.b:1 imports pkg.data.a._helper"]},
    ),
    (
        "relative imports resolve like absolute ones",
        {"data/__init__.py": "", "data/a.py": "from .b import _x\n", "data/b.py": "from . import a\n_x = 1\n"},
        {"cycles": [["pkg.data.a", "pkg.data.b", "pkg.data.a"]], "private": ["pkg.data.a:1 imports pkg.data.b._x"]},
    ),
    (
        "cycle across the planes, through core (objectives -> training/steps -> training/config -> objectives)",
        {
            "objectives.py": "from pkg.training.steps import DpoStep\n",
            "training/__init__.py": "",
            "training/steps.py": "from pkg.training.config import TrainingConfig\n",
            "training/config.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.objectives import Objective\n",
        },
        {
            "cycles": [["pkg.objectives", "pkg.training.steps", "pkg.training.config", "pkg.objectives"]],
            "upward": ["pkg.objectives:1 imports pkg.training.steps (core -> training)"],
        },
    ),
    (
        "imports back up the planes: training -> delivery, control -> delivery, core -> data, data -> control",
        {
            "data/__init__.py": "",
            "data/a.py": "def f():\n    from pkg.control import plan\n",
            "training/__init__.py": "",
            "training/steps.py": "from pkg.delivery.evaluate import stop_tokens\n",
            "delivery/__init__.py": "",
            "delivery/evaluate.py": "stop_tokens = 1\n",
            "control/__init__.py": "",
            "control/plan.py": "import pkg.delivery.evaluate\n",
            "materialize.py": "from pkg.data import a\n",
        },
        {
            "local": ["pkg.data.a:2 imports pkg.control.plan"],
            "upward": [
                "pkg.control.plan:1 imports pkg.delivery.evaluate (control -> delivery)",
                "pkg.data.a:2 imports pkg.control.plan (data -> control)",
                "pkg.materialize:1 imports pkg.data.a (core -> data)",
                "pkg.training.steps:1 imports pkg.delivery.evaluate (training -> delivery)",
            ],
        },
    ),
    (
        "clean: one direction, public names, third-party imports in functions",
        {
            "data/__init__.py": "",
            "data/a.py": "from pkg.data.b import helper\nfrom pkg import shards\n",
            "data/b.py": "def helper():\n    import json\n",
            "shards.py": "",
            "delivery/__init__.py": "",
            "delivery/scoring.py": "from pkg.data import b\nfrom pkg.training import loss\n",
            "training/__init__.py": "",
            "training/loss.py": "from pkg.data.a import helper\n",
            "cli/__init__.py": "from pkg.delivery import scoring\nfrom pkg.control import plan\n",
            "control/__init__.py": "",
            "control/plan.py": "from pkg.training import loss\n",
            "definitions.py": "import pkg.cli\n",
        },
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
    assert import_cycles(known, "pkg") == expected.get("cycles", [])
    assert local_imports(known, "pkg.data") == expected.get("local", [])
    assert sorted(private_imports(known)) == expected.get("private", [])
    assert upward_imports(known) == expected.get("upward", [])


def test_the_package_has_no_import_cycle():
    known = modules(PACKAGE)
    edges = {(name, target) for name, path in known.items() for target, _, _, _ in imports(name, path, known)}
    planes = {(plane_of(name), plane_of(target)) for name, target in edges}
    assert len(edges) > 300 and len(planes) > 10, (
        f"only {len(edges)} imports between the package's modules were read: the graph is not being built"
    )
    cycles = import_cycles(known, "ft_assets")
    assert not cycles, "import cycles (move the shared names to the module both can import):\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


def test_no_import_runs_back_up_the_planes():
    found = upward_imports(modules(PACKAGE))
    assert not found, (
        "imports against the planes' direction (move what both need down to the lower plane or to core):\n"
        + "\n".join(found)
    )


@pytest.mark.integration
def test_the_torch_check_finds_the_module_that_loads_it(tmp_path):
    for relative, text in {"__init__.py": "", "heavy.py": "", "data/__init__.py": "", "data/a.py": "",
                           "data/b.py": "from pkg.data import c\n", "data/c.py": "import pkg.heavy\n"}.items():  # fmt: skip
        (tmp_path / "pkg" / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / relative).write_text(text)
    assert loading(["pkg.data.a", "pkg.data.b", "pkg.data.c"], "pkg.heavy", tmp_path) == ["pkg.data.b"]
    assert loading(["pkg.data.a"], "pkg.heavy", tmp_path) == []


@pytest.mark.integration
def test_the_data_and_control_planes_load_without_torch_or_mlx():
    """Every module of the CPU planes, imported one after another in a fresh interpreter: torch never loads (the
    data plane's workers and the control host would pay for it at every start: 321 MB and 9-10 s against 136 MB
    and 5-6 s for ``import ft_assets.data.assets, ft_assets.control.assets``, ``ft_assets/objectives/objective.py``)."""
    names = sorted(name for name in modules(PACKAGE) if plane_of(name) in TORCH_FREE)
    assert len(names) > 35, names
    assert loading(names, "torch", PACKAGE.parent) == [], "loads torch at import: import it inside the function"
    # nor mlx (the MLX backend and export import it where they run; the planner knows a Mac without it)
    assert loading(names, "mlx", PACKAGE.parent) == [], "loads mlx at import: import it inside the function"


def test_the_data_plane_imports_the_package_at_module_level_only():
    found = local_imports(modules(PACKAGE), DATA_PLANE)
    assert not found, "imports of the package inside functions (import at the top of the module):\n" + "\n".join(found)


def test_no_module_of_the_package_imports_a_private_name_of_another():
    found = private_imports(modules(PACKAGE))
    assert not found, (
        "private names used across modules (make them public, or move them to their owner):\n" + "\n".join(found)
    )
