"""The code a GPU target's worker runs: the control host's own ft-assets, as a wheel in the store (``code=wheel``).

With ``code=wheel`` (every target's default) the session (``ft_assets.targets.session``) builds a wheel of the
ft-assets that planned the run, from its source tree (``pip wheel --no-deps``, kept in
``~/.cache/ft-assets/worker-wheels/<source digest>/`` until the source changes), and puts it in the store once at
``code/<sha256>/<wheel>``. The worker's ``python`` needs torch and nothing of ft-assets: ``bootstrap.py`` fetches the
wheel, checks its sha256 and installs it in a cached virtual environment on the machine (see there). So the code
that trains is the code that planned, with no image to build or registry to push to; the lineage names the wheel's
sha256 (``lora_adapter``'s ``worker_code``).

``code=installed`` runs ``python -m ft_assets.training.remote`` with the target's ``python`` as it is: an image built
from ``deploy/image/Containerfile`` (faster to start: nothing to install), or a venv on a cluster's shared filesystem.

``DEFAULT_IMAGE`` is the image a SkyPilot worker gets without ``image=``: PyTorch's own CUDA runtime image of the
torch version ft-assets is tested with (the Containerfile's ``BASE`` too), whose Python has torch and pip.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import ft_assets
from ft_assets import layout
from ft_assets.targets import INSTALLED, WHEEL, TargetError
from ft_assets.storage import ObjectStore, sha256_file

CODE_MODES = (WHEEL, INSTALLED)
DEFAULT_IMAGE = "docker.io/pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime"
URL_EXPIRES_S = 7 * 24 * 3600  # a presigned URL's longest life (SigV4): a worker started later gets a new one
SOURCE_FILES = ("pyproject.toml", "README.md")  # besides the package: what ``pip wheel`` reads
CACHE = Path.home() / ".cache" / "ft-assets" / "worker-wheels"  # not wheels/: the Makefile keeps llama.cpp's there


@dataclass(frozen=True)
class WorkerCode:
    """The wheel a worker installs: its file name, sha256 and key in the store."""

    wheel: str
    sha256: str
    key: str

    def lineage(self, store: ObjectStore) -> dict:
        return {"wheel": self.wheel, "sha256": self.sha256, "uri": store.uri(self.key)}

    def environment(self, store: ObjectStore) -> tuple[dict, dict]:
        """(plain settings, secrets) of a worker that bootstraps from this wheel; the URL is a secret (presigned)."""
        plain = {"FT_BOOTSTRAP": (Path(__file__).parent / "bootstrap.py").read_text(), "FT_CODE_SHA256": self.sha256,
                 "FT_CODE_WHEEL": self.wheel}  # fmt: skip
        return plain, {"FT_CODE_URL": store.download_url(self.key, URL_EXPIRES_S)}


def source_tree() -> Path | None:
    """The checkout this ft-assets runs from (its pyproject.toml beside the package); None for an installed wheel."""
    root = Path(ft_assets.__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    return root if pyproject.is_file() and 'name = "ft-assets"' in pyproject.read_text() else None


def _package_files(root: Path) -> list[Path]:
    files = [root / name for name in SOURCE_FILES if (root / name).is_file()]
    files += [p for p in (root / "ft_assets").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return sorted(files)


def source_digest(root: Path) -> str:
    """sha256 of the files ``pip wheel`` packages (their paths and bytes): the wheel cache's key."""
    digest = hashlib.sha256()
    for path in _package_files(root):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_wheel(root: Path, cache: Path = CACHE) -> Path:
    """The wheel of the source at ``root``: built once per source digest (from a copy, so the checkout gets no
    build/ or egg-info), then taken from ``cache``."""
    folder = cache / source_digest(root)[:16]
    built = sorted(folder.glob("ft_assets-*.whl"))
    if built:
        return built[0]
    with tempfile.TemporaryDirectory(prefix="ft-wheel-") as tmp:
        src = Path(tmp) / "src"
        for path in _package_files(root):
            (src / path.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / path.relative_to(root))
        isolation = ["--no-build-isolation"] if _has_setuptools(68) else []  # else pip fetches a setuptools for it
        done = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", *isolation,
             "--disable-pip-version-check", "--wheel-dir", str(Path(tmp) / "dist"), str(src)],
            capture_output=True, text=True,
        )  # fmt: skip
        wheels = sorted((Path(tmp) / "dist").glob("ft_assets-*.whl"))
        if done.returncode != 0 or not wheels:
            tail = " ".join((done.stderr or done.stdout).split())[-400:]
            raise TargetError(f"cannot build the ft-assets wheel for the worker from {root}: {tail}")
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{wheels[0].name}.{os.getpid()}"  # another process may build the same one meanwhile
        shutil.copy2(wheels[0], partial)
        os.replace(partial, folder / wheels[0].name)
    return folder / wheels[0].name


def _has_setuptools(major: int) -> bool:
    """Whether this Python has setuptools ``major`` or later (pyproject.toml's build requirement)."""
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0]) >= major
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False


def worker_code(store: ObjectStore) -> WorkerCode:
    """This ft-assets as a wheel in ``store`` (put there once per sha256)."""
    root = source_tree()
    if root is None:
        raise TargetError(
            f"ft-assets here ({Path(ft_assets.__file__).parent}) is installed without its source, so no wheel can be built for the "
            "worker: add code=installed to the target with a python that has the same ft-assets (an image built "
            "from deploy/image), or run from a checkout"
        )
    wheel = build_wheel(root)
    sha256 = sha256_file(wheel)
    key = layout.worker_wheel(sha256, wheel.name)
    if not store.exists(key):
        store.put_file(key, wheel)
    return WorkerCode(wheel.name, sha256, key)


def code_setting(text: str, value: str | None) -> str:
    """A target's ``code=`` setting, checked: ``wheel`` (default) or ``installed``."""
    if value is None:
        return WHEEL
    if value not in CODE_MODES:
        raise TargetError(f"GPU target {text!r}: code={value}; use code=wheel (default) or code=installed")
    return value
