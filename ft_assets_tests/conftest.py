"""Fixtures shared by the test modules; the plain builders they use are in ``support.py``."""

import multiprocessing
import os
from pathlib import Path

import pytest

# One intra-op thread for the session, set before torch is imported (the test modules import it): the tiny models'
# ops are too small to share, and 2 threads spinning against each other and the suite's servers cost CPU for nothing
# (test_pipeline.py + test_signed_delivery.py: 160 s of CPU with torch's default 2 threads, 70 s with 1, at load ~10).
# Subprocesses inherit it, as ONE_THREAD gave it to most of them before; test_real_gemma.py takes 2 for its 268M model.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vllm_smoke serves with vLLM only where a test asks for it (test_vllm.py): each server start costs ~45 s, and
# every other test that runs the delivery plane would start two. Elsewhere it materializes as "vLLM is off".
os.environ.setdefault("FT_VLLM_PYTHON", "")
# Likewise mlx (the [mlx] extra): hidden, so the MLX export is off (~20 s a delivery run) and `backend: auto` is torch,
# except in the tests of the MLX backend and export (test_mlx.py, test_mlx_pipeline.py, test_general_eval.py's MLX
# server), which set FT_MLX=1.
os.environ.setdefault("FT_MLX", "0")

pytest_plugins = [
    "ft_assets_tests.s3server",
    "ft_assets_tests.mlflowserver",
    "ft_assets_tests.leaks",
    "ft_assets_tests.progress",
]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh project folder: FT_HOME (store under it) and DAGSTER_HOME in tmp_path, one torch thread."""
    monkeypatch.setenv("FT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home" / "dagster_home"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("FT_STORE", raising=False)
    return tmp_path


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.integration)])
def store(request, tmp_path):
    """An empty object store, on both backends: a local directory and a real S3 server (SeaweedFS)."""
    from ft_assets.storage import LocalStore, open_store

    if request.param == "local":
        return LocalStore(tmp_path / "store")
    return open_store(request.getfixturevalue("s3_env"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init 2-layer Llama + ChatML BPE tokenizer, built once per session (no downloads)."""
    from ft_assets_tests.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


# The slowest modules, slowest first (per-module times of a full run: junit.xml or .ci/run's progress.log). They are
# collected first, so the workers of `make test` (pytest-xdist, a module at a time) start on them and the run does not
# end with one worker alone on a long module; the rest keep their order.
SLOWEST = [  # test_image.py first: 66 s with its base, wheelhouse and layers cached, ~5 min cold
    "test_image.py", "test_slurm.py", "test_real_gemma.py", "test_vllm.py", "test_parallel.py", "test_production.py",
    "test_concurrency.py", "test_cli.py", "test_grpo.py", "test_training.py", "test_recovery.py",
    "test_skypilot_pool.py", "test_training_asset.py", "test_remote_worker.py", "test_benchmarks_smoke.py", "test_security.py", "test_fsdp.py",
    "test_variants.py", "test_ui.py", "test_data_plane.py", "test_mlx_pipeline.py",
]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """The slowest modules first (``SLOWEST``); `gpu` tests need CUDA: on CPU-only machines (CI) they are reported
    as skipped, with the reason."""
    import torch

    rank = {name: i for i, name in enumerate(SLOWEST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (CI has none; run on a GPU worker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def with_mlx(monkeypatch):
    """mlx visible to ft-assets (the suite hides it: FT_MLX=0 above)."""
    monkeypatch.setenv("FT_MLX", "1")


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Tiny models on 2 shared cores: intra-op threads spin against each other, 1 thread is ~10x faster."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """tiny.py's trainable Llama, with a tokenizer that knows the training tests' chat examples."""
    from ft_assets_tests.support import SYSTEM, chat_examples
    from ft_assets_tests.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-model"), extra_text=[SYSTEM] + [u + " " + a for u, a in chat_examples(19)]
    )


@pytest.fixture(scope="module")
def shards(tiny_model, tmp_path_factory) -> Path:
    """Packed train (48 examples) and eval (12) shards of the training tests' chat examples."""
    from ft_assets_tests.support import chat_examples, write_shards

    examples = chat_examples(60)
    out = tmp_path_factory.mktemp("shards")
    write_shards(tiny_model, out, "train", examples[:48], window=16)  # 3 shards, a window each
    write_shards(tiny_model, out, "eval", examples[48:], window=16)
    return out


@pytest.fixture(scope="module")
def reference(tiny_model, shards, tmp_path_factory):
    """An uninterrupted run, to compare interrupted-and-resumed runs against."""
    from ft_assets.storage import LocalStore
    from ft_assets.training.recipe import train
    from ft_assets_tests.support import RUN, final_weights, training_config

    tmp = tmp_path_factory.mktemp("reference")
    result = train(
        training_config(max_steps=24),
        tiny_model,
        shards,
        LocalStore(tmp / "store"),
        RUN,
        tmp / "work",
        log=lambda line: None,
    )
    return final_weights(result)


@pytest.fixture(scope="module")
def pair_model(tmp_path_factory) -> Path:
    """tiny.py's trainable Llama, with a tokenizer that knows the timer preference pairs."""
    from ft_assets_tests.support import timer_pairs
    from ft_assets_tests.tiny import build_tiny_model

    texts = [" ".join((row["prompt"], row["chosen"], row["rejected"])) for row in timer_pairs(12)]
    return build_tiny_model(tmp_path_factory.mktemp("pair-model"), extra_text=[timer_pairs(1)[0]["system"], *texts])


@pytest.fixture(scope="module")
def pair_shards(pair_model, tmp_path_factory) -> Path:
    """48 training and 12 held-out timer pairs, tokenized and packed by the data plane's pair packer."""
    import json

    from transformers import AutoTokenizer

    from ft_assets.data.chat_encoding import ChatEncoder
    from ft_assets.data.decoding import parse_line
    from ft_assets.data.pair_packing import tokenize_and_pack_pairs
    from ft_assets_tests.support import PAIR_SEQ_LEN, timer_pairs

    out = tmp_path_factory.mktemp("pair-shards")
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(pair_model))
    rows = [parse_line(json.dumps(row).encode()) for row in timer_pairs(60)]
    for split, part in (("train", rows[:48]), ("eval", rows[48:])):
        stats = tokenize_and_pack_pairs(
            ((f"{split}-{i}", m) for i, m in enumerate(part)), encoder, PAIR_SEQ_LEN, out, split, window=16
        )
        assert stats.examples == len(part), stats.rejected
    return out


@pytest.fixture(scope="module")
def dpo_reference(pair_model, pair_shards, tmp_path_factory):
    """An uninterrupted DPO run, to compare interrupted-and-resumed runs against."""
    from ft_assets.storage import LocalStore
    from ft_assets.training.recipe import train
    from ft_assets.objectives import DPO
    from ft_assets_tests.support import DPO_RUN, dpo_config, final_weights

    tmp = tmp_path_factory.mktemp("dpo-reference")
    return final_weights(
        train(
            dpo_config(),
            pair_model,
            pair_shards,
            LocalStore(tmp / "store"),
            DPO_RUN,
            tmp / "work",
            log=lambda line: None,
            objective=DPO,
        )
    )


@pytest.fixture(scope="module")
def forkserver():
    """A forkserver that has imported torch, transformers and ft-assets once: each killed worker starts in a second or two."""
    from ft_assets_tests.support import PRELOAD

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A Hub cache with ``acme/qa``: ``main`` (train 30 rows in two files, test 5) and tag ``v1.0`` (train 10)."""
    import huggingface_hub.constants

    from ft_assets_tests.support import MAIN, V1, add_hub_revision, qa_rows

    cache = tmp_path / "hf-cache"
    add_hub_revision(cache, "acme/qa", MAIN, {
        "data/train-00000-of-00002.parquet": qa_rows(20),
        "data/train-00001-of-00002.parquet": qa_rows(10, "r"),
        "data/test-00000-of-00001.parquet": qa_rows(5, "t"),
        "README.md": b"# acme/qa\n",
    }, refs=("main",))  # fmt: skip
    add_hub_revision(cache, "acme/qa", V1, {"data/train-00000-of-00001.parquet": qa_rows(10)}, refs=("v1.0",))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(scope="module")
def grpo_model(tmp_path_factory) -> Path:
    """A tiny Llama that answers timer requests with a tool call or in prose (``support.prose_or_call_model``)."""
    from ft_assets_tests.support import prose_or_call_model

    return prose_or_call_model(tmp_path_factory.mktemp("grpo-model"))


@pytest.fixture(scope="module")
def prompt_shards(grpo_model, tmp_path_factory) -> Path:
    """48 training and 16 held-out timer prompts with their reference calls, tokenized by the data plane."""
    from ft_assets_tests.support import timer_prompts, write_prompt_shards

    return write_prompt_shards(
        grpo_model,
        tmp_path_factory.mktemp("prompt-shards"),
        {"train": timer_prompts(48), "eval": timer_prompts(16, 48)},
    )


@pytest.fixture(scope="module")
def grpo_reference(grpo_model, prompt_shards, tmp_path_factory):
    """An uninterrupted GRPO run, to compare interrupted-and-resumed runs against."""
    from ft_assets.objectives import GRPO
    from ft_assets.storage import LocalStore
    from ft_assets.training.recipe import train
    from ft_assets_tests.support import GRPO_RUN, final_weights, grpo_config

    tmp = tmp_path_factory.mktemp("grpo-reference")
    return final_weights(
        train(
            grpo_config(),
            grpo_model,
            prompt_shards,
            LocalStore(tmp / "store"),
            GRPO_RUN,
            tmp / "work",
            log=lambda line: None,
            objective=GRPO,
        )
    )


@pytest.fixture(scope="session")
def published_run(tmp_path_factory, tiny_model_dir):
    """All four planes on the tiny model, published once for the session, signed and tracked (``published.py``):
    test_pipeline.py and test_signed_delivery.py read it; a test that changes files works on ``published_run.copy()``."""
    from ft_assets_tests.published import publish

    return publish(tmp_path_factory.mktemp("published"), tiny_model_dir)
