"""A vision-language model's GGUF and its projector in llama.cpp's multimodal path (libmtmd), through llama-cpp-python.

llama.cpp runs a VLM from two files: the language model's GGUF and the vision projector's (``mmproj``: the image
encoder and the projection into the text model's width), both written by llama.cpp's converter
(``ft_assets.delivery.converter``, its ``--mmproj`` run). libmtmd (``llama_cpp.mtmd_cpp``) turns a prompt that holds
a media marker per image, and the images as RGB bitmaps, into chunks: text tokens, and for each image its encoder's
embeddings, framed by the tokens the family's processor puts around them (Qwen's ``<|vision_start|>``/``<|vision_end|>``,
Gemma 3's ``<start_of_image>``/``<end_of_image>``, Idefics3's tile tags); then it evaluates them in the language model.
``VisionModel`` is that path: the two files loaded, a prompt tokenized with its images, its chunks evaluated, the
logits after them, a greedy continuation. ``chat_answers`` answers image conversations with it, through the chat
template embedded in the GGUF, as llama.cpp's own front ends do.

``check_vision_file`` holds one GGUF + projector to transformers on picture prompts (``vision_reference``: the merged
model and its processor on the same pictures): the token ids (an image standing as its number of image tokens) must be
the processor's, and the next-token logits after each prompt within ``TOLERANCES`` (``rel_error``, as for text files).
Two things make the ids equal rather than close:

- **How a template's image becomes libmtmd's marker** (``MARKERS``, by the projector type in the mmproj file): the
  chat template writes Qwen's ``<|vision_start|><|image_pad|><|vision_end|>``, Gemma 3's ``<start_of_image>`` and
  Idefics3's ``<image>``, which the processor expands around the image tokens; libmtmd adds the framing itself, so the
  marker replaces the template's text, and for Gemma 3 keeps the blank lines its processor puts around each image.
- **Qwen-VL's image size.** Its processor resizes an image to between ``min_pixels`` and ``max_pixels``; libmtmd
  bounds it by 8 to 4096 tokens unless told otherwise (``image_min_tokens``/``image_max_tokens``: llama-mtmd-cli's
  and llama-server's ``--image-min-tokens``/``--image-max-tokens``), and does not read pixel bounds from a Qwen-VL
  projector. The converter writes the processor's bounds into the projector (fix 5), and ``VisionModel`` sets the
  two token bounds from them (``image_token_bounds``), so an image gets the processor's grid and token count. The
  tiny test models see 4 to 16 tokens an image; without the bounds libmtmd gives them at least 8.

Where libmtmd reads a picture otherwise than transformers, whatever the files: Qwen-VL and Gemma 3 keep an image's
aspect ratio and pad it to the size they resize to (transformers stretches it), and Qwen-VL rounds a side to its grid
half up (transformers: half to even). The probe pictures are square and of sizes that are no tie, so that the check
holds the files, not those choices; docs/guides/vision.md tells users.

Measured on the tiny random models of ``ft_assets_tests/vlm_families.py`` (``python -m ft_assets.delivery.mtmd
MODEL_DIR OUT_DIR``; the table in docs/guides/vision.md): token ids equal on every prompt, relative logit error
6e-4 to 3.7e-3 for F16 and 1.7e-2 to 9.5e-2 for Q8_0 (the projector F16 in both).

Imports ``llamacpp`` (loading, its stderr capture) and never the other way round: the text runtime stays free of
libmtmd.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ft_assets.delivery import llamacpp
from ft_assets.delivery.converter import MMPROJ_OUTTYPE
from ft_assets.delivery.gguf_export import logit_agreement, render_chat
from ft_assets.generation import answer_text

# Bound on rel_error of the logits after a picture prompt (projector F16, language model of each type). Measured on the
# tiny models: F32 2.7e-4 to 1.9e-3 (the F16 projector and KV cache), F16 6.1e-4 to 3.7e-3, Q8_0 1.7e-2 to 9.5e-2
# (docs/guides/vision.md); a wrong tensor layout, a lost image or a misplaced one lands at 0.2 and above.
TOLERANCES = {"f32": 1e-2, "f16": 1e-2, "q8_0": 0.15}
# What the chat template writes for an image -> what stands for it in libmtmd's prompt, by the projector's
# clip.projector_type. The marker is libmtmd's default (mtmd_default_marker).
MARKER = "<__media__>"
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
MARKERS = {
    "qwen2vl_merger": (QWEN_IMAGE, MARKER),
    "qwen2.5vl_merger": (QWEN_IMAGE, MARKER),
    "qwen3vl_merger": (QWEN_IMAGE, MARKER),
    "gemma3": ("<start_of_image>", f"\n\n{MARKER}\n\n"),
    "idefics3": ("<image>", MARKER),
}
# Projectors whose image size libmtmd bounds by token counts of its own (clip.cpp), not by the file's pixel bounds
TOKEN_BOUNDED = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")
# clip.cpp's spatial merge for a Qwen-VL projector that names none (Qwen2.5-VL's converter writes none)
QWEN_MERGE = 2

# Picture prompts of the check: one picture before the question, and two pictures of other sizes inside the text
# (Qwen-VL gives each its own number of tokens). "<image>" marks where each picture goes. Square pictures, of sizes
# that are no tie for Qwen-VL's rounding to its grid (see the module docstring).
VISION_PROMPTS = (
    ("<image>What is in the picture?", ((64, 64),)),
    ("Compare <image> with <image>: which is brighter?", ((120, 120), (72, 72))),
)
GGML_LOG_ERROR = 3  # libmtmd's log level that is printed (to sys.stderr, which a load captures); the rest is dropped
_log_callback = None  # the ctypes callback, kept alive while libmtmd holds it


def mmproj_file(stem: str) -> str:
    """The projector's file name beside ``<stem>-<qtype>.gguf``: ``<stem>-mmproj-f16.gguf`` (one for every type)."""
    return f"{stem}-{MMPROJ_OUTTYPE}.gguf"


def mmproj_path(gguf: str | Path) -> Path:
    """The projector beside a VLM's GGUF ``<stem>-<qtype>.gguf`` (whether it is there or not)."""
    gguf = Path(gguf)
    return gguf.with_name(mmproj_file(gguf.name.removesuffix(".gguf").rsplit("-", 1)[0]))


def projector_metadata(mmproj: str | Path) -> dict:
    """The projector file's ``clip.*`` keys (its type, patch size, pixel bounds)."""
    from gguf import GGUFReader

    fields = GGUFReader(mmproj).fields
    return {key: field.contents() for key, field in fields.items() if key.startswith("clip.")}


def image_token_bounds(metadata: dict) -> tuple[int, int]:
    """libmtmd's ``image_min_tokens``/``image_max_tokens`` that give a Qwen-VL image the processor's grid: the
    projector's pixel bounds in merged patches. (-1, -1), libmtmd's own, for any other projector or one without bounds."""
    if metadata.get("clip.projector_type") not in TOKEN_BOUNDED or "clip.vision.image_min_pixels" not in metadata:
        return -1, -1
    side = metadata["clip.vision.patch_size"] * metadata.get("clip.vision.spatial_merge_size", QWEN_MERGE)
    low, high = metadata["clip.vision.image_min_pixels"], metadata["clip.vision.image_max_pixels"]
    return -(-low // side**2), high // side**2


def rgb(image):
    """``image`` (a path, PNG/JPEG bytes or a PIL image) as a PIL RGB image."""
    from PIL import Image

    if isinstance(image, (str, Path)):
        image = Image.open(image)
    elif isinstance(image, bytes):
        image = Image.open(io.BytesIO(image))
    return image.convert("RGB")


class VisionModel:
    """A VLM's GGUF and its projector loaded in llama.cpp (libmtmd beside llama-cpp-python's ``Llama``). Close it."""

    def __init__(self, path: str | Path, mmproj: str | Path, n_ctx: int = llamacpp.N_CTX):
        from llama_cpp import mtmd_cpp

        self.path, self.mmproj, self.lib = Path(path), Path(mmproj), mtmd_cpp
        _quiet(mtmd_cpp)
        self.metadata = projector_metadata(mmproj)
        self.projector_type = self.metadata.get("clip.projector_type")
        if self.projector_type not in MARKERS:
            raise llamacpp.LlamaCppError(
                f"{self.mmproj.name}: a {self.projector_type} projector is not one checked here ({', '.join(MARKERS)})"
            )
        self.llm = llamacpp.load(path, n_ctx=n_ctx)
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu, params.print_timings, params.warmup = False, False, False
        params.n_threads = self.llm.n_threads
        params.image_min_tokens, params.image_max_tokens = image_token_bounds(self.metadata)
        with llamacpp.captured_stderr() as stderr:
            self.ctx = mtmd_cpp.mtmd_init_from_file(str(mmproj).encode(), self.llm.model, params)
        if not self.ctx:
            self.llm.close()
            reasons = [line.strip() for line in stderr().splitlines() if "error" in line.lower() or "failed" in line]
            raise llamacpp.LlamaCppError(
                f"libmtmd cannot load {mmproj} with {path}: {'; '.join(reasons) or 'no reason given'}"
            )
        self.vocab = llamacpp.require().llama_model_get_vocab(self.llm.model)

    def close(self) -> None:
        self.lib.mtmd_free(self.ctx)
        self.llm.close()

    def __enter__(self) -> VisionModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prompt_text(self, rendered: str) -> str:
        """A chat-rendered prompt as libmtmd takes it: each of the template's images replaced by the marker."""
        template_image, marked = MARKERS[self.projector_type]
        return rendered.replace(template_image, marked)

    def tokenize(self, text: str, images: list) -> Chunks:
        """libmtmd's chunks of ``text`` (markers where the images go, special tokens parsed, no BOS added: a rendered
        chat carries its own) with ``images`` (paths, bytes or PIL images), in order."""
        lib = self.lib
        bitmaps = []
        try:
            for image in images:
                picture = rgb(image)
                pixels = picture.tobytes()
                bitmaps.append(
                    lib.mtmd_bitmap_init(
                        picture.width, picture.height, (ctypes.c_uint8 * len(pixels)).from_buffer_copy(pixels)
                    )
                )
            encoded = text.encode("utf-8")
            prompt = lib.mtmd_input_text(text=encoded, text_len=len(encoded), add_special=False, parse_special=True)
            chunks = lib.mtmd_input_chunks_init()
            array = (lib.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
            status = lib.mtmd_tokenize(self.ctx, chunks, ctypes.byref(prompt), array, len(bitmaps))
            if status != 0:
                lib.mtmd_input_chunks_free(chunks)
                raise llamacpp.LlamaCppError(
                    f"libmtmd cannot tokenize a prompt of {len(images)} images with {self.mmproj.name} (status {status}: "
                    f"{'the markers and images differ in number' if status == 1 else 'an image failed to preprocess'})"
                )
            return Chunks(self, chunks)
        finally:
            for bitmap in bitmaps:
                lib.mtmd_bitmap_free(bitmap)

    def evaluate(self, chunks: Chunks) -> tuple[np.ndarray, int]:
        """Evaluate ``chunks`` from an empty cache: the logits after the last one and the next position."""
        llama_cpp = llamacpp.require()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.llm.ctx), True)
        n_past = llama_cpp.llama_pos(0)
        status = self.lib.mtmd_helper_eval_chunks(
            self.ctx, self.llm.ctx, chunks.handle, 0, 0, self.llm.n_batch, True, ctypes.byref(n_past)
        )
        if status != 0:
            raise llamacpp.LlamaCppError(
                f"libmtmd could not evaluate a prompt with {self.mmproj.name} (status {status})"
            )
        return self._last_logits(), n_past.value

    def greedy(self, chunks: Chunks, max_new_tokens: int) -> list[int]:
        """The greedy continuation of ``chunks``, up to and without the first end-of-generation token."""
        llama_cpp = llamacpp.require()
        logits, position = self.evaluate(chunks)
        batch = llama_cpp.llama_batch_init(1, 0, 1)
        out: list[int] = []
        try:
            while len(out) < max_new_tokens:
                token = int(logits.argmax())
                if llama_cpp.llama_vocab_is_eog(self.vocab, token):
                    break
                out.append(token)
                batch.n_tokens, batch.token[0], batch.pos[0] = (
                    1,
                    token,
                    position,
                )  # after an image: M-RoPE's own position
                batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = 1, 0, True
                if llama_cpp.llama_decode(self.llm.ctx, batch) != 0:
                    raise llamacpp.LlamaCppError(f"llama.cpp could not decode a token of {self.path.name}")
                logits, position = self._last_logits(), position + 1
        finally:
            llama_cpp.llama_batch_free(batch)
        return out

    def detokenize(self, tokens: list[int]) -> str:
        return self.llm.detokenize(tokens).decode("utf-8", "replace")

    def special_token(self, token: int) -> str:
        return self.llm.detokenize([token], special=True).decode("utf-8", "replace")

    def _last_logits(self) -> np.ndarray:
        llama_cpp = llamacpp.require()
        n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(n_vocab,)).copy()


def _quiet(mtmd_cpp) -> None:
    """libmtmd logs every image it encodes; keep its errors only, printed where llama.cpp's are."""
    global _log_callback
    if _log_callback is None:
        import sys

        def log(level: int, text: bytes, user_data) -> None:
            if level == GGML_LOG_ERROR:
                print(text.decode("utf-8", "replace"), end="", file=sys.stderr, flush=True)

        _log_callback = llamacpp.require().llama_log_callback(log)
    mtmd_cpp.mtmd_log_set(_log_callback, None)
    mtmd_cpp.mtmd_helper_log_set(_log_callback, None)


@dataclass
class Chunks:
    """A prompt tokenized by libmtmd: text and image chunks, in order. Free it (a ``with`` block does)."""

    model: VisionModel
    handle: object

    def __enter__(self) -> Chunks:
        return self

    def __exit__(self, *exc) -> None:
        self.model.lib.mtmd_input_chunks_free(self.handle)

    def token_ids(self, image_token_id: int) -> list[int]:
        """The prompt's ids as a processor writes them: the text tokens, and each image as its number of
        ``image_token_id``."""
        lib, ids = self.model.lib, []
        for index in range(lib.mtmd_input_chunks_size(self.handle)):
            chunk = lib.mtmd_input_chunks_get(self.handle, index)
            if lib.mtmd_input_chunk_get_type(chunk) == lib.MTMD_INPUT_CHUNK_TYPE_TEXT:
                count = ctypes.c_size_t()
                tokens = lib.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                ids += [tokens[i] for i in range(count.value)]
            else:
                ids += [image_token_id] * lib.mtmd_input_chunk_get_n_tokens(chunk)
        return ids


@dataclass
class VisionReference:
    """What the merged VLM gives under transformers on the picture prompts, computed once for every GGUF file."""

    conversations: list[list[dict]]  # each prompt as a chat: content parts, image parts naming no file
    images: list[list]  # each prompt's pictures (PIL RGB), in order
    token_ids: list[list[int]]  # the processor's ids of each chat-rendered prompt with its pictures
    logits: list[np.ndarray]  # transformers' next-token logits after each prompt ([1, vocab])
    image_token_id: int


def probe_pictures(sizes: tuple[tuple[int, int], ...], seed: int) -> list:
    """Pictures of random pixels (fixed by ``seed``) of ``sizes`` (width, height): every pixel tells."""
    from PIL import Image

    state = np.random.RandomState(seed)
    return [Image.fromarray(state.randint(0, 255, (height, width, 3), dtype=np.uint8)) for width, height in sizes]


def image_conversation(text: str) -> list[dict]:
    """One user turn whose ``<image>`` markers become image parts, as the chat templates take them."""
    parts = []
    for index, piece in enumerate(text.split("<image>")):
        if index:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return [{"role": "user", "content": parts}]


def vision_reference(model_dir: str | Path, prompts=VISION_PROMPTS) -> VisionReference:
    """The merged VLM in ``model_dir`` and its processor on ``prompts`` ((text with ``<image>`` markers, picture sizes)),
    as eval_report runs it (``evaluate.generate_with_images``: the template's text, then the processor on it)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from ft_assets.vision import image_token_id, load_processor, read_config

    processor = load_processor(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    conversations, images, ids, logits = [], [], [], []
    with torch.inference_mode():
        for number, (text, sizes) in enumerate(prompts):
            conversation, pictures = image_conversation(text), probe_pictures(sizes, seed=number)
            rendered = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            inputs = processor(text=[rendered], images=[pictures] if pictures else None, return_tensors="pt")
            conversations.append(conversation)
            images.append(pictures)
            ids.append(inputs["input_ids"][0].tolist())
            logits.append(model(**inputs).logits[0, -1:].numpy())
    return VisionReference(conversations, images, ids, logits, image_token_id(read_config(model_dir)))


def rendered_prompt(model: VisionModel, conversation: list[dict]) -> str:
    """``conversation`` through the chat template embedded in the GGUF (with its BOS and EOS), for libmtmd."""
    template = model.llm.metadata.get("tokenizer.chat_template")
    if not template:
        raise llamacpp.LlamaCppError(f"{model.path.name} embeds no chat template (tokenizer.chat_template)")
    messages = [{**m, "content": [{"type": part["type"], **({"text": part["text"]} if part["type"] == "text" else {})}
                                  for part in m["content"]]} if isinstance(m["content"], list) else m
                for m in conversation]  # fmt: skip
    bos, eos = (model.special_token(token) for token in (model.llm.token_bos(), model.llm.token_eos()))
    return model.prompt_text(render_chat(template, messages, bos_token=bos, eos_token=eos))


def check_vision_file(path: str | Path, mmproj: str | Path, ref: VisionReference) -> dict:
    """Load ``path`` and its projector in libmtmd and compare them with the merged VLM on ``ref``'s picture prompts.

    ``tokens_match`` (and ``token_mismatches``: the prompts whose ids differ) where each image stands as its number of
    image tokens, ``image_tokens`` (per prompt, libmtmd's and the processor's), and ``logit_agreement``'s
    ``rel_error``, ``max_abs_diff``, ``top1_agreement`` and ``kl_divergence`` of the logits after each prompt.
    """
    pairs, mismatches, counts = [], [], []
    with VisionModel(path, mmproj, n_ctx=max(256, max(len(ids) for ids in ref.token_ids) + 16)) as model:
        for conversation, pictures, expected, logits in zip(ref.conversations, ref.images, ref.token_ids, ref.logits):
            with model.tokenize(rendered_prompt(model, conversation), pictures) as chunks:
                got = chunks.token_ids(ref.image_token_id)
                pairs.append((logits, model.evaluate(chunks)[0][None, :]))
            counts.append([got.count(ref.image_token_id), expected.count(ref.image_token_id)])
            if got != expected:
                mismatches.append(" ".join(part.get("text", "<image>") for part in conversation[0]["content"]))
    return {
        "tokens_match": not mismatches,
        "token_mismatches": mismatches,
        "image_tokens": counts,
        **logit_agreement(pairs),
        "prompts": len(ref.token_ids),
    }


def chat_answers(
    path: str | Path,
    mmproj: str | Path,
    conversations: list[list[dict]],
    max_new_tokens: int,
    log: Callable[[str], None] = print,
) -> list[str]:
    """Greedy answers of a VLM's GGUF and projector to chat conversations, through libmtmd and the chat template
    embedded in the file; a turn's image parts name their files (``{"type": "image", "image": path}``)."""
    answers = []
    with VisionModel(path, mmproj) as model:
        for number, conversation in enumerate(conversations, 1):
            pictures = [part["image"] for m in conversation if isinstance(m["content"], list)
                        for part in m["content"] if part["type"] == "image"]  # fmt: skip
            with model.tokenize(rendered_prompt(model, conversation), pictures) as chunks:
                answers.append(answer_text(model.detokenize(model.greedy(chunks, max_new_tokens))))
            if number % 16 == 0 or number == len(conversations):
                log(f"llama.cpp (libmtmd) answered {number}/{len(conversations)}")
    return answers


def _main() -> None:
    """Export a VLM directory to GGUF files and its projector, and check each in libmtmd against transformers."""
    import argparse
    import json

    from ft_assets.delivery.gguf_export import SUPPORTED_QTYPES, export_ggufs

    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("model_dir", help="Hugging Face directory of a vision-language model (weights + processor)")
    parser.add_argument("out_dir", help="where the .gguf files and the projector go")
    parser.add_argument("--qtypes", nargs="+", default=["f16", "q8_0"], choices=SUPPORTED_QTYPES)
    args = parser.parse_args()
    stem = Path(args.model_dir).name
    outputs = {qtype: Path(args.out_dir) / f"{stem}-{qtype}.gguf" for qtype in args.qtypes}
    written = export_ggufs(args.model_dir, {**outputs, MMPROJ_OUTTYPE: Path(args.out_dir) / mmproj_file(stem)})
    ref = vision_reference(args.model_dir)
    for qtype, path in outputs.items():
        check = check_vision_file(path, mmproj_path(path), ref)
        print(
            json.dumps({"file": path.name, "bytes": written[qtype]["bytes"], "tolerance": TOLERANCES[qtype], **check})
        )


if __name__ == "__main__":
    _main()
