"""The worker image as the tests build it: buildah on a Debian base bootstrapped here, from a wheelhouse made here.

No image registry is reachable from this machine, so the base is ``debootstrap --variant=minbase bookworm``
(Debian's packages; Python 3.11 is Debian 12's) committed as an image with ``buildah``; pip's own
configuration here (its indexes, find-links, constraints) is invisible inside a build, so the build installs
from a wheelhouse that ``deploy/image/wheelhouse.py`` makes with this machine's pip (torch 2.13.0+cpu,
llama-cpp-python from the portable build ``make install`` keeps in ``$FT_LLAMA_WHEELS``). Both are kept in the suite's cache directory (``CACHE``, by default
``~/.cache/ft-assets/image``; ``FT_TEST_CACHE`` moves it) and never made twice: the base once (101 s on 2
loaded cores, 176 MB), the wheelhouse once per set of requirements (52 s, 583 MB); buildah's own layer cache
(its storage, /var/lib/containers) keeps the image's layers, so a cached build redoes only what changed (377 s
cold, 50 s after a change under ft_assets/: docs/validation/verified.md, "The worker image"). Each build after a code change leaves
the previous image's top layers (~5 MB) behind, untagged: ``buildah rmi --prune`` drops them.

``podman run`` is refused in this sandbox (crun cannot set RLIMIT_NPROC); ``buildah run --isolation chroot``
is not, and it shares the host's network, so a server on loopback (SeaweedFS) is the store outside the image.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTAINERFILE = REPO / "deploy" / "image" / "Containerfile"
CACHE = Path(os.environ.get("FT_TEST_CACHE") or "~/.cache/ft-assets").expanduser() / "image"
LLAMA_WHEELS = (
    [Path(os.environ["FT_LLAMA_WHEELS"])] if os.environ.get("FT_LLAMA_WHEELS") else []
)  # make install's build
# What the base adds to minbase: the Python the image runs on, ensurepip for its venv, llama.cpp's OpenMP and C++
# runtimes, CA certificates, useradd.
BASE_PACKAGES = ("python3", "python3-venv", "libgomp1", "libstdc++6", "ca-certificates", "passwd")
SUITE = "bookworm"
IMAGE = "localhost/ft-assets:test"
BUILDAH = ("buildah",)
ISOLATION = ("--isolation", "chroot")
BOOTSTRAP_TIMEOUT_S = 900
BUILD_TIMEOUT_S = 1800


def tool(name: str) -> str | None:
    """Where ``name`` is, /usr/sbin included (debootstrap lies there, off a non-root PATH)."""
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


def missing_tools() -> list[str]:
    return [name for name in ("buildah", "debootstrap") if tool(name) is None]


def run(*argv: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """``argv``, its output captured; a failure raises with the command and the end of its output."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {done.returncode}:\n{tail}")
    return done


@contextmanager
def cache_lock():
    """One test session at a time makes the base or a wheelhouse (other engineers share this machine)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def image_exists(ref: str) -> bool:
    return subprocess.run([*BUILDAH, "inspect", "--type", "image", ref], capture_output=True).returncode == 0


def base_key() -> str:
    return hashlib.sha256(" ".join((SUITE, *BASE_PACKAGES)).encode()).hexdigest()[:12]


def debian_base() -> tuple[str, bool]:
    """(image id, cached) of the Debian base: the one this cache made, else bootstrapped now and committed."""
    with cache_lock():
        id_file, tar = CACHE / f"base-{base_key()}.id", CACHE / f"base-{base_key()}.tar"
        if id_file.is_file() and image_exists(id_file.read_text().strip()):
            return id_file.read_text().strip(), True
        if not tar.is_file():
            with tempfile.TemporaryDirectory(dir=CACHE) as work:
                root = Path(work) / "root"
                run(tool("debootstrap"), "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(root),
                    timeout=BOOTSTRAP_TIMEOUT_S)  # fmt: skip
                for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
                    for path in (root / cache).glob("*"):
                        if path.is_file():
                            path.unlink()
                run("tar", "-C", str(root), "--exclude=./dev/*", "-cf", f"{tar}.partial", ".")
                os.replace(f"{tar}.partial", tar)
        container = run(*BUILDAH, "from", "scratch").stdout.strip()
        run(*BUILDAH, "add", container, str(tar), "/")
        run(*BUILDAH, "config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--cmd", "/bin/sh", container)  # fmt: skip
        run(*BUILDAH, "commit", "--rm", "--quiet", "--iidfile", str(id_file), container,
            f"localhost/ft-assets-test-base:{SUITE}-{base_key()}")  # fmt: skip
        return id_file.read_text().strip(), False


def containerfile_default(arg: str) -> str:
    """The default of ``ARG <arg>=...`` in the Containerfile (what a plain ``docker build`` takes)."""
    for line in CONTAINERFILE.read_text().splitlines():
        if line.startswith(f"ARG {arg}="):
            return line.split("=", 1)[1]
    raise KeyError(f"{CONTAINERFILE} has no ARG {arg}=")


def wheelhouse() -> tuple[Path, str, bool]:
    """(folder, key, cached): the wheelhouse of the Containerfile's torch pin and extras, made once per requirements."""
    spec = importlib.util.spec_from_file_location("wheelhouse", REPO / "deploy" / "image" / "wheelhouse.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    torch, extras = containerfile_default("TORCH"), containerfile_default("EXTRAS")
    pyproject = str(REPO / "pyproject.toml")
    wanted = [torch, *maker.requirements(pyproject, extras.split(",")), *maker.build_requirements(pyproject)]
    ident = json.dumps([wanted, platform.python_version_tuple()[:2], platform.machine()])
    folder = CACHE / f"wheelhouse-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"
    with cache_lock():
        if (folder / "KEY").is_file():
            return folder, (folder / "KEY").read_text().strip(), True
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        key = maker.make(partial, torch, extras, find_links=LLAMA_WHEELS)
        (partial / "KEY").write_text(key)
        os.replace(partial, folder)
        return folder, key, False


def build_context(dest: Path, wheels: Path) -> Path:
    """``dest`` laid out as the repository's build context: the files git sees (the working tree, uncommitted
    changes included) and the wheelhouse, hard-linked, in deploy/image/wheels."""
    listed = run("git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", cwd=REPO).stdout
    for relative in filter(None, listed.split("\0")):
        source = REPO / relative
        if source.is_symlink() or not source.is_file():
            continue  # a clone's .venv links; files deleted in the working tree
        (dest / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest / relative)
    for wheel in wheels.iterdir():
        if wheel.suffix in (".whl", ".gz"):
            os.link(wheel, dest / "deploy" / "image" / "wheels" / wheel.name)
    return dest


@dataclass
class Build:
    image_id: str
    digest: str  # the manifest digest in buildah's storage: what a launcher pinning this image would name
    base: str
    wheelhouse_key: str
    seconds: float
    log: str

    def cached_steps(self) -> list[str]:
        """The steps buildah took from its cache (the step line before each "Using cache")."""
        lines = self.log.splitlines()
        return [lines[i - 1] for i, line in enumerate(lines) if line.startswith("--> Using cache") and i]

    def layer_sizes(self) -> list[int]:
        """Each layer's size, uncompressed (as buildah stores it; a registry holds them compressed)."""
        manifest = json.loads(inspect(self.image_id)["Manifest"])
        return [layer["size"] for layer in manifest["layers"]]

    def layers(self) -> list[str]:
        """The layers' content digests (diff ids), base first."""
        return inspect(self.image_id)["OCIv1"]["rootfs"]["diff_ids"]


def inspect(image: str) -> dict:
    return json.loads(run(*BUILDAH, "inspect", "--type", "image", image).stdout)


def build(context: Path, base: str, wheelhouse_key: str, tag: str | None = IMAGE) -> Build:
    """``buildah bud`` of the Containerfile in ``context`` on ``base``, offline (the wheelhouse only), layers cached."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as work:
        iid = Path(work) / "iid"
        done = run(*BUILDAH, "bud", *ISOLATION, "--layers", "--force-rm", "--iidfile", str(iid), *(("-t", tag) if tag else ()),
                   "-f", str(context / "deploy" / "image" / "Containerfile"),
                   "--build-arg", f"BASE={base}", "--build-arg", "PIP_NO_INDEX=1",
                   "--build-arg", f"WHEELHOUSE={wheelhouse_key}", str(context), timeout=BUILD_TIMEOUT_S)  # fmt: skip
        image_id = iid.read_text().strip().removeprefix("sha256:")
    digest = run(*BUILDAH, "inspect", "--type", "image", "--format", "{{.FromImageDigest}}", image_id).stdout.strip()
    return Build(image_id, digest, base, wheelhouse_key, time.monotonic() - started, done.stdout + done.stderr)


@contextmanager
def container(image_id: str):
    """A working container of the image (``buildah from``), removed afterwards."""
    name = run(*BUILDAH, "from", "--pull-never", "--quiet", image_id).stdout.strip()
    try:
        yield name
    finally:
        subprocess.run([*BUILDAH, "rm", name], capture_output=True)


def run_in(
    name: str,
    command: list[str],
    mounts: dict[Path, str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """``command`` inside the container ``name`` as the image's user, with host folders bind-mounted and ``env`` set."""
    argv = [*BUILDAH, "run", *ISOLATION]
    for host, inside in (mounts or {}).items():
        argv += ["-v", f"{host}:{inside}"]
    for key, value in (env or {}).items():
        argv += ["-e", f"{key}={value}"]
    return subprocess.run([*argv, name, "--", *command], capture_output=True, text=True, timeout=timeout)
