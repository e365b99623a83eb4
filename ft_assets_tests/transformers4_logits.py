"""Run under transformers 4.x (``PYTHONPATH=.venv-transformers4``): load each model folder given, write what it sees.

``python ft_assets_tests/transformers4_logits.py OUT DIR...`` writes ``OUT/<i>.npy`` (the logits of the
chat-rendered probe prompt; the model is then saved back, as a 4.x user would) and ``OUT/result.json`` (per
folder: token ids, rope_theta, whether it saved, or the error that stopped the load). Imports nothing of ft_assets: this process has another transformers than the package.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = [{"role": "user", "content": "Set a timer for 12 minutes."}]


def probe(model_dir: str, out: Path) -> dict:
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # the test reads the reason
        return {"error": f"tokenizer: {type(exc).__name__}: {exc}"[:500]}
    # eager: 4.57's default SDPA drops Gemma 2's attention soft-capping, which 5.x (eager) keeps
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    except Exception as exc:  # a config 4.x reads otherwise (an MoE without num_experts) refuses the weights
        return {"error": f"model: {type(exc).__name__}: {exc}"[:500]}
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        np.save(out, model(torch.tensor([ids])).logits[0].numpy())
    try:  # a 4.x user can save what they loaded (4.57 refuses some generation configs on save)
        model.save_pretrained(out.with_suffix(".resaved"))
        saves = "ok"
    except ValueError as exc:
        saves = str(exc)[:300]
    return {
        "saves": saves,
        "ids": ids,
        "rope_theta": getattr(model.config, "rope_theta", None),
        "tokenizer_class": type(tokenizer).__name__,
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir = Path(sys.argv[1])
    results = {"transformers": transformers.__version__}
    for index, model_dir in enumerate(sys.argv[2:]):
        results[model_dir] = probe(model_dir, out_dir / f"{index}.npy")
    (out_dir / "result.json").write_text(json.dumps(results, indent=2))
