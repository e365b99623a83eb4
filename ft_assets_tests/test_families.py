"""The model-family matrix at the function level: one test body per property, one case per family.

Eleven tiny random models (``families.py``: Llama 3 untied and tied with llama3 RoPE, Qwen2.5 with
q/k/v biases, Qwen3 with q/k norms, Mistral, Gemma 2 with soft-capping and a sliding window, Gemma 3,
Phi-3 with fused projections; the mixtures of experts Qwen3-MoE, Mixtral and gpt-oss with its attention
sinks and sliding window), each with its family's special tokens and chat template. For each:
packed rows stay apart on every attention backend it takes on a CPU, ``auto`` picks a backend it
accepts on each device, the recipe's loss is the model's own, LoRA adapts the projections it has and
the planner counts the same ones (and each expert of a mixture, through PEFT's target_parameters),
the planner's parameter count is the model's (a mixture's active count too), merged logits equal
PEFT's, a few LoRA steps train on packed rows, and the loss mask learns exactly the assistant replies
with their end-of-turn token, with its own template and with the named one a bare base is given.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ft_assets.control.model_shape import ModelShape, lora_params
from ft_assets.data.chat_encoding import ChatEncoder
from ft_assets.delivery.merge import merge_adapter
from ft_assets.objectives import SFT
from ft_assets.shards import IGNORE_INDEX, load_packed_rows
from ft_assets.storage import LocalStore
from ft_assets.training import chat_templates
from ft_assets.training.base_model import BaseModelError, describe, settle_chat_template
from ft_assets.training.chat_templates import ChatTemplateError
from ft_assets.training.loss import learned_tokens, packed_inputs, token_loss_sum
from ft_assets.training.model import (
    causal_lm_class,
    expert_parameters,
    experts_line,
    load_model,
    lora_target_modules,
    projection_names,
    resolve_attention,
    supported_attention,
)
from ft_assets.training.recipe import train
from ft_assets_tests.families import FAMILIES, MOE, build_family
from ft_assets_tests.support import RUN, SEQ_LEN, chat_examples, final_weights, preempt_then_resume, write_shards
from ft_assets_tests.support import training_config as config

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

NAMES = [family.name for family in FAMILIES]
CLASSES = {f.name: transformers.MODEL_FOR_CAUSAL_LM_MAPPING[getattr(transformers, f.config_class)] for f in FAMILIES}
CPU_BACKENDS = ("sdpa", "eager", "flex_attention")  # flash-attn has no CPU build; flex runs forward only here
SPLIT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROJECTIONS = {name: SPLIT for name in NAMES} | {"phi3": ["o_proj", "qkv_proj", "gate_up_proj", "down_proj"]}
PROJECTIONS |= {name: SPLIT[:4] for name in MOE}  # a mixture's MLP is its experts: fused 3-D parameters, not linear
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
NO_SDPA = {"gemma2", "gpt-oss"}  # soft-capped attention logits; attention sinks
NAMED_TEMPLATE = {  # the named template (chat_templates.TEMPLATES) of each family's format
    "llama3": "llama3", "llama3-tied": "llama3", "qwen2.5": "chatml", "qwen3": "chatml",
    "mistral": "mistral", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3", "qwen3-moe": "chatml", "mixtral": "mistral",
}  # fmt: skip  # gpt-oss was released as a chat model only, in its own harmony format
END_OF_TURN = {f.name: f.tokens.eos for f in FAMILIES}  # <|eot_id|>, <|im_end|>, </s>, <end_of_turn>, <|end|>
CONVERSATION = [
    {"role": "system", "content": "Reply with one JSON tool call."},
    {"role": "user", "content": "Set a timer for 5 minutes."},
    {"role": "assistant", "content": '{"name": "set_timer", "arguments": {"minutes": 5}}'},
    {"role": "user", "content": "And one for 12 minutes."},
    {"role": "assistant", "content": '{"name": "set_timer", "arguments": {"minutes": 12}}'},
]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """``family_dir(name)``: the tiny model of that family as a HF directory, built once per module."""
    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            built[name] = build_family(name, tmp_path_factory.mktemp(name))
        return built[name]

    return build


@pytest.fixture(scope="module")
def family_shards(family_dir, tmp_path_factory):
    """``family_shards(name)``: packed train (24 examples) and eval (8) shards made with that family's template."""
    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            out, examples = tmp_path_factory.mktemp(f"{name}-shards"), chat_examples(32)
            write_shards(family_dir(name), out, "train", examples[:24], window=8)
            write_shards(family_dir(name), out, "eval", examples[24:], window=8)
            built[name] = out
        return built[name]

    return build


def load(model_dir: Path, attention: str = "eager"):
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attention).eval()


# --- attention ---------------------------------------------------------------------------------------

PACKED_CASES = [  # flex_attention compiles with inductor (g++ processes, 6-40 s a family): integration
    pytest.param(
        name, backend, marks=[pytest.mark.integration] if backend == "flex_attention" else [], id=f"{name}-{backend}"
    )
    for name in NAMES
    for backend in CPU_BACKENDS
    if backend in supported_attention(CLASSES[name])
    and (name, backend) != ("gpt-oss", "flex_attention")  # "Attention sinks cannot be run on CPU with flex attention"
]


@pytest.mark.parametrize("name, backend", PACKED_CASES)
def test_packed_examples_do_not_attend_to_each_other(family_dir, family_shards, name, backend):
    """A packed row's logits and loss are its examples', each run alone (eager: the reference every family takes)."""
    model, reference = load(family_dir(name), backend), load(family_dir(name))
    assert model.config._attn_implementation == backend
    rows = load_packed_rows(family_shards(name), "train", max_seq_len=SEQ_LEN)
    batch = rows.batch([0], torch.device("cpu"))
    lengths = [int(n) for n in torch.bincount(torch.cumsum((batch["position_ids"][0] == 0).int(), 0))[1:]]
    assert len(lengths) >= 2, "the row should hold several examples"
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    with torch.no_grad():
        packed = model(**packed_inputs(model, inputs), use_cache=False).logits[0]  # as the recipe's forward
        if name == "gpt-oss":  # its forward builds the masks without the position_ids (transformers 5.24)
            blind = model(**inputs, use_cache=False).logits[0]
            assert not torch.allclose(blind[lengths[0] :], packed[lengths[0] :], atol=1e-2), "fixed in transformers?"
        packed_loss, alone_loss, start = float(token_loss_sum(model, batch)), 0.0, 0
        for length in lengths:
            example = {key: value[:, start : start + length] for key, value in batch.items()}
            alone = reference(input_ids=example["input_ids"], use_cache=False).logits[0]
            assert torch.allclose(packed[start : start + length], alone, atol=1e-4), f"example at {start} of the row"
            alone_loss += float(token_loss_sum(reference, example))
            start += length
    assert learned_tokens(batch) > 0 and packed_loss == pytest.approx(alone_loss, rel=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_transformers_loads_exactly_the_backends_read_from_it(family_dir, name):
    """What ``supported_attention`` reads from the class is what from_pretrained accepts (Gemma 2 refuses sdpa)."""
    supported = supported_attention(causal_lm_class(family_dir(name)))
    assert ("sdpa" in supported) == (name not in NO_SDPA) and {"eager", "flex_attention"} <= set(supported)
    for backend in CPU_BACKENDS:
        if backend in supported:
            assert load(family_dir(name), backend).config._attn_implementation == backend
        else:
            with pytest.raises(ValueError, match="does not support"):
                load(family_dir(name), backend)


DEVICES = {  # device, flash-attn installed -> what auto picks for every family but Gemma 2, and for Gemma 2
    "cpu": (False, "sdpa", "eager"),
    "cuda": (False, "flex_attention", "flex_attention"),
    "cuda-flash-attn": (True, "flash_attention_2", "flash_attention_2"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_auto_attention_is_a_backend_the_family_accepts(monkeypatch, name, device):
    flash, usual, gemma2 = DEVICES[device]
    monkeypatch.setattr("ft_assets.training.model.flash_attn_installed", lambda: flash)
    model_class = CLASSES[name]
    chosen = resolve_attention("auto", torch.device(device.split("-")[0]), model_class)
    assert chosen == (gemma2 if name in NO_SDPA else usual) and chosen in supported_attention(model_class)


def test_an_attention_backend_the_architecture_refuses_is_named_before_loading():
    with pytest.raises(ValueError, match=r"'sdpa': transformers does not support it for Gemma2ForCausalLM \(it takes "
                                         r"flash_attention_2, flex_attention, eager\); use 'auto'"):  # fmt: skip
        resolve_attention("sdpa", torch.device("cpu"), CLASSES["gemma2"])
    assert resolve_attention("eager", torch.device("cpu"), CLASSES["gemma2"]) == "eager"


# --- the loss, LoRA targets, the planner, the merge ----------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_recipe_loss_is_the_models_own_loss(family_dir, name):
    """The chunked loss (lm_head + cross-entropy outside the model) scores the model's own logits: Gemma 2's soft-capped ones."""
    model = load(family_dir(name))
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :10] = IGNORE_INDEX
    batch = {"input_ids": ids, "position_ids": torch.arange(40)[None], "labels": labels}
    with torch.no_grad():
        own = model(input_ids=ids, labels=labels).loss
        ours = token_loss_sum(model, batch) / learned_tokens(batch)
    assert float(ours) == pytest.approx(float(own), rel=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_the_planner_reads_a_config_that_leaves_out_its_defaults(family_dir, name):
    """save_pretrained writes only what differs from the class's defaults, and Gemma 3's hub text_config has no
    vocab_size, head_dim or tie_word_embeddings (4B's no head counts): the shape is the one of the model transformers
    builds from it."""
    full = AutoConfig.from_pretrained(family_dir(name)).to_dict()
    left_out = ("vocab_size", "head_dim", "tie_word_embeddings", "num_attention_heads", "num_key_value_heads")
    sparse = {key: value for key, value in full.items() if key not in left_out}
    built = AutoConfig.for_model(**sparse).to_dict()
    assert built["vocab_size"] != full["vocab_size"]  # the class's default, not the tiny model's
    assert ModelShape.from_config(sparse, name) == ModelShape.from_config(built, name)


@pytest.mark.parametrize("name", NAMES)
def test_default_lora_targets_are_the_familys_projections_and_the_planner_counts_them(family_dir, name):
    model = load(family_dir(name))
    shape = ModelShape.from_config(json.loads((family_dir(name) / "config.json").read_text()))
    targets, experts = lora_target_modules(model, []), expert_parameters(model)
    assert targets == projection_names(model) == PROJECTIONS[name] and set(targets) == set(shape.projections())
    assert experts == (EXPERTS if name in MOE else [])
    lora = get_peft_model(
        model,
        LoraConfig(r=4, lora_alpha=8, target_modules=targets, target_parameters=experts or None, task_type="CAUSAL_LM"),
    )
    assert sum(p.numel() for p in lora.parameters() if p.requires_grad) == lora_params(shape, 4)
    assert lora_params(shape, 4, ["o_proj"], experts=False) == sum(
        p.numel() for n, p in lora.named_parameters() if "o_proj.lora" in n
    )
    on_experts = sum(p.numel() for n, p in lora.named_parameters() if ".experts." in n and p.requires_grad)
    assert on_experts == lora_params(shape, 4) - lora_params(shape, 4, experts=False) and bool(on_experts) == (
        name in MOE
    )
    with pytest.raises(
        ValueError,
        match=rf"target_modules \['c_attn'\]: \w+ has no such projection; its projections are {', '.join(targets)}",
    ):
        lora_target_modules(load(family_dir(name)), ["c_attn"])
    with pytest.raises(ValueError, match=rf"its projections are {', '.join(shape.projections())}"):
        lora_params(shape, 4, ["c_attn"])


@pytest.mark.parametrize("name", NAMES)
def test_planner_reads_the_familys_config_json(family_dir, name):
    """Parameter count (tied embeddings once), the layers' linear weights (what QLoRA quantizes) and the matmul share;
    a mixture's active count is the model with only its top-k experts (built with as many experts as it routes to)."""
    model = load(family_dir(name))
    config = json.loads((family_dir(name) / "config.json").read_text())
    shape = ModelShape.from_config(config)
    assert shape.params == model.num_parameters() == describe(family_dir(name))["parameters"]
    head = model.get_output_embeddings()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    assert shape.layer_linear_params == linear
    assert shape.tied_embeddings == (head.weight is model.get_input_embeddings().weight)
    if name in MOE:
        top_k = dict(config, num_local_experts=shape.experts_per_token)  # its router still has every expert's row
        with torch.device("meta"):
            active = AutoModelForCausalLM.from_config(type(model.config).from_dict(top_k)).num_parameters()
        router = (shape.experts - shape.experts_per_token) * (shape.hidden + (1 if shape.router_bias else 0))
        assert shape.active_params == active + shape.layers * router < shape.params
    else:
        assert shape.active_params == shape.params and shape.active_matmul_params == shape.matmul_params


# config.json excerpts of released models of each family, with the parameter count transformers builds from them
RELEASED = {
    "Llama-3.2-1B": ("LlamaConfig", 1_235_814_400, dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)),
    "Qwen2.5-0.5B": ("Qwen2Config", 494_032_768, dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)),
    "Qwen3-0.6B": ("Qwen3Config", 596_049_920, dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)),
    "Mistral-7B-v0.3": ("MistralConfig", 7_248_023_552, dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, intermediate_size=14336, vocab_size=32768, tie_word_embeddings=False)),
    "Gemma-2-2B": ("Gemma2Config", 2_614_341_888, dict(hidden_size=2304, num_hidden_layers=26, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=256, intermediate_size=9216, vocab_size=256000, tie_word_embeddings=True)),
    "Phi-3-mini-4k": ("Phi3Config", 3_821_079_552, dict(hidden_size=3072, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, intermediate_size=8192, vocab_size=32064, tie_word_embeddings=False)),
    "gpt-oss-20b": ("GptOssConfig", 20_914_757_184, dict(hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
                    num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                    vocab_size=201088, tie_word_embeddings=False)),
    "Qwen3-30B-A3B": ("Qwen3MoeConfig", 30_532_122_624, dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                      num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                      num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False)),
    "Mixtral-8x7B": ("MixtralConfig", 46_702_792_704, dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                     vocab_size=32000, tie_word_embeddings=False)),
}  # fmt: skip
# Their active parameters as published: gpt-oss-20b 3.61B (OpenAI's model card counts the matmuls, not the input
# embedding), Qwen3-30B-A3B 3.3B, Mixtral-8x7B 12.9B; and Mixtral's counted by hand, layer by layer.
MIXTRAL_BY_HAND = (
    32
    * (
        2 * 4096 * 4096
        + 2 * 4096 * 1024  # q, o; k, v (8 KV heads of 128)
        + 2 * 3 * 4096 * 14336  # the 2 experts a token goes through: gate, up, down
        + 8 * 4096
        + 2 * 4096  # the router over 8 experts; two norms
    )
    + 2 * 32000 * 4096
    + 4096
)  # embeddings in and out, the final norm


@pytest.mark.parametrize("name", RELEASED)
def test_planner_counts_released_shapes_as_transformers_builds_them(name):
    """The same at full size: the model is built on the meta device (no memory), from the config the planner reads."""
    config_class, params, excerpt = RELEASED[name]
    config = getattr(transformers, config_class)(**excerpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.from_config(config.to_dict()).params == model.num_parameters() == params


def test_planner_counts_a_mixtures_active_parameters_as_published():
    shapes = {name: ModelShape.from_config(getattr(transformers, RELEASED[name][0])(**RELEASED[name][2]).to_dict())
              for name in ("gpt-oss-20b", "Qwen3-30B-A3B", "Mixtral-8x7B")}  # fmt: skip
    assert round(shapes["gpt-oss-20b"].active_matmul_params / 1e9, 2) == 3.61
    assert 3.3e9 <= shapes["Qwen3-30B-A3B"].active_params < 3.4e9  # "30.5B in total and 3.3B activated"
    assert shapes["Mixtral-8x7B"].active_params == MIXTRAL_BY_HAND and round(MIXTRAL_BY_HAND / 1e9, 1) == 12.9
    assert shapes["gpt-oss-20b"].describe_params() == "20.91B params, 3.61B active (4 of 32 experts)"


@pytest.mark.parametrize("name", NAMES)
def test_merged_logits_equal_peft_logits(family_dir, name, tmp_path):
    base_dir = family_dir(name)
    torch.manual_seed(0)
    model = load(base_dir)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=lora_target_modules(model, []), init_lora_weights=False,
                      target_parameters=expert_parameters(model) or None, task_type="CAUSAL_LM")  # fmt: skip
    peft = get_peft_model(model, lora)  # init_lora_weights=False: B is random too, so the adapter changes the logits
    peft.save_pretrained(tmp_path / "adapter")
    merge_adapter(base_dir, tmp_path / "adapter", tmp_path / "merged")
    with_adapter = PeftModel.from_pretrained(load(base_dir), tmp_path / "adapter").eval()
    merged, base = load(tmp_path / "merged"), load(base_dir)
    ids = torch.randint(0, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = with_adapter(ids).logits, merged(ids).logits
        assert not torch.allclose(expected, base(ids).logits, atol=1e-3), "the adapter should change the logits"
    assert torch.allclose(got, expected, atol=1e-4), float((got - expected).abs().max())
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "merged").chat_template
        == AutoTokenizer.from_pretrained(base_dir).chat_template
    )


# --- training ----------------------------------------------------------------------------------------


@pytest.mark.integration  # the recipe itself (train: checkpoints uploaded to a store), as in test_training.py
@pytest.mark.parametrize("name", NAMES)
def test_a_few_lora_steps_train_each_family_on_packed_rows(family_dir, family_shards, name, tmp_path):
    result = train(config(max_steps=8, save_steps=8, logging_steps=1, eval_steps=None), family_dir(name), family_shards(name),
                   LocalStore(tmp_path / "store"), RUN, tmp_path / "work", log=lambda line: None)  # fmt: skip
    losses = [loss for _, loss in result.loss_history]
    assert result.steps == 8 and losses[-1] < 0.8 * losses[0], losses
    assert result.attn_implementation == ("eager" if name in NO_SDPA else "sdpa")
    adapter = json.loads((result.output_dir / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == sorted(PROJECTIONS[name])
    assert sorted(adapter["target_parameters"] or []) == sorted(EXPERTS if name in MOE else [])  # the experts'
    with safe_open(result.output_dir / "adapter_model.safetensors", "pt") as weights:
        assert any(".experts." in key for key in weights.keys()) == (name in MOE)
    assert result.eval_loss is not None and result.eval_loss < losses[0]


# --- chat templates and the loss mask -------------------------------------------------------------------


def learned_spans(tokenizer, messages: list[dict]) -> list[str]:
    """The texts of the runs of learned tokens that the data plane's encoder marks in ``messages``."""
    example = ChatEncoder(tokenizer).encode_batch([messages])[0]
    ids, mask = example.input_ids.tolist(), example.loss_mask.tolist()
    spans, current = [], []
    for token, learned in zip(ids + [None], mask + [0]):
        if learned:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans


def replies_with_end_of_turn(end_of_turn: str) -> list[str]:
    return [m["content"] + end_of_turn for m in CONVERSATION if m["role"] == "assistant"]


HARMONY_FINAL = "<|channel|>final<|message|>"  # what follows gpt-oss's generation prompt, <|start|>assistant
HARMONY_REPLIES = [
    HARMONY_FINAL + CONVERSATION[2]["content"] + "<|end|>",
    HARMONY_FINAL + CONVERSATION[4]["content"] + "<|return|>",
]


@pytest.mark.parametrize("name", NAMES)
def test_learned_tokens_are_the_assistant_replies_and_their_end_of_turn(family_dir, name):
    """With the family's own template: no system, user, header or role token is learned (Gemma folds the system
    turn into the first user turn, Mistral has no assistant header), every reply and its end-of-turn token are."""
    tokenizer = AutoTokenizer.from_pretrained(family_dir(name))
    expected = HARMONY_REPLIES if name == "gpt-oss" else replies_with_end_of_turn(END_OF_TURN[name])
    assert learned_spans(tokenizer, CONVERSATION) == expected


def test_harmony_learns_the_channels_its_reasoning_and_where_generation_stops(family_dir):
    """gpt-oss: the channel header after <|start|>assistant is the model's to write, so it is learned; a reply in the
    history ends <|end|>, the last one <|return|> (what generation stops at), with its reasoning (analysis channel) when
    the row gives one; the system turn becomes the developer's instructions and the date is fixed, so a version
    tokenizes alike any day."""
    tokenizer = AutoTokenizer.from_pretrained(family_dir("gpt-oss"))
    thinking = [*CONVERSATION[:4], {**CONVERSATION[4], "thinking": "A second timer, 12 minutes."}]
    assert learned_spans(tokenizer, thinking) == [
        HARMONY_REPLIES[0],
        "<|channel|>analysis<|message|>A second timer, 12 minutes.<|end|><|start|>assistant" + HARMONY_REPLIES[1],
    ]
    text, _ = ChatEncoder(tokenizer).render(CONVERSATION)
    assert "Current date: 2025-08-05" in text and "<|start|>developer<|message|># Instructions" in text


def bare_base(family_dir, name: str, tmp_path: Path) -> Path:
    """The family's model with its chat template removed: a pretrained, non-instruct base."""
    bare = tmp_path / f"{name}-bare"
    shutil.copytree(family_dir(name), bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((bare / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert not AutoTokenizer.from_pretrained(bare).chat_template
    return bare


@pytest.mark.parametrize("name", NAMED_TEMPLATE)
def test_a_bare_base_is_refused_naming_the_setting_then_takes_its_named_template(family_dir, name, tmp_path):
    bare, template = bare_base(family_dir, name, tmp_path), NAMED_TEMPLATE[name]
    with pytest.raises(BaseModelError, match=rf"ships no chat template .*set base_model.chat_template to '{template}'"):
        settle_chat_template(bare, None, name)
    vocabulary = len(AutoTokenizer.from_pretrained(bare))
    record = settle_chat_template(bare, chat_templates.choose(template), name, log=lambda line: None)
    named = chat_templates.TEMPLATES[template]
    assert (
        record["setting"] == template
        and record["kind"] == "named"
        and record["sha256"] == chat_templates.choose(template).sha256
    )
    tokenizer = AutoTokenizer.from_pretrained(bare)
    assert tokenizer.chat_template == named.jinja and len(tokenizer) == vocabulary
    assert set(named.markers) <= set(tokenizer.all_special_tokens)
    assert tokenizer.eos_token == END_OF_TURN[name]  # the end of a reply ends generation
    generation = json.loads((bare / "generation_config.json").read_text())["eos_token_id"]
    assert tokenizer.eos_token_id in (generation if isinstance(generation, list) else [generation])
    prompt = CONVERSATION[:2]
    own = AutoTokenizer.from_pretrained(family_dir(name)).apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True
    )
    assert (
        tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == own
    )  # the family's format
    assert learned_spans(tokenizer, CONVERSATION) == replies_with_end_of_turn(END_OF_TURN[name])


def test_chat_template_settings_that_cannot_work_are_refused_with_what_to_do(family_dir, tmp_path):
    with pytest.raises(
        ChatTemplateError,
        match=r"'vicuna' is neither a named template \(chatml, llama3, gemma, mistral, phi3\) nor a Jinja file",
    ):
        chat_templates.choose("vicuna")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(ChatTemplateError, match=rf"{broken}:2: not a valid Jinja template"):
        chat_templates.choose(str(broken))
    gemma = bare_base(family_dir, "gemma3", tmp_path)
    with pytest.raises(ChatTemplateError, match=r"'llama3' writes <\|start_header_id\|>, <\|end_header_id\|>, <\|eot_id\|>, which the "
                                                r"base model's vocabulary lacks as single tokens; use 'gemma'"):  # fmt: skip
        settle_chat_template(gemma, chat_templates.choose("llama3"), "gemma3")


def test_a_jinja_file_is_written_into_the_tokenizer_and_recorded(family_dir, tmp_path):
    bare = bare_base(family_dir, "qwen3", tmp_path)
    custom = tmp_path / "terse.jinja"
    custom.write_text(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    record = settle_chat_template(bare, chat_templates.choose(str(custom)), "qwen3")
    assert record == {"setting": str(custom), "kind": "file", "sha256": chat_templates.choose(str(custom)).sha256}
    tokenizer = AutoTokenizer.from_pretrained(bare)
    assert tokenizer.chat_template == custom.read_text()
    assert learned_spans(tokenizer, CONVERSATION) == replies_with_end_of_turn("<|im_end|>")


def test_the_data_plane_points_a_base_without_template_at_the_setting(family_dir, tmp_path):
    with pytest.raises(
        ValueError, match=r"no chat template .*set base_model's chat_template to a named template \(chatml"
    ):
        ChatEncoder(AutoTokenizer.from_pretrained(bare_base(family_dir, "llama3", tmp_path)))


# --- a mixture's router ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
def test_a_mixtures_router_is_frozen_unless_trained_and_its_balancing_loss_has_the_settings_weight(family_dir, name):
    """Default: every expert adapted, the router frozen, no load-balancing loss. ``train_router`` trains the router in
    full beside the adapter and adds the loss at the model's own weight; ``router_aux_loss_coef`` sets another."""
    base = family_dir(name)
    frozen = load_model(config().for_base(4), "lora", base, torch.device("cpu"))
    assert not any("gate." in n or "router." in n for n, p in frozen.named_parameters() if p.requires_grad)
    assert any(".experts." in n for n, p in frozen.named_parameters() if p.requires_grad)
    assert experts_line(frozen.config).endswith("router loss weight 0")
    trained = load_model(config(train_router=True).for_base(4), "lora", base, torch.device("cpu"))
    routers = [n for n, p in trained.named_parameters() if p.requires_grad and ("gate." in n or "router." in n)]
    assert len(routers) >= 2 and all("modules_to_save" in n for n in routers)  # each layer's, saved in the adapter
    assert trained.config.router_aux_loss_coef == 0.001  # the model's own (transformers' default in the tiny config)
    weighted = load_model(config(router_aux_loss_coef=0.5).for_base(4), "lora", base, torch.device("cpu"))
    assert "router loss weight 0.5" in experts_line(weighted.config)
    ids = torch.randint(0, weighted.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "position_ids": torch.arange(40)[None], "labels": ids}
    with torch.no_grad():
        aux = weighted(input_ids=ids, use_cache=False, output_router_logits=True).aux_loss  # the model's own
        added = token_loss_sum(weighted, batch, router_aux=True) - token_loss_sum(weighted, batch)
    assert float(aux) > 0 and float(added) == pytest.approx(0.5 * float(aux) * learned_tokens(batch), rel=1e-4)


def test_a_mixture_trains_lora_by_default_and_refuses_qlora_in_one_line():
    assert config(method=None).for_base(4).method == "lora" and config(method=None).for_base(0).method is None
    assert config(lora_dropout=0.1).for_base(4).lora_dropout == 0.0  # PEFT's expert LoRA takes no dropout
    assert config(lora_dropout=0.1, lora_experts=False).for_base(4).lora_dropout == 0.1
    assert config(backend="auto").for_base(4).backend == "torch"  # a Mac's auto is mlx, which adapts linear layers only
    with pytest.raises(
        ValueError, match=r"backend 'mlx' on a mixture of 4 experts: the MLX recipe adapts linear layers"
    ):
        config(backend="mlx").for_base(4)
    with pytest.raises(ValueError, match=r"method 'qlora' on a mixture of 8 experts: bitsandbytes quantizes linear layers "
                                         r"only.*use method 'lora'"):  # fmt: skip
        config(method="qlora").for_base(8)


@pytest.mark.integration
def test_a_mixture_preempted_or_killed_resumes_to_the_uninterrupted_adapter(family_dir, family_shards, tmp_path):
    """Experts, a trained router and its balancing loss in the checkpoints: resumed from a SIGTERM's checkpoint and
    from the one before it (``support.preempt_then_resume``), the adapter equals the uninterrupted run's."""
    cfg = config(max_steps=8, train_router=True, router_aux_loss_coef=0.01)
    uninterrupted = train(cfg, family_dir("mixtral"), family_shards("mixtral"), LocalStore(tmp_path / "reference"), RUN,
                          tmp_path / "reference-work", log=lambda line: None)  # fmt: skip
    reference = final_weights(uninterrupted)
    assert any(".experts." in name for name in reference) and any(
        name.endswith("mlp.gate.weight") for name in reference
    )
    preempt_then_resume(cfg, family_dir("mixtral"), family_shards("mixtral"), RUN, tmp_path / "resumed", SFT, reference)


def test_a_rows_reasoning_is_read_cleaned_stored_and_learned_in_gpt_oss_analysis_channel(family_dir, tmp_path):
    """A reply's reasoning, under any of the names datasets give it, goes through the data plane beside its text and is
    learned where gpt-oss writes it; a message without one is read back as it was written."""
    from ft_assets.data.cleaning import CleaningRules, clean_messages
    from ft_assets.data.layouts import normalize_record
    from ft_assets.data.rows import ROW_SCHEMA, ParquetSink, iter_records

    row = {"messages": [{"role": "user", "content": "Set a timer for 12 minutes."},
                        {"role": "assistant", "content": "Done.", "reasoning_content": "A timer,\u00a012 minutes. "}]}  # fmt: skip
    messages = clean_messages(normalize_record(row), CleaningRules())
    assert messages[1] == {"role": "assistant", "content": "Done.", "thinking": "A timer, 12 minutes."}
    with ParquetSink(tmp_path / "rows.parquet", ROW_SCHEMA) as sink:
        sink.write({"source": "a:1", "cluster": "", "messages": messages})
    [stored] = iter_records(tmp_path / "rows.parquet")
    assert stored["messages"] == messages and "thinking" not in stored["messages"][0]
    tokenizer = AutoTokenizer.from_pretrained(family_dir("gpt-oss"))
    assert learned_spans(tokenizer, stored["messages"]) == [
        "<|channel|>analysis<|message|>A timer, 12 minutes.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    ]


def test_a_tool_call_and_its_result_go_through_the_data_plane_and_the_call_is_learned(family_dir):
    """OpenAI-style tool calls (arguments as a JSON string or an object), a tool message with the result, then the
    answer: the call is learned through harmony's <|call|>, the result is not, the answer is; calls out of order are
    refused naming the message."""
    from ft_assets.data.cleaning import CleaningRules, clean_messages
    from ft_assets.data.layouts import normalize_record
    from ft_assets.data.rows import RowError

    call = {"type": "function", "function": {"name": "set_timer", "arguments": '{"minutes": 12}'}}
    row = {"messages": [{"role": "user", "content": "Set a timer for 12 minutes."},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": "timer 7 set"},
                        {"role": "assistant", "content": "Done: timer 7."}]}  # fmt: skip
    messages = clean_messages(normalize_record(row), CleaningRules())
    assert json.loads(messages[1]["tool_calls"])[0]["function"] == {"name": "set_timer", "arguments": {"minutes": 12}}
    tokenizer = AutoTokenizer.from_pretrained(family_dir("gpt-oss"))
    assert learned_spans(tokenizer, messages) == [
        ' to=functions.set_timer<|channel|>commentary json<|message|>{"minutes": 12}<|call|>',
        "<|channel|>final<|message|>Done: timer 7.<|return|>",
    ]
    with pytest.raises(RowError, match="message 2 is 'user' where 'tool' was expected"):
        clean_messages([*messages[:2], {"role": "user", "content": "And?"}, messages[3]], CleaningRules())
