"""GRPO on tiny models: the loss and the advantages against TRL's, the built-in rewards, packed completion
log-probabilities in every family, seeded rollouts, the reference as the base with the adapter disabled,
learning, an exact resume (after SIGTERM, and from an earlier checkpoint as after a kill -9), and a prompt
version through all four planes into MLflow."""

from __future__ import annotations

import json
import math
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import yaml

from ft_assets import rewards as rw
from ft_assets.objectives import DPO, GRPO, SFT
from ft_assets.refs import read_ref
from ft_assets.shards import IGNORE_INDEX, Prompt, load_prompt_rows
from ft_assets.storage import LocalStore
from ft_assets.training.config import TrainingConfig, validated
from ft_assets.training.loss import group_advantages, grpo_loss_sum, token_logps
from ft_assets.training.recipe import train
from ft_assets.training.grpo import (
    RolloutFigures,
    Sampling,
    TransformersGenerator,
    pack_sequences,
    rollout,
    rollout_seed,
)
from ft_assets_tests.support import (
    GENERAL_OFF,
    GRPO_RUN as RUN,
    TOOL_REWARDS,
    final_weights,
    grpo_config,
    run_cli,
    preempt_then_resume,
    the_run,
    timer_call,
    timer_prompts,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# --- the loss and the advantages against TRL ---------------------------------------------------------


def trl_grpo_loss(
    loss_type: str,
    beta: float,
    logps: torch.Tensor,
    reference: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
):
    """TRL 1.16's own GRPOTrainer._compute_loss on given per-token log-probabilities of the completions: a stand-in
    trainer carries the attributes the method reads (on-policy: no old log-probabilities, one iteration)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    class Accelerator:
        num_processes = 1

        def gather(self, tensor):
            return tensor

        gather_for_metrics = gather

        def reduce(self, tensor, reduction="sum"):
            return tensor

    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return logps, torch.zeros_like(logps), None

    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token_logps_and_entropies, aux_loss_enabled=False, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=0.2,
        epsilon_high=0.2, use_vllm=False, vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=Accelerator(), max_completion_length=mask.shape[1],
        _entropy_bonus_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
    )  # fmt: skip
    inputs = {
        "prompt_ids": torch.zeros(mask.shape[0], 3, dtype=torch.long), "prompt_mask": torch.ones(mask.shape[0], 3, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask, "advantages": advantages,
        "ref_per_token_logps": reference, "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    return GRPOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_loss_and_gradient_equal_trls_on_random_inputs(loss_type, beta, seed):
    generator = torch.Generator().manual_seed(seed)
    completions, width = 8, 12
    lengths = torch.randint(1, width + 1, (completions,), generator=generator)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()  # TRL's layout: each completion, then padding
    values = -torch.rand(completions, width, generator=generator) * 3
    reference = values + torch.randn(completions, width, generator=generator) * 0.3
    advantages = torch.randn(completions, generator=generator)

    theirs_logps = values.clone().requires_grad_()
    theirs = trl_grpo_loss(loss_type, beta, theirs_logps, reference, advantages, mask)
    theirs.backward()

    ours_logps = values.clone().requires_grad_()
    weights = mask.float() if loss_type == "dapo" else mask.float() / lengths[:, None]
    items = mask.sum() if loss_type == "dapo" else completions  # what the recipe divides the step's summed loss by
    ours = grpo_loss_sum(ours_logps, reference, advantages[:, None].expand(-1, width), weights, beta) / items
    ours.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(ours_logps.grad, theirs_logps.grad, rtol=1e-5, atol=1e-8)
    assert ours_logps.grad.abs().sum() > 0


ADVANTAGE_CASES = [
    ("spread", [0.0, 1.0, 2.0, 3.0, 1.0, 1.0, 1.0, 5.0]),
    ("a group all alike", [2.0, 2.0, 2.0, 2.0, 0.0, 3.0, 0.0, 3.0]),
    ("rewards that did not apply", [1.0, float("nan"), 0.0, 2.0, float("nan")] + [float("nan")] * 3),
]


@pytest.mark.parametrize("name,rewards", ADVANTAGE_CASES, ids=[c[0] for c in ADVANTAGE_CASES])
def test_group_advantages_equal_trls(name, rewards):
    """TRL computes them inline in _generate_and_score_completions (scale_rewards='group'), with its own nanstd."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor(rewards)
    group = 4
    mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group)
    std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group)
    expected = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)
    assert torch.allclose(group_advantages(rewards, group), expected, atol=1e-6)
    assert (group_advantages(rewards, group)[rewards.isnan()] == 0).all()


# --- reward functions --------------------------------------------------------------------------------

REF = json.dumps(timer_call(5))
REWARD_CASES = [
    ("tool_call_json", REF, REF, 1.0),
    ("tool_call_json", '{"name": "set_timer"}', REF, 0.0),
    ("tool_call_json", "Okay, a timer for 5 minutes.", REF, 0.0),
    ("tool_call_name", json.dumps(timer_call(9)), REF, 1.0),
    ("tool_call_name", json.dumps({"name": "set_alarm", "arguments": {"minutes": 5}}), REF, 0.0),
    ("tool_call_name", REF, None, None),
    ("tool_call_arguments", REF, timer_call(5), 1.0),
    ("tool_call_arguments", json.dumps(timer_call(9)), REF, 0.0),
    ("tool_call_arguments", json.dumps({"name": "set_timer", "arguments": {"minutes": 5, "label": "tea"}}), REF, 0.5),
    ("tool_call_arguments", "not a call", REF, 0.0),
    ("tool_call_format", f"  {REF}\n", REF, 1.0),
    ("tool_call_format", '{"name": "set_timer", "arguments": {"minutes": 5} and more', REF, 0.8),
    ("tool_call_format", "Okay, a timer for 5 minutes starts now.", REF, 0.2),
    ("tool_call_format", REF + " " * 10 + "x" * 200, REF, 0.6),
]


@pytest.mark.parametrize(
    "name,reply,answer,expected", REWARD_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(REWARD_CASES)]
)
def test_built_in_tool_call_rewards(name, reply, answer, expected):
    fn = getattr(rw, name)
    [value] = fn(prompts=[[{"role": "user", "content": "Set a timer for 5 minutes."}]], completions=[[{"role": "assistant", "content": reply}]],
                 answer=[answer])  # fmt: skip
    assert value == expected if expected is None else value == pytest.approx(expected)


def test_rewards_load_from_modules_and_files_and_say_what_is_wrong(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("def shorter(prompts, completions, level, **kw):\n    return [level[i] - len(c[0]['content']) for i, c in enumerate(completions)]\n"
                    "def broken(prompts, completions, **kw):\n    return [1.0]\n"
                    "def words(prompts, completions, **kw):\n    return ['many' for _ in completions]\n")  # fmt: skip
    [file_reward, built_in] = rw.load_rewards([f"{path}:shorter", "ft_assets.rewards:tool_call_json"])
    scored = rw.score([file_reward, built_in], [[]] * 2, ["{}", "hello"], [{"level": 10}, {"level": 20}])
    assert scored == [[8.0, 15.0], [0.0, 0.0]] and rw.totals(scored) == [8.0, 15.0]
    for spec, message in [
        ("tool_call_json", "is not 'module:function'"),
        ("no_such_module:fn", "cannot import 'no_such_module'"),
        (f"{tmp_path}/missing.py:fn", "no file"),
        ("ft_assets.rewards:no_such_function", "ft_assets.rewards has no function 'no_such_function'"),
    ]:
        with pytest.raises(ValueError, match=message):
            rw.load_reward(spec)
    for name, message in [("broken", "returned 1 values for 2 completions"), ("words", "returned a non-number")]:
        with pytest.raises(ValueError, match=f"reward {path}:{name} {message}"):
            rw.score([rw.load_reward(f"{path}:{name}")], [[]] * 2, ["a", "b"], [{}, {}])


def test_a_reward_function_scores_a_chat_run():
    """eval_report.metric: module:function scores each greedy answer of a chat run, the reference as the answer column."""
    from ft_assets.delivery import evaluate as ev
    from ft_assets.delivery.scoring import ChatScorer

    prompt = [{"role": "user", "content": "Set a timer for 5 minutes."}]
    examples = [
        ev.EvalExample("a:1", prompt, REF),
        ev.EvalExample("a:2", prompt, json.dumps({"name": "set_timer", "arguments": {}})),
    ]
    answers = [json.dumps({"name": "set_timer", "arguments": {"minutes": 5, "label": "tea"}}), REF]
    assert ev.answer_scores(answers, examples, "ft_assets.rewards:tool_call_arguments") == [0.5, 0.0]
    assert ev.task_metric(answers, examples, "ft_assets.rewards:tool_call_name") == 1.0
    assert ev.task_metric(answers, examples, "exact_match") == 0.0  # the named metrics as before
    scorer = ChatScorer("ft_assets.rewards:tool_call_json", 10, 24, None)
    assert scorer.metric == "reward_mean" and ChatScorer("token_f1", 10, 24, None).metric == "token_f1"
    for metric, message in [
        ("bleu", "unknown metric 'bleu'"),
        ("ft_assets.rewards:nothing", "has no function 'nothing'"),
    ]:
        with pytest.raises(ValueError, match=f"eval_report config metric='{metric}': .*{message}"):
            ChatScorer(metric, 10, 24, None)


SETTINGS_CASES = [  # the settings under grpo, and the one line that refuses them
    ({"num_generations": 1}, "grpo.num_generations: must be >= 2: a group of one has no baseline (got 1)"),
    ({"temperature": 0}, "grpo.temperature: Input should be greater than 0 (got 0)"),
    ({"beta": -1}, "grpo.beta: Input should be greater than or equal to 0 (got -1)"),
    ({"rewards": ["tool_call_json"]}, "grpo.rewards: name each as 'module:function' or 'path/to/file.py:function'"),
    ({"loss": "bnpo"}, "grpo.loss: Input should be 'dapo' or 'grpo' (got 'bnpo')"),
    ({"max_completion_length": 0}, "grpo.max_completion_length: Input should be greater than or equal to 1 (got 0)"),
]


@pytest.mark.parametrize("settings,message", SETTINGS_CASES, ids=[m.split(":")[0] for _, m in SETTINGS_CASES])
def test_grpo_settings_are_validated_in_one_line(settings, message):
    with pytest.raises(ValueError) as refused:
        validated({"grpo": settings})
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_the_grpo_settings_change_only_the_run_ids_of_grpo_runs():
    """The run id hashes the settings of the run's own objective: GRPO's change a GRPO run's id and no other's."""
    changed = TrainingConfig(grpo={"rewards": TOOL_REWARDS, "num_generations": 4})
    for objective in (SFT, DPO):
        assert changed.result_fields(False, objective) == TrainingConfig().result_fields(False, objective)
        assert "grpo" not in changed.result_fields(False, objective)
    assert changed.result_fields(False, GRPO)["grpo"]["rewards"] == TOOL_REWARDS
    assert changed.result_fields(False, GRPO) != TrainingConfig().result_fields(False, GRPO)


# --- log-probabilities, rollouts and the reference --------------------------------------------------


@pytest.mark.parametrize(
    "family,attention", [("llama3", "sdpa"), ("qwen2.5", "sdpa"), ("gemma2", "eager"), ("phi3", "sdpa")]
)
def test_packed_completion_logps_equal_each_sequence_scored_alone(family, attention, tmp_path):
    from transformers import AutoModelForCausalLM

    from ft_assets_tests.families import build_family

    model = AutoModelForCausalLM.from_pretrained(
        build_family(family, tmp_path / family), attn_implementation=attention
    ).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (n,), generator=generator) for n in (7, 11)]
    completions = [torch.randint(5, 300, (n,), generator=generator).tolist() for n in (3, 6, 1, 9)]  # 2 per prompt
    batch = pack_sequences(prompts, completions, 2, torch.tensor([0.5, -0.5, 1.0, -1.0]), "dapo")
    temperature = 0.7
    with torch.no_grad():
        packed = token_logps(model, batch, temperature)[0]
        offset = 0
        for k, completion in enumerate(completions):
            sequence = torch.cat([prompts[k // 2], torch.tensor(completion)])
            logits = model(input_ids=sequence[None], use_cache=False).logits[0, :-1].float() / temperature
            alone = torch.log_softmax(logits, dim=-1)[torch.arange(len(sequence) - 1), sequence[1:]][-len(completion) :]
            start = offset + len(prompts[k // 2]) - 1  # label i + 1 sits at position i
            assert torch.allclose(packed[start : start + len(completion)], alone, atol=1e-4), (family, k)
            offset += len(sequence)
    labels = batch["labels"][0, 1:]
    assert (packed[labels == IGNORE_INDEX] == 0).all() and int(batch["items"]) == sum(map(len, completions))


def test_rollouts_are_seeded_and_the_reference_is_the_base_with_the_adapter_disabled(grpo_model, prompt_shards):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(grpo_model)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(grpo_model),
        LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    config = grpo_config(grpo={"max_completion_length": 12})
    generator = TransformersGenerator(Sampling(12, 1.0, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    prompts = load_prompt_rows(prompt_shards, "train", 128).batch([0, 1], torch.device("cpu"))
    rewards = rw.load_rewards(TOOL_REWARDS)

    def sample(seed: int, figures: RolloutFigures | None = None) -> dict:
        return rollout(model, generator, tokenizer, rewards, prompts, config.grpo, seed, 0, figures or RolloutFigures())

    first, again, other = (
        sample(rollout_seed(7, 3, 0, 0)),
        sample(rollout_seed(7, 3, 0, 0)),
        sample(rollout_seed(7, 4, 0, 0)),
    )
    assert torch.equal(first["input_ids"], again["input_ids"]) and not torch.equal(
        first["input_ids"], other["input_ids"]
    )
    base = AutoModelForCausalLM.from_pretrained(grpo_model).eval()
    with torch.no_grad():
        assert torch.equal(
            first["reference_logps"], token_logps(base, first)
        )  # the adapter disabled is the base, exactly
        assert not torch.allclose(
            token_logps(model.eval(), first), first["reference_logps"]
        )  # and the adapter does move it
    figures = RolloutFigures()
    sample(5, figures)
    summary = figures.summary()
    assert len(figures.rewards) == 2 * config.grpo.num_generations and 0 < summary["completion_length"] <= 12
    assert summary["reward_std"] >= 0 and set(summary) == {
        "reward_mean",
        "reward_std",
        "kl",
        "completion_length",
        "truncated_share",
    }


# --- cost -------------------------------------------------------------------------------------------

LLAMA7 = dict(layers=32, hidden=4096, heads=32, kv_heads=32, vocab=32000, intermediate=11008)


def test_the_plan_counts_the_reference_forward_and_the_generation():
    """objective_cost by hand on Llama-2-7B's shape, LoRA with checkpointing: F = 2m x 3 + a x 4 and f = 2m + a, with
    m the matmul params and a = 2 x L x seq x q; GRPO's completions decode at min(MFU, 0.5 x b / 200)."""
    from ft_assets.control.planner import ModelShape, flops_per_token, objective_cost

    shape = ModelShape(**LLAMA7)
    train, forward = flops_per_token(shape, "lora", 512, True), 2 * shape.matmul_params + 2 * 32 * 512 * 4096
    assert train == 2 * shape.matmul_params * 3 + 2 * 32 * 512 * 4096 * 4
    assert objective_cost(shape, "lora", 512, True, False, 0.0, 0, 0.4) == (train, 1.0)  # SFT: what it always was
    dpo_flops, dpo_factor = objective_cost(shape, "lora", 512, True, True, 0.0, 0, 0.4)
    assert dpo_flops == train + forward and dpo_factor == pytest.approx(1 + forward / train) == pytest.approx(
        1.33, abs=0.01
    )
    grpo_flops, grpo_factor = objective_cost(
        shape, "lora", 512, True, True, 0.5, 32, 0.4
    )  # b = 4 prompts x 8 completions
    decode = 0.5 * 32 / 200  # 0.08: decoding is memory-bound, 5x below LoRA's 0.40
    assert grpo_flops == train + 2 * forward
    assert grpo_factor == pytest.approx((train + forward + 0.5 * forward + 0.5 * forward * 0.4 / decode) / train)
    assert grpo_factor == pytest.approx(2.33, abs=0.01)
    assert (
        objective_cost(shape, "lora", 512, True, True, 0.5, 512, 0.4)[1] < grpo_factor
    )  # larger decode batches, cheaper


def test_each_objective_says_what_a_run_computes():
    shards = {"seq_len": 512, "train_tokens": 4800, "train_rows": 120}  # prompts of 40 tokens
    config = grpo_config(per_device_batch_size=4, grpo={"num_generations": 8, "max_completion_length": 60})
    resolved = config.resolve(120, cuda_available=False, objective=GRPO)
    work = GRPO.step.work(config, shards, resolved)
    assert (work.seq_len, work.attention_len, work.micro_batch, work.decode_batch) == (32 * 100, 100, 1, 32)
    assert work.tokens == resolved.total_steps * 4 * 8 * 100 and work.generated_share == 0.6 and work.reference_forward
    without_kl = grpo_config(
        per_device_batch_size=4, grpo={"num_generations": 8, "max_completion_length": 60, "beta": 0.0}
    )
    assert not GRPO.step.work(without_kl, shards, resolved).reference_forward
    for objective, reference in ((SFT, False), (DPO, True)):
        sft = objective.step.work(config, shards, resolved)
        assert (sft.seq_len, sft.micro_batch, sft.tokens, sft.reference_forward, sft.generated_share) == (
            512,
            4,
            resolved.total_steps * resolved.rows_per_step * 512,
            reference,
            0.0,
        )


# --- training --------------------------------------------------------------------------------------


PLAN_REFUSALS = [
    ({"method": "full"}, "GRPO trains a LoRA or QLoRA adapter: its reference policy is the base model"),
    ({"grpo": {"rewards": []}}, "a prompt version trains with GRPO, which needs reward functions: set grpo.rewards"),
    ({"grpo": {"rewards": ["ft_assets.rewards:no_such_reward"]}}, "has no function 'no_such_reward'"),
    ({"parallelism": "fsdp"}, "GRPO trains with parallelism 'ddp'"),
]


@pytest.mark.parametrize("overrides,message", PLAN_REFUSALS, ids=["full", "no-rewards", "unknown-reward", "fsdp"])
def test_what_grpo_cannot_train_is_refused_before_training(overrides, message):
    with pytest.raises(ValueError, match=message):
        grpo_config(**overrides).resolve(48, cuda_available=False, objective=GRPO)


@pytest.mark.integration
def test_grpo_raises_the_reward_with_one_copy_of_the_model(grpo_model, prompt_shards, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    loads = []
    original = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(
        AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: loads.append(args) or original(*args, **kwargs)
    )
    metrics, lines = [], []
    cfg = grpo_config(
        max_steps=24, per_device_batch_size=4, logging_steps=4, eval_steps=12, grpo={"num_generations": 8}
    )
    result = train(cfg, grpo_model, prompt_shards, LocalStore(tmp_path / "store"), RUN, tmp_path / "work", log=lines.append,
                   on_metrics=metrics.append, objective=GRPO)  # fmt: skip
    assert len(loads) == 1  # the reference is the same model with its adapter disabled, not a second copy
    assert result.objective == "grpo" and result.steps == 24 and result.eval_loss is None
    logged = [m for m in metrics if "reward_mean" in m]
    assert [m["step"] for m in logged] == [4, 8, 12, 16, 20, 24]
    assert logged[-1]["reward_mean"] > logged[0]["reward_mean"] + 0.5, [m["reward_mean"] for m in logged]
    assert all(m["kl"] >= 0 and m["reward_std"] >= 0 and 0 < m["completion_length"] <= 24 for m in logged)
    assert [step for step, _ in result.figure_history] == [4, 8, 12, 16, 20, 24]
    evaluation = result.eval_metrics
    assert evaluation["eval_reward_mean"] > evaluation["eval_reference_reward_mean"] + 0.5, evaluation
    assert [m["step"] for m in metrics if "eval_reward_mean" in m] == [12, 24]
    assert any("(prompts; 8 completions each of up to 24 tokens" in line and "grpo (lora)" in line for line in lines), (
        lines[:4]
    )
    assert any(line.startswith("step 24/24") and "reward mean" in line and "kl" in line for line in lines)
    curve = " -> ".join(f"{m['reward_mean']:.2f}" for m in logged)
    print(
        f"\nGRPO, 24 steps of 4 prompts x 8 completions: rollout reward {curve}; greedy eval "
        f"{evaluation['eval_reference_reward_mean']:.3f} (base) -> {evaluation['eval_reward_mean']:.3f}; "
        f"{result.step_seconds:.0f} s in steps, {result.wall_seconds:.0f} s wall"
    )


@pytest.mark.integration
def test_grpo_preempted_or_killed_resumes_to_the_uninterrupted_adapter(
    grpo_model, prompt_shards, tmp_path, grpo_reference
):
    """Resumed from the checkpoint SIGTERM made, and from the one before it (rollouts replayed): the same adapter."""
    preempt_then_resume(grpo_config(), grpo_model, prompt_shards, RUN, tmp_path, GRPO, grpo_reference)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["llama3", "qwen2.5", "gemma2"])
def test_a_few_grpo_steps_train_each_family(name, tmp_path):
    """Each family's chat template renders the prompts, its end-of-turn ends the completions, its adapter moves: sampled
    hot (temperature 3; tiny Gemma 2 repeats one token otherwise), a random model's replies differ in length, so a reward
    for short ones gives every group a spread."""
    from ft_assets_tests.families import build_family
    from ft_assets_tests.support import write_prompt_shards

    rewards = tmp_path / "length.py"
    rewards.write_text(
        "def shorter(prompts, completions, **columns):\n    return [-len(c[0]['content']) / 10 for c in completions]\n"
    )
    base = build_family(name, tmp_path / name)
    shards = write_prompt_shards(base, tmp_path / "shards", {"train": timer_prompts(8), "eval": timer_prompts(4, 8)})
    cfg = grpo_config(max_steps=2, save_steps=2, logging_steps=1, max_seq_len=256,
                      grpo={"num_generations": 2, "max_completion_length": 8, "temperature": 3.0,
                            "rewards": [f"{rewards}:shorter", *TOOL_REWARDS]})  # fmt: skip
    result = train(
        cfg, base, shards, LocalStore(tmp_path / "store"), RUN, tmp_path / "work", log=lambda line: None, objective=GRPO
    )
    assert result.steps == 2 and [step for step, _ in result.figure_history] == [1, 2]
    assert all(
        0 < figures["completion_length"] <= 8 and math.isfinite(figures["kl"]) for _, figures in result.figure_history
    )
    assert all(math.isfinite(loss) for _, loss in result.loss_history)
    assert set(result.eval_metrics) == {"eval_reward_mean", "eval_reference_reward_mean"}
    assert any(
        weight.abs().sum() > 0 for name_, weight in final_weights(result).items() if "lora_B" in name_
    )  # B starts at 0


# --- all four planes ---------------------------------------------------------------------------------


def pipeline_config(base_dir: Path, steps: int, lr: float, tracking_uri: str | None, experiment: str) -> dict:
    training = {"max_steps": steps, "save_steps": 10, "per_device_batch_size": 4, "learning_rate": lr, "warmup_steps": 0,
                "lora_r": 8, "lora_alpha": 16, "logging_steps": 4, "max_seq_len": 128, "mlflow_experiment": experiment,
                "grpo": {"num_generations": 8, "max_completion_length": 24, "rewards": TOOL_REWARDS}}  # fmt: skip
    if tracking_uri:
        training["mlflow_tracking_uri"] = tracking_uri
    return {
        "ops": {
            "base_model": {"config": {"source": str(base_dir)}},
            "tokenized_shards": {"config": {"seq_len": 64}},
            "train_eval_split": {"config": {"eval_fraction": 0.2}},
            "lora_adapter": {"config": training},
            "gguf_model": {"config": {"qtypes": ["f16"]}},
            "eval_report": {"config": {"max_examples": 16, "max_new_tokens": 24, "min_improvement": 1.0}},
            **GENERAL_OFF,
        }
    }


@pytest.mark.integration
def test_a_prompt_version_flows_to_a_published_model_tracked_in_mlflow(home, capsys, grpo_model, mlflow_server):
    experiment = "timer-prompts"
    config = home / "run_config.yaml"
    config.write_text(yaml.safe_dump(pipeline_config(grpo_model, 24, 2e-2, mlflow_server.uri, experiment)))
    data = write_jsonl(home / "prompts.jsonl", timer_prompts(80))
    code, summary, err = run_cli(
        capsys, "run", "--dataset", str(data), "--name", "timers", "--version", "v1", "--config", str(config), "--json"
    )
    assert code == 0, err
    assert summary["rows_in"] == summary["rows_kept"] == 80 and summary["accounting_invariant_holds"]
    assert summary["training_method"] == "lora" and summary["steps"] == 24
    assert summary["metric_name"] == "reward_mean" and summary["finetuned_metric"] == summary["reward_mean"]
    assert summary["reward_mean"] >= summary["base_reward_mean"] + 1.0, summary
    assert summary["gguf_metric"] >= summary["reward_mean"] - 0.05 and summary["gguf_file"].endswith(
        ".gguf"
    )  # llama.cpp agrees
    assert summary["published_uri"].endswith(f"registry/timers/v1/{summary['run_id']}")

    store = LocalStore(home / "home" / "store")
    registry = Path(summary["published_uri"]).relative_to(store.root).as_posix()
    lineage = json.loads(store.get_bytes(f"{registry}/lineage.json"))
    assert (
        lineage["eval"]["metric_name"] == "reward_mean"
        and lineage["training"]["config"]["grpo"]["rewards"] == TOOL_REWARDS
    )
    adapter = read_ref(store, "timers@v1", "lora_adapter")["stats"]
    assert [step for step, _ in adapter["figure_history"]] == [
        4,
        8,
        12,
        16,
        20,
        24,
    ]  # the adapter's metadata: its reward curve
    print(
        f"\nGRPO end to end: reward {summary['base_reward_mean']:.3f} (base) -> {summary['reward_mean']:.3f} (tuned), "
        f"{summary['gguf_metric']:.3f} (shipped GGUF); rollout reward {adapter['figure_history'][0][1]['reward_mean']:.3f} -> "
        f"{adapter['figure_history'][-1][1]['reward_mean']:.3f}; {summary['steps']} steps"
    )

    client = mlflow_server.client()
    run = the_run(client, experiment)
    assert run.data.tags["ft.objective"] == "grpo"
    assert run.data.metrics["reward_mean"] == pytest.approx(summary["reward_mean"])
    assert run.data.metrics["base_reward_mean"] == pytest.approx(summary["base_reward_mean"])
    history = {
        name: [m.value for m in client.get_metric_history(run.info.run_id, name)]
        for name in ("reward_std", "kl", "completion_length")
    }
    assert all(len(values) == 6 for values in history.values()), history  # every log line: steps 4, 8, ..., 24
    assert not math.isnan(history["kl"][-1]) and history["kl"][-1] > 0


def test_prompt_dataclass_is_what_the_rewards_read(prompt_shards):
    """The shards hand each prompt's turns and reference call to the reward functions untouched."""
    prompt: Prompt = load_prompt_rows(prompt_shards, "eval", 128).prompts[0]
    assert prompt.columns == {"answer": timer_call(1 + 48 % 97)} and prompt.messages[-1]["role"] == "user"
