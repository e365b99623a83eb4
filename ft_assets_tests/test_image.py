"""The worker image (deploy/image/Containerfile), built with buildah on a Debian base and run: the data plane on the
shipped sample and two LoRA steps of the tiny model inside it, against a SeaweedFS store outside it; the digest
the launcher hands the worker lands in lora_adapter's stats and metadata; llama.cpp's converter and quantizer work
in it; a code change rebuilds only the last layers. How the base and the wheelhouse are made and cached:
``worker_build.py``. The build's figures go to test-artifacts/image-build-{cold,cached}.json (docs/validation/verified.md, "The worker image").
"""

import json
import os
import re
import shutil
import time
import uuid

import dagster as dg
import pytest
import yaml

from ft_assets.delivery.gguf_export import tensor_types
from ft_assets.manifests import read_manifest, verify_artifact
from ft_assets.refs import read_ref
from ft_assets.storage import open_store
from ft_assets.training.worker_image import BUILD_FILE, DIGEST_ENV
from ft_assets_tests import worker_build as wb

pytestmark = pytest.mark.integration

SAMPLE = wb.REPO / "samples" / "toolcalls"
FIGURES = wb.REPO / "test-artifacts"  # image-build-cold.json (FT_TEST_CACHE=<an empty folder>), image-build-cached.json
UID = wb.containerfile_default("UID")
SECRET_NAME = re.compile(r"SECRET|PASSWORD|(^|_)TOKEN$|ACCESS_KEY|CREDENTIAL")  # AWS_*, DAGSTER_PG_PASSWORD, HF_TOKEN


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """The image, built once for the module from this working tree (the base and wheelhouse from the cache)."""
    missing = wb.missing_tools()
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: run `make system-deps` (scripts/install-system-deps.sh)")
    figures = {}
    started = time.monotonic()
    base, figures["base_cached"] = wb.debian_base()
    figures["base_s"] = round(time.monotonic() - started, 1)
    started = time.monotonic()
    wheels, key, figures["wheelhouse_cached"] = wb.wheelhouse()
    figures["wheelhouse_s"] = round(time.monotonic() - started, 1)
    context = wb.build_context(tmp_path_factory.mktemp("context"), wheels)
    built = wb.build(context, base, key)
    sizes = built.layer_sizes()
    figures.update(
        build_s=round(built.seconds, 1),
        steps_from_cache=len(built.cached_steps()),
        image_bytes=sum(sizes),
        layer_bytes=sizes,
        wheelhouse_bytes=sum(p.stat().st_size for p in wheels.iterdir()),
    )
    yield built, context, figures
    cold = not (figures["base_cached"] or figures["wheelhouse_cached"])  # FT_TEST_CACHE=<an empty folder>
    FIGURES.mkdir(exist_ok=True)
    (FIGURES / f"image-build-{'cold' if cold else 'cached'}.json").write_text(json.dumps(figures, indent=2) + "\n")


def test_the_image_trains_against_a_store_outside_it_and_records_its_digest(image, s3_env, tiny_model_dir, tmp_path):
    built, _, figures = image
    model, home = tmp_path / "model", tmp_path / "dagster_home"
    shutil.copytree(tiny_model_dir, model)  # built on the host, in-process (tiny.py)
    home.mkdir()
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"ops": {
        "base_model": {"config": {"source": "/model"}},
        "lora_adapter": {"config": {"max_steps": 2, "save_steps": 1, "per_device_batch_size": 2, "lora_r": 8, "lora_alpha": 16}},
    }}))  # fmt: skip
    for path in (tmp_path, model, home, *model.iterdir(), config):
        path.chmod(
            0o777 if path in (tmp_path, home) else 0o755 if path.is_dir() else 0o644
        )  # the image's user reads them
    env = {
        key: os.environ[key]
        for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    env.update(FT_STORE=s3_env, DAGSTER_HOME="/dagster_home", OMP_NUM_THREADS="1", AWS_EC2_METADATA_DISABLED="true")
    env[DIGEST_ENV] = built.digest  # what a launcher starting the pinned image sets
    started = time.monotonic()
    with wb.container(built.image_id) as name:
        done = wb.run_in(
            name,
            ["ft-assets", "run", "--in-process", "--dataset", "/sample", "--name", "toolcalls", "--version", "image-v1",
             "--until", "training", "--config", "/run.yaml", "--json"],
            mounts={model: "/model:ro", SAMPLE: "/sample:ro", config: "/run.yaml:ro", home: "/dagster_home"},
            env=env,
        )  # fmt: skip
    figures["run_s"] = round(time.monotonic() - started, 1)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["completed"] == ["data", "training"] and summary["store"] == s3_env
    # the data plane in the image accounts for the sample as on the host (test_data_plane.py)
    assert (summary["rows_in"], summary["exact_duplicates"], summary["steps"]) == (3330, 150, 2)
    assert (
        summary["rows_in"]
        == summary["rows_kept"] + summary["rows_quarantined"] + summary["exact_duplicates"] + summary["near_duplicates"]
    )

    store = open_store(s3_env)  # the store outside the image: the adapter and its checkpoints are there
    adapter = read_ref(store, "toolcalls@image-v1", "lora_adapter")
    verify_artifact(store, read_manifest(store, adapter["prefix"]))
    assert len(adapter["stats"]["checkpoints"]) == 2
    with wb.container(built.image_id) as name:
        build_file = json.loads(wb.run_in(name, ["cat", str(BUILD_FILE)]).stdout)
    recorded = adapter["stats"]["worker_image"]
    assert recorded == {
        "digest": built.digest, "reference": None, "source": DIGEST_ENV, "base": built.base,
        "ft_assets": build_file["ft_assets"], "torch": build_file["torch"], "packages_sha256": build_file["packages_sha256"],
        "reason": None,
    }  # fmt: skip
    assert recorded["torch"] == "2.13.0+cpu" and len(recorded["packages_sha256"]) == 64
    # ... and in the materialization's metadata, in the instance the run in the image wrote
    with dg.DagsterInstance.from_config(str(home)) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("lora_adapter"))
    shown = event.asset_materialization.metadata["worker_image"].value
    assert shown.startswith(f"{built.digest} ({DIGEST_ENV}); built on {built.base} with ft-assets ")


def test_the_image_has_each_planes_tools_as_a_non_root_user_and_no_secrets(image, tiny_model_dir, tmp_path):
    built, _, _ = image
    config = wb.inspect(built.image_id)
    assert config["OCIv1"]["config"]["User"] == UID != "0"
    # the image's environment, and the build arguments its history keeps ("|N KEY=VALUE ... /bin/sh -c ...")
    history = " ".join(h.get("created_by", "").split("/bin/sh")[0] for h in config["Docker"]["history"])
    names = [item.split("=")[0] for item in config["OCIv1"]["config"]["Env"] + history.split() if "=" in item]
    assert "WHEELHOUSE" in names and not [name for name in names if SECRET_NAME.search(name)], names
    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(tiny_model_dir, model)
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    for path in (tmp_path, model, *model.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    script = (
        "set -e; id -u; command -v dagster; command -v ft-assets; dagster api execute_run --help | head -1; "
        "python -c 'import pytest' 2>/dev/null && echo 'test extras installed'; "
        "python -c \"import importlib.metadata as m, json; print(json.loads(m.distribution('ft-assets').read_text('direct_url.json'))['url'].rsplit('.', 1)[-1])\"; "
        "python -c \"from ft_assets.delivery import gguf_export, llamacpp; "
        "gguf_export.export_gguf('/model', '/out/m-f16.gguf', 'f16'); print(llamacpp.quantize('/out/m-f16.gguf', '/out/m-q4_0.gguf', 'q4_0')['qtype'])\""
    )  # fmt: skip
    with wb.container(built.image_id) as name:
        done = wb.run_in(
            name, ["sh", "-c", script], mounts={model: "/model:ro", out: "/out"}, env={"OMP_NUM_THREADS": "1"}
        )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split()
    assert lines[:3] == [UID, "/opt/ft-assets/bin/dagster", "/opt/ft-assets/bin/ft-assets"]
    assert "Usage: dagster api execute_run" in done.stdout and "test extras installed" not in done.stdout
    assert lines[-2:] == ["whl", "q4_0"]  # installed from the wheel's file (an editable install names a folder)
    assert tensor_types(out / "m-q4_0.gguf")["Q4_0"] > 0  # llama.cpp's converter and quantizer, in the image


def test_a_code_change_rebuilds_only_the_ft_assets_layers(image):
    built, context, figures = image
    init, change = (
        context / "ft_assets" / "__init__.py",
        f"\n# a code change {uuid.uuid4().hex}\n",
    )  # never built before
    init.write_text(init.read_text() + change)
    changed = wb.build(context, built.base, built.wheelhouse_key, tag=None)
    figures["code_change_build_s"] = round(changed.seconds, 1)
    try:
        cached = "\n".join(changed.cached_steps())
        assert "${TORCH_INDEX_URL:+--extra-index-url" in cached  # torch: from the cache
        assert "-r /tmp/ft-deps/requirements.txt" in cached  # the dependencies: from the cache
        assert "COPY ft_assets /src/ft_assets" not in cached and changed.image_id != built.image_id
        old, new = built.layers(), changed.layers()
        assert len(old) == len(new) and old[:-2] == new[:-2] and old[-1] != new[-1]  # all but the wheel's two layers
    finally:
        init.write_text(init.read_text().removesuffix(change))
        wb.run(*wb.BUILDAH, "rmi", changed.image_id)
