"""The shape of a base model, read from its config.json: what the planner's memory and FLOP estimates need.

``ModelShape.from_config`` reads the sizes (layers, hidden, heads, KV heads, head_dim, MLP width,
vocabulary, tied embeddings) and, from ``model_type``, what each family's modeling code adds that
config.json does not spell out (``LAYOUTS``): Qwen2's q/k/v biases, Qwen3's and Gemma 3's per-head
q/k norms, Gemma 2/3's four norms per layer, Phi-3's fused ``qkv_proj`` and ``gate_up_proj``. The
parameter count it computes equals that of the transformers model built from the same config for
each family of the test matrix (Llama 3 tied and untied, Qwen2.5, Qwen3, Mistral, Gemma 2, Gemma 3,
Phi-3: ``test_families.py``) and the published counts of the reference models (``test_planner.py``).

``projections()`` names each decoder layer's linear layers as the family does, so the LoRA targets
the planner counts are the modules the training plane adapts (``training.model.projection_names``
finds the same names in the loaded model; empty ``target_modules`` means all of them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class DecoderLayout:
    """What a family's model_type implies about its decoder layers beyond config.json's sizes (transformers' modeling code)."""

    fused_projections: bool = False  # one qkv_proj and one gate_up_proj instead of q/k/v and gate/up (Phi-3)
    qkv_bias: bool = False  # q/k/v biases whatever the config says (Qwen2)
    qk_norm: bool = False  # an RMSNorm over head_dim on the queries and one on the keys (Qwen3, Gemma 3)
    layer_norms: int = 2  # hidden-size norms per layer: Gemma 2 and 3 add one before and one after the MLP
    bias_settings: bool = (
        True  # config.json's attention_bias / mlp_bias switch biases on (Llama; Qwen3, Gemma: attention)
    )


LAYOUTS = {
    "qwen2": DecoderLayout(qkv_bias=True, bias_settings=False),
    "qwen3": DecoderLayout(qk_norm=True),
    "mistral": DecoderLayout(bias_settings=False),
    "gemma2": DecoderLayout(layer_norms=4),
    "gemma3_text": DecoderLayout(qk_norm=True, layer_norms=4),
    "phi3": DecoderLayout(fused_projections=True, bias_settings=False),
}  # any other model_type (llama, and the Llama-style decoders like it): the default layout


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-style decoder (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3: gated MLP, GQA).

    ``params`` is computed from the dimensions when not given: for the reference models it matches
    the published counts exactly (Llama-2-7B 6,738,415,616; Qwen2.5-0.5B 494,032,768), and for the
    tiny models of every family in the test matrix the count of the transformers model built from the
    same config.json (``test_families.py``).
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int
    head_dim: int | None = None  # hidden // heads unless the config says otherwise (Gemma, Qwen3)
    tied_embeddings: bool = False  # lm_head shares the input embedding matrix
    qkv_bias: bool = False  # biases on q/k/v (Qwen2: a 0.01% effect, counted for exact params)
    attention_bias: bool = False  # biases on q/k/v and o (attention_bias: true)
    mlp_bias: bool = False  # biases on the MLP projections (Llama's mlp_bias: true)
    qk_norm: bool = False  # per-head RMSNorms on queries and keys (Qwen3, Gemma 3)
    layer_norms: int = 2  # hidden-size RMSNorms per layer (Gemma 2/3: 4)
    fused_projections: bool = False  # Phi-3's qkv_proj and gate_up_proj
    params: int | None = None  # total parameters; computed from the dimensions when None
    name: str = ""

    def __post_init__(self):
        for attr in ("layers", "hidden", "heads", "kv_heads", "vocab", "intermediate"):
            if not isinstance(getattr(self, attr), int) or getattr(self, attr) < 1:
                raise ValueError(f"ModelShape.{attr} must be a positive integer (got {getattr(self, attr)!r})")
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}; give head_dim")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.params is None:
            object.__setattr__(self, "params", self._count_params())

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear layer of one decoder layer, by the family's module names.

        These are the modules LoRA adapts by default (``training.model.projection_names`` finds the same
        names in the loaded model).
        """
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        if self.fused_projections:
            return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def layer_linear_params(self) -> int:
        """Weights of the decoder layers' linear projections: what QLoRA quantizes to NF4."""
        return self.layers * sum(a * b for a, b in self.projections().values())

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (the input embedding is a lookup)."""
        return self.params - (0 if self.tied_embeddings else self.embedding_params)

    def _count_params(self) -> int:
        per_layer = sum(a * b for a, b in self.projections().values()) + self.layer_norms * self.hidden
        if self.qkv_bias or self.attention_bias:
            per_layer += self.q_dim + 2 * self.kv_dim
        if self.attention_bias:
            per_layer += self.hidden  # o_proj's
        if self.mlp_bias:
            per_layer += 2 * self.intermediate + self.hidden
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        embeddings = self.embedding_params * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embeddings + self.hidden  # + final norm

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str = "", params: int | None = None) -> ModelShape:
        """Build from a transformers config.json (as a dict). Multimodal configs: their ``text_config``."""
        if isinstance(config.get("text_config"), Mapping):
            config = config["text_config"]
        moe = [key for key in MOE_KEYS if config.get(key)]
        if moe:
            raise ValueError(f"mixture-of-experts config ({', '.join(moe)}): the estimate covers dense models only")
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [key for key in required if key not in config]
        if missing:
            raise ValueError(
                f"config.json of {name or 'the base model'} lacks {', '.join(missing)}: the estimate needs a "
                f"Llama-style decoder config with {', '.join(required)}"
            )
        heads = int(config["num_attention_heads"])
        layout = LAYOUTS.get(str(config.get("model_type")), DecoderLayout())
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=int(config["hidden_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            vocab=int(config["vocab_size"]),
            intermediate=int(config["intermediate_size"]),
            head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=layout.qkv_bias,
            attention_bias=layout.bias_settings and bool(config.get("attention_bias", False)),
            mlp_bias=layout.bias_settings and bool(config.get("mlp_bias", False)),
            qk_norm=layout.qk_norm,
            layer_norms=layout.layer_norms,
            fused_projections=layout.fused_projections,
            params=params,
            name=name or str(config.get("_name_or_path") or config.get("model_type") or ""),
        )


def lora_targets_of(shape: ModelShape, lora_targets: Sequence[str] = ()) -> list[str]:
    """The projections LoRA adapts: ``lora_targets``, or every projection of ``shape`` when empty (the training default)."""
    projections = shape.projections()
    unknown = [name for name in lora_targets if name.rsplit(".", 1)[-1] not in projections]  # "self_attn.q_proj" too
    if unknown:
        raise ValueError(
            f"target_modules {unknown}: {shape.name or 'the model'} has no such projection; its projections are "
            f"{', '.join(projections)}. List some of those, or leave target_modules empty to adapt all of them"
        )
    return [name.rsplit(".", 1)[-1] for name in lora_targets] or list(projections)


def lora_params(shape: ModelShape, lora_r: int, lora_targets: Sequence[str] = ()) -> int:
    """Trainable LoRA parameters: r x (in + out) per adapted projection per layer (every projection by default)."""
    projections = shape.projections()
    return shape.layers * sum(lora_r * sum(projections[name]) for name in lora_targets_of(shape, lora_targets))
