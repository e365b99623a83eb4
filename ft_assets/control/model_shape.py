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

A mixture of experts (Qwen3-MoE, Mixtral, gpt-oss: ``MOE_LAYOUTS``) is counted twice: ``params`` holds
every expert (what the weights take in memory), ``active_params`` only the ``experts_per_token`` a
token goes through (what its FLOPs cost). Its experts are fused 3-D parameters (``expert_projections``,
per expert), which LoRA reaches through PEFT's ``target_parameters``, and its router stays frozen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ft_assets.training.config import MOE_KEYS, experts_of


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
    expert_bias: bool = False  # a bias on each expert's gate_up_proj and down_proj (gpt-oss)
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    attention_sinks: bool = False  # one learned sink logit per query head (gpt-oss)


LAYOUTS = {
    "qwen2": DecoderLayout(qkv_bias=True, bias_settings=False),
    "qwen3": DecoderLayout(qk_norm=True),
    "mistral": DecoderLayout(bias_settings=False),
    "gemma2": DecoderLayout(layer_norms=4),
    "gemma3_text": DecoderLayout(qk_norm=True, layer_norms=4),
    "phi3": DecoderLayout(fused_projections=True, bias_settings=False),
}  # any other model_type (llama, and the Llama-style decoders like it): the default layout
MOE_LAYOUTS = {
    "qwen3_moe": DecoderLayout(qk_norm=True),
    "mixtral": DecoderLayout(bias_settings=False),
    "gpt_oss": DecoderLayout(expert_bias=True, router_bias=True, attention_sinks=True),
}  # the mixtures of experts whose layers the count knows; another one is refused rather than guessed


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
    experts: int = 0  # experts per MoE layer (0: a dense model)
    experts_per_token: int = 0  # the top-k experts each token goes through
    expert_intermediate: int = 0  # each expert's MLP width (moe_intermediate_size; the intermediate size if 0)
    moe_layers: int | None = None  # layers whose MLP is a mixture (all of them if None; Qwen3-MoE may keep dense ones)
    expert_bias: bool = False  # gpt-oss
    router_bias: bool = False  # gpt-oss
    attention_sinks: bool = False  # gpt-oss
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
        if self.experts:
            if not 1 <= self.experts_per_token <= self.experts:
                raise ValueError(
                    f"experts_per_token {self.experts_per_token!r} must be between 1 and the {self.experts} experts"
                )
            object.__setattr__(self, "expert_intermediate", self.expert_intermediate or self.intermediate)
            object.__setattr__(self, "moe_layers", self.layers if self.moe_layers is None else self.moe_layers)
        else:
            object.__setattr__(self, "moe_layers", 0)
        if self.params is None:
            object.__setattr__(self, "params", self._count_params(self.experts))

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_projections(self) -> dict[str, tuple[int, int]]:
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        if self.fused_projections:
            return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h)}
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}

    def mlp_projections(self) -> dict[str, tuple[int, int]]:
        """A dense layer's MLP (every layer of a dense model, none of a mixture whose every layer is one)."""
        h, i = self.hidden, self.intermediate
        if self.fused_projections:
            return {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
        return {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def expert_projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) of one expert's fused gate_up_proj and down_proj (transformers 5's 3-D expert parameters)."""
        h, i = self.hidden, self.expert_intermediate
        return {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)} if self.experts else {}

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear layer of a decoder layer, by the family's module names.

        These are the modules LoRA adapts by default (``training.model.projection_names`` finds the same
        names in the loaded model); a mixture's experts are not among them (``expert_projections``).
        """
        mlp = self.mlp_projections() if self.dense_layers else {}
        return self.attention_projections() | mlp

    def projection_layers(self, name: str) -> int:
        """How many layers hold the projection ``name`` (a dense MLP's only the dense layers)."""
        return self.layers if name in self.attention_projections() else self.dense_layers

    @property
    def layer_linear_params(self) -> int:
        """Weights of the decoder layers' linear projections: what QLoRA quantizes to NF4 (bitsandbytes quantizes
        ``nn.Linear`` layers only: a mixture's experts and router are not among them)."""
        return sum(self.projection_layers(name) * a * b for name, (a, b) in self.projections().items())

    @property
    def active_params(self) -> int:
        """Parameters a token goes through: every one of a dense model, the top-k experts of a mixture."""
        return self._count_params(self.experts_per_token) if self.experts else self.params

    @property
    def active_matmul_params(self) -> int:
        """``matmul_params`` of the experts a token goes through: what its FLOPs cost."""
        return self.matmul_params - (self.params - self.active_params)

    @property
    def mlp_width(self) -> int:
        """The MLP width a token's activations take: a dense model's intermediate size, a mixture's top-k experts'."""
        return self.experts_per_token * self.expert_intermediate if self.experts else self.intermediate

    def describe_params(self) -> str:
        """ "7.62B params", or for a mixture "20.91B params, 3.61B active (4 of 32 experts)"."""
        if not self.experts:
            return f"{_count(self.params)} params"
        return (
            f"{_count(self.params)} params, {_count(self.active_matmul_params)} active "
            f"({self.experts_per_token} of {self.experts} experts)"
        )

    def counts(self) -> dict:
        """What a plan shows of the model's size: its total and active parameters (a dense model's are the same), how
        many experts a token takes of how many, and ``describe_params``."""
        return {
            "total": self.params,
            "active": self.active_matmul_params if self.experts else self.params,
            "experts": self.experts,
            "experts_per_token": self.experts_per_token,
            "describe": self.describe_params(),
        }

    def _expert_size(self) -> int:
        size = sum(a * b for a, b in self.expert_projections().values())
        return size + (2 * self.expert_intermediate + self.hidden if self.expert_bias else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (the input embedding is a lookup)."""
        return self.params - (0 if self.tied_embeddings else self.embedding_params)

    def _count_params(self, experts: int) -> int:
        """Every parameter, with ``experts`` experts per MoE layer (all of them for ``params``, top-k for the active)."""
        per_layer = sum(a * b for a, b in self.attention_projections().values()) + self.layer_norms * self.hidden
        if self.qkv_bias or self.attention_bias:
            per_layer += self.q_dim + 2 * self.kv_dim
        if self.attention_bias:
            per_layer += self.hidden  # o_proj's
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.attention_sinks:
            per_layer += self.heads
        dense_mlp = sum(a * b for a, b in self.mlp_projections().values())
        if self.mlp_bias:
            dense_mlp += 2 * self.intermediate + self.hidden
        moe_mlp = experts * self._expert_size() + self.experts * self.hidden + (self.experts if self.router_bias else 0)
        embeddings = self.embedding_params * (1 if self.tied_embeddings else 2)
        mlps = self.dense_layers * dense_mlp + self.moe_layers * moe_mlp
        return self.layers * per_layer + mlps + embeddings + self.hidden  # + final norm

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str = "", params: int | None = None) -> ModelShape:
        """Build from a transformers config.json (as a dict). Multimodal configs: their ``text_config``."""
        if isinstance(config.get("text_config"), Mapping):
            config = config["text_config"]
        config = _with_class_defaults(config)
        moe = [key for key in MOE_KEYS if config.get(key)]
        model_type = str(config.get("model_type"))
        if moe and model_type not in MOE_LAYOUTS:
            raise ValueError(
                f"mixture-of-experts config ({', '.join(moe)}) of model_type {model_type!r}: the estimate counts the "
                f"experts of {', '.join(MOE_LAYOUTS)} only"
            )
        missing = [key for key in REQUIRED_SIZES if key not in config]
        if missing:
            raise ValueError(
                f"config.json of {name or 'the base model'} lacks {', '.join(missing)}: the estimate needs a "
                f"Llama-style decoder config with {', '.join(REQUIRED_SIZES)}"
            )
        heads = int(config["num_attention_heads"])
        layout = MOE_LAYOUTS.get(model_type) or LAYOUTS.get(model_type, DecoderLayout())
        layers = int(config["num_hidden_layers"])
        experts = experts_of(config)
        return cls(
            layers=layers,
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
            experts=experts,
            experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
            expert_intermediate=int(config.get("moe_intermediate_size") or 0) if experts else 0,
            moe_layers=_moe_layers(config, layers) if experts else None,
            expert_bias=layout.expert_bias,
            router_bias=layout.router_bias,
            attention_sinks=layout.attention_sinks,
            params=params,
            name=name or str(config.get("_name_or_path") or config.get("model_type") or ""),
        )


REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
OPTIONAL_SIZES = ("head_dim", "tie_word_embeddings", "num_key_value_heads")  # the class derives or defaults them


def _with_class_defaults(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``config`` with the sizes it leaves out at their transformers defaults, as the model is built from it.

    config.json files written by ``save_pretrained`` leave out what equals the class default: Gemma 3's hub
    ``text_config`` has no ``vocab_size``, ``head_dim`` or ``tie_word_embeddings`` (Gemma 3 4B's no head counts
    either). transformers is imported only for such a file; a model_type it does not know is returned as it is
    (``from_config`` then names what is missing).
    """
    missing = [key for key in (*REQUIRED_SIZES, *OPTIONAL_SIZES) if key not in config]
    if not missing or not config.get("model_type"):
        return config
    from transformers import AutoConfig
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the class's own checks of ids against a default vocab say nothing about sizes
    try:
        settings = {key: value for key, value in config.items() if key != "model_type"}
        built = AutoConfig.for_model(str(config["model_type"]), **settings).to_dict()
    except (ValueError, KeyError, TypeError):
        return config
    finally:
        logging.set_verbosity(verbosity)
    return {**{key: built[key] for key in missing if built.get(key) is not None}, **config}


def _count(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"


def _moe_layers(config: Mapping[str, Any], layers: int) -> int:
    """The layers whose MLP is a mixture: Qwen3-MoE's every ``decoder_sparse_step``-th but its ``mlp_only_layers``."""
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    return sum(1 for layer in range(layers) if layer not in dense and (layer + 1) % step == 0)


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


def lora_params(shape: ModelShape, lora_r: int, lora_targets: Sequence[str] = (), experts: bool = True) -> int:
    """Trainable LoRA parameters: r x (in + out) per adapted projection per layer (every projection by default),
    and with ``experts`` r x (in + out) per expert of each fused expert projection (PEFT's ``target_parameters``)."""
    projections = shape.projections()
    modules = sum(
        shape.projection_layers(name) * lora_r * sum(projections[name]) for name in lora_targets_of(shape, lora_targets)
    )
    expert = sum(lora_r * (a + b) for a, b in shape.expert_projections().values())
    return modules + (shape.moe_layers * shape.experts * expert if experts else 0)
