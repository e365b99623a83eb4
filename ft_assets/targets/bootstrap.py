"""The first thing a GPU target's worker runs: the control host's own ft-assets, installed from its wheel, then the worker.

A rented machine runs a stock CUDA PyTorch image (or any Python with torch) and has no ft-assets. This file, the
standard library only, is sent to it in the environment variable ``FT_BOOTSTRAP`` and started as
``python -c 'import os; exec(os.environ.pop("FT_BOOTSTRAP"))' MODULE ARGS...`` (``WorkerLaunch.argv``). It:

1. takes the wheel the control host built and put in the store (``ft_assets.targets.code``): from
   ``FT_CODE_URL``, a presigned HTTPS URL of an S3 store or a path on a filesystem the machines share, and checks
   its sha256 against ``FT_CODE_SHA256`` (a wheel that differs is refused, not run);
2. installs it in a virtual environment of its own, ``~/.cache/ft-assets/venvs/<sha256, 16 hex>-<base>``
   (``FT_CODE_CACHE`` moves it), that sees the packages of the Python that started it (the image's torch above all;
   ``<base>`` is a hash of that Python and its site folders) and gets from the package index only what that Python
   lacks; a machine keeps it for every later attempt with the same code and Python;
3. runs ``python -m MODULE ARGS`` in it (``exec``: the worker takes this process's place and pid).

Several workers starting at once on one machine build the environment once (a lock). Progress goes to stderr,
lines starting with ``ft-assets bootstrap:``. The URL leaves the environment before anything else runs.
"""

import fcntl
import hashlib
import os
import shutil
import site
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

READY = "ft-assets-ready"  # written last in a complete environment
STARTED_ENV = "FT_BOOTSTRAP_STARTED_AT"  # when this start of the worker began (Unix time), for the bill
CHUNK = 1 << 20


def say(message: str) -> None:
    print(f"ft-assets bootstrap: {message}", file=sys.stderr, flush=True)


def fetch(url: str, wheel: Path, sha256: str) -> Path:
    """The wheel at ``url`` (https://... or a path), as ``wheel``, after its sha256 is checked."""
    wheel.parent.mkdir(parents=True, exist_ok=True)
    partial = wheel.with_suffix(".part")
    digest = hashlib.sha256()
    source = urllib.request.urlopen(url, timeout=60) if url.startswith(("https://", "http://")) else open(url, "rb")
    with source, open(partial, "wb") as out:
        while chunk := source.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise SystemExit(
            f"ft-assets bootstrap: the wheel read from the store has sha256 {digest.hexdigest()}, not {sha256} as the "
            "control host built it; not installing it"
        )
    partial.replace(wheel)
    return wheel


def base_site_dirs() -> list[str]:
    """The site-packages of the Python that started this one (an image's torch lives there)."""
    found = [*site.getsitepackages(), site.getusersitepackages()]
    return [d for d in dict.fromkeys(found) if os.path.isdir(d)]


def build(env_dir: Path, wheel: Path) -> None:
    shutil.rmtree(env_dir, ignore_errors=True)
    say(f"installing {wheel.name} into {env_dir} (once a machine and code version)")
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, stdout=sys.stderr)
    python = str(env_dir / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    lines = [f"import site; site.addsitedir({d!r})\n" for d in base_site_dirs()]
    Path(purelib, "ft-assets-base.pth").write_text("".join(lines))
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--quiet"]
    # the wheel itself, in place of any ft-assets the base has; then what it needs that the base lacks
    subprocess.run([*pip, "--no-deps", "--force-reinstall", str(wheel)], check=True, stdout=sys.stderr)
    subprocess.run([*pip, str(wheel)], check=True, stdout=sys.stderr)
    (env_dir / READY).write_text(wheel.name)


def main() -> None:
    module, args = sys.argv[1], sys.argv[2:]
    os.environ[STARTED_ENV] = repr(time.time())  # the worker bills from here: the install is paid time
    url = os.environ.pop("FT_CODE_URL")
    sha256, name = os.environ["FT_CODE_SHA256"], os.environ["FT_CODE_WHEEL"]
    cache = Path(os.environ.get("FT_CODE_CACHE") or Path.home() / ".cache" / "ft-assets").expanduser()
    base = hashlib.sha256("\n".join([sys.executable, *base_site_dirs()]).encode()).hexdigest()[:8]
    env_dir = cache / "venvs" / f"{sha256[:16]}-{base}"  # of this wheel over this Python's packages
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{env_dir}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (env_dir / READY).exists():
            say(f"{name} ({sha256[:12]}) is installed in {env_dir}")
        else:
            build(env_dir, fetch(url, cache / "downloads" / sha256 / name, sha256))
    python = str(env_dir / "bin" / "python")
    os.execv(python, [python, "-m", module, *args])


if __name__ == "__main__":  # also under ``python -c``, whose exec runs this in the module __main__
    main()
