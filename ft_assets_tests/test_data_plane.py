"""The data plane end to end through ``ft-assets run`` on a real (SQLite) Dagster instance."""

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from ft_assets.cli import main
from ft_assets.data.parts import Artifact
from ft_assets.manifests import read_manifest, verify_artifact
from ft_assets.storage import LocalStore
from ft_assets_tests.support import run_cli_quiet

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "toolcalls"
pytestmark = pytest.mark.integration


@pytest.fixture
def project(home, tiny_model_dir):
    tmp_path = home
    config = tmp_path / "run_config.yaml"
    config.write_text(yaml.safe_dump({"ops": {"base_model": {"config": {"source": str(tiny_model_dir)}}}}))
    return tmp_path, config


def run_json(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


SAMPLE_RUN = [
    "run",
    "--in-process",
    "--dataset",
    str(SAMPLE),
    "--name",
    "toolcalls",
    "--version",
    "t1",
    "--until",
    "data",
]
DATA_ASSETS = ("raw_dataset", "cleaned_dataset", "deduplicated_dataset", "train_eval_split", "tokenized_shards")


@dataclass(frozen=True)
class SampleRun:
    """The shipped sample through the data plane once, in one process (default shards): the module's reference."""

    home: Path
    config: Path
    summary: dict
    digests: dict[str, str]  # each data asset's manifest digest: the same bytes whatever the executor, shards or store
    executor: str  # what the cleaned_dataset's page says ran it


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory, tiny_model_dir) -> SampleRun:
    from ft_assets.refs import read_ref

    home = tmp_path_factory.mktemp("sample")
    config = home / "run_config.yaml"
    config.write_text(yaml.safe_dump({"ops": {"base_model": {"config": {"source": str(tiny_model_dir)}}}}))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FT_HOME", str(home / "home"))
        env.setenv("DAGSTER_HOME", str(home / "home" / "dagster_home"))
        env.setenv("OMP_NUM_THREADS", "1")
        env.delenv("FT_STORE", raising=False)
        code, summary, err = run_cli_quiet(*SAMPLE_RUN, "--config", str(config), "--data-workers", "1", "--json")
        assert code == 0, err
        executor = executor_of("cleaned_dataset")
    store = LocalStore(home / "home" / "store")
    digests = {a: read_ref(store, "toolcalls@t1", a)["digest"] for a in DATA_ASSETS}
    return SampleRun(home, config, summary, digests, executor)


def test_sample_data_plane_accounts_for_every_row(sample_run, capsys, monkeypatch):
    tmp_path, config, summary = sample_run.home, sample_run.config, sample_run.summary
    monkeypatch.setenv("FT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home" / "dagster_home"))
    monkeypatch.delenv("FT_STORE", raising=False)
    assert summary["partition"] == "toolcalls@t1" and sample_run.executor == "1 process (in-process)"
    # The generator's injected dirt (scripts/make_sample.py): 3,333 lines = 3,000 examples + 150 exact
    # duplicates + 90 near-duplicates + 90 bad rows + 3 blank lines.
    assert summary["rows_in"] == 3330
    assert summary["exact_duplicates"] == 150
    assert 90 <= summary["near_duplicates"] <= 92
    assert summary["rows_quarantined"] == 90
    assert summary["quarantine_reasons"] == {
        "bad_role_order": 20,
        "empty_answer": 30,
        "invalid_json": 18,
        "not_an_object": 12,
        "unknown_role": 10,
    }
    assert (
        summary["rows_in"]
        == summary["rows_kept"] + summary["rows_quarantined"] + summary["exact_duplicates"] + summary["near_duplicates"]
    )
    assert summary["accounting_invariant_holds"] is True
    assert summary["train_rows"] + summary["eval_rows"] == summary["rows_kept"]
    assert 0.05 < summary["eval_rows"] / summary["rows_kept"] < 0.15
    assert summary["packing_efficiency"] > 0.97  # the tiny BPE makes ~140-token rows; SmolLM2's ~74 pack tighter

    store = LocalStore(tmp_path / "home" / "store")
    for asset, uri in summary["artifacts"].items():
        prefix = Path(uri).relative_to(store.root).as_posix()
        verify_artifact(store, read_manifest(store, prefix))
    shards = Path(summary["artifacts"]["tokenized_shards"])
    table = pq.read_table(shards / "train-00000.parquet")
    assert table.column_names == ["input_ids", "loss_mask", "position_ids", "seq_lens"]
    assert {len(x) for x in table.column("input_ids").to_pylist()} == {512}
    raw = Artifact.committed(store, Path(summary["artifacts"]["raw_dataset"]).relative_to(store.root).as_posix())
    quarantined = list(raw.records("quarantine"))
    assert (
        len(quarantined)
        == summary["quarantine_reasons"]["invalid_json"] + summary["quarantine_reasons"]["not_an_object"]
    )
    assert all(q["source"].startswith("part-") and q["reason"] for q in quarantined)
    assert raw.names("rows") == [
        f"rows-{i:05d}.parquet" for i in range(3)
    ]  # a part per input file: each file is under PART_ROWS

    # Same dataset again: the version is recognised, nothing is re-registered, the runs repeat cleanly.
    again = run_json(capsys, *SAMPLE_RUN, "--config", str(config), "--json")
    assert again["rows_kept"] == summary["rows_kept"]


def test_truncated_gzip_fails_the_version_naming_the_file(project, capsys):
    tmp_path, config = project
    data = tmp_path / "bad"
    data.mkdir()
    rows = "\n".join(json.dumps({"instruction": f"say {i}", "output": f"{i}"}) for i in range(500)).encode()
    blob = gzip.compress(rows)
    (data / "part.jsonl.gz").write_bytes(blob[: len(blob) // 2])
    assert main(["run", "--in-process", "--dataset", str(data), "--until", "data", "--config", str(config)]) == 2
    assert "part.jsonl.gz: the gzip stream is truncated" in capsys.readouterr().err


def test_existing_version_with_other_content_is_refused(project, capsys):
    tmp_path, config = project
    first = tmp_path / "a.jsonl"
    first.write_text(json.dumps({"instruction": "hi", "output": "hello"}) + "\n")
    second = tmp_path / "b.jsonl"
    second.write_text(json.dumps({"instruction": "hi", "output": "bye"}) + "\n")
    common = ["--name", "same", "--version", "v1", "--until", "data", "--config", str(config)]
    main(["run", "--in-process", "--dataset", str(first), *common])
    capsys.readouterr()
    assert main(["run", "--in-process", "--dataset", str(second), *common]) == 2
    assert "already exists" in capsys.readouterr().err


def test_a_json_array_with_other_column_names_through_the_run_config(project, capsys):
    """The issue's case: alpaca_data.json's layout (a JSON array) under its own name, columns mapped by config."""
    tmp_path, config = project
    data = tmp_path / "qa_data.json"
    rows = [{"question": f"What is {i} times three?", "answer": f"It is {3 * i}."} for i in range(60)]
    data.write_text(json.dumps(rows[:30] + [{"question": "no answer"}] + rows[30:], indent=2))
    mapped = tmp_path / "mapped.yaml"
    run_config = yaml.safe_load(config.read_text())
    run_config["ops"]["raw_dataset"] = {"config": {"columns": {"prompt": "question", "response": "answer"}}}
    mapped.write_text(yaml.safe_dump(run_config))
    summary = run_json(
        capsys, "run", "--in-process", "--dataset", str(data), "--until", "data", "--config", str(mapped), "--json"
    )
    assert summary["partition"].startswith("qa_data@v-")
    assert (summary["rows_in"], summary["rows_kept"], summary["quarantine_reasons"]) == (61, 60, {"unknown_format": 1})
    store = LocalStore(tmp_path / "home" / "store")
    raw = Artifact.committed(store, Path(summary["artifacts"]["raw_dataset"]).relative_to(store.root).as_posix())
    assert [(q["source"], q["reason"]) for q in raw.records("quarantine")] == [("qa_data.json#31", "unknown_format")]
    # Without the mapping the version fails, naming the file and the columns it has.
    assert main(["run", "--in-process", "--dataset", str(data), "--until", "data", "--config", str(config)]) == 2
    assert "qa_data.json: no row has an accepted layout (qa_data.json#1: " in capsys.readouterr().err


COUNTS = ("rows_in", "rows_kept", "rows_quarantined", "quarantine_reasons", "exact_duplicates", "near_duplicates",
          "train_rows", "eval_rows", "tokens", "packing_efficiency", "accounting_invariant_holds")  # fmt: skip


def sharded_config(project) -> Path:
    """The run config with shards of 700 rows: the 3,333-line sample is cut in 5 or more a stage."""
    tmp_path, config = project
    sharded = tmp_path / "sharded.yaml"
    settings = {**yaml.safe_load(config.read_text()), "resources": {"data_executor": {"config": {"shard_rows": 700}}}}
    sharded.write_text(yaml.safe_dump(settings))
    return sharded


def executor_of(asset: str) -> str:
    """What the asset's page says ran it (its latest materialization's ``executor``)."""
    import dagster as dg

    event = dg.DagsterInstance.get().get_latest_materialization_event(dg.AssetKey(asset))
    return event.asset_materialization.metadata["executor"].value


def test_ray_workers_publish_what_one_process_does_and_another_executor_is_not_stale(project, capsys, sample_run):
    """``--ray-address local --data-workers 2``: every data artifact has the one-process run's manifest digest (so the
    same bytes), the same counts; then ``--data-workers 2`` finds the plane current. (Every executor writing the same
    files stage by stage: test_parallel.py; 2 worker processes through the command: the S3 test below.)"""
    from ft_assets.refs import read_ref

    tmp_path, _ = project
    base = [*SAMPLE_RUN, "--config", str(sharded_config(project)), "--json"]
    store = LocalStore(tmp_path / "home" / "store")
    on_ray = run_json(capsys, *base, "--ray-address", "local", "--data-workers", "2")
    assert {asset: read_ref(store, "toolcalls@t1", asset)["digest"] for asset in DATA_ASSETS} == sample_run.digests
    assert executor_of("cleaned_dataset") == "Ray, 2 tasks at a time"
    assert {k: on_ray[k] for k in COUNTS} == {k: sample_run.summary[k] for k in COUNTS}
    assert run_json(capsys, *base, "--data-workers", "2")["skipped"] == ["data"]


def test_with_an_s3_store_the_workers_write_the_parts_there(project, capsys, s3_env, monkeypatch, sample_run):
    """``FT_STORE=s3://…`` and 2 worker processes, through the instance: the workers read their input parts from the
    bucket and write theirs there, the driver commits each manifest; every artifact is the one a single process makes
    on a local store (``sample_run``)."""
    from ft_assets.refs import read_ref
    from ft_assets.storage import open_store

    base = ["run", "--dataset", str(SAMPLE), "--name", "toolcalls", "--version", "t1", "--until", "data",
            "--config", str(sharded_config(project)), "--json"]  # fmt: skip
    monkeypatch.setenv("FT_STORE", s3_env)
    on_s3 = run_json(capsys, *base, "--data-workers", "2")
    assert executor_of("cleaned_dataset") == "2 worker processes"
    bucket = open_store(s3_env)
    for asset in DATA_ASSETS:
        ref = read_ref(bucket, "toolcalls@t1", asset)
        assert ref["uri"].startswith("s3://") and ref["digest"] == sample_run.digests[asset], asset
        manifest = read_manifest(bucket, ref["prefix"])
        assert sorted(key.removeprefix(ref["prefix"] + "/") for key in bucket.list(ref["prefix"])) == sorted(
            [*manifest.files, "manifest.json"]
        )
        assert all(bucket.sha256(f"{ref['prefix']}/{name}") == info["sha256"] for name, info in manifest.files.items())
    assert on_s3["accounting_invariant_holds"] is True


def test_a_ray_address_that_does_not_answer_fails_the_run_within_30_s(project, capsys):
    import socket
    import time

    tmp_path, config = project
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    started = time.monotonic()
    assert (
        main(
            [
                "run",
                "--in-process",
                "--dataset",
                str(SAMPLE),
                "--until",
                "data",
                "--config",
                str(config),
                "--ray-address",
                address,
            ]
        )
        == 2
    )
    assert time.monotonic() - started < 30
    error = capsys.readouterr().err
    assert f"the Ray cluster at {address} does not answer" in error, error
