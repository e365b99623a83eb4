"""The tree is formatted with the configured formatter (`make fmt`): a `# fmt: skip` marks a table kept by hand."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_tree_is_formatted():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -e '.[test]'"
    done = subprocess.run([ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"run `make fmt`:\n{done.stdout}{done.stderr}"


BUILDERS = {"build_init_resource_context", "build_asset_context", "build_op_context", "build_resources"}


def unclosed_context_builders(source: str) -> list[int]:
    """Lines where one of Dagster's ``build_*_context`` builders is called without ``instance=`` outside a ``with``
    (or ``ExitStack.enter_context``). Such a context opens an ephemeral instance and sets it as Dagster's current
    defs-state storage (a context variable) when built, and closes it only when exited or garbage-collected: closed
    out of order by the collector, it left that variable pointing at a deleted instance, and a later
    ``dg.materialize`` in the same process failed with ``sqlite3.OperationalError: unable to open database file``."""
    tree = ast.parse(source)
    closed = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            closed.update(id(item.context_expr) for item in node.items)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "enter_context":
            closed.update(id(arg) for arg in node.args)
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in BUILDERS
        and not any(k.arg == "instance" for k in node.keywords)
        and id(node) not in closed
    ]


def test_dagster_contexts_without_an_instance_are_closed_where_they_are_built():
    assert unclosed_context_builders("ctx = dg.build_init_resource_context()\n") == [1]  # the check itself
    assert unclosed_context_builders("with dg.build_asset_context(partition_key='k') as c:\n    pass\n") == []
    found = {
        f"{path.relative_to(ROOT)}:{line}"
        for folder in ("ft_assets", "ft_assets_tests", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line in unclosed_context_builders(path.read_text())
    }
    assert not found, f"use these in a `with` (or pass instance=): {sorted(found)}"
