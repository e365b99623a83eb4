import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["ft_assets_tests.s3server", "ft_assets_tests.mlflowserver"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh project folder: FT_HOME (store under it) and DAGSTER_HOME in tmp_path, one torch thread."""
    monkeypatch.setenv("FT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home" / "dagster_home"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("FT_STORE", raising=False)
    return tmp_path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init 2-layer Llama + ChatML BPE tokenizer, built once per session (no downloads)."""
    from ft_assets_tests.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: on CPU-only machines (CI) they are reported as skipped, with the reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (CI has none; run on a GPU worker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
