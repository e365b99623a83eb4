"""The SentencePiece (``llama``) vocabulary of a GGUF, from a ``tokenizer.json`` whose ``tokenizer.model`` is gone.

A SentencePiece BPE (Gemma, Llama 2, Mistral v0.1, Phi-3) reaches us as a ``tokenizers`` BPE with
``byte_fallback`` and ``▁`` for spaces, often without its ``tokenizer.model``: transformers writes
none when it builds the tokenizer from a GGUF (a Gemma 3 270M GGUF as ``base_model.source``), and a
fine-tune saved by transformers 5 has none either. llama.cpp's converter then has nothing right to
write: Gemma 3's ``set_vocab`` goes to the GPT-2 (byte-level) writer, which gives llama.cpp a vocabulary
it cannot tokenize with (transformers' GGUF reader stops at "Token '\\n' out of vocabulary"), and
Llama's goes to ``_set_vocab_llama_hf``, which gives every token the score -1000.

The score is what llama.cpp's SentencePiece tokenizer merges by (``llm_tokenizer_spm_session`` in
``src/llama-vocab.cpp``: the adjacent pair whose concatenation is the highest-scoring token first,
the leftmost one on a tie), where transformers applies the merges in their listed order. So this module
writes each token with score minus the rank of the first merge that makes it: llama.cpp then merges in
the order transformers does. With every score equal it merges leftmost-first instead: 4 of the 15
strings that ``llamacpp.check_file`` compares (its hard strings and chat prompts) then tokenize
differently on google/gemma-3-270m (measured once on the Q8_0 file of ``test_real_gemma``, rewritten with
``test_sentencepiece_vocab.with_scores``), 5 of 15 on the tiny tokenizers of
``ft_assets_tests/test_sentencepiece_vocab.py`` (``pytest -s`` prints it); with merge-rank scores none
does, and that Gemma's Q8_0 file gives transformers' logits within 0.028 (relative), 98% equal top-1.

Regenerating a ``tokenizer.model`` instead would need the same scores (the tokenizer.json has only the
merges) and a protobuf writer, to end in the converter's same SentencePiece writer: no gain.

Token types follow what the SentencePiece writer gives a real ``tokenizer.model``: ``<0xNN>`` bytes are
BYTE (llama.cpp's byte fallback), special added tokens CONTROL, other added tokens USER_DEFINED (llama.cpp
matches them in the raw text before tokenizing, as transformers matches added tokens; one that
transformers matches after its normalizer is written with spaces for ``▁``), ids with no token UNUSED.
``add_space_prefix`` comes from the pipeline: a ``Prepend("▁")`` normalizer (Llama 2, legacy) means yes,
Gemma's bare ``Replace(" ", "▁")`` or a Metaspace that never prepends no. Any other pipeline over a
byte-fallback BPE (transformers 5's non-legacy Llama: Metaspace prepending "first") is refused in one
line, so the model ships without a GGUF rather than with one that tokenizes differently.

Standard library only: the converter's child process imports this before its own gguf-py.
"""

from __future__ import annotations

import re

SPACE = "\u2581"  # SentencePiece's visible space
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
REPLACE_SPACE = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
PREPEND_SPACE = {"type": "Prepend", "prepend": SPACE}
# The pre-tokenizer GemmaTokenizer sets: a split at " ", which never occurs once the normalizer made every space "▁".
SPLIT_AT_SPACE = {"type": "Split", "pattern": {"String": " "}}
# llama.cpp's add_space_prefix puts a space before every text that starts the input or follows a special or added
# token, even one that starts with a space. Metaspace's "first" prefixes the start of the input only, its "always"
# skips a text that already starts with one ("<s> x": "▁x" there, "▁▁x" in llama.cpp); only "never" agrees.
METASPACE_PREFIX = {"never": False}  # Metaspace(split=False) prepend_scheme -> add_space_prefix
BPE_OPTIONS_UNSUPPORTED = ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "ignore_merges")


class NotSentencePiece(ValueError):
    """A byte-fallback BPE whose pipeline llama.cpp's SentencePiece tokenizer would not reproduce (one line: what)."""


def is_sentencepiece_bpe(tokenizer: dict) -> bool:
    """Whether ``tokenizer`` (a serialized ``tokenizers`` pipeline) is a BPE with byte fallback: SentencePiece's kind."""
    model = tokenizer.get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def add_space_prefix(tokenizer: dict) -> bool:
    """llama.cpp's ``tokenizer.ggml.add_space_prefix`` for a SentencePiece-style BPE; ``NotSentencePiece`` for another shape."""
    model, normalizer, pre = tokenizer.get("model") or {}, tokenizer.get("normalizer"), tokenizer.get("pre_tokenizer")
    problems = [f"model.{key} = {model[key]!r}" for key in BPE_OPTIONS_UNSUPPORTED if model.get(key)]
    steps = (
        (normalizer or {}).get("normalizers", [normalizer])
        if (normalizer or {}).get("type") == "Sequence"
        else [normalizer]
    )
    if steps == [REPLACE_SPACE] and (pre is None or _matches(pre, SPLIT_AT_SPACE)):
        prefix = False
    elif steps == [PREPEND_SPACE, REPLACE_SPACE] and pre is None:
        prefix = True
    elif (
        normalizer is None
        and pre
        and pre.get("type") == "Metaspace"
        and pre.get("replacement") == SPACE
        and not pre.get("split")
    ):
        prefix = METASPACE_PREFIX.get(pre.get("prepend_scheme"))
        if prefix is None:
            problems.append(
                f"Metaspace prepend_scheme {pre.get('prepend_scheme')!r} (llama.cpp prefixes a space to every text after a special "
                "token, even one that starts with a space)"
            )
    else:
        prefix = None
        problems.append(f"normalizer {_short(normalizer)} with pre-tokenizer {_short(pre)}")
    if problems:
        raise NotSentencePiece(
            "a byte-fallback BPE that llama.cpp's SentencePiece tokenizer would not reproduce: " + "; ".join(problems)
            + f". Known shapes: normalizer Replace(' ', '{SPACE}') (Gemma), Prepend('{SPACE}') + Replace (Llama 2), "
            "Metaspace without split that never prepends"
        )  # fmt: skip
    return prefix


def sentencepiece_vocab(tokenizer: dict, vocab_size: int) -> tuple[list[str], list[float], list[str]]:
    """(tokens, scores, token type names) of a SentencePiece-style BPE, ``vocab_size`` long (the model's embedding rows).

    Type names are those of gguf's ``TokenType`` (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE).
    """
    model, added_tokens = tokenizer["model"], tokenizer.get("added_tokens", [])
    beyond = [
        t for t, i in [*model["vocab"].items(), *((a["content"], a["id"]) for a in added_tokens)] if i >= vocab_size
    ]
    if beyond:
        raise NotSentencePiece(
            f"{len(beyond)} tokens (first {beyond[0]!r}) have ids past the model's {vocab_size} embedding rows"
        )
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    first_rank: dict[str, int] = {}
    for rank, (left, right) in enumerate(merges):
        first_rank.setdefault(left + right, rank)
    unmerged = -float(len(merges))  # a token no merge makes: single characters, bytes, added tokens
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [unmerged] * vocab_size
    types = ["UNUSED"] * vocab_size
    for text, index in model["vocab"].items():
        tokens[index], types[index] = text, "BYTE" if BYTE_TOKEN.fullmatch(text) else "NORMAL"
        scores[index] = -float(first_rank[text]) if text in first_rank else unmerged
    if model.get("unk_token") in model["vocab"]:
        types[model["vocab"][model["unk_token"]]] = "UNKNOWN"
    for added in added_tokens:
        index = added["id"]
        if added.get("special"):
            tokens[index], types[index] = added["content"], "CONTROL"
        else:  # matched in the raw text by llama.cpp: one transformers matches after its normalizer has spaces there
            tokens[index] = added["content"].replace(SPACE, " ") if added.get("normalized") else added["content"]
            types[index] = "USER_DEFINED"
        scores[index] = unmerged
    return tokens, scores, types


def _matches(step: dict, shape: dict) -> bool:
    return all(step.get(key) == value for key, value in shape.items())


def _short(step: dict | None) -> str:
    return "none" if step is None else str(step)[:160]
