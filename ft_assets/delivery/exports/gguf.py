"""The GGUF export: llama.cpp / Ollama files of the merged model, checked, scored and served in llama.cpp.

- **Export**: F32/F16/Q8_0 by llama.cpp's own converter (``ft_assets.delivery.converter``, one child
  process for every type), Q4_0 and the K-quants by its quantizer from the F16 file
  (``llamacpp.quantize``); each file is loaded in llama.cpp and compared with the merged model
  (``llamacpp.check_file``: token ids of 15 hard strings, logits, greedy continuations), and F32/F16/Q8_0
  are also read back by transformers' GGUF reader, recorded but not a gate (it reads Llama 3, Gemma 2/3
  and Qwen3 files differently from llama.cpp). ``ship`` picks the file that ships (``llamacpp.choose_shipped``:
  by default the smallest within ``ship_max_rel_error`` of the merged model's logits), and an Ollama
  Modelfile names it.
- **Runtime**: llama.cpp in process (``LlamaCpp``): greedy chat completions through the chat template
  embedded in the file for chat and GRPO runs, and for DPO the log-probabilities of each pair's replies
  from llama.cpp's logits; for ``general_eval``, the file behind llama.cpp's OpenAI-compatible server as
  lm-eval's ``local-completions`` model, which answers ``generate_until`` tasks only (``NO_PROMPT_LOGPROBS``).
- **Gate**: the shipped file may score at most ``max_drop`` (0.05) below the merged model.
- **Vision-language models** (``takes_vision``): the converter also writes the projector, ``<stem>-mmproj-f16.gguf``,
  one for every type; each file is also checked with it in libmtmd on picture prompts (``mtmd.check_vision_file``:
  token ids equal to the processor's, logits within ``mtmd.TOLERANCES``), the projector ships beside the chosen file
  (``Made.companions``), and the runtime answers through libmtmd when it finds the projector there. The Modelfile
  stays text-only; transformers' GGUF reader, which takes no VLM, is not run.

Refused (``ExportRefused``, one line; the run goes on without a GGUF unless ``required``): an
architecture or tokenizer the converter cannot take (``GgufUnsupported``), a converter or quantizer that
fails, a file llama.cpp will not load, or one whose token ids differ from the HF tokenizer's (a VLM's: or from its
processor's on pictures, or whose logits there part beyond the bound).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import Field

from ft_assets.delivery import llamacpp, mtmd
from ft_assets.delivery.converter import MMPROJ_OUTTYPE, GgufExportError, GgufUnsupported
from ft_assets.delivery.harness import HarnessModel, served_model
from ft_assets.delivery.exports.protocol import Export, ExportRefused, ExportSettings, Made, one_line
from ft_assets.delivery.gguf_export import SUPPORTED_QTYPES, export_ggufs, verify_gguf, write_modelfile
from ft_assets.vision import model_has_vision

QTYPES = (*SUPPORTED_QTYPES, *llamacpp.QUANTIZED)  # the converter's, then the quantizer's
OFF = "GGUF export is off (gguf_model qtypes: [])"
NO_PROMPT_LOGPROBS = (
    "llama.cpp's server returns no log-probabilities of the prompt's tokens (llama-server; lm-eval#4158), which "
    "loglikelihood and multiple-choice tasks score; the merged model is scored on them instead"
)


class GgufSettings(ExportSettings):
    """GGUF files of the merged model (llama.cpp / Ollama), checked in llama.cpp."""

    qtypes: list[str] = Field(
        default=["f16", "q8_0", "q4_k_m", "q5_k_m", "q6_k"],
        description=(
            "GGUF types to export: f32, f16, q8_0 (llama.cpp's converter) and q4_0, q4_k_m, q5_k_m, q6_k (llama.cpp's quantizer on the "
            "f16 file). [] turns GGUF off: the merged model and the adapter are evaluated and published without one."
        ),
    )
    verify: bool = Field(
        default=True,
        description="Also load each f32/f16/q8_0 file with transformers' GGUF reader and record its logit error against the merged "
        "model (a second reader, not a gate: llama.cpp's check is).",
    )
    ship: str = Field(
        default="auto",
        description=(
            "The GGUF that ships (scored by eval_report, served by serving_smoke, FROM of the Modelfile): one of qtypes, or 'auto' = "
            "the smallest file whose logit error through llama.cpp is within ship_max_rel_error (the most accurate file when none is)."
        ),
    )
    ship_max_rel_error: float = Field(
        default=0.08,
        description=(
            "For ship='auto': the largest relative logit error against the merged model (through llama.cpp) a shipped file may have; "
            "0.08 is the bound a Q8_0 file is held to (gguf_export.TOLERANCES)."
        ),
    )
    system_prompt: str = Field(default="", description="SYSTEM line of the Ollama Modelfile (empty: none).")


def off(settings: GgufSettings) -> str | None:
    return None if settings.qtypes else OFF


def check(settings: GgufSettings) -> None:
    unknown = sorted(set(settings.qtypes) - set(QTYPES))
    if unknown:
        raise ValueError(f"qtypes={settings.qtypes}: choose from {', '.join(QTYPES)}, or [] for no GGUF")
    if settings.qtypes and settings.ship not in ("auto", *settings.qtypes):
        raise ValueError(f"ship={settings.ship!r}: 'auto' or one of the exported qtypes {settings.qtypes}")


def make(merged_dir: Path, out: Path, work: Path, stem: str, settings: GgufSettings, log) -> Made:
    """Every file of ``settings.qtypes`` in ``out``, each checked in llama.cpp, the shipped one chosen, and its Modelfile;
    for a vision-language model also its projector (``mtmd``), beside the files and shipped with the chosen one."""
    projector = mtmd.mmproj_file(stem) if model_has_vision(merged_dir) else None
    try:
        files, chat_template = _written_and_checked(merged_dir, out, work, stem, settings, log, projector)
        shipped = llamacpp.choose_shipped(files, settings.ship, settings.ship_max_rel_error)
        write_modelfile(
            shipped, out / "Modelfile", chat_template, system=settings.system_prompt or None, projector=projector
        )
    except GgufUnsupported as exc:
        raise ExportRefused(f"llama.cpp cannot take this model: {one_line(exc)}") from exc
    except (GgufExportError, llamacpp.LlamaCppError) as exc:
        raise ExportRefused(one_line(exc)) from exc
    log.info(
        f"shipping {shipped}{f' and {projector}' if projector else ''} ({settings.ship}; llama.cpp rel. logit error "
        f"{llamacpp.shipped_error(files[shipped]):.2e})"
    )
    stats = {"ship": settings.ship, "ship_max_rel_error": settings.ship_max_rel_error, "modelfile": "Modelfile"}
    if projector:
        stats["mmproj"] = projector
    return Made(files, shipped, stats, rows(files, shipped), companions=[projector] if projector else [])


def _written_and_checked(
    merged_dir: Path, out: Path, work: Path, stem: str, settings: GgufSettings, log, projector: str | None
) -> tuple[dict[str, dict], str | None]:
    """Every file of ``settings.qtypes`` (the converter's in one process, the projector first, then the quantizer's from
    the f16 file), each checked in llama.cpp, on picture prompts too for a VLM; and the chat template they embed."""
    converted = [q for q in settings.qtypes if q in SUPPORTED_QTYPES]
    quantized = [q for q in settings.qtypes if q in llamacpp.QUANTIZED]
    outputs = {q: out / f"{stem}-{q}.gguf" for q in converted}
    if quantized and "f16" not in outputs:
        outputs["f16"] = work / f"{stem}-f16.gguf"  # the quantizer's input, not shipped
    if projector:
        outputs[MMPROJ_OUTTYPE] = out / projector
    written = export_ggufs(merged_dir, outputs, name=stem)
    for qtype in quantized:
        written[qtype] = llamacpp.quantize(outputs["f16"], out / f"{stem}-{qtype}.gguf", qtype)
    reference = llamacpp.reference(merged_dir)
    pictures = mtmd.vision_reference(merged_dir) if projector else None
    files = {
        Path(written[q]["path"]).name: _checked(merged_dir, Path(written[q]["path"]), written[q], reference, settings.verify, log)
        for q in settings.qtypes
    }  # fmt: skip
    if pictures is not None:
        for name, entry in files.items():
            entry["mtmd"] = _checked_with_pictures(out / name, out / projector, entry["qtype"], pictures, log)
    return files, reference.chat_template


def _checked_with_pictures(path: Path, mmproj: Path, qtype: str, pictures: mtmd.VisionReference, log) -> dict:
    """A VLM's file and its projector in libmtmd on the picture prompts (``mtmd.check_vision_file``): refused when the token
    ids differ from the processor's, or (f32, f16, q8_0) when the logits part from the merged model's beyond
    ``mtmd.TOLERANCES``: a projector laid out wrong, or images read otherwise."""
    try:
        check = mtmd.check_vision_file(path, mmproj, pictures)
    except llamacpp.LlamaCppError as exc:
        raise ExportRefused(f"libmtmd refuses {path.name} with {mmproj.name}: {one_line(exc)}") from exc
    if not check["tokens_match"]:
        raise ExportRefused(
            f"{path.name} with {mmproj.name}: libmtmd tokenizes {len(check['token_mismatches'])} picture prompts differently "
            f"from the processor (image tokens per prompt, libmtmd vs processor: {check['image_tokens']})"
        )
    tolerance = mtmd.TOLERANCES.get(qtype)
    if tolerance is not None and check["rel_error"] > tolerance:
        raise ExportRefused(
            f"{path.name} with {mmproj.name}: llama.cpp's logits after picture prompts are {check['rel_error']:.2e} from the "
            f"merged model's (relative; at most {tolerance} for {qtype}): the projector does not see what the model saw"
        )
    log.info(
        f"{path.name} + {mmproj.name}: libmtmd rel. logit error {check['rel_error']:.2e} on {check['prompts']} picture prompts"
    )
    return {k: v for k, v in check.items() if k != "token_mismatches"}


def _checked(merged_dir: Path, path: Path, written: dict, reference: llamacpp.Reference, verify: bool, log) -> dict:
    """One file's entry in gguf_model's stats: what was written, llama.cpp's check, transformers' round trip (a text
    model's: its GGUF reader takes no vision-language model)."""
    try:
        check = llamacpp.check_file(path, reference)
    except llamacpp.LlamaCppError as exc:
        raise ExportRefused(
            f"llama.cpp refuses {path.name}: {one_line(str(exc).replace(str(path), path.name))}"
        ) from exc
    if not check["tokens_match"]:
        log.warning(
            f"{path.name}: the strings llama.cpp tokenizes differently: {json.dumps(check['token_mismatches'])}"
        )
        raise ExportRefused(
            f"{path.name}: llama.cpp tokenizes {len(check['token_mismatches'])} test strings differently from the HF tokenizer, "
            f"e.g. {check['token_mismatches'][0][:80]!r}; the tokenizer metadata is wrong"
        )
    entry = {
        "qtype": written["qtype"], "bytes": written["bytes"], "sha256": written["sha256"], "tensor_types": written["tensor_types"],
        "llamacpp": {k: v for k, v in check.items() if k != "token_mismatches"},
    }  # fmt: skip
    if verify and written["qtype"] in SUPPORTED_QTYPES and not model_has_vision(merged_dir):
        entry["transformers"] = _second_reader(merged_dir, path, written["qtype"], check["rel_error"], log)
    log.info(
        f"{path.name}: {written['bytes'] / 1e6:.1f} MB {written['tensor_types']}; llama.cpp rel. logit error {check['rel_error']:.2e}, "
        f"greedy equal on {check['greedy_match']}/{check['greedy_prompts']} prompts ({check['greedy_near_ties']} more part at a near-tie)"
    )
    return entry


def _second_reader(merged_dir: Path, path: Path, qtype: str, llamacpp_rel_error: float, log) -> dict:
    """transformers' own GGUF reader on the file, recorded beside llama.cpp's check but not a gate: it reads Llama 3's
    RoPE scaling, Gemma 2/3 and Qwen3 files differently from llama.cpp (python -m benchmarks.gguf_families), and
    llama.cpp is the runtime the file ships to."""
    try:
        report = verify_gguf(merged_dir, path, qtype)
    except Exception as exc:  # noqa: BLE001 - a second reader, not a gate: an architecture or vocabulary it cannot read is recorded
        log.warning(f"{path.name}: transformers' GGUF reader cannot load it: {' '.join(str(exc).split())[:300]}")
        return {"error": " ".join(str(exc).split())[:300]}
    if not report["ok"]:
        log.warning(
            f"{path.name}: transformers' GGUF reader gives rel. logit error {report['rel_error']:.2e} (tolerance {report['tolerance']}), "
            f"tokens match {report['tokens_match']}; llama.cpp gives {llamacpp_rel_error:.2e}"
        )
    return {k: report[k] for k in ("rel_error", "top1_agreement", "tolerance", "tokens_match", "ok")}


def rows(files: dict[str, dict], shipped: str) -> list[dict]:
    """gguf_model's metadata table: one row per file, headed with short names that wrap, so it fits the page."""
    return [
        {"file": name, "type": e["qtype"], "MB": e["bytes"] / 1e6, "shipped": name == shipped,
         "rel. logit error": e["llamacpp"]["rel_error"], "top-1": e["llamacpp"]["top1_agreement"],
         "KL": e["llamacpp"]["kl_divergence"],
         "greedy equal": f"{e['llamacpp']['greedy_match']}/{e['llamacpp']['greedy_prompts']}"
                         + (f" +{e['llamacpp']['greedy_near_ties']} near-tie" if e["llamacpp"]["greedy_near_ties"] else ""),
         "token ids equal": e["llamacpp"]["tokens_match"],
         **({"picture logit error": e["mtmd"]["rel_error"]} if "mtmd" in e else {}),
         "HF reader error": e.get("transformers", {}).get("rel_error"),
         "tensors": ", ".join(f"{t} {n}" for t, n in sorted(e["tensor_types"].items()))}
        for name, e in files.items()
    ]  # fmt: skip


class LlamaCpp:
    """A GGUF file in llama.cpp (llama-cpp-python, in process), answering the eval prompts; a VLM's with its projector
    beside it (``mtmd.mmproj_path``) through libmtmd, pictures and all."""

    def __init__(self, path: Path):
        self.path = path
        self.mmproj = mtmd.mmproj_path(path) if mtmd.mmproj_path(path).is_file() else None

    def chat_answers(self, conversations: list[list[dict]], max_new_tokens: int, log) -> list[str]:
        """Greedy chat completions through the file's own chat template, stopping at its end of turn."""
        try:
            if self.mmproj:
                return mtmd.chat_answers(self.path, self.mmproj, conversations, max_new_tokens, log)
            return llamacpp.chat_answers(self.path, conversations, max_new_tokens, log)
        except llamacpp.LlamaCppError as exc:
            raise ExportRefused(one_line(str(exc).replace(str(self.path), self.path.name))) from exc

    @contextmanager
    def harness(self, tokenizer_dir: Path, label: str, chat: bool) -> Iterator[HarnessModel]:
        """The file behind llama.cpp's OpenAI-compatible server (``llamacpp.serve``, a free loopback port) as an lm-eval
        model, generate_until only. ``chat`` (lm-eval's apply_chat_template): ``local-chat-completions``, the prompt
        rendered by the chat template embedded in the file, as the file is deployed; else ``local-completions``, the
        prompt as text, tokenized by the server (the export checked its token ids equal the HF tokenizer's, which
        lm-eval reads from ``tokenizer_dir`` for lengths)."""
        try:
            with llamacpp.serve(self.path) as url:
                yield served_model(url, self.path.name, llamacpp.N_CTX, tokenizer_dir, label, chat, NO_PROMPT_LOGPROBS)
        except llamacpp.LlamaCppError as exc:
            raise ExportRefused(one_line(str(exc).replace(str(self.path), self.path.name))) from exc

    def pair_logps(self, rows):
        """The summed log-probabilities of every eval pair's chosen and rejected reply, as ``evaluate.pair_scores`` gives
        the merged model's: each sequence evaluated alone (its own positions, as in the packed rows), the log-softmax
        of llama.cpp's logits summed over the reply's tokens."""
        import numpy as np
        import torch

        from ft_assets.shards import IGNORE_INDEX
        from ft_assets.training.loss import PairLogps

        try:
            llm = llamacpp.load(self.path, logits_all=True, n_ctx=max(llamacpp.N_CTX, rows.seq_len))
        except llamacpp.LlamaCppError as exc:
            raise ExportRefused(one_line(str(exc).replace(str(self.path), self.path.name))) from exc
        sums, tokens = torch.zeros(rows.pair_mask.shape + (2,)), torch.zeros(rows.pair_mask.shape + (2,))
        try:
            for row, k in zip(*rows.pair_mask.nonzero(as_tuple=True)):
                for side in (0, 1):
                    where = rows.segment_ids[row] == 2 * k + side
                    ids, labels = rows.input_ids[row][where].tolist(), rows.labels[row][where].numpy()
                    logits = llamacpp.logits(llm, ids)[:-1].astype(np.float64)
                    logps = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
                    learned = np.flatnonzero(labels[1:] != IGNORE_INDEX)
                    sums[row, k, side] = float(logps[learned, labels[1:][learned]].sum())
                    tokens[row, k, side] = len(learned)
        finally:
            llm.close()
        return PairLogps(sums[..., 0], sums[..., 1], tokens[..., 0], tokens[..., 1])


GGUF = Export(
    name="gguf", asset="gguf_model", title="GGUF", runtime_name="llama.cpp", variant="qtype",
    kinds=frozenset({"llama", "gguf"}),
    description="GGUF files (llama.cpp / Ollama) with tokenizer and chat template embedded, each checked in llama.cpp against "
    "the merged model, and a vision-language model's projector (mmproj) beside them, checked in libmtmd on pictures; or none, "
    "with the reason in one line (qtypes: [], or a model llama.cpp refuses): the model still ships.",
    settings=GgufSettings, off=off, check=check, make=make, runtime=LlamaCpp, takes_vision=True,
)  # fmt: skip
