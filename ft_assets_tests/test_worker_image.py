"""The worker image a run records (``ft_assets.training.worker_image``): where the digest comes from, the build file,
and the lineage that carries it. The image itself is built and run in test_image.py."""

import http.server
import json
import re
import socket
import threading

import pytest

from ft_assets.delivery.lineage import build_lineage
from ft_assets.training.worker_image import (
    DIGEST_ENV,
    ECS_METADATA_ENV,
    ImageDigestError,
    build_info,
    describe,
    packages_sha256,
    worker_image,
)
from ft_assets_tests.support import lineage_refs

DIGEST = "sha256:" + "0123456789abcdef" * 4
PINNED = f"ghcr.io/acme/ft-assets@{DIGEST}"
ECS_DIGEST = "sha256:" + "d691691e9652791a" * 4


@pytest.fixture
def build_file(tmp_path):
    path = tmp_path / "image.json"
    path.write_text(json.dumps(build_info("python:3.11-slim-bookworm")))
    return path


class FakeEcsMetadata(http.server.BaseHTTPRequestHandler):
    """The ECS task metadata endpoint v4: the container's own metadata at ``$ECS_CONTAINER_METADATA_URI_V4``."""

    def do_GET(self):
        body = json.dumps({"Name": "run", "Image": "111122223333.dkr.ecr.us-west-2.amazonaws.com/ft-assets:0.1.0",
                           "ImageID": ECS_DIGEST, "DesiredStatus": "RUNNING"}).encode()  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def ecs_endpoint():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeEcsMetadata)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v4/abc-123"
    server.shutdown()
    server.server_close()


def closed_port_uri() -> str:
    with socket.socket() as probe:  # nobody listens: refused at once
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}/v4/abc-123"


@pytest.mark.parametrize(
    "env, digest, reference, source",
    [
        ({DIGEST_ENV: DIGEST}, DIGEST, None, DIGEST_ENV),
        ({DIGEST_ENV: f" {PINNED}\n"}, DIGEST, PINNED, DIGEST_ENV),  # the reference the pod was started from
        ({DIGEST_ENV: DIGEST, ECS_METADATA_ENV: "http://unused"}, DIGEST, None, DIGEST_ENV),  # the launcher's wins
    ],
)
def test_the_digest_the_launcher_sets_is_recorded_with_the_build_file(build_file, env, digest, reference, source):
    record = worker_image(env, build_file)
    assert (record["digest"], record["reference"], record["source"], record["reason"]) == (
        digest,
        reference,
        source,
        None,
    )
    assert record["base"] == "python:3.11-slim-bookworm" and record["packages_sha256"] == packages_sha256()
    assert record["ft_assets"] == "0.1.0" and record["torch"].startswith("2.13.0")


def test_on_ecs_the_task_metadata_names_the_image_pulled(build_file, ecs_endpoint):
    record = worker_image({ECS_METADATA_ENV: ecs_endpoint}, build_file)
    assert (record["digest"], record["source"]) == (ECS_DIGEST, "ECS task metadata")
    assert record["reference"] == "111122223333.dkr.ecr.us-west-2.amazonaws.com/ft-assets:0.1.0"


def test_without_a_digest_the_reason_says_what_names_the_image(build_file, tmp_path):
    in_image = worker_image({}, build_file)
    assert in_image["digest"] is None and in_image["base"] == "python:3.11-slim-bookworm"
    assert in_image["reason"] == (
        f"no {DIGEST_ENV} and no ECS task metadata: the image is named by its build file {build_file} only; "
        f"set {DIGEST_ENV} where the container is started"
    )
    ecs_down = worker_image({ECS_METADATA_ENV: closed_port_uri()}, build_file)
    assert ecs_down["digest"] is None and ecs_down["reason"].startswith("the ECS task metadata at http://127.0.0.1:")
    outside = worker_image({}, tmp_path / "absent.json")  # a venv worker
    assert outside == {
        "digest": None, "reference": None, "source": None, "base": None, "ft_assets": None, "torch": None,
        "packages_sha256": None,
        "reason": f"not in an ft-assets image: no {DIGEST_ENV}, no ECS task metadata, no {tmp_path / 'absent.json'}",
    }  # fmt: skip
    assert describe(outside) == f"no digest: {outside['reason']}"


@pytest.mark.parametrize("value", ["latest", "sha256:1234", "ghcr.io/acme/ft-assets:0.1.0", "sha256:" + "G" * 64])
def test_a_value_that_is_no_digest_is_refused_in_one_line(build_file, value):
    with pytest.raises(ImageDigestError, match=rf"^{DIGEST_ENV}=.+ is not an image digest: set it to sha256:<64 hex>"):
        worker_image({DIGEST_ENV: value}, build_file)


def test_the_packages_digest_is_that_of_name_and_version_pairs(build_file):
    info = json.loads(build_file.read_text())
    assert info["packages_sha256"] == packages_sha256() and len(info["packages_sha256"]) == 64
    assert info["built_at"].endswith("+00:00")


def test_the_lineage_names_the_image_that_trained_the_model():
    refs = lineage_refs()
    record = {"digest": DIGEST, "reference": PINNED, "source": DIGEST_ENV, "base": "b", "ft_assets": "0.1.0",
              "torch": "2.13.0", "packages_sha256": "ab" * 32, "reason": None}  # fmt: skip
    refs["lora_adapter"]["stats"]["worker_image"] = record
    assert build_lineage("toolcalls@v1", refs, "registry/toolcalls/v1/r1")["training"]["image"] == record
    del refs["lora_adapter"]["stats"]["worker_image"]  # an adapter trained by an older ft-assets
    assert build_lineage("toolcalls@v1", refs, "registry/toolcalls/v1/r1")["training"]["image"] is None


def test_the_image_pins_the_torch_the_makefile_installs():
    from ft_assets_tests.worker_build import REPO, containerfile_default

    pinned = re.search(r"^TORCH := (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE).group(1)
    wheelhouse = re.search(
        r'^DEFAULT_TORCH = "([^"]+)"', (REPO / "deploy/image/wheelhouse.py").read_text(), re.MULTILINE
    )
    assert containerfile_default("TORCH") == pinned == wheelhouse.group(1) == "torch==2.13.0"
