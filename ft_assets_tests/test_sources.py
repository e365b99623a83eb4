"""Non-file sources, offline: a Hub cache built here, ``save_to_disk`` directories, a real S3 server (SeaweedFS).

The Hub cache has the layout ``huggingface_hub`` keeps (``datasets--owner--name/{refs,snapshots,blobs}``,
snapshot files symlinked to content-addressed blobs), so ``snapshot_download`` resolves revisions from
it exactly as it would after a download, with outgoing traffic disabled.
"""

from __future__ import annotations

import json

import pytest

from ft_assets.cli import main
from ft_assets.data.layouts import ColumnMapping
from ft_assets.data.parts import Artifact
from ft_assets.data.readers import read_dataset
from ft_assets.data.registration import register_dataset
from ft_assets.data.rows import DatasetFileError
from ft_assets.data.sources import describe_source, stage
from ft_assets.storage import LocalStore
from ft_assets_tests.support import MAIN, V1, add_hub_revision, qa_rows

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


QA = ColumnMapping.of({"prompt": "question", "response": "answer"})


@pytest.mark.parametrize(
    "spec,commit,rows",
    [
        ("hf://acme/qa@main", MAIN, 30),
        ("hf://acme/qa", MAIN, 30),
        (f"acme/qa@{MAIN}", MAIN, 30),
        ("hf://acme/qa@v1.0", V1, 10),
    ],
    ids=["branch", "default-main", "bare-commit", "tag"],
)
def test_hub_dataset_pinned_to_the_commit_of_its_revision(hub_cache, tmp_path, spec, commit, rows):
    staged = stage(spec, tmp_path / "work")
    assert staged.name == "qa"
    assert (
        staged.source["commit"] == commit and staged.source["repo"] == "acme/qa" and staged.source["split"] == "train"
    )
    assert all(rel.startswith("data/train-") for rel, _ in staged.files)  # the test split stays out
    stats = read_dataset(staged.files, Artifact.folder(tmp_path / "raw"), QA)
    assert stats["rows_parsed"] == rows
    assert describe_source(staged.source) == [
        f"  source {staged.source['uri']} → commit {commit} (split train, {len(staged.files)} file(s))"
    ]


def test_hub_split_from_the_readme_configs(hub_cache, tmp_path):
    """Which files make a split is what ``datasets`` reads from the repo's README (``configs``)."""
    readme = b"---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: chats/*.jsonl\n---\n"
    chats = (json.dumps({"messages": CHAT}) + "\n").encode()
    add_hub_revision(
        hub_cache, "acme/chats", MAIN, {"README.md": readme, "chats/a.jsonl": chats, "other/b.jsonl": chats}, ("main",)
    )
    staged = stage("hf://acme/chats@main", tmp_path / "work")
    assert [rel for rel, _ in staged.files] == ["chats/a.jsonl"]


@pytest.mark.parametrize(
    "spec,error",
    [
        ("hf://acme/qa@v9", r"hf://acme/qa@v9: not in the local Hugging Face cache and HF_HUB_OFFLINE is set"),
        ("hf://acme/missing@main", r"hf://acme/missing@main: not in the local Hugging Face cache"),
    ],
)
def test_hub_revision_not_in_the_cache_offline(hub_cache, tmp_path, spec, error):
    with pytest.raises(DatasetFileError, match=error):
        stage(spec, tmp_path / "work")


def test_hub_split_that_does_not_exist(hub_cache, tmp_path):
    with pytest.raises(DatasetFileError, match=r"hf://acme/qa@main: no split 'validation'; splits: test, train"):
        stage("hf://acme/qa@main", tmp_path / "work", split="validation")


def test_save_to_disk_directories(tmp_path):
    import datasets

    one = datasets.Dataset.from_dict({"question": ["hi", "x"], "answer": ["hello", "y"]})
    one.save_to_disk(str(tmp_path / "saved"))
    staged = stage(str(tmp_path / "saved"), tmp_path / "work")
    assert staged.name == "saved" and staged.source["kind"] == "save_to_disk" and staged.source["rows"] == 2
    assert all(rel.endswith(".arrow") for rel, _ in staged.files)
    rows = read_dataset(staged.files, raw := Artifact.folder(tmp_path / "raw"), QA)
    assert rows["rows_parsed"] == 2
    assert next(raw.records("rows"))["messages"] == CHAT

    splits = datasets.DatasetDict({"train": one, "test": one.select([0])})
    splits.save_to_disk(str(tmp_path / "dict"))
    staged = stage(str(tmp_path / "dict"), tmp_path / "work2")
    assert staged.source["split"] == "train" and all(rel.startswith("train/") for rel, _ in staged.files)
    with pytest.raises(DatasetFileError, match=r"dict: no split 'validation'; splits: test, train"):
        stage(str(tmp_path / "dict"), tmp_path / "work3", split="validation")


@pytest.mark.integration
def test_parquet_prefix_in_s3(s3_env, seaweedfs, tmp_path):
    bucket = s3_env.removeprefix("s3://").split("/")[0]
    client = seaweedfs.client()
    client.put_object(Bucket=bucket, Key="exports/chat/part-0.parquet", Body=qa_rows(7))
    client.put_object(Bucket=bucket, Key="exports/chat/day=2/part-1.parquet", Body=qa_rows(3, "r"))
    client.put_object(Bucket=bucket, Key="exports/chat/_SUCCESS", Body=b"")
    client.put_object(Bucket=bucket, Key="exports/other/part-0.parquet", Body=qa_rows(5))
    staged = stage(f"s3://{bucket}/exports/chat/", tmp_path / "work")
    assert staged.name == "chat"
    assert staged.source == {
        "kind": "s3",
        "uri": f"s3://{bucket}/exports/chat/",
        "files": ["day=2/part-1.parquet", "part-0.parquet"],
    }
    stats = read_dataset(staged.files, Artifact.folder(tmp_path / "raw"), QA)
    assert stats["rows_per_file"] == {"day=2/part-1.parquet": 3, "part-0.parquet": 7}
    with pytest.raises(DatasetFileError, match=rf"s3://{bucket}/exports/none/: no data files"):
        stage(f"s3://{bucket}/exports/none/", tmp_path / "work2")


NAMES = [
    ("x.json", "x"),
    ("alpaca_data.json", "alpaca_data"),
    ("train.csv", "train"),
    ("train.tsv", "train"),
    ("chat.jsonl.gz", "chat"),
    ("chat.jsonl", "chat"),
    ("part.parquet", "part"),
    ("data-00000-of-00001.arrow", "data-00000-of-00001"),
    ("my data.csv.gz", "my-data"),
]


@pytest.mark.parametrize("filename,name", NAMES, ids=[n[0] for n in NAMES])
def test_default_dataset_names_drop_the_extension(tmp_path, filename, name):
    store = LocalStore(tmp_path / "store")
    path = tmp_path / filename
    path.write_bytes(b"")
    key, new = register_dataset(store, str(path), None, "v1")
    assert (key, new) == (f"{name}@v1", True)


def test_unsupported_input_is_refused_before_anything_is_uploaded(home, capsys):
    inputs = home / "inputs"
    inputs.mkdir()
    (inputs / "notes.xlsx").write_bytes(b"PK")
    (inputs / "README.md").write_text("# notes\n")
    for path, error in [
        (
            inputs / "notes.xlsx",
            r"notes\.xlsx: not an input ft-assets reads; use a data file \(\.jsonl, .*hf://owner/name@revision",
        ),
        (inputs, r"inputs: no data files in this directory \(found: README\.md, notes\.xlsx\); use a data file"),
        (home / "missing.jsonl", r"dataset path .*missing\.jsonl does not exist"),
    ]:
        assert main(["run", "--dataset", str(path), "--until", "data"]) == 2
        assert __import__("re").search(error, capsys.readouterr().err)
    assert not (home / "home" / "store" / "datasets").exists()


def test_a_hub_version_records_its_origin(hub_cache, tmp_path):
    """Registered from the Hub: the files as they are, plus _source.json; the same revision at the same commit is
    the same version, another commit another version."""
    store = LocalStore(tmp_path / "store")
    key, new = register_dataset(store, "hf://acme/qa@main", None, None)
    again = register_dataset(store, "hf://acme/qa@main", None, None)
    assert new and again[1] is False and key.startswith("qa@v-")
    version = key.split("@")[1]
    assert sorted(store.list(f"datasets/qa/{version}")) == [
        f"datasets/qa/{version}/{name}"
        for name in (
            "_SUCCESS",
            "_source.json",
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet",
        )
    ]
    assert store.get_json(f"datasets/qa/{version}/_source.json")["commit"] == MAIN
    assert register_dataset(store, "hf://acme/qa@v1.0", None, None)[0] != key
