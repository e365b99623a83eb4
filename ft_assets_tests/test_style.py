"""The tree is formatted with the configured formatter (`make fmt`): a `# fmt: skip` marks a table kept by hand.

Dagster contexts left open are found as the tests run, with the line that opened them (``leaks.py``).
"""

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
