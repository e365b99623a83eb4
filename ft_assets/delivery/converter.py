"""llama.cpp's own Hugging Face → GGUF converter, from the llama.cpp that the installed llama-cpp-python vendors.

Why this converter and not one of our own: llama.cpp's ``convert_hf_to_gguf.py`` knows the tensor
layout and hyper-parameter keys of every architecture llama.cpp runs (Llama 3's ``rope_freqs``,
Qwen's biases and q/k norms, Gemma's soft-capping, norm offsets and embedding scale, Phi-3's fused
projections, ...), and it comes from the same source tree as the runtime that reads its files: the
llama-cpp-python 0.3.36 sdist on PyPI carries ``vendor/llama.cpp/convert_hf_to_gguf.py``, its
``conversion/`` package and its ``gguf-py`` (newer than PyPI's gguf 0.19.0, whose files differ), while
the built wheel carries none of them. ``install`` fetches that sdist with pip (``make install`` runs
``python -m ft_assets.delivery.converter install``; 15 s, 1.2 MB unpacked) and keeps those three
paths under ``<venv>/share/ft-assets/llama.cpp-<version>/``, so writer and reader are one release by
construction and nothing is fetched at run time.

The converter runs in a child process (``convert``): it puts its own ``gguf-py`` first on
``sys.path``, which must not replace the gguf package of this process, and importing torch there
costs ~8 s, so one child writes every type asked for, and a vision-language model's projector too
(``MMPROJ_OUTTYPE``: the converter's ``--mmproj`` run, F16, read by llama.cpp's libmtmd beside the language model's
file: ``ft_assets.delivery.mtmd``). Around it this module adds five things, each because the converter alone fails on
models our users bring:

1. **An unknown BPE pre-tokenizer.** The converter names the pre-tokenizer (``tokenizer.ggml.pre``) by
   the sha256 of the ids the tokenizer gives for one test text (``get_vocab_base_pre``, ``chkhsh``);
   a hash it does not list makes it stop with ``NotImplementedError("BPE pre-tokenizer was not
   recognized")``. A fine-tuned tokenizer of a listed base keeps its base's hash; any retrained or
   extended one (and every test tokenizer here) has a new one. Then ``pre_tokenizer_name`` names it
   from the shape of the loaded HF tokenizer's pipeline (what transformers actually runs: for a
   ``qwen2`` model it is Qwen2Tokenizer's digit-splitting regex, whatever tokenizer.json says), for
   the four shapes matched here against llama.cpp's ``src/llama-vocab.cpp``: GPT-2's byte level
   (``gpt-2``), SmolLM's digits + GPT-2 (``smollm``), Llama 3's regex (``llama-bpe``) and Qwen2's
   (``qwen2``). Any other shape, a normalizer, byte fallback or added tokens that strip spaces is
   refused in one line (``GgufUnsupported``): the model is still published, without a GGUF.
2. **A byte-level BPE where the family's converter wants SentencePiece.** Gemma 2 and Phi-3 read a
   ``tokenizer.model``; a directory that has only a byte-level ``tokenizer.json`` (Phi-4, a retrained
   tokenizer) goes through the converter's own GPT-2 vocabulary writer instead of stopping (one with
   byte fallback, SentencePiece's kind, goes to fix 4).
3. **Gemma 2/3 layer pattern.** llama.cpp assumes 1 global layer in 2 (Gemma 2) or in 6 (Gemma 3)
   unless the file lists them; the converter does not, so ``layer_types`` from config.json is written
   (``attention.sliding_window_pattern``). Without it a Gemma 3 whose pattern differs attends through
   the wrong window.
4. **A SentencePiece BPE with only its tokenizer.json.** A Gemma 3 converted from a GGUF (a user's own
   Gemma 3 270M as ``base_model.source``) or saved by transformers 5 has no ``tokenizer.model``; Gemma 3's
   converter then writes it as GPT-2 byte-level BPE, Llama's with every score equal (``_set_vocab_llama_hf``),
   and llama.cpp tokenizes either differently from transformers. ``write_sentencepiece_from_json`` writes
   it as llama.cpp's SentencePiece vocabulary with the merge ranks as scores
   (``ft_assets.delivery.sentencepiece_vocab``: why, and the shapes it refuses).
5. **Qwen-VL's image size bounds.** Its processor resizes an image to between ``min_pixels`` and ``max_pixels`` (the
   tiny test models: 4 to 16 tokens); the converter writes neither into the projector, and libmtmd then gives an
   image 8 to 4,096 tokens, so the image tokens differ from the processor's. ``pixel_bounds`` reads them from the
   saved processor (transformers 4's and 5's keys) and writes them (``clip.vision.image_min_pixels`` / ``max_pixels``),
   from which the runtime sets libmtmd's token bounds (``mtmd.image_token_bounds``).

An architecture the converter has no layout for is named in one line (``GgufUnsupported``), and so is a vision tower
whose projector it does not write (LLaVA-1.5's CLIP: its projector class takes Pixtral's and Mistral 3's only).

And one thing around the runtime: **llama.cpp keys Phi-3's token attributes on ``general.name``**
(``llama_vocab::impl::load``, "set attributes by model/tokenizer/architecture name"): a name that holds
"phi3" or "phi-3" makes every added token right-strip except ``<unk>``, ``<s>`` and ``<|endoftext|>``,
and looks those three and ``</s>`` up with ``unordered_map::at``. Phi-3-mini's SentencePiece vocabulary
has all four, and its tokenizer right-strips exactly so; a GPT-2-style byte-level BPE (Phi-4-mini's,
or any retrained one) has ``<|endoftext|>`` alone, so llama.cpp refuses the file ("error loading model
vocabulary: unordered_map::at"), and a dataset called ``phi3-toolcalls`` was enough to make every
file of its run unloadable. ``general_name`` keeps such a name only for a tokenizer those attributes
describe and writes it as "phi 3" (which llama.cpp does not match) for any other.

Only the standard library (and ``sentencepiece_vocab``, which imports nothing else) is imported at
module level: the child imports this module before it puts the vendored gguf first on ``sys.path``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ft_assets.delivery import sentencepiece_vocab

CONVERTER_PATHS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")  # what is kept of the sdist
OUTTYPES = (
    "f32",
    "f16",
    "bf16",
    "q8_0",
)  # what the converter writes itself; other types come from llama.cpp's quantizer
MMPROJ_OUTTYPE = "mmproj-f16"  # a VLM's vision projector (its --mmproj run), F16 as llama.cpp's releases ship it
# Projector classes of the converter whose processor bounds an image by pixels (fix 5); not their subclasses (GLM-4V's)
PIXEL_BOUNDED_PROJECTORS = ("Qwen2VLVisionModel", "Qwen3VLVisionModel")
REFUSED = "ft-assets refused: "  # the child's one-line answer when it refuses a model (then exit REFUSED_EXIT)
REFUSED_EXIT = 3

# Pre-tokenizer shapes (the HF tokenizer's pipeline as tokenizers serializes it) -> llama.cpp's name
# (tokenizer.ggml.pre), checked against src/llama-vocab.cpp of llama.cpp as vendored in 0.3.36: the
# Split regexes are the "original regex from tokenizer.json" it quotes for LLAMA_VOCAB_PRE_TYPE_LLAMA3
# and _QWEN2; "llama-bpe" also sets ignore_merges there, so it is matched only with the tokenizer's
# model.ignore_merges on, and the others only with it off.
GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
BYTE_LEVEL_BYTES_ONLY = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}
SMOLLM_DIGITS = {"type": "Digits", "individual_digits": True}
LLAMA3_REGEX = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
QWEN2_REGEX = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
SPLIT_NAMES = {LLAMA3_REGEX: "llama-bpe", QWEN2_REGEX: "qwen2"}
IGNORE_MERGES = {"llama-bpe"}  # names under which llama.cpp takes a whole word found in the vocabulary before merging
# What llama.cpp does to a file whose general.name holds one of PHI3_NAMES (src/llama-vocab.cpp, as vendored in 0.3.36): every
# added token right-strips, except PHI3_KEPT; those and PHI3_RSTRIPPED are looked up with unordered_map::at (must exist).
PHI3_NAMES = re.compile(r"(phi)-?(3)", re.IGNORECASE)  # "phi-3" or "phi3" anywhere in the lower-cased name
PHI3_RSTRIPPED, PHI3_KEPT = ("</s>",), ("<unk>", "<s>", "<|endoftext|>")
# Qwen2's tokenizer NFC-normalizes; llama.cpp does not normalize, and its converter lists Qwen's hash all the same:
# text already in NFC, nearly all text, tokenizes the same. Any other normalizer is refused.
NORMALIZER_IGNORED = "NFC"
# tokenizer.json model options of the tokenizers library that llama.cpp's BPE does not implement.
BPE_OPTIONS_LLAMACPP_LACKS = ("dropout", "continuing_subword_prefix", "end_of_word_suffix")


class GgufExportError(ValueError):
    """The model directory cannot be exported to GGUF as it is (what, where, what to do)."""


class GgufUnsupported(GgufExportError):
    """llama.cpp cannot take this model (its architecture or its tokenizer): the model ships without a GGUF."""


def llama_cpp_version() -> str:
    try:
        return version("llama-cpp-python")
    except PackageNotFoundError as exc:
        raise GgufExportError(
            "llama-cpp-python is not installed; GGUF export uses the converter of the llama.cpp it vendors: "
            "pip install 'ft-assets[llamacpp]'"
        ) from exc


def install_dir(llama_version: str | None = None) -> Path:
    """Where ``install`` keeps the converter of llama-cpp-python ``llama_version`` (default: the installed one)."""
    return Path(sys.prefix) / "share" / "ft-assets" / f"llama.cpp-{llama_version or llama_cpp_version()}"


def location() -> Path:
    """The installed converter of the installed llama-cpp-python, or an error that says how to install it."""
    where = install_dir()
    if not (where / "convert_hf_to_gguf.py").is_file():
        raise GgufExportError(
            f"llama.cpp's converter for llama-cpp-python {llama_cpp_version()} is not installed at {where}; "
            "run `python -m ft_assets.delivery.converter install` (make install does)"
        )
    return where


def install(log=print, sdist: Path | None = None) -> Path:
    """Keep the converter of the llama-cpp-python sdist of the installed version, fetched with pip unless ``sdist``
    names it (an offline image build: deploy/image/Containerfile); return where."""
    llama_version = llama_cpp_version()
    target = install_dir(llama_version)
    if (target / "convert_hf_to_gguf.py").is_file():
        log(f"llama.cpp's converter is already at {target}")
        return target
    if sdist is not None and sdist.name != f"llama_cpp_python-{llama_version}.tar.gz":
        raise GgufExportError(f"{sdist} is not the sdist of the installed llama-cpp-python {llama_version}")
    with tempfile.TemporaryDirectory() as work:
        if sdist is None:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={llama_version}", "--dest", work],
                check=True,
            )  # fmt: skip
            (sdist,) = Path(work).glob("llama_cpp_python-*.tar.gz")
        staging = Path(work) / "converter"
        prefix = f"llama_cpp_python-{llama_version}/vendor/llama.cpp/"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix) and _kept(m.name[len(prefix) :])]
            for member in members:
                member.name = member.name[len(prefix) :]
            # Python < 3.11.4 (Debian 12's 3.11.2: the image test's base) has no extraction filters: keep plain files
            # and folders inside the target only
            data_filter = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            if not data_filter:
                members = [m for m in members if (m.isfile() or m.isdir()) and ".." not in Path(m.name).parts]
            archive.extractall(staging, members=members, **data_filter)
        if not (staging / "convert_hf_to_gguf.py").is_file():
            raise GgufExportError(f"{sdist.name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(staging, target)
    log(f"llama.cpp's converter of llama-cpp-python {llama_version} installed at {target}")
    return target


def _kept(relative: str) -> bool:
    return any(relative == path or (path.endswith("/") and relative.startswith(path)) for path in CONVERTER_PATHS)


def convert(model_dir: str | Path, outputs: dict[str, Path], name: str) -> None:
    """Write ``model_dir`` as one GGUF file per ``outputs`` entry (outtype -> path) with llama.cpp's converter."""
    convert_many([(model_dir, name, outtype, path) for outtype, path in outputs.items()])


def convert_many(jobs: list[tuple[str | Path, str, str, str | Path]], timeout_s: float = 3600) -> None:
    """Run llama.cpp's converter once for every (model_dir, name, outtype, out_path) job, in one child process.

    Raises ``GgufUnsupported`` (one line) for a model llama.cpp cannot take, ``GgufExportError`` with the
    converter's last lines for anything else; either stops the jobs after it.
    """
    unknown = sorted({outtype for _, _, outtype, _ in jobs} - {*OUTTYPES, MMPROJ_OUTTYPE})
    if unknown:
        raise GgufExportError(
            f"llama.cpp's converter writes {', '.join((*OUTTYPES, MMPROJ_OUTTYPE))}, not {', '.join(unknown)}"
        )
    spec = json.dumps(
        [[str(model_dir), general_name(name, model_dir), outtype, str(path)] for model_dir, name, outtype, path in jobs]
    )
    command = [sys.executable, "-m", "ft_assets.delivery.converter", "run", str(location()), spec]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode == 0:
        return
    refusal = [line.removeprefix(REFUSED) for line in done.stderr.splitlines() if line.startswith(REFUSED)]
    if done.returncode == REFUSED_EXIT and refusal:
        raise GgufUnsupported(refusal[-1])
    tail = "\n".join(done.stderr.strip().splitlines()[-15:])
    models = sorted({str(job[0]) for job in jobs})
    raise GgufExportError(f"llama.cpp's converter failed on {', '.join(models)} (exit {done.returncode}):\n{tail}")


def general_name(name: str, model_dir: str | Path) -> str:
    """The ``general.name`` written for ``name``: as it is, unless llama.cpp would give the tokenizer of ``model_dir`` Phi-3's
    token attributes for it (a name holding "phi3" or "phi-3") and they do not describe it; then "phi 3" instead."""
    tokenizer_json = Path(model_dir) / "tokenizer.json"
    if not PHI3_NAMES.search(name) or not tokenizer_json.is_file():
        return name
    if has_phi3_attributes(json.loads(tokenizer_json.read_text(encoding="utf-8"))):
        return name
    return PHI3_NAMES.sub(r"\1 \2", name)


def has_phi3_attributes(tokenizer: dict) -> bool:
    """Whether llama.cpp's Phi-3 token attributes are the serialized HF tokenizer's own: the four tokens it looks up are
    there, and each added token right-strips unless it is one of ``PHI3_KEPT``."""
    added = {entry["content"]: entry for entry in tokenizer.get("added_tokens", [])}
    vocab = (tokenizer.get("model") or {}).get("vocab") or {}
    pieces = set(vocab) if isinstance(vocab, dict) else {piece for piece, _ in vocab}  # BPE: a dict; Unigram: pairs
    if not all(token in pieces | set(added) for token in (*PHI3_RSTRIPPED, *PHI3_KEPT)):
        return False
    return all(bool(entry.get("rstrip")) == (content not in PHI3_KEPT) for content, entry in added.items())


def pre_tokenizer_name(tokenizer: dict) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a serialized HF tokenizer pipeline whose hash the converter does not list.

    ``tokenizer`` is ``json.loads(hf_tokenizer.backend_tokenizer.to_str())``: the pipeline transformers
    runs. Raises ``GgufUnsupported`` for one llama.cpp would not reproduce.
    """
    model, pre = tokenizer.get("model") or {}, tokenizer.get("pre_tokenizer")
    problems = []
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        problems.append(
            f"model {model.get('type')} (byte_fallback={model.get('byte_fallback')}) is not a byte-level BPE"
        )
    problems += [f"model.{key} = {model[key]!r}" for key in BPE_OPTIONS_LLAMACPP_LACKS if model.get(key)]
    if (tokenizer.get("normalizer") or {"type": NORMALIZER_IGNORED}).get("type") != NORMALIZER_IGNORED:
        problems.append(f"a normalizer ({tokenizer['normalizer'].get('type')})")
    if (tokenizer.get("decoder") or {}).get("type") != "ByteLevel":
        problems.append(f"decoder {(tokenizer.get('decoder') or {}).get('type')} is not ByteLevel")
    problems += [
        f"added token {entry['content']!r} strips spaces ({', '.join(k for k in ('lstrip', 'rstrip', 'single_word') if entry.get(k))})"
        for entry in tokenizer.get("added_tokens", [])
        if entry.get("lstrip") or entry.get("rstrip") or entry.get("single_word")
    ]
    name = _shape_name(pre)
    if name is None:
        problems.append(f"pre-tokenizer {json.dumps(pre)[:300]} is none of gpt-2, smollm, llama-bpe, qwen2")
    elif bool(model.get("ignore_merges")) != (name in IGNORE_MERGES):
        problems.append(f"model.ignore_merges = {model.get('ignore_merges')} differs from llama.cpp's {name!r}")
    if problems:
        raise GgufUnsupported(
            "llama.cpp's converter does not know this tokenizer (its hash is not listed) and it is not one named here: "
            + "; ".join(problems)
            + ". Keep the base model's tokenizer, or add its shape to ft_assets/delivery/converter.py"
        )
    return name


def _shape_name(pre: dict | None) -> str | None:
    def matches(step: dict, shape: dict) -> bool:
        return all(step.get(key) == value for key, value in shape.items())

    if pre and matches(pre, GPT2_BYTE_LEVEL):
        return "gpt-2"
    steps = (pre or {}).get("pretokenizers", []) if (pre or {}).get("type") == "Sequence" else []
    if len(steps) == 2 and matches(steps[0], SMOLLM_DIGITS) and matches(steps[1], GPT2_BYTE_LEVEL):
        return "smollm"
    if (
        len(steps) == 2
        and steps[0].get("type") == "Split"
        and steps[0].get("behavior") == "Isolated"
        and not steps[0].get("invert")
        and matches(steps[1], BYTE_LEVEL_BYTES_ONLY)
    ):
        return SPLIT_NAMES.get((steps[0].get("pattern") or {}).get("Regex"))
    return None


# ---- the child process: runs inside `python -m ft_assets.delivery.converter run ...` ----


class _Refused(Exception):
    pass


def _run_converter(converter_dir: Path, jobs: list[list[str]]) -> None:
    """Import llama.cpp's converter with its own gguf-py, add the five fixes, and run each (model_dir, name, outtype, path) job."""
    sys.path[0:0] = [str(converter_dir / "gguf-py"), str(converter_dir)]
    import convert_hf_to_gguf as script  # noqa: PLC0415 -- only after its gguf-py is first on sys.path
    import gguf  # noqa: PLC0415 -- the vendored one
    from conversion import base  # noqa: PLC0415

    hashed_name = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return hashed_name(self, tokenizer)
        except NotImplementedError:  # "BPE pre-tokenizer was not recognized"
            if not hasattr(tokenizer, "backend_tokenizer"):
                raise _Refused(
                    f"{self.dir_model}: the tokenizer is not a fast (tokenizers) one; llama.cpp's converter cannot name it"
                ) from None
            try:
                return pre_tokenizer_name(json.loads(tokenizer.backend_tokenizer.to_str()))
            except GgufUnsupported as exc:
                raise _Refused(f"{self.dir_model}: {exc}") from None

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    script.get_model_class = _model_class_with_fixes(script.get_model_class, gguf)
    for model_dir, name, outtype, path in jobs:
        projector = ["--mmproj", "--outtype", outtype.removeprefix("mmproj-")] if outtype == MMPROJ_OUTTYPE else []
        types = projector or ["--outtype", outtype]
        sys.argv = ["convert_hf_to_gguf.py", *types, "--outfile", path, "--model-name", name, model_dir]
        script.main()


def _model_class_with_fixes(get_model_class, gguf):
    """``get_model_class`` of the converter, returning the family's class with fixes 2 to 5 of the module docstring."""
    layer_pattern_archs = {gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3}

    def model_class(architecture: str, mmproj: bool = False):
        what = "vision projector (mmproj)" if mmproj else "GGUF"
        try:
            family = get_model_class(architecture, mmproj=mmproj)
        except NotImplementedError:
            raise _Refused(
                f"llama.cpp {llama_cpp_version()}'s converter has no {what} layout for architecture {architecture}"
            ) from None

        class WithFixes(family):
            model_arch = family.model_arch

            def __init__(self, *args, **kwargs):
                try:
                    super().__init__(*args, **kwargs)
                except (
                    ValueError
                ) as exc:  # a projector class refusing a vision tower (LLaVA's: "Unsupported model type")
                    if not mmproj:
                        raise
                    tower = (getattr(self, "global_config", {}).get("vision_config") or {}).get("model_type", "unknown")
                    raise _Refused(
                        f"llama.cpp {llama_cpp_version()}'s converter has no vision projector (mmproj) layout for "
                        f"{architecture} with a {tower} vision tower ({exc})"
                    ) from None

            # Fix 4: every way a family's set_vocab writes a vocabulary, for a SentencePiece-style tokenizer.json alone.
            def _set_vocab_sentencepiece(self, add_to_gguf=True):
                if not write_sentencepiece_from_json(self, gguf):
                    super()._set_vocab_sentencepiece(add_to_gguf)

            def _set_vocab_llama_hf(self):
                if not write_sentencepiece_from_json(self, gguf):
                    super()._set_vocab_llama_hf()

            def _set_vocab_gpt2(self):
                if not write_sentencepiece_from_json(self, gguf):
                    super()._set_vocab_gpt2()

            def set_vocab(self):
                try:
                    return super().set_vocab()
                except (FileNotFoundError, ValueError) as exc:
                    # Gemma 2, Phi-3: "File not found: .../tokenizer.model" / "Missing .../tokenizer.model"
                    if "tokenizer.model" not in str(exc) or not (self.dir_model / "tokenizer.json").is_file():
                        raise
                    return self._set_vocab_gpt2()

            def set_gguf_parameters(self):
                super().set_gguf_parameters()
                layer_types = self.hparams.get("layer_types")
                if self.model_arch in layer_pattern_archs and layer_types:
                    self.gguf_writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in layer_types])
                if mmproj and family.__name__ in PIXEL_BOUNDED_PROJECTORS:  # fix 5
                    low, high = pixel_bounds(self.preprocessor_config, self.dir_model)
                    self.gguf_writer.add_vision_min_pixels(low)
                    self.gguf_writer.add_vision_max_pixels(high)

        WithFixes.__name__ = WithFixes.__qualname__ = family.__name__
        return WithFixes

    return model_class


def pixel_bounds(image_processor: dict, model_dir: Path) -> tuple[int, int]:
    """Fix 5: the (min, max) pixels a Qwen-VL image processor resizes an image to, from its saved settings: transformers
    5 writes them as ``size: {shortest_edge, longest_edge}`` (in pixels), 4.x as ``min_pixels``/``max_pixels``."""
    size = image_processor.get("size") or {}
    for low, high in (("min_pixels", "max_pixels"), ("shortest_edge", "longest_edge")):
        for where in (image_processor, size):
            if isinstance(where.get(low), int) and isinstance(where.get(high), int):
                return where[low], where[high]
    raise _Refused(
        f"{model_dir}: the Qwen-VL image processor (preprocessor_config.json / processor_config.json) names no pixel "
        "bounds (min_pixels/max_pixels or size.shortest_edge/longest_edge); save the model's processor with it"
    )


def write_sentencepiece_from_json(model, gguf) -> bool:
    """Fix 4: write the SentencePiece vocabulary of ``model`` (the converter's instance) from its tokenizer.json.

    Only for a directory with no tokenizer.model whose tokenizer is a byte-fallback BPE; returns False
    for any other, which the family's own writer then takes. The pipeline read is the one transformers
    loads (as for fix 1). A byte-fallback BPE of a shape llama.cpp would not reproduce is refused.
    """
    on_disk = model.dir_model / "tokenizer.json"
    if (model.dir_model / "tokenizer.model").is_file() or not on_disk.is_file():
        return False
    if not sentencepiece_vocab.is_sentencepiece_bpe(json.loads(on_disk.read_text(encoding="utf-8"))):
        return False  # byte-level: the family's writer loads it once, not twice
    from transformers import AutoTokenizer  # noqa: PLC0415 -- child process only, and only for this case

    tokenizer = json.loads(AutoTokenizer.from_pretrained(model.dir_model).backend_tokenizer.to_str())
    if not sentencepiece_vocab.is_sentencepiece_bpe(tokenizer):
        return False
    max_id = max([*tokenizer["model"]["vocab"].values(), *(added["id"] for added in tokenizer.get("added_tokens", []))])
    try:
        prefix = sentencepiece_vocab.add_space_prefix(tokenizer)
        tokens, scores, types = sentencepiece_vocab.sentencepiece_vocab(
            tokenizer, model.hparams.get("vocab_size") or max_id + 1
        )
    except sentencepiece_vocab.NotSentencePiece as exc:
        raise _Refused(f"{model.dir_model}: {exc}") from None
    writer = model.gguf_writer
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token.encode("utf-8") for token in tokens])
    writer.add_token_scores(scores)
    writer.add_token_types([gguf.TokenType[name] for name in types])
    writer.add_add_space_prefix(prefix)
    gguf.SpecialVocab(model.dir_model, n_vocab=len(tokens)).add_to_gguf(writer)
    return True


def _main(argv: list[str]) -> int:
    if argv[:1] == ["install"] and len(argv) <= 2:
        install(sdist=Path(argv[1]) if len(argv) == 2 else None)
        return 0
    if argv[:1] == ["run"] and len(argv) == 3:
        try:
            _run_converter(Path(argv[1]), json.loads(argv[2]))
        except _Refused as exc:
            print(REFUSED + " ".join(str(exc).split()), file=sys.stderr)
            return REFUSED_EXIT
        return 0
    print(
        "usage: python -m ft_assets.delivery.converter install [SDIST] | run CONVERTER_DIR JOBS_JSON", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
