import dagster as dg
import pytest

from ft_assets.definitions import defs
from ft_assets.training.config import TrainingConfig

PLANE_GROUPS = {
    "data": {"raw_dataset", "cleaned_dataset", "deduplicated_dataset", "train_eval_split", "tokenized_shards"},
    "model": {"base_model"},  # its own group: it feeds the data, training and delivery planes
    "training": {"training_plan", "lora_adapter"},  # the training plane's run: the plan first, then the adapter
}


def test_definitions_load_and_resolve():
    repository = defs.get_repository_def()
    assert repository.get_job("data_plane") is not None
    assert defs.resolve_sensor_def("dataset_version_sensor") is not None


def test_every_asset_is_partitioned_by_dataset_version_and_grouped_by_plane():
    graph = defs.get_repository_def().asset_graph
    groups: dict[str, set[str]] = {}
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.partitions_def is not None and node.partitions_def.name == "dataset_version", key
        groups.setdefault(node.group_name, set()).add(key.to_user_string())
    assert set(groups) <= {"model", "control", "data", "training", "delivery"}
    for group, assets in PLANE_GROUPS.items():
        assert assets <= groups[group], group


def test_the_groups_depend_on_each_other_without_a_cycle():
    """The UI's collapsed lineage draws one box per group; a group that feeds and is fed by another reads as a cycle."""
    graph = defs.get_repository_def().asset_graph
    feeds: dict[str, set[str]] = {}
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        for parent in node.parent_keys:
            if graph.get(parent).group_name != node.group_name:
                feeds.setdefault(graph.get(parent).group_name, set()).add(node.group_name)
    order, left = [], set(feeds) | {group for downstream in feeds.values() for group in downstream}
    while left:
        sources = {group for group in left if not any(group in feeds.get(other, ()) for other in left)}
        assert sources, f"the groups {sorted(left)} feed each other in a cycle: {feeds}"
        order += sorted(sources)
        left -= sources
    assert order[:2] == ["model", "data"]


def test_blocking_checks_guard_the_data_plane():
    graph = defs.get_repository_def().asset_graph
    checks = {key.name: graph.get_check_spec(key) for key in graph.asset_check_keys}
    assert checks["quarantine_fraction_within_limit"].blocking
    assert checks["rows_accounted_for"].blocking


@pytest.mark.parametrize("job", ["data_plane", "training_plane", "delivery_plane"])
def test_launchpad_config_has_help_texts(job):
    described = 0
    for node in defs.resolve_job_def(job).graph.nodes:
        schema = node.definition.config_schema
        if schema is None or not hasattr(schema.config_type, "fields"):
            continue
        for name, field in schema.config_type.fields.items():
            assert field.description, f"{node.name}.{name} has no help text"
            described += 1
    assert described >= 5, (
        f"{job}: only {described} settings found: the walk over the launchpad config found nothing to check"
    )


def test_the_training_settings_are_lora_adapters_and_the_plan_runs_first_in_their_plane():
    """One owner of the training settings: lora_adapter's launchpad has every TrainingConfig field; training_plan
    has only its own and runs in the training plane before lora_adapter, which trains against it."""
    job = defs.resolve_job_def("training_plane")
    fields = {node: set(job.graph.node_named(node).definition.config_schema.config_type.fields)
              for node in ("training_plan", "lora_adapter")}  # fmt: skip
    assert fields["lora_adapter"] == set(TrainingConfig.model_fields)
    assert fields["training_plan"] == {"purpose", "data_region", "cost_model_path"}
    graph = defs.get_repository_def().asset_graph
    assert dg.AssetKey("training_plan") in graph.get(dg.AssetKey("lora_adapter")).parent_keys
    assert "training_plan" not in {
        k.to_user_string() for k in defs.resolve_job_def("data_plane").asset_layer.selected_asset_keys
    }


def kinds(definitions) -> dict[str, set[str]]:
    graph = definitions.get_repository_def().asset_graph
    return {
        key.to_user_string(): {
            tag.removeprefix("dagster/kind/") for tag in graph.get(key).tags if tag.startswith("dagster/kind/")
        }
        for key in graph.get_all_asset_keys()
    }


def test_every_asset_says_what_it_is_and_where_it_is_stored():
    shown = kinds(defs)
    assert {"parquet"} <= shown["raw_dataset"] and {"huggingface", "parquet"} <= shown["tokenized_shards"]
    assert {"huggingface", "pytorch"} <= shown["lora_adapter"] and {"llama", "gguf"} <= shown["gguf_model"]
    assert all("file" in found for asset, found in shown.items() if asset != "serving_smoke"), shown


@pytest.mark.integration  # the definitions loaded in a fresh process per store
def test_the_storage_kind_follows_the_store(tmp_path):
    import json
    import os
    import subprocess
    import sys

    script = (
        "import json; from ft_assets.definitions import defs; graph = defs.get_repository_def().asset_graph; "
        "print(json.dumps({k.to_user_string(): sorted(graph.get(k).tags) for k in graph.get_all_asset_keys()}))"
    )
    env = {**os.environ, "FT_STORE": "s3://bucket/prefix"}
    shown = json.loads(
        subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    )
    assert "dagster/kind/s3" in shown["raw_dataset"] and "dagster/kind/s3" in shown["published_model"]
    assert "dagster/kind/file" not in shown["lora_adapter"]
