"""A SentencePiece-style tokenizer.json with no tokenizer.model, through llama.cpp's converter (fix 4 of converter.py).

A tiny SentencePiece BPE is built in-process the way transformers rebuilds Gemma's from a GGUF
(``GemmaTokenizer``: byte fallback, ``Replace(" ", "▁")``, ``<unusedN>`` and ``<start_of_turn>`` as
special added tokens, newline runs as plain added tokens), and once in Llama 2's legacy shape
(``Prepend("▁")`` + ``Replace``, as Mistral v0.1 has it). Tiny random models of three families carry it,
Gemma 3, Gemma 2 and Mistral, whose converters take three different paths when tokenizer.model is missing (the GPT-2 writer,
the SentencePiece writer, ``_set_vocab_llama_hf``). Each F16 file must give transformers' token ids in
llama.cpp on ``llamacpp.HARD_STRINGS`` and the chat prompts, and its logits. The same file with every
score equal (what ``_set_vocab_llama_hf`` writes) must not: that is why the scores are merge ranks.
One converter process for all three (~10 s), then llama.cpp; no download.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from ft_assets.delivery import converter, llamacpp
from ft_assets.delivery.converter import convert_many
from ft_assets.delivery.sentencepiece_vocab import NotSentencePiece, add_space_prefix, sentencepiece_vocab
from ft_assets_tests.families import BY_NAME, GEMMA_TEMPLATE, MISTRAL_TEMPLATE, family_config
from ft_assets_tests.tiny import CORPUS

SPACE = "\u2581"
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]  # Gemma's ids 0-4
TURNS = ["<start_of_turn>", "<end_of_turn>"]
NEWLINES = ["\n", "\n\n", "\n\n\n"]  # plain (user-defined) added tokens, as in Gemma's vocabulary
FLAT_SCORE = -1000.0  # the score gguf.LlamaHfVocab gives every token


@dataclass(frozen=True)
class Case:
    family: str  # of ft_assets_tests.families
    legacy_llama: bool  # Llama 2's Prepend("▁") normalizer, else Gemma's pipeline
    add_space_prefix: bool


CASES = [
    Case("gemma3", False, False),
    Case("gemma2", False, False),
    Case("mistral", True, True),
]  # Mistral v0.1: Llama 2's tokenizer


def trained_merges() -> tuple[list[str], list[tuple[str, str]]]:
    """A SentencePiece-like BPE trained on the test corpus: pieces never cross a space, a space starts a piece."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True)
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=1000, show_progress=False))
    model = json.loads(tokenizer.to_str())["model"]
    return sorted(model["vocab"], key=model["vocab"].get), [tuple(pair) for pair in model["merges"]]


def build_tokenizer(legacy_llama: bool):
    """Gemma's vocabulary layout (specials, newlines, the 256 bytes, trained pieces, ``<unusedN>`` up to a multiple of 64)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import GemmaTokenizer, PreTrainedTokenizerFast

    pieces, merges = trained_merges()
    vocab: dict[str, int] = {}
    for token in [*SPECIAL, *TURNS, *NEWLINES, *(f"<0x{b:02X}>" for b in range(256)), *pieces]:
        vocab.setdefault(token, len(vocab))
    unused = [f"<unused{i}>" for i in range(-len(vocab) % 64)]
    vocab.update({token: len(vocab) + i for i, token in enumerate(unused)})
    if legacy_llama:
        backend = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
        )
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        backend.decoder = decoders.Sequence(
            [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
                                            add_bos_token=True)  # fmt: skip
        tokenizer.chat_template = MISTRAL_TEMPLATE
    else:
        tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
        tokenizer.chat_template = GEMMA_TEMPLATE
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in [*SPECIAL, *TURNS, *unused]], special_tokens=True
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in NEWLINES])
    return tokenizer


def build_model(case: Case, out_dir):
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(case.legacy_llama)
    tokenizer.save_pretrained(out_dir)
    tokenizer_json = json.loads((out_dir / "tokenizer.json").read_text())
    assert not (out_dir / "tokenizer.model").exists() and tokenizer_json["model"]["byte_fallback"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(family_config(BY_NAME[case.family], tokenizer)).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple]:
    """family -> (model dir, its F16 GGUF), all three written by one converter process."""
    root = tmp_path_factory.mktemp("spm-vocab")
    dirs = {case.family: build_model(case, root / case.family) for case in CASES}
    convert_many([(model_dir, "tiny", "f16", root / f"{family}.gguf") for family, model_dir in dirs.items()])
    return {family: (model_dir, root / f"{family}.gguf") for family, model_dir in dirs.items()}


def fields(path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {
        name: reader.fields[name].contents()
        for name in ("tokenizer.ggml.model", "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.pre")
    }


@pytest.mark.integration  # the converter process, then llama.cpp
@pytest.mark.parametrize("case", CASES, ids=[case.family for case in CASES])
def test_llamacpp_tokenizes_and_answers_like_transformers(converted, case, tmp_path):
    model_dir, path = converted[case.family]
    assert fields(path) == {"tokenizer.ggml.model": "llama", "tokenizer.ggml.add_space_prefix": case.add_space_prefix,
                            "tokenizer.ggml.pre": "default"}  # fmt: skip
    ref = llamacpp.reference(model_dir)
    check = llamacpp.check_file(path, ref)
    assert check["tokens_match"], check["token_mismatches"]
    assert check["rel_error"] <= 5e-3, check  # what test_gguf_families holds F16 to

    flat = tmp_path / "flat-scores.gguf"
    with_scores(path, flat, FLAT_SCORE)
    llm = llamacpp.load(flat, vocab_only=True)
    try:
        differ = [
            text
            for text, bos, ids in zip(ref.strings, ref.plain, ref.token_ids)
            if llamacpp.tokenize(llm, text, bos) != ids
        ]
    finally:
        llm.close()
    print(f"{case.family}: {len(differ)} of {len(ref.strings)} strings tokenize differently with equal scores")
    assert differ  # merged leftmost-first instead of in the merges' order


def with_scores(source, target, score: float) -> None:
    """Copy the GGUF ``source`` to ``target`` with every token score ``score``, with the vendored gguf-py."""
    script = (
        "import sys, gguf\n"
        "from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata\n"
        "reader = gguf.GGUFReader(sys.argv[1])\n"
        "n = len(reader.fields['tokenizer.ggml.scores'].data)\n"
        "writer = gguf.GGUFWriter(sys.argv[2], arch=reader.fields['general.architecture'].contents(), endianess=reader.endianess)\n"
        "new = {'tokenizer.ggml.scores': MetadataDetails(gguf.GGUFValueType.ARRAY, [float(sys.argv[3])] * n, "
        "sub_type=gguf.GGUFValueType.FLOAT32)}\n"
        "copy_with_new_metadata(reader, writer, new, [])\n"
    )
    where = converter.location() / "gguf-py"
    env = {**os.environ, "PYTHONPATH": str(where)}
    subprocess.run(
        [sys.executable, "-c", script, str(source), str(target), str(score)], env=env, check=True, capture_output=True
    )


# ---- the pure functions, no llama.cpp ----

GEMMA_PIPELINE = {
    "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
    "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
}
LEGACY_LLAMA = {"normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE},
                {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]}, "pre_tokenizer": None}  # fmt: skip


def metaspace(scheme: str, split: bool = False) -> dict:
    return {
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": scheme, "split": split},
    }


SHAPE_CASES = [
    ("gemma", GEMMA_PIPELINE, False),
    ("gemma without its no-op split", {**GEMMA_PIPELINE, "pre_tokenizer": None}, False),
    ("llama 2 legacy", LEGACY_LLAMA, True),
    ("metaspace never", metaspace("never"), False),
    ("metaspace first (transformers 5 llama)", metaspace("first"), "prepend_scheme 'first'"),
    ("metaspace always", metaspace("always"), "prepend_scheme 'always'"),
    ("metaspace that splits", metaspace("never", split=True), "normalizer none with pre-tokenizer"),
    ("dropout", {**GEMMA_PIPELINE, "model": {"dropout": 0.1}}, "model.dropout = 0.1"),
    (
        "a lowercase normalizer",
        {**GEMMA_PIPELINE, "normalizer": {"type": "Lowercase"}},
        "normalizer {'type': 'Lowercase'}",
    ),
]


@pytest.mark.parametrize("case, pipeline, expected", SHAPE_CASES, ids=[c[0] for c in SHAPE_CASES])
def test_add_space_prefix_of_each_shape(case, pipeline, expected):
    tokenizer = {**pipeline, "model": {"type": "BPE", "byte_fallback": True, **pipeline.get("model", {})}}
    if isinstance(expected, bool):
        assert add_space_prefix(tokenizer) is expected
    else:
        with pytest.raises(NotSentencePiece, match="would not reproduce") as caught:
            add_space_prefix(tokenizer)
        assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_scores_are_merge_ranks_and_types_follow_sentencepiece():
    tokenizer = {
        "model": {"type": "BPE", "byte_fallback": True, "unk_token": "<unk>",
                  "vocab": {"<unk>": 0, "<0x0A>": 1, "a": 2, "b": 3, "ab": 4, f"{SPACE}a": 5, SPACE: 6, "abab": 7},
                  "merges": [["a", "b"], [SPACE, "a"], ["ab", "ab"], ["a", "bab"]]},
        "added_tokens": [{"id": 8, "content": "<start_of_turn>", "special": True, "normalized": False},
                         {"id": 9, "content": f"{SPACE}{SPACE}", "special": False, "normalized": True}],
    }  # fmt: skip
    tokens, scores, types = sentencepiece_vocab(tokenizer, 11)
    assert tokens == ["<unk>", "<0x0A>", "a", "b", "ab", f"{SPACE}a", SPACE, "abab", "<start_of_turn>", "  ", "[PAD10]"]
    assert scores[4:8:3] == [0.0, -2.0] and scores[5] == -1.0  # the first merge that makes a token ranks it
    assert scores[0] == scores[2] == scores[8] == -4.0  # made by no merge: below every merged token
    assert types == [
        "UNKNOWN",
        "BYTE",
        "NORMAL",
        "NORMAL",
        "NORMAL",
        "NORMAL",
        "NORMAL",
        "NORMAL",
        "CONTROL",
        "USER_DEFINED",
        "UNUSED",
    ]
    with pytest.raises(NotSentencePiece, match="past the model's 8 embedding rows"):
        sentencepiece_vocab(tokenizer, 8)
