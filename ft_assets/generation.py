"""Where a generated reply ends, and what of it is the answer: shared by GRPO's rollouts (training) and the eval
answers (delivery).

A reply ends at the tokenizer's eos or at any end-of-turn id of the model's generation config: Gemma
ends a turn with ``<end_of_turn>`` beside ``<eos>``, Phi-3 with ``<|end|>`` beside ``<|endoftext|>``, and a
reply that ran on past its turn would be scored (and trained on) with the next turn's text in it. One
function both planes import downward, so the training plane never reaches up into delivery for it.

gpt-oss replies in harmony channels: ``<|channel|>analysis<|message|>`` reasoning, then
``<|start|>assistant<|channel|>final<|message|>`` and the answer. Decoded without its special tokens the
whole reply reads "analysis...assistantfinal<answer>"; ``answer_ids`` keeps what follows the last final
channel's header.
"""

from __future__ import annotations


def stop_tokens(model, tokenizer) -> list[int]:
    """The ids that end a reply: the tokenizer's eos and every eos id of the model's generation config, sorted."""
    configured = model.generation_config.eos_token_id
    configured = configured if isinstance(configured, list) else [configured]
    return sorted({token for token in [tokenizer.eos_token_id, *configured] if token is not None})


HARMONY_FINAL = "<|channel|>final<|message|>"  # what opens the answer of a gpt-oss reply


def answer_ids(tokenizer, ids: list[int]) -> list[int]:
    """The answer of a generated reply: all of it, or of a harmony reply what follows its last final-channel header."""
    if "<|channel|>" not in tokenizer.get_vocab():
        return ids
    marker = tokenizer.encode(HARMONY_FINAL, add_special_tokens=False)
    for start in range(len(ids) - len(marker), -1, -1):
        if ids[start : start + len(marker)] == marker:
            return ids[start + len(marker) :]
    return ids


def answer_text(text: str) -> str:
    """``answer_ids`` for a runtime that returns text with the harmony markup in it (llama.cpp, mlx-lm): what follows
    the last final-channel header, without the end marker after it."""
    if HARMONY_FINAL not in text:
        return text
    answer = text.rsplit(HARMONY_FINAL, 1)[1]
    for end in ("<|return|>", "<|end|>", "<|call|>"):
        answer = answer.split(end, 1)[0]
    return answer
