"""A wheelhouse for an offline image build: every wheel the image installs, made here with this machine's pip.

An image build sees none of the host's pip configuration (its indexes, find-links, constraints) and, on a
cluster without internet, no index at all. This script resolves what the image installs (the torch pin,
ft-assets' dependencies and extras, what building the ft-assets wheel needs) with the host's pip and
writes it as wheels into one folder, building those that PyPI has only as source (llama-cpp-python: take
an earlier portable build with ``--find-links``, the folder ``make install`` builds it into), plus llama-cpp-python's sdist, from which the image takes
llama.cpp's converter (ft_assets/delivery/converter.py). The wheels must fit the image's Python and libc:
make them with the same Python minor version on the same or an older distribution than the image's base.

    python3 deploy/image/wheelhouse.py deploy/image/wheels [--find-links ~/.cache/ft-assets/wheels/llama-cpp-portable]
    docker build --build-arg PIP_NO_INDEX=1 --build-arg WHEELHOUSE=<the key it prints> -f deploy/image/Containerfile .

It prints the wheelhouse's key (the sha256 of its sorted file names, 16 hex): the Containerfile's
``WHEELHOUSE`` argument, which makes buildah and podman rerun the install when the wheelhouse changes
(they do not look into a bind mount to decide whether a cached layer still holds; BuildKit does).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from requirements import build_requirements, requirements  # noqa: E402 -- the script's own folder

REPO = Path(__file__).resolve().parents[2]
DEFAULT_EXTRAS = "llamacpp,k8s,mlflow,signing"  # the Containerfile's EXTRAS default
DEFAULT_TORCH = "torch==2.13.0"  # the Containerfile's TORCH default (the Makefile's pin)


def key(folder: Path) -> str:
    """The wheelhouse's content key: the sha256 of its sorted file names (name, version and tags), 16 hex."""
    names = sorted(path.name for path in folder.iterdir() if path.suffix in (".whl", ".gz"))
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def make(
    out: Path,
    torch: str = DEFAULT_TORCH,
    extras: str = DEFAULT_EXTRAS,
    pyproject: Path = REPO / "pyproject.toml",
    find_links: list[Path] = (),
) -> str:
    """Fill ``out`` with the wheels of ``torch``, the requirements of ``extras`` and the build requirements; its key.
    A wheel in a ``find_links`` folder is taken before building one from source."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        torch,
        *requirements(str(pyproject), [e for e in extras.split(",") if e]),
        *build_requirements(str(pyproject)),
    ]
    pip = [sys.executable, "-m", "pip", "--quiet"]
    links = [arg for folder in find_links if Path(folder).is_dir() for arg in ("--find-links", str(folder))]
    subprocess.run([*pip, "wheel", *links, "--wheel-dir", str(out), *lines], check=True)
    llama = [line for line in lines if line.replace("_", "-").lower().startswith("llama-cpp-python")]
    if llama:  # the image keeps llama.cpp's converter from the sdist (the wheel carries none of it)
        subprocess.run(
            [*pip, "download", "--no-deps", "--no-binary", "llama-cpp-python", "--dest", str(out), *llama], check=True
        )
    return key(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "out", type=Path, help="the wheelhouse folder (deploy/image/wheels for a build from the repository)"
    )
    parser.add_argument("--torch", default=DEFAULT_TORCH, help=f"the torch requirement (default {DEFAULT_TORCH})")
    parser.add_argument(
        "--extras", default=DEFAULT_EXTRAS, help=f"ft-assets extras, comma-separated (default {DEFAULT_EXTRAS})"
    )
    parser.add_argument(
        "--find-links",
        type=Path,
        action="append",
        default=[],
        help="a folder of wheels built before (llama-cpp-python's portable build), taken before building from source",
    )
    args = parser.parse_args()
    print(make(args.out, args.torch, args.extras, find_links=args.find_links))


if __name__ == "__main__":
    main()
