"""What an export is: a shipped format of the merged model, made and checked in its own runtime, and what its gate allows.

An ``Export`` says three things, each a plain function of its module (``ft_assets.delivery.exports.gguf``):

- **how to export** (``make``): the merged model directory → the files that ship, each checked in the
  format's own runtime (llama.cpp for GGUF), and which one ``eval_report`` scores (``Made.shipped``);
- **how to answer the eval prompts with its runtime** (``runtime``): a ``Runtime`` over the shipped file
  that gives greedy chat answers (chat and GRPO runs) and the log-probabilities of preference pairs (DPO),
  so every objective's scorer scores it as it scores the merged model, and lm-eval's model of the file
  (``harness``: the request types its runtime answers, and why not the others), so ``general_eval`` runs the
  general-ability tasks on what ships;
- **what its gate allows** (``ExportSettings.max_drop``, the format's own default): how far below the
  merged model the shipped file may score.

An export its runtime refuses (a converter that cannot take the model, a file the runtime cannot load
or that tokenizes differently, answers it cannot give) raises ``ExportRefused`` with one line. The run
goes on without it: the line is in the export's metadata, ``eval_report``'s stats, ``lineage.json`` and
``ft-assets run --json``, and the merged model and adapter are evaluated and published; unless its
settings say ``required: true``, and then the run fails with that line. The trade-off: a run that was
asked for a format may publish without it, visibly, instead of stranding a trained model (a few minutes
of delivery) or hours of training behind a format problem.

Nothing here imports Dagster: the assets (``delivery/assets.py``) and checks are made from the registry
(``ft_assets.delivery.exports.EXPORTS``), one of each per export.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field

from ft_assets.vision import model_has_vision

MAX_REASON = 400  # characters of a refusal kept in stats, lineage and --json; the run's log has all of it


class ExportRefused(Exception):
    """The export cannot be made, or its runtime refuses it: one line saying what, where, and what to do."""


def refuse_model(export: Export, merged_dir: Path) -> None:
    """Refuse, before any work, a model of a kind ``export`` does not declare it takes (``Export.takes_vision``): a
    vision-language model's export would otherwise lose its image encoder."""
    if not export.takes_vision and model_has_vision(merged_dir):
        raise ExportRefused(
            f"{export.title} of a vision-language model is not supported (its image encoder would be lost): "
            "the merged model and the adapter ship without it"
        )


def one_line(text: object, limit: int = MAX_REASON) -> str:
    """A refusal as one line: its first line, and for a longer text (a converter's traceback) its last one too."""
    lines = [" ".join(line.split()) for line in str(text).splitlines() if line.strip()]
    line = " … ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else "no reason given"
    return line if len(line) <= limit else line[: limit - 1] + "…"


class ExportSettings(BaseModel):
    """What every export's settings hold beside its own; the export's asset shows them in the launchpad."""

    required: bool = Field(
        default=False,
        description="Fail the run when this export is refused (by its converter or runtime). Off: the run goes on without "
        "it, the merged model and adapter are evaluated and published, and the one-line reason is in the metadata, "
        "lineage.json and `ft-assets run --json`.",
    )
    max_drop: float = Field(
        default=0.05,
        description="Blocking gate: the shipped file, answering the eval prompts in its own runtime, may score at most this "
        "much below the merged model on the same prompts and metric (absolute, 0.05 = 5 points).",
    )


@dataclass
class Made:
    """What an export wrote: its files (each checked in its runtime) and the one that ships."""

    # file (or folder) name -> what was written (its variant, bytes, sha256) and its runtime's check
    files: dict[str, dict]
    shipped: str  # the name eval_report scores, the registry ships and a server serves
    stats: dict = field(default_factory=dict)  # the export's own figures beside those (GGUF: ship, Modelfile)
    rows: list[dict] = field(default_factory=list)  # the asset's metadata table, one row per file
    # names of files that travel with the shipped one wherever it goes (eval, registry): a VLM GGUF's projector
    companions: list[str] = field(default_factory=list)


class Runtime(Protocol):
    """A shipped file in its own runtime, answering what eval_report asks of every model. Raises ``ExportRefused``."""

    def chat_answers(
        self, conversations: list[list[dict]], max_new_tokens: int, log: Callable[[str], None]
    ) -> list[str]: ...

    def pair_logps(self, rows) -> Any: ...  # training.loss.PairLogps of every eval pair of the packed rows

    def harness(
        self, tokenizer_dir: Path, label: str, chat: bool
    ) -> AbstractContextManager[Any]: ...  # harness.HarnessModel: lm-eval's model of the file (general_eval)


@dataclass(frozen=True)
class Export:
    """One shipped format. Its asset, its blocking check and its keys everywhere follow from ``name`` and ``asset``."""

    name: (
        str  # "gguf": its folder in the registry, its key in eval_report's stats and lineage.json, --json's <name>_file
    )
    asset: str  # "gguf_model": the asset that makes it
    title: str  # "GGUF": how logs, tables and summaries name it
    runtime_name: str  # "llama.cpp": what answers through it
    variant: str  # "qtype": what its files differ by (a key of each file's entry; --json's <name>_<variant>)
    kinds: frozenset[str]  # the asset's kinds in the UI graph
    description: str  # the asset's description in the UI
    settings: type[ExportSettings]  # its settings: the common ones and its own
    off: Callable[[Any], str | None]  # settings -> why they make no files (GGUF: qtypes []), else None
    check: Callable[[Any], None]  # settings -> None; ValueError (one line) for a setting that cannot work
    make: Callable[..., Made]  # (merged_dir, out, work, stem, settings, log) -> Made; ExportRefused
    runtime: Callable[[Path], Runtime]  # the shipped file (or folder) -> its runtime
    # whether it takes a vision-language model (writes its image encoder too, and its runtime answers image prompts);
    # one that does not is refused for such a model before ``make`` (``refuse_model``)
    takes_vision: bool = False
