import json
import types

import pytest
import torch

from ft_assets.delivery.evaluate import EvalExample, eval_examples, exact_match, rouge_l, token_f1
from ft_assets.generation import stop_tokens
from ft_assets.delivery.merge import merge_adapter
from ft_assets.delivery.lineage import LINEAGE_CHAIN, build_lineage
from ft_assets.delivery.publish import hub_upload_plan, push_to_hub
from ft_assets_tests.support import lineage_refs

METRIC_CASES = [
    ("exact", exact_match, '{"a": 1}', ' {"a": 1}\n', 1.0),
    ("exact-differs", exact_match, '{"a": 1}', '{"a": 2}', 0.0),
    ("f1-partial", token_f1, "the cat sat", "the cat ran", 2 / 3),
    ("f1-disjoint", token_f1, "a b", "c d", 0.0),
    ("f1-empty-both", token_f1, "", "", 1.0),
    ("f1-repeats", token_f1, "a a a", "a", 0.5),
    ("rouge-order", rouge_l, "a b c d", "a c d", 2 * (3 / 4) * 1 / (3 / 4 + 1)),
    ("rouge-same", rouge_l, "x y", "x y", 1.0),
    ("rouge-none", rouge_l, "x", "y", 0.0),
]


@pytest.mark.parametrize("name,fn,prediction,reference,expected", METRIC_CASES, ids=[c[0] for c in METRIC_CASES])
def test_metrics(name, fn, prediction, reference, expected):
    assert fn(prediction, reference) == pytest.approx(expected)


def test_eval_examples_cut_before_the_last_reply():
    rows = [{"source": "f:1", "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
    ]}] * 3  # fmt: skip
    examples = eval_examples(rows, limit=2)
    assert len(examples) == 2
    assert examples[0] == EvalExample("f:1", rows[0]["messages"][:4], "a2")


def test_merged_model_reproduces_base_plus_adapter(tiny_model_dir, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # a non-zero update, as after training
    peft_model.save_pretrained(tmp_path / "adapter")
    merge_adapter(tiny_model_dir, tmp_path / "adapter", tmp_path / "merged")

    ids = torch.tensor([[1, 5, 9, 12, 40, 7]])
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", use_safetensors=True)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        expected, got, before = reference(ids).logits, merged(ids).logits, plain(ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, before, atol=1e-3), "the adapter changed nothing: the test would prove nothing"
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    assert not list((tmp_path / "merged").glob("*.bin"))


def test_lineage_names_every_upstream_artifact_and_hash():
    lineage = build_lineage("toolcalls@v1", lineage_refs(), "registry/toolcalls/v1/r1")
    assert [a["asset"] for a in lineage["artifacts"]] == list(LINEAGE_CHAIN)
    assert "/store" not in json.dumps(lineage)  # store-relative keys only: a moved store still verifies
    assert (
        lineage["published_key"] == "registry/toolcalls/v1/r1"
        and lineage["artifacts"][0]["key"] == "runs/t/v1/raw_dataset"
    )
    assert all(len(a["digest"]) == 64 for a in lineage["artifacts"])
    assert lineage["artifacts"][1]["upstream"] == {"raw_dataset": f"{0:064x}"}
    assert lineage["base_model"]["source_sha256"] == "ab" * 32
    assert lineage["base_model"]["chat_template"] == {
        "setting": "gemma",
        "kind": "named",
        "sha256": "12" * 32,
    }  # base_model.chat_template
    assert lineage["training"]["checkpoint"] == {"key": "runs/t/v1/train/r1/checkpoint-00000008", "digest": "ef" * 32}
    assert lineage["exports"]["gguf"]["files"]["m-f16.gguf"]["sha256"] == "cd" * 32
    assert (lineage["exports"]["gguf"]["shipped"], lineage["exports"]["gguf"]["reason"]) == ("m-q8_0.gguf", None)
    assert (lineage["eval"]["exports"]["gguf"]["file"], lineage["eval"]["exports"]["gguf"]["metric"]) == (
        "m-q8_0.gguf",
        0.85,
    )  # what ships, as scored
    assert lineage["code_version"]
    refs = lineage_refs()
    del refs["merged_model"]
    with pytest.raises(ValueError, match="no reference for merged_model"):
        build_lineage("toolcalls@v1", refs, "/x")


def test_hub_dry_run_lists_files_and_never_needs_a_token(tmp_path):
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "m.gguf").write_bytes(b"x")
    (tmp_path / "lineage.json").write_text(json.dumps({}))
    logged = []
    assert push_to_hub(tmp_path, "me/model", token=None, dry_run=True, log=logged.append) == [
        "gguf/m.gguf",
        "lineage.json",
    ]
    assert logged == [
        "[dry run] would upload gguf/m.gguf to hf://me/model",
        "[dry run] would upload lineage.json to hf://me/model",
    ]
    assert hub_upload_plan(tmp_path) == ["gguf/m.gguf", "lineage.json"]
    with pytest.raises(ValueError, match="HF_TOKEN"):
        push_to_hub(tmp_path, "me/model", token=None, dry_run=False)


STOP_CASES = [  # generation config's eos ids -> where eval answers stop (the tokenizer's eos is 4)
    ("none configured", None, [4]),
    ("the same eos", 4, [4]),
    ("an end-of-turn token beside eos (Gemma, Phi-3)", [7, 4], [4, 7]),
]


@pytest.mark.parametrize("case, configured, expected", STOP_CASES, ids=[c[0] for c in STOP_CASES])
def test_eval_answers_stop_at_every_end_of_turn_token(case, configured, expected):
    model = types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=configured))
    assert stop_tokens(model, types.SimpleNamespace(eos_token_id=4)) == expected


# --- the gate, for each objective: a run that learned nothing is blocked ---------------------------

WEAK_CASES = [  # objective, its tiny model and eval shards (conftest), the gate's metric, what the report's line says
    ("sft", "tiny_model", "shards", "exact_match", "eval loss"),
    ("dpo", "pair_model", "pair_shards", "reward_accuracy", "reward margin"),
    ("grpo", "grpo_model", "prompt_shards", "reward_mean", "reward"),
]


@pytest.mark.integration
@pytest.mark.usefixtures("one_cpu_thread")
@pytest.mark.parametrize("objective, model, data, metric, said", WEAK_CASES, ids=[c[0] for c in WEAK_CASES])
def test_the_gate_blocks_a_run_that_learned_nothing_with_the_objectives_metric(
    request, objective, model, data, metric, said
):
    """What eval_report meets after a run that learned nothing (its merged model is its base): the objective's own
    scorer scores it, the gate blocks it, and the blocking check's line names the objective's metric and eval loss
    (GRPO's prompts have no reference reply: no eval loss). Through the instance, with nothing published: test_cli.py."""
    from ft_assets import objectives
    from ft_assets.delivery import evaluate as ev
    from ft_assets.delivery.checks import finetuned_beats_base
    from ft_assets.delivery.gate import dropped, gate
    from ft_assets_tests.support import chat_examples, conversations, dpo_config, grpo_config

    model_dir, shards_dir = request.getfixturevalue(model), request.getfixturevalue(data)
    settings = {"sft": None, "dpo": dpo_config().dpo, "grpo": grpo_config().grpo}[objective]
    scorer = objectives.named(objective).scorer(metric if objective == "sft" else "exact_match", 12, 12, settings)
    if objective == "sft":  # the eval conversations the `shards` fixture packed (chat_examples 48-59)
        rows = [{"source": rid, "messages": messages} for rid, messages in conversations(chat_examples(60)[48:])]
        scorer.examples, scorer.shards_dir = ev.eval_examples(rows, 12), shards_dir
    else:
        assert scorer.load(lambda ref, name, include=None: shards_dir, {}, {}) > 0
    assert scorer.metric == metric
    scored = scorer.score(model_dir, log=lambda line: None)
    report = scorer.report(scored, scored, [])
    off = {name: dropped(f"{name} export is off", 0.05) for name in ("gguf", "mlx")}  # the gate on the model alone
    verdict = gate(metric, scored.metric, scored.metric, 0.1, off)
    check = finetuned_beats_base({"stats": {**verdict.as_dict(), **report.stats}})
    assert not verdict.beats_base and not verdict.passed and not check.passed
    assert check.description.startswith(
        f"{metric}: base {scored.metric:.3f}, fine-tuned {scored.metric:.3f} (improvement +0.000, required +0.100)"
    )
    assert ("; eval loss " in check.description) == (objective != "grpo") and said in report.summary
