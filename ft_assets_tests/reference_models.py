"""Published configs of the models the planner's VRAM and throughput estimates are checked against.

Used by ``test_planner.py`` and by ``python -m scripts.planner_tables``, which prints the tables
quoted in ``ft_assets/control/planner.py``'s docstring.
"""

from typing import Any

# config.json excerpts: the values of the models' published config.json files on the Hugging Face hub.
REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "Llama-2-7B": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    "Llama-2-13B": {
        "model_type": "llama",
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "intermediate_size": 13824,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    "Llama-2-70B": {  # grouped-query attention: 8 KV heads
        "model_type": "llama",
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
}
