"""Print the sha256 of every file the data plane writes, to check that a change leaves its outputs byte for byte.

``python -m scripts.data_digests WORK_DIR > after.json`` runs every stage (read, the version's kind,
clean, dedup, split, tokenize) in this process on four inputs: the shipped sample, the parallel
tests' corpus (``benchmarks.corpus``, 3,000 rows a unit), 200 timer preference pairs and 200 timer
prompts, tokenized with the tests' tiny tokenizer. Run it once with the code before a change (``PYTHONPATH=<that
checkout>``) and once after, and diff the two: a data-plane refactor must print the same digests.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from benchmarks.corpus import write_corpus
from ft_assets import objectives
from ft_assets.data.chat_encoding import TokenizerFiles
from ft_assets.data.cleaning import CleaningRules, clean_dataset
from ft_assets.data.dedup import DedupRules, deduplicate_dataset
from ft_assets.data.parts import Artifact
from ft_assets.data.readers import read_dataset
from ft_assets.data.split import split_dataset
from ft_assets.data.tokenizing import tokenize_splits
from ft_assets_tests.support import timer_pairs, timer_prompts, write_jsonl
from ft_assets_tests.tiny import build_tiny_model

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "toolcalls"


def digests(files: list[tuple[str, Path]], work: Path, tokenizer: TokenizerFiles) -> tuple[str, dict[str, str]]:
    """The version's kind and the sha256 (16 hex digits) of every file its stages wrote under ``work``."""
    stage = {name: Artifact.folder(work / name) for name in ("raw", "clean", "dedup", "split", "shards")}
    kind = read_dataset(files, stage["raw"], None)["data_kind"]
    objective = objectives.for_data_kind(kind)
    clean_dataset(stage["raw"], stage["clean"], CleaningRules(), None, objective.clean_row)
    deduplicate_dataset(stage["clean"], stage["dedup"], DedupRules())
    split_dataset(stage["dedup"], stage["split"], 0.2, "ft-assets")
    tokenize_splits(stage["split"], ("train", "eval"), tokenizer, 512, stage["shards"], 1000, kind=objective.pack_kind)
    return kind, {
        str(p.relative_to(work)): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        for p in sorted(work.rglob("*"))
        if p.is_file()
    }


def main(out: Path) -> None:
    tokenizer = TokenizerFiles.from_dir(build_tiny_model(out / "model"))
    corpus = out / "corpus"
    write_corpus(corpus, rows_per_unit=3000)
    pairs = write_jsonl(out / "pairs" / "pairs.jsonl", timer_pairs(200))
    prompts = write_jsonl(out / "prompts" / "prompts.jsonl", timer_prompts(200))
    inputs = {
        "sample": [(p.name, p) for p in sorted(SAMPLE.iterdir())],
        "corpus": [(p.name, p) for p in sorted(corpus.iterdir())],
        "pairs": [("pairs.jsonl", pairs)],
        "prompts": [("prompts.jsonl", prompts)],
    }
    print(
        json.dumps(
            {name: digests(files, out / name, tokenizer) for name, files in inputs.items()}, indent=1, sort_keys=True
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
