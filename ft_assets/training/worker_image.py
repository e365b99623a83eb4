"""The image a worker runs in, as ``lora_adapter`` records it (stats ``worker_image``; ``training.image`` in the lineage).

A published model names the exact image that trained it. An image cannot name its own digest, though:
the digest is the sha256 of the image's manifest, known only once the image is built (and pushed). So
the worker learns it from whoever started its container, the first found of:

1. ``FT_IMAGE_DIGEST``: ``sha256:<64 hex>``, or the whole reference pinned by digest
   (``ghcr.io/acme/ft-assets@sha256:…``), set where the container is started from a pinned reference: a
   Kubernetes launcher's ``env_vars``, Slurm's ``--container-env`` (Pyxis) or ``apptainer --env``,
   ``docker run -e``. A value that is neither fails the run at its start (a wrong digest in a lineage is
   worse than none).
2. On Amazon ECS, the container's ``ImageID`` in the task metadata (``$ECS_CONTAINER_METADATA_URI_V4``,
   which ECS sets in every container): the manifest digest of the image ECS pulled, whatever tag the task
   definition names. Nothing to configure.
3. Neither: no digest, and ``reason`` says why.

Beside the digest goes the image's build file (``BUILD_FILE``, written by the Containerfile's last layer):
the ``BASE`` it was built on, the ft-assets and torch versions, and ``packages_sha256``, the sha256 of
every installed distribution's ``name==version`` (sorted), so that a run in an image started by tag
still says what was in it, and two images with equal packages are seen to be equal. A worker outside any
image (a venv) has no build file: it records no digest and says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import urllib.request
from datetime import UTC, datetime
from importlib.metadata import distributions, version
from pathlib import Path

DIGEST_ENV = "FT_IMAGE_DIGEST"
ECS_METADATA_ENV = "ECS_CONTAINER_METADATA_URI_V4"  # set by the ECS agent in every container it starts
BUILD_FILE = Path("/etc/ft-assets/image.json")  # written at build time (deploy/image/Containerfile)
ECS_TIMEOUT_S = 2.0  # the endpoint is local to the task; it answers in milliseconds
DIGEST_RE = re.compile(r"^(?:(?P<name>[^@\s]+)@)?(?P<digest>sha256:[0-9a-f]{64})$")


class ImageDigestError(ValueError):
    """FT_IMAGE_DIGEST holds something that is not an image digest."""


def packages_sha256() -> str:
    """The sha256 of every installed distribution's ``name==version``, sorted: equal for equal environments."""
    pins = sorted({f"{dist.metadata['Name'].lower().replace('_', '-')}=={dist.version}" for dist in distributions()})
    return hashlib.sha256("\n".join(pins).encode()).hexdigest()


def build_info(base: str) -> dict:
    """The build file's content: what the image was built from and what it holds (the Containerfile writes it)."""
    return {
        "base": base,
        "ft_assets": version("ft-assets"),
        "torch": version("torch"),
        "packages_sha256": packages_sha256(),
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _ecs_image(uri: str) -> tuple[str | None, str | None, str | None]:
    """(digest, reference, problem) from the ECS container metadata endpoint."""
    try:
        with urllib.request.urlopen(uri.rstrip("/"), timeout=ECS_TIMEOUT_S) as response:
            container = json.load(response)
    except (OSError, ValueError) as exc:
        return None, None, f"the ECS task metadata at {uri} did not answer ({exc})"
    digest = container.get("ImageID")
    if not isinstance(digest, str) or not DIGEST_RE.match(digest):
        return None, None, f"the ECS task metadata at {uri} names no image digest (ImageID {digest!r})"
    return digest, container.get("Image"), None


def worker_image(env: dict | None = None, build_file: Path = BUILD_FILE) -> dict:
    """This worker's image: ``digest`` (None when unknown), where it came from, the build file's fields, ``reason``."""
    env = os.environ if env is None else env
    record = {"digest": None, "reference": None, "source": None}
    build = json.loads(build_file.read_text()) if build_file.is_file() else None
    record.update({key: (build or {}).get(key) for key in ("base", "ft_assets", "torch", "packages_sha256")})
    problem = None
    if env.get(DIGEST_ENV):
        pinned = DIGEST_RE.match(env[DIGEST_ENV].strip())
        if not pinned:
            raise ImageDigestError(
                f"{DIGEST_ENV}={env[DIGEST_ENV]!r} is not an image digest: set it to sha256:<64 hex> or to the reference "
                f"pinned by digest the container was started from (NAME@sha256:<64 hex>), or unset it"
            )
        reference = f"{pinned['name']}@{pinned['digest']}" if pinned["name"] else None
        record.update(digest=pinned["digest"], reference=reference, source=DIGEST_ENV)
    elif env.get(ECS_METADATA_ENV):
        digest, reference, problem = _ecs_image(env[ECS_METADATA_ENV])
        if digest:
            record.update(digest=digest, reference=reference, source="ECS task metadata")
    if record["digest"]:
        record["reason"] = None
    elif build is None:
        record["reason"] = f"not in an ft-assets image: no {DIGEST_ENV}, no ECS task metadata, no {build_file}"
    else:
        record["reason"] = (
            problem or f"no {DIGEST_ENV} and no ECS task metadata"
        ) + f": the image is named by its build file {build_file} only; set {DIGEST_ENV} where the container is started"
    return record


def describe(record: dict) -> str:
    """One line for the asset page: the digest and where it came from, or why there is none; then the build file."""
    head = f"{record['digest']} ({record['source']})" if record["digest"] else f"no digest: {record['reason']}"
    if record["base"]:
        head += f"; built on {record['base']} with ft-assets {record['ft_assets']}, torch {record['torch']}"
    return head


if __name__ == "__main__":  # python -m ft_assets.training.worker_image BASE  (the Containerfile's build file)
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m ft_assets.training.worker_image BASE > /etc/ft-assets/image.json")
    print(json.dumps(build_info(sys.argv[1]), indent=2))
