"""training_plan plans the run lora_adapter trains: one reader of the settings, one request to the planner, and the
checks that tie a run to the plan made for it. Function level, table-driven; test_production.py starts the training
plane once as the launchpad does and checks the same on a real instance.

- ``run_training_config`` reads lora_adapter's settings from a run config (defaults where absent): training_plan,
  the pool launcher's GPU request and ``ft-assets run``'s plan before training all go through it.
- ``plan_run`` (training_plan's and the CLI's) plans the settings it is given: LoRA rank and targets, GPUs.
- lora_adapter refuses a plan made for other settings; training_cost refuses a plan other than its run's.
"""

from __future__ import annotations

import dagster as dg
import pytest

from ft_assets.cli.output import CliError
from ft_assets.cli.summaries import plan_before_training
from ft_assets.control.assets import PlanConfig, plan_of_the_run, plan_run, planned_for
from ft_assets.control.cost_model import load_cost_model
from ft_assets.control.launcher import gpu_request_tags, gpus_per_node
from ft_assets.targets import TARGETS, Target, TargetKind, worker_has_cuda
from ft_assets.targets.ssh import first_card
from ft_assets.refs import RefOutdated, write_ref
from ft_assets.storage import LocalStore
from ft_assets.training.assets import plan_mismatch
from ft_assets.training.config import TrainingConfig
from ft_assets.training.settings import run_training_config
from ft_assets_tests.reference_models import REFERENCE_CONFIGS

KEY = "acks@v1"


def training(**settings) -> dict:
    return {"ops": {"lora_adapter": {"config": settings}}}


READS = [  # (run config, lora_r, num_processes, target_modules)
    ({}, 16, 1, []),  # a run without lora_adapter (training_plan alone): the defaults
    ({"ops": {"training_plan": {"config": {"purpose": "validation"}}}}, 16, 1, []),
    ({"ops": {"lora_adapter": {}}}, 16, 1, []),
    (training(lora_r=64, num_processes=2), 64, 2, []),
    (training(target_modules=["q_proj", "v_proj"]), 16, 1, ["q_proj", "v_proj"]),
]


@pytest.mark.parametrize("run_config, lora_r, processes, targets", READS)
def test_the_run_configs_training_settings_are_lora_adapters_with_defaults(run_config, lora_r, processes, targets):
    settings = run_training_config(run_config)
    assert (settings.lora_r, settings.num_processes, settings.target_modules) == (lora_r, processes, targets)
    assert gpus_per_node(run_config) == processes  # the pool's GPU request reads them the same way


MISTAKES = [
    (training(lora_r=0), "ops.lora_adapter.config: invalid training config: lora_r must be >= 1 (got 0)"),
    (training(lora_rr=3), "ops.lora_adapter.config: lora_rr: Extra inputs are not permitted (got 3)"),
    (
        training(method="dora"),
        "ops.lora_adapter.config: method: Input should be 'qlora', 'lora' or 'full' (got 'dora')",
    ),
]


@pytest.mark.parametrize("run_config, said", MISTAKES)
def test_a_setting_trainingconfig_refuses_is_one_line_naming_it(run_config, said):
    with pytest.raises(ValueError) as caught:
        run_training_config(run_config)
    assert str(caught.value) == said
    with pytest.raises(ValueError, match="ops.lora_adapter.config: "):
        gpus_per_node(run_config)


@pytest.mark.parametrize(
    "launcher, gpus, tags, asked",
    [
        ("K8sRunLauncher", 2, {}, '"nvidia.com/gpu": "2"'),
        ("EcsRunLauncher", 4, {}, '"value": "4"'),
        ("K8sRunLauncher", 1, {}, None),  # one GPU: what the pool's launcher asks for anyway
        ("K8sRunLauncher", 2, {"dagster-k8s/config": "{}"}, None),  # an override already on the run wins
        ("DefaultRunLauncher", 2, {}, None),  # a launcher without a GPU override
    ],
)
def test_the_gpu_request_is_the_inner_launchers_own_override(launcher, gpus, tags, asked):
    request = gpu_request_tags(launcher, gpus, tags)
    assert (asked in next(iter(request.values()))) if asked else request == {}


def refs(model: str = "Llama-2-7B", objective: str = "sft") -> tuple[dict, dict]:
    """The references training_plan reads (what the planner needs of them: the shards' figures, the model's config)."""
    shards = {
        "asset": "tokenized_shards", "partition": KEY, "uri": "mem://shards", "digest": "d" * 64,
        "stats": {"objective": objective, "seq_len": 512, "train_rows": 4000, "eval_rows": 40, "train_packed_rows": 1000,
                  "tokens": 2_000_000, "train_tokens": 1_900_000, "packing_efficiency": 0.95, "accounting": {}},
    }  # fmt: skip
    base = {
        "asset": "base_model", "partition": KEY, "uri": "mem://base", "digest": "b" * 64,
        "model_config": REFERENCE_CONFIGS[model], "stats": {"model_id": model, "source": model, "source_sha256": "0" * 64},
    }  # fmt: skip
    return shards, base


PLANS = [  # (lora_adapter's settings, GPUs planned, adapter GiB vs the defaults', parallelism)
    ({}, 1, 1.0, "ddp"),
    ({"lora_r": 64}, 1, 4.0, "ddp"),
    ({"target_modules": ["q_proj", "v_proj"]}, 1, 2 * 8192 / 78_080, "ddp"),  # 2 of the 7 projections' in + out
    ({"num_processes": 2}, 2, 1.0, "ddp"),
    ({"num_processes": 4, "num_nodes": 2, "parallelism": "fsdp"}, 8, 1 / 8, "fsdp"),
]


@pytest.mark.parametrize("settings, gpus, adapter, parallelism", PLANS)
def test_the_plan_is_made_for_the_settings_it_is_given(settings, gpus, adapter, parallelism):
    shards, base = refs()
    default = plan_run(TrainingConfig(), PlanConfig(), shards, base, cuda=False)
    run = plan_run(run_training_config(training(**settings)), PlanConfig(), shards, base, cuda=False)
    assert (run.plan.gpus, run.plan.vram.gpus, run.plan.parallelism) == (gpus, gpus, parallelism)
    assert run.plan.vram.adapter_gib == pytest.approx(adapter * default.plan.vram.adapter_gib)
    stats = run.stats("lora_adapter of run r1")
    assert stats["training_config"] == TrainingConfig(**settings).model_dump() and stats["gpus"] == gpus
    assert stats["planned_for"] == "lora_adapter of run r1" and stats["resolved"]["method"] == "lora"  # no CUDA here


TARGET_PLANS = [  # (the run's GPU target, tier planned, rental mode, $/h: the cost model's price of that mode)
    ("ssh://me@gpu-box?gpu=h100-80gb", "h100-80gb", "on_demand", 3.50),
    ("slurm://login/a100?gpu=a100-80gb", "a100-80gb", "slurm", 1.00),
]


@pytest.mark.parametrize("target, tier, mode, usd_per_hour", TARGET_PLANS)
def test_the_plan_is_made_for_the_card_the_target_names_at_its_price(target, tier, mode, usd_per_hour):
    shards, base = refs()
    plan = plan_run(TrainingConfig(), PlanConfig(), shards, base, cuda=False, target=target).plan
    cheapest = plan_run(TrainingConfig(), PlanConfig(), shards, base, cuda=False).plan
    assert (plan.tier, plan.mode) == (tier or cheapest.tier, mode) and (tier is None or tier != cheapest.tier)
    if usd_per_hour is not None:
        assert plan.usd_per_hour == pytest.approx(usd_per_hour)


def test_a_target_card_the_cost_model_lacks_is_refused_in_one_line():
    shards, base = refs()
    with pytest.raises(ValueError, match=r"GPU target slurm://login/a100\?gpu=slurm-a100-80gb: no GPU offering named"):
        plan_run(
            TrainingConfig(), PlanConfig(), shards, base, cuda=False, target="slurm://login/a100?gpu=slurm-a100-80gb"
        )


@pytest.mark.parametrize(
    "selected, said",
    [
        ({"training_plan", "lora_adapter"}, "lora_adapter of run r1"),  # the training_plane job
        ({"training_plan"}, "lora_adapter's defaults: a preview (lora_adapter is not in run r1)"),
    ],
)
def test_the_plan_says_whose_settings_it_planned(selected, said):
    assert planned_for({dg.AssetKey(name) for name in selected}, "r1").startswith(said)


def plan_ref(settings: dict, method: str = "lora", digest: str = "p" * 64) -> dict:
    shards, base = refs()
    run = plan_run(TrainingConfig(**settings), PlanConfig(), shards, base, cuda=method == "qlora")
    return {"asset": "training_plan", "partition": KEY, "uri": "mem://plan", "digest": digest,
            "stats": run.stats("lora_adapter of run r1")}  # fmt: skip


MISMATCHES = [  # (planned for, lora_adapter's settings, its method, what lora_adapter says)
    ({"lora_r": 64}, {"lora_r": 64}, "lora", None),
    ({}, {"lora_r": 64}, "lora", "made for other settings (lora_r 16 vs 64; planned vs this run's)"),
    ({}, {"num_processes": 2, "target_modules": ["q_proj"]}, "lora",
     "(target_modules [] vs ['q_proj'], num_processes 1 vs 2; planned vs this run's)"),
    ({}, {}, "qlora", "(method 'lora' vs 'qlora'; planned vs this run's)"),  # planned without CUDA, trains with it
]  # fmt: skip


@pytest.mark.parametrize("planned, settings, method, said", MISMATCHES)
def test_lora_adapter_refuses_a_plan_made_for_other_settings(planned, settings, method, said):
    reason = plan_mismatch(plan_ref(planned), TrainingConfig(**settings), method)
    assert reason == said if said is None else said in reason and "the training_plane job" in reason


def test_lora_adapter_refuses_a_plan_of_an_older_ft_assets():
    old = plan_ref({})
    del old["stats"]["training_config"]
    with pytest.raises(RefOutdated, match="has no training_config in its stats"):
        plan_mismatch(old, TrainingConfig(), "lora")


@pytest.mark.parametrize(
    "trained_with, said",
    [
        ("p" * 64, None),
        ("q" * 64, "is not the plan lora_adapter run r1 trained with (mem://plan, digest qqqqqqqqqqqq)"),
        (None, "records no training plan (written by an older ft-assets)"),
    ],
)
def test_training_cost_prices_against_the_plan_of_the_run_only(trained_with, said):
    upstream = {"training_plan": {"asset": "training_plan", "uri": "mem://plan", "digest": trained_with}}
    adapter = {"partition": KEY, "stats": {"run_id": "r1"}, "upstream": upstream if trained_with else {}}
    reason = plan_of_the_run(adapter, plan_ref({}))
    assert reason == said if said is None else said in reason


@pytest.mark.parametrize(
    "run_config, model, said",
    [
        (training(lora_r=64, num_processes=2), "Llama-2-7B", None),
        (training(method="full"), "Llama-2-70B", "training_plan for acks@v1: no GPU offering fits full of Llama-2-70B"),
        (
            training(lora_r=0),
            "Llama-2-7B",
            "training_plan for acks@v1: ops.lora_adapter.config: invalid training config",
        ),
    ],
)
def test_ft_assets_run_plans_before_it_submits_training_and_refuses_what_fits_no_gpu(tmp_path, run_config, model, said):
    store = LocalStore(tmp_path / "store")
    shards, base = refs(model)
    write_ref(store, KEY, "tokenized_shards", shards)
    write_ref(store, KEY, "base_model", base)
    if said:
        with pytest.raises(CliError, match=f"^{said}"):
            plan_before_training(store, KEY, run_config)
        return
    summary = plan_before_training(store, KEY, run_config)
    expected = plan_run(run_training_config(run_config), PlanConfig(), shards, base, cuda=False).plan
    assert summary["gpus"] == 2 and summary["estimated_vram_gib"] == round(expected.vram.total_gib, 2)
    assert summary["gpu_tier"] == expected.tier and summary["estimated_cost_usd"] == round(expected.est_cost_usd, 4)


@pytest.mark.parametrize(
    "target", ["ssh://me@gpu-box?gpu=a100-80gb", "skypilot:runpod", "slurm://login/a100?gpu=a100-80gb"]
)
def test_a_run_on_a_gpu_target_is_planned_for_the_workers_cuda_from_a_control_host_without_one(target):
    """The laptop has no CUDA, the rented worker has: an unset ``method`` is qlora there, so it is planned (and
    pinned in the worker's job) as qlora, not as the lora this machine would resolve."""
    shards, base = refs()
    cuda = worker_has_cuda(target, here=False)
    run = plan_run(TrainingConfig(), PlanConfig(), shards, base, cuda=cuda, target=target)
    assert cuda and run.resolved.method == "qlora" and run.plan.method == "qlora"
    assert not worker_has_cuda("local", here=False) and not worker_has_cuda(None, here=False)
    assert run.stats("r1")["accelerator"] == load_cost_model(None).offering(run.plan.tier).accelerator != ""


class CardHost(Target):
    """A GPU target that says which card it has, as an ssh host's ``nvidia-smi`` does (``SshTarget.card``); the plan
    asks it nothing else (it starts no worker)."""

    scheme = "cardhost"

    def __init__(self, answer: str):
        self.answer = answer

    def card(self):
        return first_card(self.answer)

    def describe(self) -> str:
        return f"cardhost:{self.answer}"

    def launch(self, launch):
        raise AssertionError("planning starts no worker")

    poll = cancel = launch


def card_host(text: str) -> CardHost:
    return CardHost(text.split(":", 1)[1].replace(";", "\n"))


CARD_HOST = TargetKind("cardhost", f"{__name__}:card_host", "cardhost:<nvidia-smi lines>", "a host of a given card")


@pytest.mark.parametrize(
    "answer, tier",
    [
        ("NVIDIA A100-SXM4-80GB, 81920;NVIDIA A100-SXM4-80GB, 81920", "a100-80gb"),  # nvidia-smi's CSV, 2 cards
        ("NVIDIA A100-PCIE-40GB, 40960", "a100-40gb"),
        ("NVIDIA GeForce RTX 4090, 24564", "rtx4090-24gb"),
        ("NVIDIA H100 80GB HBM3, 81559", "h100-80gb"),
        ("", None),  # no nvidia-smi (a CPU host): the cheapest offering, as with no target
    ],
)
def test_a_host_without_gpu_setting_is_planned_for_the_card_its_nvidia_smi_names(answer, tier, monkeypatch):
    monkeypatch.setitem(TARGETS, "cardhost", CARD_HOST)
    shards, base = refs()
    settings = TrainingConfig(gradient_checkpointing=True)  # a 7B model that fits a 24 GB card too
    plan = plan_run(settings, PlanConfig(), shards, base, cuda=True, target=f"cardhost:{answer}").plan
    cheapest = plan_run(settings, PlanConfig(), shards, base, cuda=True).plan
    assert (plan.tier, plan.mode) == ((tier, "on_demand") if tier else (cheapest.tier, cheapest.mode))


def test_a_host_that_cannot_say_its_card_is_refused_in_one_line_that_says_how_to_plan_without_it():
    shards, base = refs()
    with pytest.raises(ValueError, match=r"ssh://me@gpu-box.invalid: ssh failed: .* name it with gpu=<offering>") as e:
        plan_run(TrainingConfig(), PlanConfig(), shards, base, cuda=True, target="ssh://me@gpu-box.invalid")
    assert "\n" not in str(e.value)


def test_a_host_card_the_cost_model_lacks_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(TARGETS, "cardhost", CARD_HOST)
    shards, base = refs()
    with pytest.raises(ValueError, match=r"the host's card NVIDIA RTX A6000 \(48 GiB\) is no GPU offering .* gpu="):
        plan_run(TrainingConfig(), PlanConfig(), shards, base, cuda=True, target="cardhost:NVIDIA RTX A6000, 49140")
