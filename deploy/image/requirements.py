"""The requirement lines of ft-assets and the given extras, read from pyproject.toml (standard library only).

The image installs its dependencies from these lines before the ft-assets wheel (deploy/image/Containerfile),
so that a code change rebuilds one small layer and never the dependency layers under it; the wheelhouse of an
offline build (deploy/image/wheelhouse.py) is made from the same lines.

    python3 deploy/image/requirements.py pyproject.toml llamacpp,k8s,mlflow,signing
"""

import sys
import tomllib


def load(pyproject: str) -> dict:
    with open(pyproject, "rb") as handle:
        return tomllib.load(handle)


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    """The dependencies of the project in ``pyproject``, then those of each extra in ``extras``; an unknown extra: an error."""
    project = load(pyproject)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise SystemExit(
            f"{pyproject}: no extra {', '.join(unknown)} in [project.optional-dependencies]; "
            f"choose from {', '.join(sorted(optional))}"
        )
    return [*project["dependencies"], *(line for extra in extras for line in optional[extra])]


def build_requirements(pyproject: str) -> list[str]:
    """What building the ft-assets wheel needs ([build-system] requires)."""
    return load(pyproject)["build-system"]["requires"]


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: requirements.py PYPROJECT EXTRA,EXTRA,...")
    print("\n".join(requirements(sys.argv[1], [extra for extra in sys.argv[2].split(",") if extra])))
