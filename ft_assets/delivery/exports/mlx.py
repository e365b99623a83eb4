"""The MLX export: mlx-lm folders of the merged model (bf16/fp16 and 4-bit), checked, scored and answered by mlx-lm;
a vision-language model's are mlx-vlm folders, checked on pictures too and answered by mlx-vlm (``mlx_vision``).

What a Mac runs: ``mlx_lm generate --model <folder>`` / ``mlx_lm.server`` / LM Studio's MLX engine read these
folders as they are.

- **Export**: ``mlx_lm.convert`` of the merged model per variant (``bf16``, ``fp16``: a cast; ``4bit``, ``8bit``:
  mlx-lm's affine quantization, ``group_size`` weights a scale), then ``config.json`` gets the keys mlx-lm 0.32
  needs to build what transformers builds (``training.mlx_model.mlx_config``: transformers 4's RoPE keys, Gemma
  3's layer pattern). Each folder is loaded by ``mlx_lm.load`` and compared with the merged model in transformers
  on the GGUF export's reference (``llamacpp.reference``: token ids of 15 hard strings, logits of the chat-rendered
  prompts, greedy continuations). ``ship: auto`` ships the smallest folder within ``ship_max_rel_error`` of the
  merged model's logits, else the most accurate one.
- **Runtime**: mlx-lm in process (``MlxLm``): greedy chat completions with ``mlx_lm.generate`` through the folder's
  chat template (mlx-lm's own stop tokens), and for DPO the log-probabilities of each pair's replies from
  mlx-lm's logits; for ``general_eval``, ``mlx_lm server`` as lm-eval's ``local-(chat-)completions`` model
  (generate_until only: the server gives no log-probabilities of the prompt).
- **Gate**: the shipped folder may score at most ``max_drop`` (0.05) below the merged model.

- **Vision-language models** (``takes_vision``): mlx-vlm folders instead, converted and checked by ``mlx_vision`` (in a
  child process: mlx-vlm replaces transformers' ``AutoProcessor`` process-wide), on the text reference and on picture
  prompts (token ids equal to the processor's, logits within ``mlx_vision.TOLERANCES``); the runtime (``MlxLm``) answers
  picture questions through ``mlx_vlm.generate``. What a Mac runs: ``mlx_vlm.generate --model <folder> --image <picture>``.
  mlx-vlm 0.7.10 takes Qwen2.5-VL, Qwen3-VL, Idefics3 and SmolVLM; Gemma 3 (image tokens attended causally) and
  LLaVA-1.5 (picture prompts it cannot prepare under transformers 5) are refused in one line (``mlx_vision.REFUSED``).

Off where mlx and mlx-lm are not installed (or ``FT_MLX=0``), with that reason. Refused (``ExportRefused``, one
line; the run goes on without an MLX model unless ``required``): an architecture mlx-lm does not have, a folder it
cannot load or answer with, one whose tokenizer gives other ids than the merged model's.

On this project's Linux machines this runs on mlx's CPU build (``pip install 'ft-assets[mlx]'``); on a Mac on its
GPU, the same calls. Mixtures of experts (Qwen3-MoE, Mixtral, gpt-oss) export as the dense families do; gpt-oss's
experts are first laid out as mlx-lm reads float ones (``experts_as_mlx_reads_them``). mlx's CPU build runs experts in
float32 only, so there a mixture's bf16/fp16 folders are refused and its 8bit/4bit ones are checked.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from pydantic import Field

from ft_assets.delivery import llamacpp, servers
from ft_assets.delivery.exports import mlx_vision
from ft_assets.delivery.exports.protocol import Export, ExportRefused, ExportSettings, Made, one_line
from ft_assets.delivery.gguf_export import logit_agreement
from ft_assets.delivery.harness import HarnessModel, served_model
from ft_assets.generation import answer_text
from ft_assets.training import backends
from ft_assets.training.mlx_model import mlx_config
from ft_assets.vision import model_has_vision

VARIANTS = {  # variant -> mlx_lm.convert's arguments
    "bf16": {"dtype": "bfloat16"},
    "fp16": {"dtype": "float16"},
    "8bit": {"quantize": True, "q_bits": 8},
    "4bit": {"quantize": True, "q_bits": 4},
}
OFF = "MLX export is off (mlx_model variants: [])"
NO_PROMPT_LOGPROBS = (
    "mlx-lm's server returns log-probabilities of the generated tokens only, not of the prompt's, which loglikelihood "
    "and multiple-choice tasks score; the merged model is scored on them instead"
)
SERVER_START_S = 120.0  # mlx_lm server loads the folder before it answers: ~3 s for the test models on a CPU
MAX_LENGTH = 2048  # the context lm-eval fits a prompt and its generation in
NOT_INSTALLED = f"MLX export is off: mlx and mlx-lm are not installed here ({backends.INSTALL}; or FT_MLX=0 hides them)"


class MlxSettings(ExportSettings):
    """mlx-lm folders of the merged model (Apple silicon), checked in mlx-lm."""

    variants: list[str] = Field(
        default=["bf16", "4bit"],
        description="MLX variants to export with mlx_lm.convert: bf16, fp16 (a cast), 8bit, 4bit (mlx-lm's affine "
        "quantization). [] turns the MLX export off: the model ships without one.",
    )
    group_size: int = Field(default=64, description="Weights per quantization scale for 4bit/8bit (mlx-lm's default).")
    ship: str = Field(
        default="auto",
        description="The variant that ships (scored by eval_report, published in mlx/): one of variants, or 'auto' = the "
        "smallest whose logit error through mlx-lm is within ship_max_rel_error (the most accurate one when none is).",
    )
    ship_max_rel_error: float = Field(
        default=0.08,
        description="For ship='auto': the largest relative logit error against the merged model (through mlx-lm) a "
        "shipped folder may have; the bound the GGUF export holds its files to.",
    )


def off(settings: MlxSettings) -> str | None:
    if not settings.variants:
        return OFF
    return None if backends.mlx_installed() else NOT_INSTALLED


def check(settings: MlxSettings) -> None:
    unknown = sorted(set(settings.variants) - set(VARIANTS))
    if unknown:
        raise ValueError(f"variants={settings.variants}: choose from {', '.join(VARIANTS)}, or [] for no MLX model")
    if settings.variants and settings.ship not in ("auto", *settings.variants):
        raise ValueError(f"ship={settings.ship!r}: 'auto' or one of the exported variants {settings.variants}")
    if settings.group_size not in (32, 64, 128):
        raise ValueError(f"group_size={settings.group_size}: mlx-lm quantizes in groups of 32, 64 or 128")


def make(merged_dir: Path, out: Path, work: Path, stem: str, settings: MlxSettings, log) -> Made:
    """Every variant of ``settings.variants`` as an mlx-lm folder in ``out``, each checked in mlx-lm; the one that ships.
    A vision-language model's are mlx-vlm folders, checked on picture prompts too (``mlx_vision``)."""
    vision = model_has_vision(merged_dir)
    if vision:
        arguments = {variant: convert_arguments(variant, settings.group_size) for variant in settings.variants}
        files = mlx_vision.written_and_checked(merged_dir, out, work, stem, arguments, log)
    else:
        reference = llamacpp.reference(merged_dir)
        files = {}
        for variant in settings.variants:
            folder = out / f"{stem}-mlx-{variant}"
            convert(merged_dir, folder, variant, settings.group_size)
            files[folder.name] = _checked(folder, variant, reference, log)
    shipped = choose_shipped(files, settings.ship, settings.ship_max_rel_error)
    log.info(
        f"shipping {shipped} ({settings.ship}; {'mlx-vlm' if vision else 'mlx-lm'} rel. logit error "
        f"{files[shipped]['mlx']['rel_error']:.2e})"
    )
    stats = {
        "ship": settings.ship,
        "ship_max_rel_error": settings.ship_max_rel_error,
        "group_size": settings.group_size,
    }
    return Made(files, shipped, stats, rows(files, shipped))


def convert_arguments(variant: str, group_size: int) -> dict:
    """mlx_lm.convert's (and mlx_vlm.convert's) arguments for ``variant``."""
    arguments = dict(VARIANTS[variant])
    if arguments.get("quantize"):
        arguments["q_group_size"] = group_size
    return arguments


def convert(merged_dir: Path, folder: Path, variant: str, group_size: int) -> None:
    """``mlx_lm.convert`` of the merged model to ``folder``, then the config keys mlx-lm needs (``mlx_config``)."""
    from mlx_lm import convert as mlx_convert

    merged_dir = experts_as_mlx_reads_them(merged_dir, folder.with_name(folder.name + "-source"))

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # mlx-lm prints its [INFO] lines; the asset logs its own
            mlx_convert(str(merged_dir), str(folder), **convert_arguments(variant, group_size))
    except (ValueError, KeyError) as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise ExportRefused(f"mlx_lm.convert cannot take this model ({variant}): {one_line(exc)}") from exc
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | mlx_config(config), indent=2))


def experts_as_mlx_reads_them(merged_dir: Path, work: Path) -> Path:
    """The merged model as mlx_lm.convert takes it: itself, or for gpt-oss a copy with its experts split and laid out.

    transformers writes gpt-oss's float experts fused, gate and up interleaved (``gate_up_proj``, (experts, hidden,
    2 x intermediate), gate in the even columns) and ``down_proj`` (experts, intermediate, hidden); mlx-lm 0.32 splits
    only the released MXFP4 blocks and takes anything else as already split: ``gate_proj.weight`` and ``up_proj.weight``
    (experts, intermediate, hidden), ``down_proj.weight`` (experts, hidden, intermediate), and their biases.
    """
    config = json.loads((merged_dir / "config.json").read_text())
    if config.get("model_type") != "gpt_oss":
        return merged_dir
    from safetensors.torch import load_file, save_file

    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(merged_dir, work, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    for path in sorted(merged_dir.glob("*.safetensors")):
        weights = {}
        for name, value in load_file(path).items():
            stem = name.rsplit(".", 1)[0] + "."
            if name.endswith("experts.gate_up_proj"):
                weights[stem + "gate_proj.weight"] = value[..., ::2].transpose(1, 2).contiguous()
                weights[stem + "up_proj.weight"] = value[..., 1::2].transpose(1, 2).contiguous()
            elif name.endswith("experts.gate_up_proj_bias"):
                weights[stem + "gate_proj.bias"] = value[..., ::2].contiguous()
                weights[stem + "up_proj.bias"] = value[..., 1::2].contiguous()
            elif name.endswith("experts.down_proj"):
                weights[stem + "down_proj.weight"] = value.transpose(1, 2).contiguous()
            elif name.endswith("experts.down_proj_bias"):
                weights[stem + "down_proj.bias"] = value
            else:
                weights[name] = value
        save_file(weights, work / path.name, metadata={"format": "pt"})
    return work


def _checked(folder: Path, variant: str, reference: llamacpp.Reference, log) -> dict:
    """One folder's entry in mlx_model's stats: what was written, and mlx-lm's check against the merged model."""
    import mlx.core as mx

    model, tokenizer = _load(folder)
    mismatches = [
        text
        for text, plain, ids in zip(reference.strings, reference.plain, reference.token_ids)
        if tokenizer.encode(text, add_special_tokens=plain) != ids
    ]
    if mismatches:
        raise ExportRefused(
            f"{folder.name}: mlx-lm tokenizes {len(mismatches)} test strings differently from the merged model's "
            f"tokenizer, e.g. {mismatches[0][:80]!r}"
        )
    try:
        pairs = [(expected, np.asarray(model(mx.array([ids]))[0].astype(mx.float32))) for ids, expected in
                 zip(reference.prompt_ids, reference.logits)]  # fmt: skip
    except RuntimeError as exc:  # mlx's CPU build: "[GatherMM::eval] Currently only supports float32."
        if "GatherMM" not in str(exc):
            raise
        raise ExportRefused(
            f"{folder.name}: mlx's CPU build runs a mixture's experts in float32 only (gather_mm), so mlx-lm cannot "
            f"answer with {variant} here; a Mac's GPU can. Export 8bit or 4bit on this machine"
        ) from exc
    agreement = logit_agreement(pairs)
    parted = [
        llamacpp.parting_step(_greedy(model, tokenizer, ids, len(expected) or 1, reference.eos_token_id), expected)
        for ids, expected in zip(reference.prompt_ids, reference.continuations)
    ]
    weights = sorted(folder.glob("*.safetensors"))
    entry = {
        "variant": variant,
        "bytes": sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()),
        "sha256": _sha256(weights),
        "mlx": {**agreement, "tokens_match": True, "greedy_match": parted.count(None), "greedy_prompts": len(parted)},
    }
    log.info(
        f"{folder.name}: {entry['bytes'] / 1e6:.1f} MB; mlx-lm rel. logit error {agreement['rel_error']:.2e}, top-1 "
        f"{agreement['top1_agreement']:.3f}, greedy equal on {parted.count(None)}/{len(parted)} prompts"
    )
    return entry


def _load(folder: Path):
    from mlx_lm import load

    try:
        return load(str(folder))
    except (ValueError, FileNotFoundError) as exc:
        raise ExportRefused(f"mlx-lm cannot load {folder.name}: {one_line(exc)}") from exc


def _greedy(model, tokenizer, ids: list[int], max_tokens: int, eos: int | None) -> list[int]:
    """mlx-lm's greedy continuation of ``ids``, cut after the merged model's end of sequence as transformers' is."""
    from mlx_lm import stream_generate

    tokens = [response.token for response in stream_generate(model, tokenizer, ids, max_tokens=max_tokens)]
    return llamacpp.cut_at(tokens, eos)


def _sha256(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def choose_shipped(files: dict[str, dict], ship: str, max_rel_error: float) -> str:
    """The folder that ships: the named variant, or the smallest within ``max_rel_error``, else the most accurate."""
    if ship != "auto":
        return next(name for name, entry in files.items() if entry["variant"] == ship)
    within = [name for name, entry in files.items() if entry["mlx"]["rel_error"] <= max_rel_error]
    if within:
        return min(within, key=lambda name: files[name]["bytes"])
    return min(files, key=lambda name: files[name]["mlx"]["rel_error"])


def rows(files: dict[str, dict], shipped: str) -> list[dict]:
    """mlx_model's metadata table: one row per folder (a VLM's: its logit error after pictures too)."""
    return [
        {"folder": name, "variant": e["variant"], "MB": e["bytes"] / 1e6, "shipped": name == shipped,
         "mlx_rel_logit_error": e["mlx"]["rel_error"], "mlx_top1": e["mlx"]["top1_agreement"], "mlx_kl": e["mlx"]["kl_divergence"],
         "greedy_equal": f"{e['mlx']['greedy_match']}/{e['mlx']['greedy_prompts']}", "token_ids_equal": e["mlx"]["tokens_match"],
         **({"picture_logit_error": e["mlx_vlm"]["rel_error"]} if "mlx_vlm" in e else {})}
        for name, e in files.items()
    ]  # fmt: skip


class MlxLm:
    """An mlx-lm folder in mlx-lm (in process), answering the eval prompts; a VLM's mlx-vlm folder through mlx-vlm
    (``mlx_vision.MlxVlm``), pictures and all."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.vision = mlx_vision.MlxVlm(folder) if model_has_vision(folder) else None

    def chat_answers(self, conversations: list[list[dict]], max_new_tokens: int, log) -> list[str]:
        """Greedy chat completions by ``mlx_lm.generate`` through the folder's chat template, at mlx-lm's stop tokens (a
        VLM's by ``mlx_vlm.generate``, pictures and all: ``MlxVlm.chat_answers``)."""
        if self.vision:
            return self.vision.chat_answers(conversations, max_new_tokens, log)
        from mlx_lm import generate

        if not backends.mlx_installed():
            raise ExportRefused(f"mlx and mlx-lm are not installed here: {backends.INSTALL}")
        model, tokenizer = _load(self.folder)
        answers = []
        for number, messages in enumerate(conversations, 1):
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            answers.append(answer_text(generate(model, tokenizer, prompt, max_tokens=max_new_tokens)).strip())
            if number % 16 == 0 or number == len(conversations):
                log(f"mlx-lm answered {number}/{len(conversations)}")
        return answers

    @contextmanager
    def harness(self, tokenizer_dir: Path, label: str, chat: bool) -> Iterator[HarnessModel]:
        """The folder behind mlx-lm's OpenAI-compatible server (``mlx_lm server``, as a Mac serves it; a free loopback
        port) as an lm-eval model, generate_until only. ``chat``: ``local-chat-completions``, the prompt rendered by
        the folder's chat template; else ``local-completions``, the prompt as text (lm-eval reads ``tokenizer_dir``,
        the merged model's tokenizer, whose ids the export checked equal, for lengths)."""
        if self.vision:
            self.vision.harness(tokenizer_dir, label, chat)
        if not backends.mlx_installed():
            raise ExportRefused(f"mlx and mlx-lm are not installed here: {backends.INSTALL}")

        def command(port: int) -> list[str]:
            return [sys.executable, "-m", "mlx_lm", "server", "--model", str(self.folder), "--host", "127.0.0.1",
                    "--port", str(port), "--temp", "0", "--log-level", "WARNING"]  # fmt: skip

        try:
            with servers.serve(command, "mlx_lm server", self.folder.name, SERVER_START_S) as url:
                yield served_model(url, "default_model", MAX_LENGTH, tokenizer_dir, label, chat, NO_PROMPT_LOGPROBS)
        except servers.ServerError as exc:
            raise ExportRefused(one_line(str(exc).replace(str(self.folder), self.folder.name))) from exc

    def pair_logps(self, rows):
        """The summed log-probabilities of every eval pair's chosen and rejected reply from mlx-lm's logits, each
        sequence alone (its own positions, as in the packed rows), as ``evaluate.pair_scores`` gives the merged model's."""
        import mlx.core as mx
        import torch

        from ft_assets.shards import IGNORE_INDEX
        from ft_assets.training.loss import PairLogps

        if self.vision:
            return self.vision.pair_logps(rows)
        model, _ = _load(self.folder)
        sums, tokens = torch.zeros(rows.pair_mask.shape + (2,)), torch.zeros(rows.pair_mask.shape + (2,))
        for row, k in zip(*rows.pair_mask.nonzero(as_tuple=True)):
            for side in (0, 1):
                where = rows.segment_ids[row] == 2 * k + side
                ids, labels = rows.input_ids[row][where].tolist(), rows.labels[row][where].numpy()
                logits = np.asarray(model(mx.array([ids]))[0].astype(mx.float32))[:-1].astype(np.float64)
                logps = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
                learned = np.flatnonzero(labels[1:] != IGNORE_INDEX)
                sums[row, k, side] = float(logps[learned, labels[1:][learned]].sum())
                tokens[row, k, side] = len(learned)
        return PairLogps(sums[..., 0], sums[..., 1], tokens[..., 0], tokens[..., 1])


MLX = Export(
    name="mlx", asset="mlx_model", title="MLX", runtime_name="mlx-lm", variant="variant",
    kinds=frozenset({"mlx"}),
    description="mlx-lm folders (Apple silicon: mlx_lm generate, mlx_lm.server, LM Studio) of the merged model, bf16 and "
    "4-bit, each checked in mlx-lm against the merged model; a vision-language model's as mlx-vlm folders, checked on "
    "pictures too; or none, with the reason in one line (variants: [], mlx not installed, a model or VLM family mlx-lm "
    "or mlx-vlm refuses): the model still ships.",
    settings=MlxSettings, off=off, check=check, make=make, runtime=MlxLm, takes_vision=True,
)  # fmt: skip


def _main() -> None:
    """Export a model directory (a text model or a VLM) to MLX folders and check each against transformers: one JSON line
    per variant, or its refusal."""
    import argparse
    import logging

    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("model_dir", help="Hugging Face directory of the merged model (weights, tokenizer, processor)")
    parser.add_argument("out_dir", help="where the MLX folders go")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    model_dir, out = Path(args.model_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for variant in args.variants:  # one a run, so that one refused does not hide the others
        try:
            made = make(
                model_dir, out, out / "work", model_dir.name, MlxSettings(variants=[variant]), logging.getLogger()
            )
        except ExportRefused as exc:
            print(json.dumps({"model": model_dir.name, "variant": variant, "refused": str(exc)}))
            continue
        entry = made.files[made.shipped]
        print(json.dumps({"model": model_dir.name, "folder": made.shipped, "bytes": entry["bytes"], "variant": variant,
                          "text": entry["mlx"], **({"pictures": entry["mlx_vlm"]} if "mlx_vlm" in entry else {})}))  # fmt: skip
    shutil.rmtree(out / "work", ignore_errors=True)


if __name__ == "__main__":
    _main()
