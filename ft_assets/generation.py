"""Where a generated reply ends: shared by GRPO's rollouts (training) and the eval answers (delivery).

A reply ends at the tokenizer's eos or at any end-of-turn id of the model's generation config: Gemma
ends a turn with ``<end_of_turn>`` beside ``<eos>``, Phi-3 with ``<|end|>`` beside ``<|endoftext|>``, and a
reply that ran on past its turn would be scored (and trained on) with the next turn's text in it. One
function both planes import downward, so the training plane never reaches up into delivery for it.
"""

from __future__ import annotations


def stop_tokens(model, tokenizer) -> list[int]:
    """The ids that end a reply: the tokenizer's eos and every eos id of the model's generation config, sorted."""
    configured = model.generation_config.eos_token_id
    configured = configured if isinstance(configured, list) else [configured]
    return sorted({token for token in [tokenizer.eos_token_id, *configured] if token is not None})
