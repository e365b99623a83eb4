"""What a fine-tune needs from a GPU: peak memory per GPU, FLOPs per token and tokens/s, from the model's shape.

Before a training run rents anything, the planner estimates peak VRAM from the base model's shape
(``ModelShape``, read from its config.json by ``model_shape.py``) and its speed on a GPU offering;
``ft_assets.control.gpu_plan`` then picks the cheapest offering and GPU count that fit, the rental
mode, and prices the run. How each constant below was checked (published tables, a GPU run):
docs/validation/planner-calibration.md.

Peak VRAM (``estimate_vram``), bytes, for N parameters, L layers, hidden h, query width q = heads x
head_dim, key/value width kv = kv_heads x head_dim, MLP width i, vocabulary V and T = seq_len x batch
tokens per micro-batch. It models the training plane's recipe (``ft_assets.training.recipe``):

    weights + trainable state
      full   16 N             fp32 master weights 4 + fp32 grads 4 + AdamW m, v 8 (ZeRO paper, sec. 3.1:
                              16 bytes/param for mixed-precision Adam)
      lora    2 N + 16 A      frozen bf16 base; A adapter params in fp32 (PEFT upcasts them) + grads + AdamW
      qlora 0.516 Nq + 4 (N - Nq) + 16 A
                              Nq = decoder-layer linear weights in NF4 with double quantization: 4 + 0.127
                              bits/param (QLoRA paper, sec. 3); embeddings, lm_head and norms are upcast
                              to fp32 by peft.prepare_model_for_kbit_training
      A = r x sum(in + out) over the adapted projections x L
    activations (bf16; the attention scores are a term of their own)
      per layer per token  8h + 6q + 4kv + 8i   (norm inputs, q/k/v, attention out, o_proj input, the
                                                four SwiGLU tensors), plus for LoRA per adapted projection
                                                (2 or 3) x in + 2r (adapter input copy, dropout mask)
      with gradient checkpointing  L x 2h x T (each layer's input) + one layer recomputed in backward
      without                      L x per-layer x T
    attention scores  10 x heads x seq^2 x batch bytes, for one layer with checkpointing (all L without),
              only on the sdpa/eager path: a packed row's block-diagonal mask is a dense mask, and they
              keep per-head scores (bf16 2 + fp32 softmax 4 + bf16 probabilities 2 + their gradient 2).
              flash_attention_2 (varlen from position_ids) and flex_attention (document mask) keep none.
      logits  16 V x T_logits: bf16 logits, their fp32 upcast in the loss, fp32 log-softmax kept for
              backward, its fp32 gradient and the bf16 one back into lm_head. T_logits = T with a
              full-logit loss (Hugging Face's), one chunk (``training.chunking.chunk_tokens``: 64 MiB of fp32
              logits) with the recipe's chunked loss.
    slack     4% of all the tensors above: what the caching allocator reserves beyond what is allocated
              (block rounding, fragmentation).
    overhead  0.6 GiB: the CUDA context (CUDA 13 driver, lazy module loading).

The plan keeps 10% VRAM headroom on top. What that gives for the recipe's own path (chunked loss, flash
or flex attention; batch 1, gradient checkpointing, LoRA r=16 on all seven projections, dropout 0.05;
``python -m scripts.planner_tables`` prints it):

    GiB at seq 512 / 2048   qlora          lora           full
    Qwen2.5-0.5B            1.8 / 2.0      2.0 / 2.2      8.6 / 8.7
    Llama-2-7B              6.0 / 6.8     14.8 / 15.6    105.5 / 106.1
    Llama-2-13B             9.8 / 10.9    27.4 / 28.5    202.9 / 203.8
    Llama-2-70B            41.2 / 44.1   138.6 / 141.4  1070.6 / 1073.1

With a full-logit loss the 0.5B column would be mostly logits: Qwen's 151,936-token vocabulary costs
2.3 GiB per 1k tokens; chunked, one 64 MiB chunk's worth.

Throughput: hardware FLOPs per token = 2 x matmul params x (1 forward + 2 backward for full, 1 for
LoRA whose frozen weights need input gradients only + 1 recompute with checkpointing) + causal
attention 2 x L x seq x q x (1 + 2 + 1 recompute): the 6N rule of Kaplan et al., with attention as in
PaLM's appendix B, halved for the causal mask. tokens/s = bf16 TFLOPS x MFU(method) x mfu_scale(tier)
/ FLOPs per token, with the assumptions of the cost model. For Llama-2-7B LoRA at 2048 tokens
(41.8 GFLOP/token) that is ~2,990 tokens/s on an A100, ~670 on an A10G and ~1,580 on an RTX 4090.

On W GPUs (``gpus``, ``parallelism``; the recipe's ``ft_assets.training.parallelism``):

    ddp   every GPU holds all of the above, plus DDP's gradient buckets: a second copy of the
          gradients (the reducer's flat buckets; LoRA: megabytes, full: 4 N)
    fsdp  weights, adapter, gradients and AdamW state / W (FSDP2 shards every parameter, frozen
          ones too), plus what is gathered at the peak: the root's parameters (embeddings, lm_head,
          final norm; not resharded between forward and backward) and two decoder layers (the one
          computing and the one prefetched), in compute precision, and for full fine-tuning those
          two layers' unsharded fp32 gradients before their reduce-scatter. Activations, scores and
          logits do not shrink: each GPU runs its own micro-batches.

    GiB per GPU, seq 2048, batch 1, checkpointing, LoRA r=16 (python -m scripts.planner_tables)
    Llama-2-13B full  1 GPU 203.8   fsdp 2: 107.3   4:  56.8   8:  31.6
    Llama-2-13B lora  1 GPU  28.5   fsdp 2:  17.3   4:  10.7   8:   7.5

Tokens/s on W GPUs: W x one GPU's x ``SCALING_EFFICIENCY`` (0.9 within a node, 0.8 across nodes:
assumptions for gradient all-reduce / FSDP all-gathers overlapping compute on NVLink / InfiniBand).

A vision-language model (``ModelShape.vision``: Qwen2.5-VL, Qwen3-VL, Gemma 3, Idefics3, SmolVLM) adds its vision
side, V parameters of tower and projector (``model_shape.VisionShape``, counted from ``vision_config``). Its image
tokens are ordinary tokens of the packed rows: they count in seq_len, so every term above stands as it is. Per
micro-batch the tower sees the rows' images, P patches = image tokens x patches a token (Qwen's 2x2 merge 4; Gemma 3's
4,096 patches pooled to 256 tokens, 16; Idefics3's pixel shuffle, scale_factor^2). With ``train_vision: none`` (the
default: tower and projector frozen, kept out of QLoRA's 4-bit):

    vision          2 V (bf16; 4 V under full fine-tuning) + the micro-batch's pixel values (fp32, as the image
                    processor returns them: 4 x channels x temporal patch x patch^2 a patch); whole on every GPU
    vision_forward  max(0, tower peak - (activations + attention + logits)). The frozen tower keeps no graph, and it
                    runs and frees its tensors before the first decoder layer, so its transient peak only counts
                    where it is the larger: one layer's live tensors a patch, the larger of 12 h_v bf16 (+ 3 h_v fp32
                    for Qwen's rotary embedding) and bf16 (2 h_v + 3 i_v, 2 i_v without a gated MLP), plus the image
                    features (bf16, the language model's width a token), plus under eager attention the tower's
                    scores (10 bytes x heads x span^2: Qwen's sequences one at a time, the others' images batched)
    FLOPs a token   + images a row x (2 x the tower's matmul params x P_image + 4 x layers x P_image x span x h_v
                    + 2 x projector params x image tokens) / seq_len, forward only; span = the patches a patch attends
                    over: Qwen2.5-VL's 112-px windows (64 patches) but on its fullatt_block_indexes, a Gemma 3 image,
                    an Idefics3 tile

``train_vision: projector`` trains the projector in full (16 bytes a parameter, as the adapter's; its input, norm and
hidden activations kept per image token; a backward for its weight gradients); ``all`` adds LoRA on the tower's linear
layers (full fine-tuning: the tower's weights), whose activations are kept like a decoder's and whose backward and
recompute the FLOPs count. Gemma 3's packed rows get dense masks from the trainer, so ``auto`` plans sdpa there.
The images a row are the shards' (``images`` and ``image_tokens`` over ``train_packed_rows``: the mean row) or, before
any data, the processor's own limit, stated in the plan: one image a row, the largest the processor makes, within the
row (Qwen2.5-VL-7B-Instruct's max_pixels 12,845,056: 16,384 tokens, so a whole 4,096-token row). Qwen2.5-VL-7B QLoRA
at 4,096 x 2 tokens that way: 14.6 GiB, 1.4 of it the vision side (``examples/qwen2.5-vl-7b-qlora-24gb.yaml``).

Objectives that do more than a forward and a backward per trained token (``objective_cost``): with
F = flops_per_token and f = its forward alone (2 x matmul params + 2 x L x seq x q),

    DPO    F + f                     the reference's forward (the base, adapter disabled, no gradients)
    GRPO   F + r f + (1 - g) f + g f x MFU(method) / MFU_decode
           r = 1 when grpo_beta > 0 (the reference's forward), g = completion tokens / trained tokens
           (the rest is the prompt, prefilled at training efficiency), and the completions are decoded
           one token at a time: a decode step reads every weight once for the b = per_device_batch_size
           x num_generations sequences it extends, so it reaches MFU_decode = min(MFU(method), 0.5 x b /
           200): an arithmetic intensity of b FLOPs per weight byte (bf16) against a roofline ridge of
           ~200 FLOPs/byte (bf16 TFLOPS over memory bandwidth of the offerings' GPUs: A100 156, A10G 208,
           H100 295, L4 403), half of it reached by ``model.generate``. An assumption.

The plan divides that by F: the run's trained tokens times this factor are what it prices (the
plan's ``total_tokens``, training-equivalent); the hardware FLOPs per trained token (F + r f + f for
GRPO, without the decode discount) are what measured MFU is computed against. A GRPO row is one
micro-batch's sequences packed together: seq_len = b x (mean prompt + max_completion_length), batch 1;
the generation's KV cache is not planned (it is freed before the training forward).

Cost: hours = startup + tokens x epochs / tokens/s (x 1.1 on spot for restarts); cost = $/h x hours.
Rental mode follows the purpose: experiments that checkpoint run on spot, validation runs on-demand,
delivery rents no GPU (merge and export run on CPU).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from ft_assets.control.cost_model import GIB, CostModel, GpuOffering
from ft_assets.control.model_shape import ImageLoad, ModelShape, VisionShape, lora_params, lora_targets_of
from ft_assets.training.chunking import chunk_tokens
from ft_assets.training.config import AttentionImplementation, Method, Parallelism, TrainingConfig

if TYPE_CHECKING:  # a name for annotations only: the training step module imports torch
    from ft_assets.training.steps import StepWork

METHODS: tuple[Method, ...] = get_args(Method)  # ("qlora", "lora", "full")

BF16_BYTES = 2  # frozen LoRA base and every activation
FP32_BYTES = 4  # full FT's master weights and grads; LoRA adapters (PEFT upcasts them to fp32) and their grads;
# QLoRA's non-quantized params (embeddings, lm_head, norms) after prepare_model_for_kbit_training
ADAMW_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32; with fp32 weight and grad the ZeRO paper's 16 bytes/param
NF4_BYTES_PER_PARAM = (4 + 8 / 64 + 32 / (64 * 256)) / 8  # 4-bit codes + double-quantized absmax: 0.516 B
LOGITS_BYTES_PER_TOKEN_PER_VOCAB = 16  # bf16 logits 2 + fp32 upcast 4 + log-softmax 4 + grads 4 (fp32) + 2 (bf16)
DROPOUT_MASK_BYTES = 1  # torch keeps a bool mask per dropped element
SCORE_BYTES = (
    10  # per score element at the peak: bf16 scores 2 + fp32 softmax 4 + bf16 probabilities kept 2 + their grad 2
)
CUDA_CONTEXT_GIB = 0.6  # measured on the H200 (CUDA 13 driver, lazy module loading): NVML use minus torch reserved
ALLOCATOR_SLACK = 0.04  # reserved over allocated (block rounding, fragmentation), fitted on the H200 run
DENSE_SCORE_ATTENTION = ("sdpa", "eager")  # packed rows get a dense block mask: per-head seq x seq scores
LossPath = Literal["chunked", "full"]
GPUS_PER_NODE = 8  # the largest GPU host (8 x H100/A100 per node): more GPUs are more nodes
FSDP_GATHERED_LAYERS = 2  # decoder layers unsharded at once under FSDP: the one computing and the one prefetched
SCALING_EFFICIENCY = {"node": 0.9, "nodes": 0.8}  # throughput per GPU on several GPUs (an assumption, not measured)
# A vision-language model's tower and projector as the recipe loads them: bf16 beside the language model (kept out of
# QLoRA's 4-bit by llm_int8_skip_modules), fp32 under full fine-tuning (every weight is)
VISION_BYTES = {"qlora": BF16_BYTES, "lora": BF16_BYTES, "full": FP32_BYTES}
PIXEL_BYTES = FP32_BYTES  # pixel_values as the image processor returns them, on the GPU for the whole step
# One tower layer's live tensors per patch in a no-grad forward, in units of its hidden width h (bf16): the input, its
# norm, q/k/v, the attention output and the residual sum (12 h); Qwen's rotary embedding adds q and k in fp32 and a
# product (3 h fp32). Checked against torch's CPU memory timeline of full-width towers (test_planner.py;
# docs/validation/planner-calibration.md): Qwen2.5-VL +8%, Qwen3-VL -10%, SmolVLM +10%.
TOWER_ATTENTION_WIDTHS = 12
TOWER_ROTARY_FP32_WIDTHS = 3


@dataclass(frozen=True)
class VramEstimate:
    """Peak GPU memory of one training process (one GPU), by component (GiB)."""

    method: Method
    seq_len: int
    micro_batch: int
    grad_checkpointing: bool
    attention: str  # the attention backend planned for
    loss: LossPath
    gpus: int  # GPUs the run is spread over; every figure is per GPU
    parallelism: Parallelism
    trainable_params: int
    weights_gib: (
        float  # model weights as stored (fp32 master, bf16 or NF4 + fp32 rest); FSDP: the shard + what is gathered
    )
    adapter_gib: float  # LoRA adapter weights (0 for full)
    gradients_gib: float
    optimizer_gib: float  # AdamW exp_avg + exp_avg_sq
    activations_gib: float  # saved for backward, logits and attention scores excluded
    attention_gib: float  # per-head score matrices (sdpa/eager with packed rows); 0 for flash/flex
    logits_gib: float  # every token's (full loss) or one chunk's (chunked loss)
    slack_gib: float  # the caching allocator's reserved-but-unused memory
    overhead_gib: float  # CUDA context
    vision_gib: float = 0.0  # a vision-language model's tower and projector weights and the micro-batch's pixels
    vision_forward_gib: float = 0.0  # what the frozen tower's forward peak adds beyond the decoder's (0: it is smaller)
    tower_peak_gib: float = 0.0  # the tower's forward peak itself (one layer's tensors, the image features): not a part
    images: ImageLoad | None = None  # the images a row the estimate counts, and where that figure comes from

    PARTS = (
        "weights", "vision", "adapter", "gradients", "optimizer", "activations", "vision_forward", "attention", "logits",
        "slack", "overhead",
    )  # fmt: skip

    @property
    def total_gib(self) -> float:
        return sum(getattr(self, part + "_gib") for part in self.PARTS)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_gib": self.total_gib}

    def breakdown(self) -> str:
        shown = ", ".join(
            f"{p} {getattr(self, p + '_gib'):.1f}" for p in self.PARTS if getattr(self, p + "_gib") >= 0.05
        )
        return f"{self.total_gib:.1f} GiB ({shown})"


@dataclass(frozen=True)
class PlanRequest:
    """One run as the planner sees it: the model, the run's settings, its method and what its objective computes.

    ``settings`` is the run's ``TrainingConfig`` (LoRA rank, targets and dropout, attention, gradient
    checkpointing, processes x nodes, parallelism): every default is TrainingConfig's, declared there once.
    ``work`` is the objective's ``StepWork`` (rows of seq_len, micro-batch, trained tokens, the reference's
    forward, generation). ``training_plan`` makes one from the data; ``ft-assets plan`` from its options.
    """

    shape: ModelShape
    settings: TrainingConfig
    method: Method  # settings.method resolved (ResolvedTraining.method): which weights train
    work: StepWork
    loss: LossPath = "chunked"  # the recipe's (ft_assets.training.loss); "full": Hugging Face's loss over every logit
    # a vision-language model's images a row: the shards' counts (ImageLoad.of_shards), or None before any data: the
    # largest image its processor makes, one a row (VisionShape.assumed_images)
    images: ImageLoad | None = None

    def planned_images(self) -> ImageLoad | None:
        """The images a row the plan counts: the request's, else the assumption; None for a text model."""
        if self.shape.vision is None:
            return None
        return self.images or self.shape.vision.assumed_images(self.work.seq_len)

    def variant(self, method: Method, grad_checkpointing: bool, micro_batch: int) -> PlanRequest:
        """The same run with another method, gradient checkpointing or micro-batch (what a no-fit suggests)."""
        settings = self.settings.model_copy(update={"gradient_checkpointing": grad_checkpointing})
        return replace(self, method=method, settings=settings, work=replace(self.work, micro_batch=micro_batch))


def estimate_vram(
    request: PlanRequest, gpus: int | None = None, parallelism: Parallelism | None = None
) -> VramEstimate:
    """Peak VRAM of one GPU of the run, on ``gpus`` GPUs with ``parallelism`` (the settings' processes x nodes and
    parallelism unless given; formula in the module docstring).

    The settings' ``attn_implementation`` and the request's ``loss`` name the path: the recipe's default
    (``auto``: flash or flex attention on a GPU, and the chunked loss of ``ft_assets.training.loss``), or
    e.g. sdpa and the full-logits loss of a plain Hugging Face run.
    """
    shape, method, settings, loss = request.shape, request.method, request.settings, request.loss
    seq_len, micro_batch, attention = request.work.seq_len, request.work.micro_batch, settings.attn_implementation
    if attention == "auto" and shape.vision is not None and shape.vision.dense_masks:
        attention = "sdpa"  # the trainer's dense masks (Gemma 3): auto resolves to sdpa on a GPU
    gpus = settings.world_size if gpus is None else gpus
    parallelism = parallelism or settings.parallelism
    _check_inputs(method, seq_len, micro_batch, gpus, attention, loss, parallelism)
    grad_checkpointing = settings.gradient_checkpointing
    tokens = seq_len * micro_batch
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.mlp_width
    per_layer_token = BF16_BYTES * (2 * h + 3 * q + 2 * kv) + BF16_BYTES * (2 * h + 4 * i)  # attention + MLP
    trainable, weights, adapter, gradients, optimizer, adapter_per_token = _model_state(shape, method, settings)
    per_layer_token += adapter_per_token
    weights, adapter, gradients, optimizer = _per_gpu(
        shape, method, (weights, adapter, gradients, optimizer), gpus, parallelism
    )
    layers_alive = 1 if grad_checkpointing else shape.layers  # whose saved tensors coexist at the peak
    if grad_checkpointing:
        activations = shape.layers * BF16_BYTES * h * tokens + per_layer_token * tokens
    else:
        activations = shape.layers * per_layer_token * tokens
    scores = 0
    if attention in DENSE_SCORE_ATTENTION:  # dense per-row scores: the documents of a packed row do not shrink them
        scores = layers_alive * SCORE_BYTES * shape.heads * seq_len**2 * micro_batch
    logit_tokens = tokens if loss == "full" else min(tokens, chunk_tokens(shape.vocab))
    logits = LOGITS_BYTES_PER_TOKEN_PER_VOCAB * shape.vocab * logit_tokens
    images, vision, tower_peak = request.planned_images(), 0.0, 0.0
    if shape.vision is not None:
        image_tokens = micro_batch * images.tokens_per_row
        vision = VISION_BYTES[method] * shape.vision.params
        vision += PIXEL_BYTES * shape.vision.patch_pixels * shape.vision.patches(image_tokens)
        activations += _vision_saved(shape.vision, method, settings, image_tokens)
        tower_peak = tower_forward_peak(shape.vision, images, micro_batch, attention)
    vision_forward = max(0.0, tower_peak - (activations + scores + logits))  # the tower runs before the decoder's peak
    tensors = weights + vision + adapter + gradients + optimizer + activations + vision_forward + scores + logits
    return VramEstimate(
        method=method,
        seq_len=seq_len,
        micro_batch=micro_batch,
        grad_checkpointing=grad_checkpointing,
        attention=attention,
        loss=loss,
        gpus=gpus,
        parallelism=parallelism,
        trainable_params=trainable,
        weights_gib=weights / GIB,
        adapter_gib=adapter / GIB,
        gradients_gib=gradients / GIB,
        optimizer_gib=optimizer / GIB,
        activations_gib=activations / GIB,
        attention_gib=scores / GIB,
        logits_gib=logits / GIB,
        slack_gib=ALLOCATOR_SLACK * tensors / GIB,
        overhead_gib=CUDA_CONTEXT_GIB,
        vision_gib=vision / GIB,
        vision_forward_gib=vision_forward / GIB,
        tower_peak_gib=tower_peak / GIB,
        images=images,
    )


def _check_inputs(method, seq_len, micro_batch, gpus, attention, loss, parallelism) -> None:
    """A ValueError naming what ``estimate_vram`` cannot plan (TrainingConfig has checked the settings' ranges)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    if loss not in get_args(LossPath) or attention not in get_args(AttentionImplementation):
        raise ValueError(f"unknown loss {loss!r} or attention {attention!r}")
    if seq_len < 1 or micro_batch < 1 or gpus < 1:
        raise ValueError(f"seq_len, micro_batch and gpus must be >= 1 (got {seq_len}, {micro_batch}, {gpus})")
    if parallelism not in get_args(Parallelism):
        raise ValueError(f"unknown parallelism {parallelism!r}: use one of {', '.join(get_args(Parallelism))}")


def _model_state(
    shape: ModelShape, method: Method, settings: TrainingConfig
) -> tuple[int, float, float, float, float, float]:
    """(trainable parameters, weight, adapter, gradient and AdamW bytes of the whole model, the adapter's saved bytes
    per token and layer) of ``method``: full trains every fp32 weight; LoRA and QLoRA train the adapter beside bf16
    or NF4 weights and save each targeted projection's input (and dropout mask) and its rank-r product."""
    vision = _vision_trainable(shape.vision, method, settings)
    if method == "full":
        trained = shape.params + vision
        return trained, FP32_BYTES * shape.params, 0, FP32_BYTES * trained, ADAMW_STATE_BYTES * trained, 0
    lora_r, lora_targets = settings.lora_r, settings.target_modules
    trainable = lora_params(shape, lora_r, lora_targets, experts=settings.lora_experts) + vision
    if method == "lora":
        weights = BF16_BYTES * shape.params
    else:
        quantized = shape.layer_linear_params
        weights = NF4_BYTES_PER_PARAM * quantized + FP32_BYTES * (shape.params - quantized)
    saved_per_input = BF16_BYTES + (DROPOUT_MASK_BYTES if settings.lora_dropout > 0 else 0)
    projections = shape.projections()
    per_token = sum(
        saved_per_input * projections[t][0] + BF16_BYTES * lora_r for t in lora_targets_of(shape, lora_targets)
    )
    if settings.lora_experts:  # each of the top-k experts a token goes through saves its input and rank-r product
        per_token += shape.experts_per_token * sum(
            saved_per_input * a + BF16_BYTES * lora_r for a, _ in shape.expert_projections().values()
        )
    return trainable, weights, FP32_BYTES * trainable, FP32_BYTES * trainable, ADAMW_STATE_BYTES * trainable, per_token


def _per_gpu(
    shape: ModelShape, method: Method, whole: tuple[float, ...], gpus: int, parallelism: Parallelism
) -> tuple[float, ...]:
    """Weights, adapter, gradients and AdamW bytes of the whole model -> what one of ``gpus`` GPUs holds (docstring)."""
    weights, adapter, gradients, optimizer = whole
    if gpus == 1:
        return whole
    if parallelism == "ddp":
        return weights, adapter, 2 * gradients, optimizer  # + the reducer's buckets, a copy of every gradient
    root = shape.embedding_params * (1 if shape.tied_embeddings else 2) + shape.hidden
    layer = (shape.params - root) / shape.layers
    if method == "qlora":  # 4-bit layers gathered as they are stored; the root upcast to fp32, cast to bf16 for compute
        gathered = (
            FSDP_GATHERED_LAYERS * shape.layer_linear_params / shape.layers * NF4_BYTES_PER_PARAM + BF16_BYTES * root
        )
    else:
        gathered = BF16_BYTES * (root + FSDP_GATHERED_LAYERS * layer)
    unsharded_grads = FSDP_GATHERED_LAYERS * layer * FP32_BYTES if method == "full" else 0
    return weights / gpus + gathered, adapter / gpus, gradients / gpus + unsharded_grads, optimizer / gpus


def _tower_linears(vision: VisionShape, settings: TrainingConfig) -> list[tuple[str, int, int]]:
    """The tower's linear layers LoRA adapts under ``train_vision: all``: those of ``target_modules`` (a name matches the
    tower's as the language model's), or every one when empty."""
    named = {target.rsplit(".", 1)[-1] for target in settings.target_modules}
    return [linear for linear in vision.linears if not named or linear[0] in named]


def _vision_trainable(vision: VisionShape | None, method: Method, settings: TrainingConfig) -> int:
    """Trained parameters of a vision-language model's vision side: none by default (``train_vision: none``); the
    projector in full (``projector``); and with ``all`` LoRA on the tower's linear layers (full fine-tuning: every
    tower weight). PEFT trains the projector as a copy (``modules_to_save``), counted with the adapter in fp32."""
    if vision is None or settings.train_vision == "none":
        return 0
    tower = 0
    if settings.train_vision == "all":
        lora = vision.layers * settings.lora_r * sum(a + b for _, a, b in _tower_linears(vision, settings))
        tower = vision.tower_params if method == "full" else lora
    return vision.projector_params + tower


def _vision_saved(vision: VisionShape, method: Method, settings: TrainingConfig, image_tokens: float) -> float:
    """Bytes the vision side keeps for backward when it trains: the projector's input, norm and hidden activations per
    image token, and under ``all`` the tower's like a decoder's (each layer's input with gradient checkpointing, plus
    one layer recomputed; LoRA's inputs on top but under full fine-tuning). 0 when it is frozen: its forward builds no
    graph."""
    if settings.train_vision == "none":
        return 0.0
    saved = BF16_BYTES * (2 * vision.projector_in + 2 * vision.projector_hidden) * image_tokens
    if settings.train_vision == "all":
        patches, h = vision.patches(image_tokens), vision.hidden
        lora_input = BF16_BYTES + (DROPOUT_MASK_BYTES if settings.lora_dropout > 0 else 0)
        lora = sum(lora_input * a + BF16_BYTES * settings.lora_r for _, a, _ in _tower_linears(vision, settings))
        per_layer = BF16_BYTES * (8 * h + 4 * vision.intermediate) + (0 if method == "full" else lora)
        if settings.gradient_checkpointing:
            saved += vision.layers * BF16_BYTES * h * patches + per_layer * patches
        else:
            saved += vision.layers * per_layer * patches
    return saved


def tower_forward_peak(vision: VisionShape, images: ImageLoad, micro_batch: int, attention: str) -> float:
    """The frozen tower's forward peak over a micro-batch's images, bytes: one layer's live tensors per patch (the
    larger of its attention and MLP stages), the image features it hands the language model, and under eager
    attention the score matrices (Qwen's packed sequence one image or window at a time, the others' images batched)."""
    h, i = vision.hidden, vision.intermediate
    image_tokens = micro_batch * images.tokens_per_row
    attention_stage = BF16_BYTES * TOWER_ATTENTION_WIDTHS * h + (
        FP32_BYTES * TOWER_ROTARY_FP32_WIDTHS * h if vision.rotary_fp32 else 0
    )
    mlp_stage = BF16_BYTES * (2 * h + (3 if vision.gated_mlp else 2) * i)
    peak = (
        max(attention_stage, mlp_stage) * vision.patches(image_tokens) + BF16_BYTES * vision.out_hidden * image_tokens
    )
    if attention == "eager" and image_tokens:
        image = vision.patches(images.tokens_per_image)
        span = min(vision.sequence_patches or image, image)
        sequences = 1 if not vision.sequence_patches else micro_batch * images.per_row * image / span
        peak += SCORE_BYTES * vision.heads * span**2 * sequences
    return peak


def _tower_attention_flops(vision: VisionShape, patches: float) -> float:
    """One image's attention FLOPs in the tower, forward: QK^T and AV over each sequence (a tile, an image, Qwen2.5-VL's
    64-patch windows on its windowed layers), no causal mask."""
    full = min(vision.sequence_patches or patches, patches)
    windowed = min(vision.window_patches, full) if vision.window_patches else full
    spans = vision.full_attention_layers * full + (vision.layers - vision.full_attention_layers) * windowed
    return 4 * patches * vision.hidden * spans


def vision_flops_per_token(
    shape: ModelShape,
    method: Method,
    seq_len: int,
    grad_checkpointing: bool,
    images: ImageLoad | None,
    train_vision: str = "none",
) -> float:
    """Hardware FLOPs of a vision-language model's vision side per token of a row (module docstring): the tower's
    forward (2 x its matmul parameters per patch + attention) and the projector's (2 x its parameters per image token)
    over the row's images, and their backward where they train; 0 for a text model or a row without images."""
    vision = shape.vision
    if vision is None or images is None or not images.per_row:
        return 0.0
    patches = vision.patches(images.tokens_per_image)
    per_patch = vision.tower_params - vision.lookup_params - vision.token_params
    tower = 2 * per_patch * patches + 2 * vision.token_params * images.tokens_per_image
    attention = _tower_attention_flops(vision, patches)
    projector = 2 * vision.projector_params * images.tokens_per_image
    if train_vision == "all":  # LoRA's input gradients through every layer (full: weight gradients too), recomputed
        recompute = 1 if grad_checkpointing else 0
        tower = tower * (1 + (2 if method == "full" else 1) + recompute) + attention * (1 + 2 + recompute)
        projector *= 1 + 2  # weight and input gradients
    else:
        tower += attention
        projector *= 2 if train_vision == "projector" else 1  # its weight gradients (its input needs none)
    return images.per_row * (tower + projector) / seq_len


def flops_per_token(
    shape: ModelShape,
    method: Method,
    seq_len: int,
    grad_checkpointing: bool,
    images: ImageLoad | None = None,
    train_vision: str = "none",
) -> float:
    """Hardware FLOPs one trained token costs (module docstring); LoRA's own matmuls (<1%) left out. A vision-language
    model's ``images`` a row add the vision side's (``vision_flops_per_token``)."""
    forward_matmul = 2 * shape.active_matmul_params  # a mixture: the experts a token goes through
    forward_attention = 2 * shape.layers * seq_len * shape.q_dim  # QK^T and AV, halved by the causal mask
    recompute = 1 if grad_checkpointing else 0
    backward_matmul = 2 if method == "full" else 1
    vision = vision_flops_per_token(shape, method, seq_len, grad_checkpointing, images, train_vision)
    return forward_matmul * (1 + backward_matmul + recompute) + forward_attention * (1 + 2 + recompute) + vision


DECODE_RIDGE_FLOPS_PER_BYTE = (
    200.0  # bf16 TFLOPS / memory bandwidth of the offerings' GPUs: A100 156, A10G 208, H100 295, L4 403
)
DECODE_BANDWIDTH_SHARE = 0.5  # of the memory bandwidth model.generate sustains while decoding (an assumption)


def objective_cost(
    shape: ModelShape,
    method: Method,
    seq_len: int,
    grad_checkpointing: bool,
    reference_forward: bool,
    generated_share: float,
    decode_batch: int,
    training_mfu: float,
    images: ImageLoad | None = None,
    train_vision: str = "none",
) -> tuple[float, float]:
    """(hardware FLOPs per trained token, training-equivalent tokens per trained token) of an objective's step: the
    reference's forward (DPO; GRPO with beta > 0) and, for GRPO, generating ``generated_share`` of the tokens, decoded
    ``decode_batch`` sequences at a time (module docstring). SFT: (flops_per_token, 1.0). A vision-language model's
    forward runs its tower over the row's ``images`` too."""
    train = flops_per_token(shape, method, seq_len, grad_checkpointing, images, train_vision)
    forward = 2 * shape.active_matmul_params + 2 * shape.layers * seq_len * shape.q_dim
    forward += vision_flops_per_token(shape, method, seq_len, False, images)
    reference = forward if reference_forward else 0.0
    if not generated_share:
        return train + reference, (train + reference) / train
    decode_mfu = min(training_mfu, DECODE_BANDWIDTH_SHARE * decode_batch / DECODE_RIDGE_FLOPS_PER_BYTE)
    equivalent = (
        train + reference + (1 - generated_share) * forward + generated_share * forward * training_mfu / decode_mfu
    )
    return train + reference + forward, equivalent / train


def tokens_per_second(
    shape: ModelShape,
    method: Method,
    seq_len: int,
    grad_checkpointing: bool,
    offering: GpuOffering,
    cost_model: CostModel,
    gpus: int = 1,
    images: ImageLoad | None = None,
    train_vision: str = "none",
) -> float:
    """Assumed training throughput of ``gpus`` x ``offering``: bf16 peak x MFU over FLOPs per token (a vision-language
    model's with its ``images`` a row), per GPU, times the GPUs at ``SCALING_EFFICIENCY``."""
    sustained = offering.bf16_tflops * 1e12 * cost_model.mfu(method) * offering.mfu_scale
    scaling = 1.0 if gpus == 1 else SCALING_EFFICIENCY["node" if gpus <= GPUS_PER_NODE else "nodes"]
    flops = flops_per_token(shape, method, seq_len, grad_checkpointing, images, train_vision)
    return gpus * scaling * sustained / flops


@dataclass(frozen=True)
class Throughput:
    """How fast a run trains and what a token costs, on one GPU tier (planned or measured)."""

    tokens_per_second: float
    mfu: float | None  # model FLOPs/s over the tier's bf16 peak; None where the device's peak is unknown (CPU)
    usd_per_million_tokens: float | None  # None without a price or without throughput

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self)


def throughput(
    tokens_per_second: float, flops: float, offering: GpuOffering | None, usd_per_hour: float | None, gpus: int = 1
) -> Throughput:
    """MFU and $ per million tokens of ``tokens_per_second`` at ``flops`` per token (``flops_per_token``).

    ``offering`` is the GPU the tokens ran on (None for a CPU or an unknown device: no MFU), ``gpus`` how many
    of them made the tokens; the price is that of all of them, as the run is billed.
    """
    mfu = tokens_per_second * flops / (gpus * offering.bf16_tflops * 1e12) if offering is not None else None
    price = (
        usd_per_hour / (tokens_per_second * 3600) * 1e6 if usd_per_hour is not None and tokens_per_second > 0 else None
    )
    return Throughput(tokens_per_second=tokens_per_second, mfu=mfu, usd_per_million_tokens=price)
