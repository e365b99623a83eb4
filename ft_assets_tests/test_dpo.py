"""DPO on a tiny Llama: the loss against its formula and TRL's, packed pair log-probabilities, the reference
as the base with the adapter disabled, learning, the same recovery guarantees as supervised runs (an exact resume
from the checkpoint a SIGTERM made, and from an earlier one, as after a kill -9), and a preference version through
all four planes into MLflow."""

from __future__ import annotations

import json
import math
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import yaml

from ft_assets.manifests import read_manifest
from ft_assets.objectives import DPO
from ft_assets.refs import read_ref
from ft_assets.shards import IGNORE_INDEX, load_pair_rows
from ft_assets.storage import LocalStore
from ft_assets.training.config import validated
from ft_assets.training.loss import PairLogps, dpo_losses, pair_logps
from ft_assets.training.recipe import train
from ft_assets_tests.support import (
    DPO_RUN as RUN,
    GENERAL_OFF,
    PAIR_SEQ_LEN as SEQ_LEN,
    dpo_config,
    run_cli,
    preempt_then_resume,
    the_run,
    timer_pairs,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# --- the loss --------------------------------------------------------------------------------------

# policy chosen/rejected, reference chosen/rejected log-probabilities, tokens chosen/rejected, beta -> loss.
# h = beta * ((-2 + 3) - (-5 + 4)) = 0.5 * 2 = 1; IPO: d = 1 / 2 - (-1) / 4 = 0.75, target 1 / (2 * 0.5) = 1.
DPO_CASES = [
    ("sigmoid", math.log(1 + math.exp(-1.0))),
    ("hinge", 0.0),
    ("ipo", (0.75 - 1.0) ** 2),
]


@pytest.mark.parametrize("loss_type,expected", DPO_CASES, ids=[c[0] for c in DPO_CASES])
def test_dpo_loss_equals_its_formula(loss_type, expected):
    def logps(chosen, rejected):
        return PairLogps(torch.tensor([chosen]), torch.tensor([rejected]), torch.tensor([2.0]), torch.tensor([4.0]))

    loss = dpo_losses(logps(-2.0, -5.0), logps(-3.0, -4.0), beta=0.5, loss_type=loss_type)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def trl_dpo_loss(
    loss_type: str, beta: float, per_token_logps: torch.Tensor, completion_mask: torch.Tensor, ref: torch.Tensor
) -> float:
    """TRL 1.16's own DPOTrainer._compute_loss on given per-token log-probabilities (chosen rows first, then rejected)
    and precomputed reference log-probabilities: a stand-in trainer carries the attributes the method reads."""
    from trl.trainer.dpo_trainer import DPOTrainer

    class Accelerator:
        device = torch.device("cpu")

        def gather_for_metrics(self, tensor):
            return tensor

        gather = gather_for_metrics

    def model(**kwargs):
        zeros = torch.zeros_like(per_token_logps)
        return types.SimpleNamespace(log_probs=per_token_logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    pairs = ref.shape[0] // 2
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=Accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        use_weighting=False, label_smoothing=0.0, _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    inputs = {"input_ids": torch.zeros_like(completion_mask), "attention_mask": torch.ones_like(completion_mask),
              "completion_mask": completion_mask, "ref_chosen_logps": ref[:pairs], "ref_rejected_logps": ref[pairs:]}  # fmt: skip
    return float(DPOTrainer._compute_loss(trainer, model, inputs, False))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dpo_loss_equals_trls_on_random_inputs(loss_type, seed):
    generator = torch.Generator().manual_seed(seed)
    pairs, width = 8, 24
    completion = torch.zeros(2 * pairs, width, dtype=torch.long)
    for row, length in enumerate(torch.randint(1, width - 2, (2 * pairs,), generator=generator).tolist()):
        completion[row, width - length :] = 1  # prompt, then the reply: TRL's layout
    per_token = -torch.rand(2 * pairs, width - 1, generator=generator) * 4 * completion[:, 1:]
    ref = -torch.rand(2 * pairs, generator=generator) * 40
    beta = [0.05, 0.1, 0.5][seed]
    sums, tokens = per_token.sum(dim=1), completion.sum(dim=1).float()
    ours = dpo_losses(
        PairLogps(sums[:pairs], sums[pairs:], tokens[:pairs], tokens[pairs:]),
        PairLogps(ref[:pairs], ref[pairs:], tokens[:pairs], tokens[pairs:]), beta, loss_type,
    ).mean()  # fmt: skip
    assert ours.item() == pytest.approx(trl_dpo_loss(loss_type, beta, per_token, completion, ref), rel=1e-6)


BAD_SETTINGS = [  # settings, the one line that refuses them
    ({"dpo": {"beta": 0}}, "dpo.beta: Input should be greater than 0 (got 0)"),
    ({"dpo": {"loss": "kto"}}, "dpo.loss: Input should be 'sigmoid', 'ipo' or 'hinge' (got 'kto')"),
    ({"dpo": {"betta": 0.2}}, "dpo.betta: Extra inputs are not permitted (got 0.2)"),
    ({"dpo_beta": 0.2}, "dpo_beta is now dpo.beta: each objective's settings sit under its name"),
    ({"rewards": ["m:f"], "grpo_loss": "dapo"}, "rewards is now grpo.rewards, grpo_loss is now grpo.loss"),
    ({"report_to": ["mlflow"]}, "report_to: for MLflow set mlflow_tracking_uri"),
]


@pytest.mark.parametrize("settings,message", BAD_SETTINGS, ids=[m.split(":")[0] for _, m in BAD_SETTINGS])
def test_dpo_and_tracking_settings_are_validated_in_one_line(settings, message):
    with pytest.raises(ValueError) as refused:
        validated(settings)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


# --- log-probabilities of packed pairs -------------------------------------------------------------


def test_packed_pair_logps_equal_each_sequence_scored_alone(pair_model, pair_shards):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pair_model, attn_implementation="sdpa").eval()
    rows = load_pair_rows(pair_shards, "eval", SEQ_LEN)
    batch = rows.batch(torch.arange(len(rows)).numpy(), torch.device("cpu"))
    with torch.no_grad():
        packed = pair_logps(model, batch)
        for row in range(len(rows)):
            for slot in range(int(rows.pair_mask[row].sum())):
                for side, scores, tokens in (
                    (0, packed.chosen, packed.chosen_tokens),
                    (1, packed.rejected, packed.rejected_tokens),
                ):
                    where = batch["segment_ids"][row] == 2 * slot + side
                    ids, labels = batch["input_ids"][row][where], batch["labels"][row][where]
                    logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
                    learned = labels[1:] != IGNORE_INDEX
                    alone = torch.log_softmax(logits, dim=-1)[learned, labels[1:][learned]].sum()
                    assert scores[row, slot].item() == pytest.approx(alone.item(), abs=1e-4)
                    assert tokens[row, slot].item() == learned.sum().item() > 0
        empty = ~rows.pair_mask
        assert (packed.chosen[empty] == 0).all() and (packed.rejected_tokens[empty] == 0).all()


# --- training --------------------------------------------------------------------------------------


def test_full_fine_tuning_is_refused_for_dpo(pair_model, pair_shards, tmp_path):
    with pytest.raises(ValueError, match="DPO trains a LoRA or QLoRA adapter: its reference policy is the base model"):
        train(
            dpo_config(method="full"),
            pair_model,
            pair_shards,
            LocalStore(tmp_path / "store"),
            RUN,
            tmp_path / "work",
            log=lambda line: None,
            objective=DPO,
        )


@pytest.mark.integration
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_dpo_learns_the_preferences_with_one_copy_of_the_model(pair_model, pair_shards, tmp_path, monkeypatch, method):
    from transformers import AutoModelForCausalLM

    loads = []
    original = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(
        AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: loads.append(args) or original(*args, **kwargs)
    )
    metrics, lines = [], []
    result = train(dpo_config(method=method, max_steps=24, eval_steps=12), pair_model, pair_shards, LocalStore(tmp_path / "store"), RUN,
                   tmp_path / "work", log=lines.append, on_metrics=metrics.append, objective=DPO)  # fmt: skip
    assert len(loads) == 1  # the reference is the same model with its adapter disabled, not a second copy
    assert result.objective == "dpo" and result.method == method and result.steps == 24
    first, last = result.loss_history[0][1], result.loss_history[-1][1]
    assert first == pytest.approx(math.log(2), abs=1e-5)  # the adapter starts at zero: policy = reference
    assert last < 0.5 * first, result.loss_history
    evaluation = result.eval_metrics
    assert evaluation["eval_reference_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert evaluation["eval_loss"] == result.eval_loss < evaluation["eval_reference_loss"]
    assert evaluation["eval_reward_accuracy"] > evaluation["eval_reference_reward_accuracy"], evaluation
    assert evaluation["eval_reward_margin"] > evaluation["eval_reference_reward_margin"]
    assert [m["step"] for m in metrics if "eval_reward_accuracy" in m] == [12, 24]
    assert all(m["grad_norm"] > 0 for m in metrics if "loss" in m)
    assert any("(48 pairs; beta 0.1, sigmoid loss)" in line and f"dpo ({method})" in line for line in lines), lines[:4]


@pytest.mark.integration
def test_the_reference_is_the_base_model_with_the_adapter_disabled(pair_model, pair_shards, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = train(
        dpo_config(max_steps=8),
        pair_model,
        pair_shards,
        LocalStore(tmp_path / "store"),
        RUN,
        tmp_path / "work",
        log=lambda line: None,
        objective=DPO,
    )
    rows = load_pair_rows(pair_shards, "eval", SEQ_LEN)
    batch = rows.batch(torch.arange(len(rows)).numpy(), torch.device("cpu"))
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pair_model), result.output_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(pair_model).eval()
    with torch.no_grad():
        policy = pair_logps(tuned, batch)
        with tuned.disable_adapter():
            reference = pair_logps(tuned, batch)
        expected = pair_logps(base, batch)
    assert torch.equal(reference.chosen, expected.chosen) and torch.equal(reference.rejected, expected.rejected)
    assert not torch.allclose(policy.chosen, expected.chosen)


@pytest.mark.integration
def test_dpo_preempted_or_killed_resumes_to_the_uninterrupted_adapter(pair_model, pair_shards, tmp_path, dpo_reference):
    """Resumed from the checkpoint SIGTERM made, and from the one before it (steps replayed): the same adapter."""
    preempt_then_resume(dpo_config(), pair_model, pair_shards, RUN, tmp_path, DPO, dpo_reference)


# --- all four planes ---------------------------------------------------------------------------------


def pipeline_config(tiny_model_dir, steps: int, lr: float, tracking_uri: str, experiment: str) -> dict:
    return {
        "ops": {
            "base_model": {"config": {"source": str(tiny_model_dir)}},
            "tokenized_shards": {"config": {"seq_len": 512}},
            "train_eval_split": {"config": {"eval_fraction": 0.2}},
            "lora_adapter": {"config": {"max_steps": steps, "save_steps": 10, "per_device_batch_size": 4, "learning_rate": lr,
                                        "warmup_steps": 0, "lora_r": 8, "lora_alpha": 16, "logging_steps": 5,
                                        "mlflow_tracking_uri": tracking_uri, "mlflow_experiment": experiment,
                                        "dpo": {"beta": 0.2}}},
            "gguf_model": {"config": {"qtypes": ["f16"]}},
            "eval_report": {"config": {"min_improvement": 0.1}},
            **GENERAL_OFF,
        }
    }  # fmt: skip


@pytest.mark.integration
def test_a_preference_version_flows_to_a_published_model_tracked_in_mlflow(home, capsys, tiny_model_dir, mlflow_server):
    experiment = "timers-v1"
    config = home / "run_config.yaml"
    config.write_text(yaml.safe_dump(pipeline_config(tiny_model_dir, 40, 5e-3, mlflow_server.uri, experiment)))
    data = write_jsonl(home / "prefs.jsonl", timer_pairs(150))
    code, summary, err = run_cli(
        capsys,
        "run",
        "--in-process",
        "--dataset",
        str(data),
        "--name",
        "timers",
        "--version",
        "v1",
        "--config",
        str(config),
        "--json",
    )
    assert code == 0, err
    assert summary["rows_in"] == summary["rows_kept"] == 150 and summary["accounting_invariant_holds"]
    assert summary["training_method"] == "lora" and summary["steps"] == 40
    assert summary["metric_name"] == "reward_accuracy" and summary["finetuned_metric"] == summary["reward_accuracy"]
    assert summary["reward_accuracy"] == 1.0 >= summary["base_reward_accuracy"] + 0.1, summary
    assert summary["reward_margin"] > summary["base_reward_margin"]
    assert (
        summary["finetuned_eval_loss"] < summary["base_eval_loss"] == pytest.approx(math.log(2))
    )  # DPO loss against the base
    assert summary["gguf_metric"] >= summary["reward_accuracy"] - 0.05 and summary["gguf_file"].endswith(
        ".gguf"
    )  # llama.cpp agrees
    assert summary["published_uri"].endswith(f"registry/timers/v1/{summary['run_id']}")

    store = LocalStore(home / "home" / "store")
    registry = Path(summary["published_uri"]).relative_to(store.root).as_posix()
    lineage = json.loads(store.get_bytes(f"{registry}/lineage.json"))
    assert lineage["eval"]["metric_name"] == "reward_accuracy" and lineage["training"]["config"]["dpo"]["beta"] == 0.2
    for artifact in lineage["artifacts"]:
        assert read_manifest(store, artifact["key"]).digest == artifact["digest"], artifact["asset"]

    client = mlflow_server.client()
    run = the_run(client, experiment)
    assert run.info.run_name == summary["run_id"] and run.data.tags["ft.dataset_version"] == "timers@v1"
    # the nested setting reached the step (MLflow's params), and the scorer (eval_report's DPO loss used it)
    assert (run.data.params["dpo.beta"], run.data.params["dpo.loss"]) == ("0.2", "sigmoid")
    assert read_ref(store, "timers@v1", "eval_report")["stats"]["dpo_beta"] == 0.2
    digests = {artifact["asset"]: artifact["digest"] for artifact in lineage["artifacts"]}
    for asset in (
        "raw_dataset",
        "cleaned_dataset",
        "deduplicated_dataset",
        "train_eval_split",
        "tokenized_shards",
        "base_model",
        "lora_adapter",
    ):
        assert run.data.tags[f"ft.digest.{asset}"] == digests[asset], asset
    assert run.data.metrics["reward_accuracy"] == pytest.approx(summary["reward_accuracy"])
    assert run.data.metrics["base_reward_accuracy"] == pytest.approx(summary["base_reward_accuracy"])
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 8 and losses[-1] < 0.5 * losses[0]
