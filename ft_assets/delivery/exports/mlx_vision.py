"""The MLX export of a vision-language model: mlx-vlm folders of the merged VLM, checked on picture prompts, answered by mlx-vlm.

What a Mac runs: ``mlx_vlm.generate --model <folder> --image <picture> --prompt "..."`` (and mlx-vlm's server) reads
these folders as they are. ``ft_assets.delivery.exports.mlx`` calls this module for a merged model with an image
encoder; its text path is untouched.

- **Families**: ``TAKEN`` (Qwen2.5-VL, Qwen3-VL, Idefics3, SmolVLM): mlx-vlm 0.7.10 builds them as transformers
  does, once ``config.json`` says what it reads (``vlm_config``: transformers 4's RoPE keys in ``text_config``, Qwen-VL's
  M-RoPE sections, and for Qwen2.5-VL the text keys at the top, where its 4.x configs kept them). ``REFUSED`` names the
  others, with why, in one line (``ExportRefused``): Gemma 3, whose image tokens mlx-vlm attends over causally, and
  LLaVA-1.5, whose picture prompts mlx-vlm cannot prepare under transformers 5.
- **Export**: ``mlx_vlm.convert`` per variant (``bf16``, ``fp16``: a cast; ``8bit``, ``4bit``: mlx's affine
  quantization of the language model, the vision tower kept in float), then each folder is loaded by mlx-vlm and held
  to the merged model in transformers: token ids of the hard strings and logits of the text prompts
  (``llamacpp.reference``, as the text MLX export), and on picture prompts (``mtmd.vision_reference``) the processor's
  token ids (each image as its number of image tokens) and the next-token logits within ``TOLERANCES``.
- **Runtime** (``MlxVlm``): greedy chat answers by ``mlx_vlm.generate`` through the folder's chat template and
  processor, a turn's image parts naming their files; mlx-vlm's server and log-probabilities are not used, so DPO pairs
  and ``general_eval`` are scored on the merged model (one line each, ``ExportRefused``).

mlx-vlm runs in a child process (``python -m ft_assets.delivery.exports.mlx_vision``): importing its model modules
replaces transformers' ``AutoProcessor.from_pretrained`` process-wide with mlx-vlm's processors, which return mlx
arrays, so a transformers processor loaded after it in the same process (the merged model's, in eval_report) would
break. The trade-off: 4-5 s of imports per export and per set of answers.

Measured on the tiny random VLMs of ``ft_assets_tests/vlm_families.py`` (``python -m ft_assets.delivery.exports.mlx
MODEL_DIR OUT_DIR``; the table in docs/guides/vision.md): token ids equal on every picture prompt; relative logit error
after a picture 1.6e-3 to 7.7e-3 for fp16, 1.8e-2 to 4.4e-2 for bf16, 2.1e-2 to 5.9e-2 for 8bit, 0.35 to 0.77 for 4bit
(4 bits of random weights; not gated, ``ship: auto`` weighs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ft_assets.delivery import llamacpp, mtmd
from ft_assets.delivery.exports.protocol import ExportRefused, one_line
from ft_assets.delivery.gguf_export import logit_agreement
from ft_assets.portable import legacy_rope
from ft_assets.training.backends import INSTALL
from ft_assets.vision import read_config

MLX_VLM = "0.7.10"  # the version the families below were measured with (the mlx extra pins it)
TAKEN = ("qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm")  # model types mlx-vlm builds as transformers does
REFUSED = {  # model type -> why mlx-vlm cannot take it (one line)
    "gemma3": f"mlx-vlm {MLX_VLM}'s gemma3 attends causally over an image's tokens, where Gemma 3 attends "
    "bidirectionally within each image, so its logits after a picture part from the merged model's by 8e-2 "
    "(relative) even in float32",
    "llava": f"mlx-vlm {MLX_VLM} prepares its picture prompts through transformers' LlavaProcessor with arguments "
    "transformers 5 no longer takes (ImagesKwargs: unexpected keyword argument 'padding'), so it answers no picture",
}
# Bound on rel_error of the next-token logits after a picture prompt, by variant. Measured on the tiny models: fp16
# 1.6e-3 to 7.7e-3, bf16 1.8e-2 to 4.4e-2, 8bit 2.1e-2 to 5.9e-2 (Gemma 3's causal image attention: 8e-2 in every
# variant). 4bit is not gated (0.35 to 0.77 on random weights): its tokens must match, ship: auto weighs its error.
TOLERANCES = {"fp16": 0.02, "bf16": 0.1, "8bit": 0.15}
WORKER_TIMEOUT_S = 1800.0  # a child process's convert and checks: ~6 s for the tiny models on a CPU, minutes at 7B


def refuse_family(merged_dir: Path) -> None:
    """Refuse, before any work, a VLM family mlx-vlm cannot take, or a machine without mlx-vlm: one line naming why."""
    _require_mlx_vlm()
    model_type = read_config(merged_dir).get("model_type")
    if model_type in TAKEN:
        return
    why = REFUSED.get(
        model_type, f"its MLX export is checked for {', '.join(TAKEN)} only (mlx-vlm {MLX_VLM} against transformers)"
    )
    raise ExportRefused(f"MLX export of a {model_type} vision-language model is not supported: {why}")


def _require_mlx_vlm() -> None:
    if importlib.util.find_spec("mlx_vlm") is None:
        raise ExportRefused(
            f"mlx-vlm is not installed here, and a vision-language model's MLX export needs it: {INSTALL}"
        )


def vlm_config(config: dict) -> dict:
    """``config.json`` as mlx-vlm 0.7.10 reads it, for the config transformers 5 writes (see the module docstring).

    mlx-vlm reads the text model's RoPE base only as ``rope_theta`` (Gemma 3: ``rope_global_base_freq``) and Qwen-VL's
    M-RoPE as ``rope_scaling.mrope_section``, with defaults of the released models where they are missing (Qwen3-VL's
    sections 24/20/20), tied embeddings from ``text_config``, and Qwen2.5-VL's text model from the top-level keys."""
    config = dict(config)
    model_type = config.get("model_type")
    text = dict(config.get("text_config") or {})
    text |= legacy_rope(text)
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    if model_type in ("qwen2_5_vl", "qwen3_vl"):
        sections = (text.get("rope_parameters") or {}).get("mrope_section") or text.get("rope_scaling", {}).get(
            "mrope_section"
        )
        text["rope_scaling"] = {"type": "mrope" if model_type == "qwen2_5_vl" else "default", "mrope_section": sections}
        config["vision_config"] = dict(config.get("vision_config") or {}) | {"model_type": model_type}
    config["text_config"] = text
    if model_type == "qwen2_5_vl":
        config = {key: value for key, value in text.items() if key != "model_type"} | config
    return config


def readable_source(merged_dir: Path, work: Path) -> Path:
    """The merged model as mlx_vlm.convert reads it: its files linked into ``work``, and ``vlm_config``'s config.json."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for path in merged_dir.iterdir():
        if path.name != "config.json":
            (work / path.name).symlink_to(path.resolve())
    config = json.loads((merged_dir / "config.json").read_text())
    (work / "config.json").write_text(json.dumps(vlm_config(config), indent=2))
    return work


def written_and_checked(merged_dir: Path, out: Path, work: Path, stem: str, arguments: dict[str, dict], log) -> dict:
    """Every variant of ``arguments`` (variant -> ``mlx_vlm.convert``'s arguments) as an mlx-vlm folder in ``out``, each
    checked in mlx-vlm on text and picture prompts against the merged model in transformers: mlx_model's entries."""
    refuse_family(merged_dir)
    reference = llamacpp.reference(merged_dir)
    pictures = mtmd.vision_reference(merged_dir)
    folders = {variant: out / f"{stem}-mlx-{variant}" for variant in arguments}
    job = {
        "source": str(readable_source(merged_dir, work / f"{stem}-mlx-source")),
        "folders": {variant: {"path": str(folders[variant]), "arguments": arguments[variant]} for variant in arguments},
        "strings": reference.strings,
        "plain": reference.plain,
        "prompt_ids": reference.prompt_ids,
        "greedy_tokens": [len(expected) or 1 for expected in reference.continuations],
        "conversations": _with_picture_files(pictures, work / f"{stem}-mlx-pictures"),
    }
    try:
        results = _with_logits(run_worker("check", job, work / f"{stem}-mlx-check"), work / f"{stem}-mlx-check")
    except ExportRefused:
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return {folder.name: checked(folder, variant, results[variant], reference, pictures, log)
            for variant, folder in folders.items()}  # fmt: skip


def checked(
    folder: Path, variant: str, result: dict, reference: llamacpp.Reference, pictures: mtmd.VisionReference, log
) -> dict:
    """One folder's entry in mlx_model's stats from mlx-vlm's answers (``result``): refused where its token ids differ
    from the merged model's, on text or pictures, or where its logits after a picture part beyond ``TOLERANCES``."""
    mismatches = [text for text, ids, expected in zip(reference.strings, result["string_ids"], reference.token_ids)
                  if ids != expected]  # fmt: skip
    if mismatches:
        raise ExportRefused(
            f"{folder.name}: mlx-vlm tokenizes {len(mismatches)} test strings differently from the merged model's "
            f"tokenizer, e.g. {mismatches[0][:80]!r}"
        )
    counts = [[got.count(pictures.image_token_id), expected.count(pictures.image_token_id)]
              for got, expected in zip(result["picture_ids"], pictures.token_ids)]  # fmt: skip
    if result["picture_ids"] != pictures.token_ids:
        raise ExportRefused(
            f"{folder.name}: mlx-vlm's processor gives other token ids than the merged model's on picture prompts (image "
            f"tokens per prompt, mlx-vlm vs transformers: {counts})"
        )
    text = logit_agreement(list(zip(reference.logits, result["text_logits"])))
    seen = logit_agreement(list(zip(pictures.logits, result["picture_logits"])))
    tolerance = TOLERANCES.get(variant)
    if tolerance is not None and seen["rel_error"] > tolerance:
        raise ExportRefused(
            f"{folder.name}: mlx-vlm's logits after picture prompts are {seen['rel_error']:.2e} from the merged model's "
            f"(relative; at most {tolerance} for {variant}): it does not see the pictures as the merged model does"
        )
    parted = [llamacpp.parting_step(llamacpp.cut_at(tokens, reference.eos_token_id), expected)
              for tokens, expected in zip(result["greedy"], reference.continuations)]  # fmt: skip
    entry = {
        "variant": variant,
        "bytes": sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()),
        "sha256": result["sha256"],
        "mlx": {**text, "tokens_match": True, "greedy_match": parted.count(None), "greedy_prompts": len(parted)},
        "mlx_vlm": {
            **seen,
            "tokens_match": True,
            "image_tokens": counts,
            "prompts": len(counts),
            "tolerance": tolerance,
        },
    }
    log.info(
        f"{folder.name}: {entry['bytes'] / 1e6:.1f} MB; mlx-vlm rel. logit error {text['rel_error']:.2e} on text, "
        f"{seen['rel_error']:.2e} after {len(counts)} picture prompts (token ids equal), greedy equal on "
        f"{parted.count(None)}/{len(parted)} prompts"
    )
    return entry


def _with_picture_files(pictures: mtmd.VisionReference, folder: Path) -> list[list[dict]]:
    """The picture prompts as eval conversations: each image part names its picture, written losslessly (PNG)."""
    folder.mkdir(parents=True, exist_ok=True)
    conversations = []
    for number, (conversation, images) in enumerate(zip(pictures.conversations, pictures.images)):
        paths = [folder / f"{number}-{index}.png" for index in range(len(images))]
        for image, path in zip(images, paths):
            image.save(path)
        files = iter(str(path) for path in paths)
        conversations.append([{**m, "content": [{"type": "image", "image": next(files)} if part["type"] == "image"
                                                else part for part in m["content"]]} for m in conversation])  # fmt: skip
    return conversations


def run_worker(command: str, job: dict, work: Path) -> dict:
    """``job`` done by mlx-vlm in a child process (see the module docstring): its results, or ``ExportRefused`` with the
    child's last line."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "job.json").write_text(json.dumps(job))
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", __name__, "--worker", command, str(work)],
            capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise ExportRefused(f"mlx-vlm did not finish {command} in {WORKER_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith(REFUSAL)), lines[-1] if lines else "")
        raise ExportRefused(one_line(reason.removeprefix(REFUSAL) or f"mlx-vlm's {command} exited {done.returncode}"))
    return json.loads((work / "results.json").read_text())


def _with_logits(results: dict, work: Path) -> dict:
    """The check's results with the logits the child wrote beside them (``logits.npz``: ``variant|kind|index``)."""
    with np.load(work / "logits.npz") as arrays:
        for key in arrays.files:
            variant, kind, index = key.split("|")
            results[variant].setdefault(kind, {})[int(index)] = arrays[key]
    for result in results.values():
        for kind in ("text_logits", "picture_logits"):
            result[kind] = [result[kind][index] for index in sorted(result[kind])]
    return results


REFUSAL = "refused: "  # how the child's stderr line that says why it refused begins


class MlxVlm:
    """An mlx-vlm folder of a VLM in mlx-vlm (a child process), answering the eval prompts, pictures and all."""

    def __init__(self, folder: Path):
        self.folder = folder

    def chat_answers(self, conversations: list[list[dict]], max_new_tokens: int, log) -> list[str]:
        """Greedy chat answers by ``mlx_vlm.generate`` through the folder's chat template and processor; a turn's image
        parts name their files (``{"type": "image", "image": path}``)."""
        _require_mlx_vlm()
        job = {"folder": str(self.folder), "conversations": conversations, "max_new_tokens": max_new_tokens}
        with tempfile.TemporaryDirectory(prefix="mlx-vlm-answers-") as work:
            answers = run_worker("answer", job, Path(work) / "job")["answers"]
        log(f"mlx-vlm answered {len(answers)}/{len(conversations)}")
        return answers

    def pair_logps(self, rows):
        raise ExportRefused(
            f"{self.folder.name}: mlx-vlm gives no log-probabilities of preference pairs here (a vision-language model's "
            "MLX folder answers chat prompts only); the merged model is scored on them instead"
        )

    def harness(self, tokenizer_dir: Path, label: str, chat: bool):
        raise ExportRefused(
            f"{self.folder.name}: general_eval does not serve a vision-language model's MLX folder (mlx-vlm's server is "
            "not wired in); the merged model is scored on the general tasks instead"
        )


# --- the child process: everything that imports mlx-vlm ------------------------------------------------------------


def _convert(source: str, folder: str, variant: str, arguments: dict) -> None:
    import contextlib
    import io

    from mlx_vlm import convert

    shutil.rmtree(folder, ignore_errors=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # mlx-vlm prints its [INFO] lines
            convert(source, folder, **arguments)
    except Exception as exc:  # noqa: BLE001 - any failure of the converter is its refusal, in one line
        shutil.rmtree(folder, ignore_errors=True)
        raise SystemExit(f"{REFUSAL}mlx_vlm.convert cannot take this model ({variant}): {one_line(exc)}") from exc


def _load(folder: str):
    from mlx_vlm import load

    try:
        return load(folder)
    except Exception as exc:  # noqa: BLE001 - a folder mlx-vlm cannot load is refused, in one line
        raise SystemExit(f"{REFUSAL}mlx-vlm cannot load {Path(folder).name}: {one_line(exc)}") from exc


def _prompt(model, processor, conversation: list[dict]) -> tuple[str, list[str]]:
    """A conversation as mlx-vlm takes it: rendered by the folder's template, and its pictures' files in order."""
    from mlx_vlm.prompt_utils import get_chat_template

    files = [part["image"] for m in conversation if isinstance(m["content"], list) for part in m["content"]
             if part["type"] == "image"]  # fmt: skip
    messages = [{**m, "content": [{"type": "image"} if part["type"] == "image" else part for part in m["content"]]}
                if isinstance(m["content"], list) else m for m in conversation]  # fmt: skip
    return get_chat_template(processor, messages, True), files


def _inputs(model, processor, prompt: str, files: list[str]) -> dict:
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    return prepare_inputs(
        processor, images=files or None, prompts=prompt, image_token_index=getattr(model.config, "image_token_index", None),
        add_special_tokens=should_add_special_tokens(model.config.model_type, processor),
    )  # fmt: skip


def _fresh(model):
    """``model`` with no M-RoPE positions left from its last prompt: mlx-vlm's Qwen-VL language models keep them
    (``_position_ids``, ``_rope_deltas``) and reuse them for the next prompt without pictures, which then gets the
    positions of the last one (or fails on their shape), as ``mlx_vlm.generate`` run once per prompt never does."""
    for name in ("_position_ids", "_rope_deltas"):
        if hasattr(model.language_model, name):
            setattr(model.language_model, name, None)
    return model


def _first_logits_and_tokens(model, inputs: dict, max_tokens: int) -> tuple[np.ndarray, list[int]]:
    """mlx-vlm's logits after the prompt (as its sampler sees them) and its greedy continuation of ``max_tokens``."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    first: list[np.ndarray] = []

    def keep_first(tokens, logits):
        if not first:
            first.append(np.asarray(logits.astype(mx.float32)).reshape(1, -1))
        return logits

    extra = {key: value for key, value in inputs.items() if key not in ("input_ids", "pixel_values", "attention_mask")}
    steps = generate_step(
        inputs["input_ids"], _fresh(model), inputs.get("pixel_values"), inputs.get("attention_mask"), max_tokens=max_tokens,
        temperature=0.0, logits_processors=[keep_first], **extra,
    )  # fmt: skip
    tokens = [int(token) for token, _ in steps]
    return first[0], tokens


def _check(job: dict, work: Path) -> None:
    import hashlib

    import mlx.core as mx

    results, arrays = {}, {}
    for variant, written in job["folders"].items():
        folder = written["path"]
        _convert(job["source"], folder, variant, written["arguments"])
        model, processor = _load(folder)
        tokenizer = processor.tokenizer if hasattr(processor, "tokenizer") else processor
        string_ids = [
            tokenizer.encode(text, add_special_tokens=plain) for text, plain in zip(job["strings"], job["plain"])
        ]
        greedy = []
        for index, (ids, count) in enumerate(zip(job["prompt_ids"], job["greedy_tokens"])):
            arrays[f"{variant}|text_logits|{index}"] = np.asarray(
                _fresh(model).language_model(mx.array([ids])).logits[0].astype(mx.float32)
            )
            greedy.append(_first_logits_and_tokens(model, {"input_ids": mx.array([ids])}, count)[1])
        picture_ids = []
        for index, conversation in enumerate(job["conversations"]):
            inputs = _inputs(model, processor, *_prompt(model, processor, conversation))
            picture_ids.append(np.asarray(inputs["input_ids"][0]).tolist())
            arrays[f"{variant}|picture_logits|{index}"] = _first_logits_and_tokens(model, inputs, 1)[0]
        digest = hashlib.sha256()
        for path in sorted(Path(folder).glob("*.safetensors")):
            digest.update(path.read_bytes())
        results[variant] = {"string_ids": string_ids, "greedy": greedy, "picture_ids": picture_ids,
                            "sha256": digest.hexdigest()}  # fmt: skip
    np.savez(work / "logits.npz", **arrays)
    (work / "results.json").write_text(json.dumps(results))


def _answer(job: dict, work: Path) -> None:
    from mlx_vlm import generate

    from ft_assets.generation import answer_text

    model, processor = _load(job["folder"])
    answers = []
    for conversation in job["conversations"]:
        prompt, files = _prompt(model, processor, conversation)
        result = generate(
            _fresh(model), processor, prompt, image=files or None, max_tokens=job["max_new_tokens"], temperature=0.0
        )
        answers.append(answer_text(result.text).strip())
    (work / "results.json").write_text(json.dumps({"answers": answers}))


def _worker() -> None:
    """The child process: ``--worker check|answer WORK``, the job in ``WORK/job.json``, the results beside it."""
    command, work = sys.argv[2], Path(sys.argv[3])
    job = json.loads((work / "job.json").read_text())
    {"check": _check, "answer": _answer}[command](job, work)


if __name__ == "__main__":
    _worker()
