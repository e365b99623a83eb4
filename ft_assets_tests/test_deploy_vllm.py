"""The vLLM deploy recipe (``deploy/vllm/deployment.yaml``): rendered for two published runs, then validated against
the Kubernetes models dagster-k8s builds its Jobs from (unknown keys and missing required fields are refused).
It cannot run here (no cluster, no GPU); what its init container runs, ``lora_registry --args-file``, does run:
on a store holding two published adapters of one base it writes the arguments the vLLM container reads.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import kubernetes.client as k8s
import pytest
from dagster_k8s.models import k8s_model_from_dict, k8s_snake_case_dict

from ft_assets.delivery import lora_registry
from ft_assets.manifests import publish_dir
from ft_assets.storage import LocalStore

RECIPE = Path(__file__).resolve().parents[1] / "deploy" / "vllm" / "deployment.yaml"
RUNS = ["registry/acks/v1/aaaa1111", "registry/acks/v2/bbbb2222"]
MODELS = {"Deployment": k8s.V1Deployment, "Service": k8s.V1Service}


def validated(document: dict):
    """The Kubernetes model of one rendered document: refuses unknown keys (any depth) and missing required fields."""
    model = MODELS[document["kind"]]
    return k8s_model_from_dict(model, k8s_snake_case_dict(model, document))


def test_the_recipe_renders_for_the_runs_and_validates_against_the_kubernetes_schema():
    documents = lora_registry.render_deployment(RECIPE.read_text(), RUNS)
    deployment, service = (validated(document) for document in documents)
    pod = deployment.spec.template.spec
    (init,), (server,) = pod.init_containers, pod.containers
    assert init.args == RUNS
    assert init.command[:3] == ["python", "-m", "ft_assets.delivery.lora_registry"]
    args_file = init.command[init.command.index("--args-file") + 1]
    assert f"$$(cat {args_file})" in server.args[0]  # $$: a literal $ to Kubernetes, the shell reads the file
    mounts = {m.name: m.mount_path for m in server.volume_mounts}
    assert {m.name: m.mount_path for m in init.volume_mounts}["models"] == mounts["models"] and args_file.startswith(
        mounts["models"]
    )
    assert server.resources.limits["nvidia.com/gpu"] == "1" and server.readiness_probe.http_get.path == "/health"
    assert service.spec.selector == deployment.spec.selector.match_labels
    assert service.spec.ports[0].target_port == server.ports[0].name


@pytest.mark.parametrize("fault,message", [
    (lambda d: d["spec"]["template"]["spec"].update(initContainer=[]), "Unexpected keys in model class V1PodSpec"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"), "name"),
])  # fmt: skip
def test_the_schema_check_finds_a_broken_recipe(fault, message):
    deployment = lora_registry.render_deployment(RECIPE.read_text(), RUNS)[0]
    fault(deployment)
    with pytest.raises(Exception, match=message):
        validated(deployment)


def test_rendering_refuses_what_is_not_a_published_run():
    with pytest.raises(lora_registry.RegistryError, match="is not a published run"):
        lora_registry.render_deployment(RECIPE.read_text(), ["registry/acks/v1"])
    with pytest.raises(ValueError, match="is not a published model"):
        lora_registry.render_deployment(RECIPE.read_text(), ["s3://bucket/acks/v1/run"])


def test_the_init_containers_command_writes_the_servers_arguments(tmp_path, capsys):
    """What the init container runs, on a store with two published adapters of one base (small files, no server)."""
    store = LocalStore(tmp_path / "store")
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama"}))
    publish_dir(store, "models/tiny/0123456789abcdef", base)
    for run, rank in zip(RUNS, (8, 16)):
        published = tmp_path / run
        (published / "adapter").mkdir(parents=True)
        (published / "adapter" / "adapter_config.json").write_text(
            json.dumps({"base_model_name_or_path": "models/tiny/0123456789abcdef", "r": rank})
        )
        (published / "merged").mkdir()
        (published / "merged" / "config.json").write_text("{}")
        publish_dir(store, run, published)
    models = tmp_path / "models"
    code = lora_registry.main(
        ["--store", str(store.root), "--dest", str(models), "--args-file", str(models / "vllm-args"), *RUNS]
    )
    assert code == 0
    printed = shlex.split(capsys.readouterr().out)
    written = shlex.split((models / "vllm-args").read_text())
    assert printed[:2] == ["vllm", "serve"] and printed[2:] == written
    assert written[0] == str(models / "base") and (models / "base" / "config.json").is_file()
    assert written[written.index("--max-lora-rank") + 1] == "16"  # the largest rank of the two
    modules = written[written.index("--lora-modules") + 1 :]
    assert modules == [f"acks-v1={models / 'acks-v1' / 'adapter'}", f"acks-v2={models / 'acks-v2' / 'adapter'}"]
    assert not (models / "acks-v1" / "merged").exists()  # the adapters only, not the merged weights
