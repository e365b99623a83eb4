"""MLflow Model Registry: published models as model versions of a real ``mlflow server`` on loopback (mlflow-skinny's
client), by reference to the store, with lineage, signature and gate tags; ``champion`` moves only to a better
model that passed its gate, ``candidate`` otherwise; a registry that fails is a warning."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest

from ft_assets.delivery import model_registry as mr
from ft_assets.delivery.gate import dropped, gate
from ft_assets.delivery.lineage import LINEAGE_CHAIN, build_lineage
from ft_assets_tests.pg import free_port
from ft_assets_tests.support import lineage_refs

SIGNED = {"signed": True, "sha256": "5e" * 32}


def release(
    name: str, run_id: str, metric: float, passed: bool = True, metric_name: str = "exact_match", mlflow_run_id=None
) -> mr.Release:
    """The release of a published run of dataset ``name``: lineage from a whole chain of references, a gate on ``metric``."""
    refs = lineage_refs()
    refs["lora_adapter"]["stats"]["run_id"] = run_id
    prefix = f"registry/{name}/v1/{run_id}"
    lineage = build_lineage(f"{name}@v1", refs, prefix)
    exports = {"gguf": dropped("GGUF export is off (gguf_model qtypes: [])", 0.05)}
    verdict = gate(metric_name, 0.0, metric, 0.05 if passed else 2.0, exports)
    published = {"uri": f"s3://models/store/{prefix}", "digest": run_id.encode().hex().ljust(64, "0")}
    return mr.release_of(f"{name}@v1", published, lineage, verdict.flat(), SIGNED, mlflow_run_id)


CHAMPION_AT_07 = {"ft.gate.metric_name": "exact_match", "ft.gate.finetuned_metric": "0.7"}  # a champion's tags
ALIASES = [  # (case, new gate passed, new metric name and value, the champion's tags (None: none), alias)
    ("first version that passed", True, "exact_match", 0.5, None, mr.CHAMPION),
    ("first version, gate failed", False, "exact_match", 0.5, None, mr.CANDIDATE),
    ("better on the same metric", True, "exact_match", 0.8, CHAMPION_AT_07, mr.CHAMPION),
    ("a tie keeps the champion", True, "exact_match", 0.7, CHAMPION_AT_07, mr.CANDIDATE),
    ("worse", True, "exact_match", 0.6, CHAMPION_AT_07, mr.CANDIDATE),
    ("better but gate failed", False, "exact_match", 0.9, CHAMPION_AT_07, mr.CANDIDATE),
    ("another metric", True, "token_f1", 0.9, CHAMPION_AT_07, mr.CANDIDATE),
]  # fmt: skip


@pytest.mark.parametrize(
    "case, passed, metric_name, metric, champion, alias", ALIASES, ids=[case[0] for case in ALIASES]
)
def test_the_alias_of_a_new_version(case, passed, metric_name, metric, champion, alias):
    chosen, why = mr.choose_alias(release("acks", "r1", metric, passed, metric_name), champion)
    assert chosen == alias, why


def test_a_version_that_regressed_on_a_general_task_is_never_champion():
    """general_eval with on_regression: warn publishes a model that forgot a general task; the registry keeps it a
    candidate, even as the first version or the best on the task metric, and its tags say what regressed."""
    from dataclasses import replace

    from ft_assets.delivery.regression import WARN, Score, judge

    forgot = judge(
        {"base": {"gsm8k": Score(0.4, 0.02)}, "finetuned": {"gsm8k": Score(0.1, 0.02)}},
        {"gsm8k": ("exact_match,strict-match", True)}, 0.05, {}, 1.0, WARN, 200, 60.0,
    )  # fmt: skip
    verdict = gate("exact_match", 0.0, 0.95, 0.05, {"gguf": dropped("off", 0.05)}, forgot)
    assert verdict.passed  # a warning does not fail the gate
    regressed = replace(release("acks", "r9", 0.95), gate=verdict.flat())
    for champion in (None, CHAMPION_AT_07):
        chosen, why = mr.choose_alias(regressed, champion)
        assert (chosen, why) == (mr.CANDIDATE, "it regressed on a general-ability task (general_eval)")
    tags = regressed.version_tags()
    assert (tags["ft.gate.general.regressed"], tags["ft.gate.general.gsm8k.finetuned"]) == ("True", "0.1")
    assert tags["ft.gate.general.gsm8k.finetuned.drop"] == "0.3"


def test_a_release_carries_lineage_signature_and_gate_tags():
    tags = release("acks", "r7", 0.75).version_tags()
    assert (
        tags["ft.dataset_version"] == "acks@v1"
        and tags["ft.run_id"] == "r7"
        and tags["ft.signature.sha256"] == "5e" * 32
    )
    assert {f"ft.digest.{name}" for name in (*LINEAGE_CHAIN, "checkpoint", "published_model")} <= set(tags)
    assert (
        tags["ft.digest.checkpoint"] == "ef" * 32
        and tags["ft.digest.tokenized_shards"] == lineage_refs()["tokenized_shards"]["digest"]
    )
    assert (tags["ft.gate.passed"], tags["ft.gate.metric_name"], tags["ft.gate.finetuned_metric"]) == (
        "True",
        "exact_match",
        "0.75",
    )
    assert (tags["ft.gate.gguf.file"], tags["ft.gate.gguf.reason"]) == (
        "None",
        "GGUF export is off (gguf_model qtypes: [])",
    )
    unsigned = mr.release_of("acks@v1", {"uri": "s3://b/p", "digest": "0" * 64}, build_lineage("acks@v1", lineage_refs(), "p"),
                             {"passed": True}, {"signed": False, "sha256": None}, None)  # fmt: skip
    assert unsigned.tags["ft.signature.sha256"] == "unsigned"


@pytest.mark.integration
def test_versions_get_champion_only_when_they_beat_it(mlflow_server):
    client = mlflow_server.client()
    name = f"acks-{uuid.uuid4().hex[:8]}"
    experiment = client.create_experiment(name)
    training_run = client.create_run(experiment).info.run_id
    lines = []
    steps = [("first", 0.6, mr.CHAMPION), ("worse", 0.5, mr.CANDIDATE), ("better", 0.8, mr.CHAMPION)]
    versions = []
    for run_id, metric, alias in steps:
        registered = mr.register(
            mlflow_server.uri, release(name, run_id, metric, mlflow_run_id=training_run), lines.append, lines.append
        )
        assert registered is not None and registered["aliases"] == [alias], lines
        versions.append(registered["version"])
    assert client.get_model_version_by_alias(name, mr.CHAMPION).version == versions[2]
    assert client.get_model_version_by_alias(name, mr.CANDIDATE).version == versions[1]
    second = client.get_model_version(name, versions[1])
    assert (
        second.source == f"s3://models/store/registry/{name}/v1/worse" and second.run_id == training_run
    )  # by reference
    assert not list((mlflow_server.root / "artifacts").rglob("*.safetensors"))  # nothing copied into MLflow
    expected = release(name, "worse", 0.5).version_tags()
    assert {k: second.tags[k] for k in expected} == expected  # every lineage, signature and gate tag
    assert [line for line in lines if "does not beat the champion's 0.6000" in line], lines

    # Publishing the same run again registers nothing new and moves no alias.
    again = mr.register(mlflow_server.uri, release(name, "worse", 0.5), lines.append, lines.append)
    assert again["version"] == versions[1] and again["reason"] == "already registered"
    assert len(client.search_model_versions(f"name = '{name}'")) == 3
    assert client.get_model_version_by_alias(name, mr.CHAMPION).version == versions[2]


@pytest.mark.integration
def test_a_registry_that_fails_is_a_warning(mlflow_server, tmp_path):
    warnings = []
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert mr.register(dead, release("acks", "r1", 0.9), print, warnings.append) is None
    assert warnings and warnings[0].startswith(f"MLflow Model Registry at {dead} did not register")
    assert "published all the same" in warnings[0]
    local = replace(
        release(f"acks-{uuid.uuid4().hex[:8]}", "r1", 0.9), source=str(tmp_path / "registry")
    )  # a local store's path
    assert mr.register(mlflow_server.uri, local, print, warnings.append) is None
    assert "Invalid model version source" in warnings[1] and "publish to an s3:// store (FT_STORE)" in warnings[1], (
        warnings[1]
    )
