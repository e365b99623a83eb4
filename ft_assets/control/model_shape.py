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

A vision-language model (a config.json with a ``vision_config``: Qwen2.5-VL, Qwen3-VL, Gemma 3, Idefics3,
SmolVLM) is its language model (``text_config``, or Qwen2.5-VL's top-level sizes) plus a ``VisionShape``: the
tower (a ViT) and the projector into the language model's width, counted per family from ``vision_config`` alone
(``VISION_FAMILIES``; torch is not imported), and the largest image its processor makes, in the language model's
tokens (from the model's preprocessor_config.json: Qwen's ``max_pixels``, Idefics3's tiles). ``params`` stays the
language model's; ``vision.params`` is the rest. The counts equal those of transformers' class built on the meta
device for the released Qwen2.5-VL-7B-Instruct (676,550,144 vision of 8,292,166,656) and Gemma 3 12B, and for the
tiny models of every family in ``ft_assets_tests/vlm_families.py`` (``test_planner.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ft_assets.control.shipped_configs import shipped_preprocessor
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
    "qwen2_5_vl": DecoderLayout(qkv_bias=True, bias_settings=False),  # Qwen2.5-VL's language model is a Qwen2 decoder
    "qwen2_5_vl_text": DecoderLayout(qkv_bias=True, bias_settings=False),
    "qwen3_vl_text": DecoderLayout(qk_norm=True),
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
    params: int | None = None  # the language model's parameters; computed from the dimensions when None
    name: str = ""
    vision: VisionShape | None = None  # a vision-language model's tower and projector (their parameters not in params)

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

    @property
    def total_params(self) -> int:
        """Every parameter of the checkpoint: the language model's and a vision-language model's tower and projector."""
        return self.params + (self.vision.params if self.vision else 0)

    def describe_params(self) -> str:
        """ "7.62B params", for a mixture "20.91B params, 3.61B active (4 of 32 experts)", for a vision-language model
        "8.29B params, 0.68B of them vision"."""
        if self.vision:
            return f"{_count(self.total_params)} params, {_count(self.vision.params)} of them vision"
        if not self.experts:
            return f"{_count(self.params)} params"
        return (
            f"{_count(self.params)} params, {_count(self.active_matmul_params)} active "
            f"({self.experts_per_token} of {self.experts} experts)"
        )

    def counts(self) -> dict:
        """What a plan shows of the model's size: its total and active parameters (a dense model's are the same), how
        many experts a token takes of how many, a vision-language model's vision parameters, and ``describe_params``."""
        return {
            "total": self.total_params,
            "active": self.active_matmul_params if self.experts else self.total_params,
            "vision": self.vision.params if self.vision else 0,
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
    def from_config(
        cls,
        config: Mapping[str, Any],
        name: str = "",
        params: int | None = None,
        processor: Mapping[str, Any] | None = None,
    ) -> ModelShape:
        """Build from a transformers config.json (as a dict). Multimodal configs: their ``text_config``, and with a
        ``vision_config`` the vision side (``VisionShape``); ``params`` is then the whole checkpoint's count (the
        base_model asset's), and the language model's what the vision side leaves of it. ``processor`` is the model's
        preprocessor_config.json (the largest image it makes); None: the one shipped for hub id ``name``, if any, else
        the image processor's defaults."""
        top = config
        if isinstance(config.get("text_config"), Mapping):
            config = config["text_config"]
            if "tie_word_embeddings" not in config and "tie_word_embeddings" in top:  # a composite's own setting
                config = {**config, "tie_word_embeddings": top["tie_word_embeddings"]}
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
        vision = None
        if isinstance(top.get("vision_config"), Mapping):
            shipped = shipped_preprocessor(name) if processor is None and "/" in name else None
            where = "the given" if processor is not None else ("the shipped" if shipped is not None else "")
            vision = VisionShape.from_config(top, int(config["hidden_size"]), processor or shipped or {}, where)
            params = None if params is None else params - vision.params
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
            vision=vision,
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


# --- the vision side of a vision-language model -------------------------------------------------------------------

# The VLM's model_type -> the model_type of its vision config (transformers 5), whose class defaults fill what a
# released config.json leaves out (SmolVLM's has no intermediate_size or num_hidden_layers)
VISION_FAMILIES = {
    "qwen2_5_vl": "qwen2_5_vl_vision",
    "qwen3_vl": "qwen3_vl_vision",
    "gemma3": "siglip_vision_model",
    "idefics3": "idefics3_vision",
    "smolvlm": "smolvlm_vision",
}
# Those classes' defaults for the sizes the count reads, written out so that no transformers (and torch) import is
# needed; test_planner.py checks them against transformers' classes
SIGLIP_DEFAULTS = {"num_channels": 3, "num_hidden_layers": 12, "intermediate_size": 3072, "image_size": 224}
VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_5_vl_vision": {
        "depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3, "patch_size": 14,
        "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 3584, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
    "qwen3_vl_vision": {
        "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3, "patch_size": 16,
        "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 3584, "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
    },
    "siglip_vision_model": {
        **SIGLIP_DEFAULTS, "hidden_size": 768, "num_attention_heads": 12, "patch_size": 16, "vision_use_head": True,
    },
    "idefics3_vision": {**SIGLIP_DEFAULTS, "hidden_size": 1152, "num_attention_heads": 16, "patch_size": 32},
    "smolvlm_vision": {**SIGLIP_DEFAULTS, "hidden_size": 1152, "num_attention_heads": 16, "patch_size": 32},
}  # fmt: skip
MULTIMODAL_DEFAULTS = {
    "gemma3": {"mm_tokens_per_image": 256},
    "idefics3": {"scale_factor": 2},
    "smolvlm": {"scale_factor": 2},
}
QWEN_MAX_PIXELS = (
    28 * 28 * 1280
)  # transformers' Qwen2VLImageProcessor default (size.longest_edge): 1,280 tokens at patch 14
TILES_PER_SIDE = (
    4  # Idefics3/SmolVLM processors' default size.longest_edge: 4 tiles (1456 = 4 x 364; SmolVLM-256M 2048)
)


@dataclass(frozen=True)
class ImageLoad:
    """The images of a packed row, as the planner counts them: from the shards' stats, or assumed before any data."""

    per_row: float  # images in a packed row (the mean over the train split's rows)
    tokens_per_image: float  # the language model's tokens each image takes (its share of seq_len), mean
    source: str  # where the figures come from, in words (the plan shows it)

    @property
    def tokens_per_row(self) -> float:
        return self.per_row * self.tokens_per_image

    @classmethod
    def of_shards(cls, stats: Mapping[str, Any]) -> ImageLoad | None:
        """The mean row's images of tokenized_shards' ``stats`` (``images``, ``image_tokens``, ``train_packed_rows``);
        None for shards that do not count them (a text model's)."""
        if "images" not in stats or "image_tokens" not in stats:
            return None
        images, tokens, rows = int(stats["images"]), int(stats["image_tokens"]), max(int(stats["train_packed_rows"]), 1)
        return cls(
            images / rows,
            tokens / images if images else 0.0,
            f"the shards: {images:,} images, {tokens:,} image tokens in {rows:,} packed rows",
        )


@dataclass(frozen=True)
class VisionShape:
    """A vision-language model's tower (a ViT over image patches) and projector, as its family builds them.

    ``tower_params`` + ``projector_params`` equal transformers' count of the vision side (``VISION_MODULES`` of
    ``ft_assets.vision``); the projector is what ``train_vision: projector`` trains (Qwen's ``merger``, Gemma 3's
    ``multi_modal_projector``, Idefics3's ``connector``; Qwen3-VL's DeepStack mergers stay with the tower).
    """

    family: str  # the model's model_type (VISION_FAMILIES)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    patch_pixels: int  # values of one patch in pixel_values: channels x temporal patch x patch_size^2
    patches_per_token: int  # patches behind one of the language model's image tokens: 2x2 merge 4, Gemma 3's pool 16
    sequence_patches: int  # patches one attention sequence holds: an Idefics3 tile, a Gemma 3 image (0: the image)
    window_patches: int  # Qwen2.5-VL's windows (112 px: 64 patches) on its windowed layers; 0: none
    full_attention_layers: int  # layers over the whole sequence (Qwen2.5-VL's fullatt_block_indexes; else all)
    gated_mlp: bool  # SwiGLU (Qwen2.5-VL) rather than fc1 -> GELU -> fc2
    rotary_fp32: bool  # Qwen's vision rotary embedding computes q and k in fp32
    dense_masks: bool  # the trainer builds its packed rows' masks dense (Gemma 3's image attention): sdpa or eager only
    tower_params: int
    projector_params: int
    lookup_params: int  # position tables: parameters that take part in no matmul
    token_params: int  # tower parameters that act once per image token, not per patch (Qwen3-VL's DeepStack mergers)
    out_hidden: int  # the language model's width: an image token's feature
    projector_in: int  # width of the projector's input per image token
    projector_hidden: int  # width of its hidden layer (0: one matmul)
    linears: tuple[
        tuple[str, int, int], ...
    ]  # (name, in, out) of a tower block's linear layers: LoRA's under train_vision all
    max_image_tokens: int  # the largest image the processor makes, in the language model's tokens
    processor: str  # the processor's setting max_image_tokens follows from, and whose it is, in words

    @property
    def params(self) -> int:
        return self.tower_params + self.projector_params

    def patches(self, image_tokens: float) -> float:
        """Patches the tower sees for ``image_tokens`` of the language model's tokens."""
        return image_tokens * self.patches_per_token

    def assumed_images(self, seq_len: int) -> ImageLoad:
        """What a plan made before any data assumes: one image a row, the largest the processor makes, within the row
        (a longer example cannot be packed)."""
        tokens = min(self.max_image_tokens, seq_len)
        capped = f", capped at the row's {seq_len:,}" if tokens < self.max_image_tokens else ""
        return ImageLoad(
            1.0,
            float(tokens),
            f"assumed before any data: one image a packed row, the largest the processor makes: "
            f"{self.max_image_tokens:,} tokens at {self.processor}{capped}",
        )

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], text_hidden: int, processor: Mapping[str, Any], where: str = ""
    ) -> VisionShape:
        """The vision side of a VLM's config.json (``vision_config`` and the top level), its language model
        ``text_hidden`` wide, with the image limits of ``processor`` (a preprocessor_config.json; empty: the image
        processor's defaults), ``where`` saying whose ("the shipped", "the given")."""
        family = str(config.get("model_type"))
        if family not in VISION_FAMILIES:
            raise ValueError(
                f"vision-language model of model_type {family!r}: the estimate counts the vision towers of "
                f"{', '.join(VISION_FAMILIES)} only"
            )
        vision = {**VISION_DEFAULTS[VISION_FAMILIES[family]], **config["vision_config"]}
        top = {**MULTIMODAL_DEFAULTS.get(family, {}), **config}
        whose = f"{where} preprocessor_config.json" if where else "the image processor's default"
        build = {"qwen2_5_vl": _qwen_tower, "qwen3_vl": _qwen_tower, "gemma3": _siglip_tower}.get(family, _tiled_tower)
        return build(family, vision, top, text_hidden, processor, whose)


def _qwen_tower(family: str, v: Mapping, top: Mapping, text_hidden: int, processor: Mapping, whose: str) -> VisionShape:
    """Qwen2.5-VL's tower (RMSNorm, SwiGLU, window attention) or Qwen3-VL's (LayerNorm, GELU MLP, a learned position
    grid, DeepStack mergers), and the 2x2 patch merger."""
    h, i, layers, merge = v["hidden_size"], v["intermediate_size"], v["depth"], v["spatial_merge_size"]
    patch, out, qwen3 = v["patch_size"], v["out_hidden_size"], family == "qwen3_vl"
    channels = v.get("in_channels", v.get("in_chans", 3))
    pixels = channels * v["temporal_patch_size"] * patch**2
    merged = h * merge**2

    def merger(norm_width: int) -> int:  # a norm, Linear(merged, merged), Linear(merged, out)
        return norm_width * (2 if qwen3 else 1) + merged * merged + merged + merged * out + out

    mlp = (h * i + i + i * h + h) if qwen3 else (2 * (h * i + i) + i * h + h)
    block = (4 if qwen3 else 2) * h + (3 * h * h + 3 * h) + (h * h + h) + mlp
    positions = v.get("num_position_embeddings", 0) * h if qwen3 else 0
    deepstack = len(v.get("deepstack_visual_indexes") or ()) * merger(merged) if qwen3 else 0
    tower = h * pixels + (h if qwen3 else 0) + positions + layers * block + deepstack
    mlp_linears = (("linear_fc1", h, i), ("linear_fc2", i, h)) if qwen3 else (("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h))  # fmt: skip
    max_pixels = int(
        processor.get("max_pixels") or (processor.get("size") or {}).get("longest_edge") or QWEN_MAX_PIXELS
    )
    window = 0 if qwen3 else (v["window_size"] // patch) ** 2
    return VisionShape(
        family=family, layers=layers, hidden=h, intermediate=i, heads=v["num_heads"], patch_pixels=pixels,
        patches_per_token=merge**2, sequence_patches=0, window_patches=window,
        full_attention_layers=layers if qwen3 else len(v.get("fullatt_block_indexes") or ()), gated_mlp=not qwen3,
        rotary_fp32=True, dense_masks=False, tower_params=tower, projector_params=merger(h), lookup_params=positions,
        token_params=deepstack, out_hidden=out, projector_in=merged, projector_hidden=merged,
        linears=(("qkv", h, 3 * h), ("proj", h, h), *mlp_linears), max_image_tokens=max_pixels // (patch * merge) ** 2,
        processor=f"max_pixels {max_pixels:,} ({whose})",
    )  # fmt: skip


def _siglip_layers(v: Mapping) -> tuple[int, int, int, int]:
    """(embeddings, the encoder's layers and post-norm, position table, patches of an image) of a SigLIP-style tower
    (Gemma 3's SigLIP, Idefics3's and SmolVLM's): LayerNorms and biases everywhere, a GELU MLP."""
    h, i, patch = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    patches = (v["image_size"] // patch) ** 2
    positions = patches * h
    embeddings = h * v["num_channels"] * patch**2 + h + positions
    layer = 4 * h + 4 * (h * h + h) + (h * i + i) + (i * h + h)
    return embeddings, v["num_hidden_layers"] * layer + 2 * h, positions, patches


def _siglip_linears(v: Mapping) -> tuple[tuple[str, int, int], ...]:
    h, i = v["hidden_size"], v["intermediate_size"]
    return (("q_proj", h, h), ("k_proj", h, h), ("v_proj", h, h), ("out_proj", h, h), ("fc1", h, i), ("fc2", i, h))


def _siglip_tower(
    family: str, v: Mapping, top: Mapping, text_hidden: int, processor: Mapping, whose: str
) -> VisionShape:
    """Gemma 3: SigLIP at 896 px / patch 14 (4,096 patches an image), average-pooled to ``mm_tokens_per_image`` (256)
    tokens, RMS-normed and projected by one matmul; pan-and-scan crops, when the processor makes them, are images too."""
    h, i = v["hidden_size"], v["intermediate_size"]
    embeddings, encoder, positions, patches = _siglip_layers(v)
    head = (h + 4 * h * h + 4 * h + 2 * h + h * i + i + i * h + h) if v.get("vision_use_head") else 0  # pooling head
    tokens = int(top["mm_tokens_per_image"])
    crops = int(processor.get("pan_and_scan_max_num_crops") or 0) if processor.get("do_pan_and_scan") else 0
    crops_words = f" and up to {crops} pan-and-scan crops ({whose})" if crops else ""
    return VisionShape(
        family=family, layers=v["num_hidden_layers"], hidden=h, intermediate=i, heads=v["num_attention_heads"],
        patch_pixels=v["num_channels"] * v["patch_size"] ** 2, patches_per_token=patches // tokens,
        sequence_patches=patches, window_patches=0, full_attention_layers=v["num_hidden_layers"], gated_mlp=False,
        rotary_fp32=False, dense_masks=True, tower_params=embeddings + encoder + head,
        projector_params=h * text_hidden + h, lookup_params=positions, token_params=0, out_hidden=text_hidden,
        projector_in=h, projector_hidden=0, linears=_siglip_linears(v), max_image_tokens=tokens * (1 + crops),
        processor=f"mm_tokens_per_image {tokens}{crops_words}",
    )  # fmt: skip


def _tiled_tower(
    family: str, v: Mapping, top: Mapping, text_hidden: int, processor: Mapping, whose: str
) -> VisionShape:
    """Idefics3 / SmolVLM: a SigLIP-style tower over tiles of ``image_size`` px, pixel-shuffled by ``scale_factor``^2
    into the tokens of a tile, then one matmul; an image is rows x cols tiles (up to ``size.longest_edge``) plus one
    global tile."""
    h, i, scale, tile = v["hidden_size"], v["intermediate_size"], int(top["scale_factor"]), v["image_size"]
    embeddings, encoder, positions, patches = _siglip_layers(v)
    longest = (processor.get("size") or {}).get("longest_edge") or TILES_PER_SIDE * tile
    tile_edge = (processor.get("max_image_size") or {}).get("longest_edge") or tile
    side = math.ceil(longest / tile_edge) if processor.get("do_image_splitting", True) else 1
    tiles = side * side + (1 if side > 1 else 0)  # the global tile beside a split image
    return VisionShape(
        family=family, layers=v["num_hidden_layers"], hidden=h, intermediate=i, heads=v["num_attention_heads"],
        patch_pixels=v["num_channels"] * v["patch_size"] ** 2, patches_per_token=scale**2, sequence_patches=patches,
        window_patches=0, full_attention_layers=v["num_hidden_layers"], gated_mlp=False, rotary_fp32=False,
        dense_masks=False, tower_params=embeddings + encoder, projector_params=h * scale**2 * text_hidden,
        lookup_params=positions, token_params=0, out_hidden=text_hidden, projector_in=h * scale**2, projector_hidden=0,
        linears=_siglip_linears(v), max_image_tokens=tiles * patches // scale**2,
        processor=f"{side} x {side} tiles of {tile} px{' and the global one' if side > 1 else ''} (size.longest_edge "
        f"{longest}, {whose})",
    )  # fmt: skip
