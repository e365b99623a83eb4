import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["ft_assets_tests.s3server"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init 2-layer Llama + ChatML BPE tokenizer, built once per session (no downloads)."""
    from ft_assets_tests.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
