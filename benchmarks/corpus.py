"""A generated chat corpus for the data-plane benchmarks: 200k rows (≈ 100 MB of JSONL) per scale unit.

``python -m benchmarks.corpus OUT_DIR --scale 1`` writes the same bytes on every machine (seed
``SEED``). The rows look like instruction-tuning data as it is found, not like the shipped sample:

- Three files, one per format, in the shares of ``FORMAT_SHARES``: ``chat.jsonl``
  (``messages``), ``sharegpt.jsonl`` (``conversations``) and ``alpaca.jsonl``
  (``instruction``/``input``/``output``, single-turn only).
- Lengths vary like real chat data: the user turn is 4-41 words, the reply is log-normal around
  ``REPLY_WORDS_MEDIAN`` words (cut at ``REPLY_WORDS_MAX``), a fifth of the chat/ShareGPT rows have
  2-3 exchanges and a third start with one of ``SYSTEM_PROMPTS``. Replies mix prose, bullet lists,
  numbers, indented Python and a little non-ASCII text (accents, CJK, emoji), so the tokenizer sees
  ≈ 4.2 bytes a token, as on English chat data.
- Dirt at the rates of ``DIRT_RATES`` (fractions of rows): exact duplicates (byte-identical, lower-
  cased, doubled spaces, or the same conversation in another format), near duplicates (a long row with
  a word or two added), rows that need normalizing (NBSP, control characters, trailing blanks),
  malformed JSON, wrong role order, empty answers, unknown formats, blank lines and a few rows over the
  cleaner's 32,000-character limit.

Rows are generated and written one at a time, with a bounded pool of earlier rows to copy duplicates
from, so generating ×4 takes no more memory than ×1 (≈ 25 s a unit here).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import deque
from pathlib import Path

SEED = 20261125
ROWS_PER_UNIT = 200_000  # scale 1: ≥ 200k rows, ≈ 100 MB
FORMAT_SHARES = {"chat.jsonl": 0.5, "sharegpt.jsonl": 0.3, "alpaca.jsonl": 0.2}
REPLY_WORDS_MEDIAN = 28  # log-normal median; mean ≈ 38 words with sigma 0.8
REPLY_WORDS_SIGMA = 0.8
REPLY_WORDS_MAX = 900  # ≈ 1,300 tokens: a few rows exceed a 1,024-token packed row, as in real data
DUPLICATE_POOL = 20_000  # earlier rows that duplicates are copied from (bounds generator memory)
GENERATOR_VERSION = 1  # bump when the output changes: cached corpora are rebuilt

DIRT_RATES = {
    "exact_duplicates": 0.04,
    "near_duplicates": 0.02,
    "needs_normalizing": 0.02,
    "malformed": 0.004,
    "wrong_roles": 0.003,
    "empty_answers": 0.003,
    "unknown_format": 0.001,
    "blank_lines": 0.001,
    "too_long": 0.0002,
}

WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or had
by word but what some we can out other were all there when up use your how said an each she which do
their time if will way about many then them write would like so these her long make thing see him two
has look more day could go come did number sound no most people my over know water than call first who
may down side been now find any new work part take get place made live where after back little only
round man year came show every good me give our under name very through just form sentence great think
say help low line differ turn cause much mean before move right boy old too same tell does set three
want air well also play small end put home read hand port large spell add even land here must big high
such follow act why ask men change went light kind off need house picture try us again animal point
mother world near build self earth father head stand own page should country found answer school grow
study still learn plant cover food sun four between state keep eye never last let thought city tree
cross farm hard start might story saw far sea draw left late run while press close night real life few
north open seem together next white children begin got walk example ease paper group always music those
both mark often letter until mile river car feet care second book carry took science eat room friend
began idea fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl
usual young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock order
fire south problem piece told knew pass since top whole king space heard best hour better true during
hundred five remember step early hold west ground interest reach fast verb sing listen six table travel
less morning ten simple several vowel toward war lay against pattern slow center love person money serve
appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry
dark machine note wait plan figure star box noun field rest correct able pound done beauty drive stood
contain front teach week final gave green oh quick develop ocean warm free minute strong special mind
behind clear tail produce fact street inch multiply nothing course stay wheel full force blue object
decide surface deep moon island foot system busy test record boat common gold possible plane stead dry
wonder laugh thousand ago ran check game shape equate hot miss brought heat snow tire bring yes distant
fill east paint language among function variable database server request response error value return
string integer parse config deploy cluster model training dataset token gradient layer memory batch
""".split()

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in as few words as possible.",
    "You are an expert Python programmer. Explain your code step by step.",
    "You are a friendly tutor for high-school science.",
    "Answer in the style of a technical reference manual, with numbered steps.",
    "You are a customer support agent for a cloud hosting company. Be polite and precise.",
    "Think carefully, then give a short final answer.",
    "You translate and explain idioms between English, French and German.",
]
OPENERS = [
    "How do I",
    "Can you explain",
    "Why does",
    "What is the best way to",
    "Write a short note about",
    "Summarize",
    "Give me three ideas for",
    "Is it true that",
    "Help me",
    "Compare",
]
NON_ASCII = ["café", "naïve", "Zürich", "São Paulo", "北京", "東京", "🙂", "👍", "λ", "€", "—", "½"]
CODE_NAMES = ["items", "total", "config", "result", "buffer", "count", "path", "rows", "tokens", "batch"]
NEAR_EDITS = ["Thanks!", "Thank you.", "Please.", "Hi there.", "Quick question:", "thanks a lot"]
CONTROL_CHARS = ["\x07", "\x1b", "\x0b", "\u200b"]


def _sentence(rng: random.Random, n: int) -> str:
    words = rng.choices(WORDS, k=n)
    if rng.random() < 0.3:
        words[rng.randrange(n)] = str(
            rng.choice([rng.randint(0, 100), rng.randint(100, 99_999), round(rng.random() * 100, 2)])
        )
    if rng.random() < 0.04:
        words[rng.randrange(n)] = rng.choice(NON_ASCII)
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(".....?!:")


def _prose(rng: random.Random, n_words: int) -> str:
    parts, left = [], n_words
    while left > 0:
        n = min(left, rng.randint(5, 18))
        parts.append(_sentence(rng, max(n, 2)))
        left -= n
    return " ".join(parts)


def _code(rng: random.Random, lines: int) -> str:
    name, other = rng.sample(CODE_NAMES, 2)
    body = [f"def {rng.choice(WORDS)}_{name}({other}):", f"    {name} = []"]
    for _ in range(lines):
        body.append(f"    for {rng.choice(WORDS)} in {other}[{rng.randint(0, 9)}:]:")
        body.append(f"        {name}.append({rng.choice(WORDS)} * {rng.randint(2, 64)})")
    body.append(f"    return {name}")
    return "```python\n" + "\n".join(body) + "\n```"


def _reply(rng: random.Random) -> str:
    words = min(REPLY_WORDS_MAX, max(3, int(rng.lognormvariate(math.log(REPLY_WORDS_MEDIAN), REPLY_WORDS_SIGMA))))
    style = rng.random()
    if style < 0.6 or words < 20:
        return _prose(rng, words)
    if style < 0.85:
        head, items = _prose(rng, 8), max(2, words // 12)
        return head + "\n\n" + "\n".join(f"{i + 1}. {_sentence(rng, 10)}" for i in range(items))
    return _prose(rng, words // 2) + "\n\n" + _code(rng, max(1, words // 20))


def _request(rng: random.Random) -> str:
    text = _prose(rng, rng.randint(3, 40))
    return f"{rng.choice(OPENERS)} {text[0].lower()}{text[1:]}"


def _conversation(rng: random.Random, multi_turn: bool) -> list[tuple[str, str]]:
    turns = [("system", rng.choice(SYSTEM_PROMPTS))] if rng.random() < 1 / 3 else []
    exchanges = rng.randint(2, 3) if multi_turn and rng.random() < 0.2 else 1
    for _ in range(exchanges):
        turns += [("user", _request(rng)), ("assistant", _reply(rng))]
    return turns


SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt"}


def _line(file: str, turns: list[tuple[str, str]]) -> str:
    if file == "chat.jsonl":
        record: dict = {"messages": [{"role": r, "content": c} for r, c in turns]}
    elif file == "sharegpt.jsonl":
        record = {"conversations": [{"from": SHAREGPT_FROM.get(r, r), "value": c} for r, c in turns]}
    else:
        system = [c for r, c in turns if r == "system"]
        user, reply = [c for r, c in turns if r == "user"][0], [c for r, c in turns if r == "assistant"][0]
        record = (
            {"instruction": system[0], "input": user, "output": reply}
            if system
            else {"instruction": user, "input": "", "output": reply}
        )
    return json.dumps(record, ensure_ascii=False)


def _replace(turns, role: str, edit) -> list[tuple[str, str]]:
    """``turns`` with the first turn of ``role`` passed through ``edit``."""
    out, done = [], False
    for r, c in turns:
        if r == role and not done:
            c, done = edit(c), True
        out.append((r, c))
    return out


def _dirty(rng: random.Random, kind: str, turns, file: str, pool: deque) -> str | None:
    """One dirty line of ``kind`` (None: this kind has no fitting source right now)."""
    if kind == "exact_duplicates":
        source_file, source = rng.choice(pool)
        variant = rng.random()
        if variant < 0.5:
            return _line(source_file, source)  # byte-identical copy
        if variant < 0.7:
            return _line(source_file, _replace(source, "user", str.lower))
        if variant < 0.85:
            return _line(source_file, _replace(source, "user", lambda c: c.replace(" ", "  ")))
        if len(source) <= 3:  # single exchange: expressible in every format
            return _line(rng.choice(list(FORMAT_SHARES)), source)
        return _line(source_file, source)
    if kind == "near_duplicates":
        source_file, source = rng.choice(pool)
        if sum(len(c.split()) for r, c in source if r != "system") < 40:
            return None
        edit = rng.choice(NEAR_EDITS)
        return _line(
            source_file, _replace(source, "user", lambda c: f"{c} {edit}" if rng.random() < 0.5 else f"{edit} {c}")
        )
    if kind == "needs_normalizing":
        variant = rng.randrange(3)
        if variant == 0:
            return _line(file, _replace(turns, "user", lambda c: c.replace(" ", "\u00a0", 1)))
        if variant == 1:
            return _line(file, _replace(turns, "user", lambda c: c.replace(" ", rng.choice(CONTROL_CHARS) + " ", 1)))
        return _line(file, _replace(turns, "assistant", lambda c: c + rng.choice(["  ", "\n", " \t"])))
    if kind == "malformed":
        line = _line(file, turns)
        return [line[: len(line) // 2], "[1, 2, 3]", "null", repr({"messages": turns[:1]}), "<<<<<<< HEAD"][
            rng.randrange(5)
        ]
    if kind == "wrong_roles":
        if file == "alpaca.jsonl":
            return None
        bad = [("assistant", "Hello."), *turns] if rng.random() < 0.5 else [*turns, ("user", "And then?")]
        return _line(file, bad)
    if kind == "empty_answers":
        return _line(file, _replace(turns, "assistant", lambda c: rng.choice(["", "   ", "\n"])))
    if kind == "unknown_format":
        return json.dumps({"prompt": turns[-2][1], "completion": turns[-1][1]}, ensure_ascii=False)
    if kind == "blank_lines":
        return rng.choice(["", "   "])
    if kind == "too_long":
        return _line(file, _replace(turns, "assistant", lambda c: _prose(rng, 6000)))
    raise ValueError(kind)


def write_corpus(out_dir: str | Path, scale: int = 1, seed: int = SEED, rows_per_unit: int = ROWS_PER_UNIT) -> dict:
    """Write ``scale`` × ``rows_per_unit`` lines into the three files of ``out_dir``; returns counts."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    files = list(FORMAT_SHARES)
    weights = list(FORMAT_SHARES.values())
    dirt_kinds, dirt_weights = list(DIRT_RATES), list(DIRT_RATES.values())
    dirt_total = sum(dirt_weights)
    counts = {"lines": 0, "good_rows": 0, **{kind: 0 for kind in DIRT_RATES}}
    pool: deque = deque(maxlen=DUPLICATE_POOL)
    handles = {file: open(out_dir / file, "w", encoding="utf-8", newline="\n") for file in files}
    try:
        for _ in range(scale * rows_per_unit):
            file = rng.choices(files, weights)[0]
            turns = _conversation(rng, multi_turn=file != "alpaca.jsonl")
            line = None
            if pool and rng.random() < dirt_total:
                kind = rng.choices(dirt_kinds, dirt_weights)[0]
                line = _dirty(rng, kind, turns, file, pool)
                if line is not None:
                    counts[kind] += 1
            if line is None:
                line = _line(file, turns)
                pool.append((file, turns))
                counts["good_rows"] += 1
            handles[file].write(line + "\n")
            counts["lines"] += 1
    finally:
        for handle in handles.values():
            handle.close()
    counts["bytes"] = sum((out_dir / file).stat().st_size for file in files)
    return counts


def ensure_corpus(cache_dir: Path, scale: int, rows_per_unit: int = ROWS_PER_UNIT) -> tuple[Path, dict]:
    """The corpus of ``scale`` under ``cache_dir``, generated once and reused while the generator is unchanged."""
    out_dir = Path(cache_dir) / f"corpus-{rows_per_unit}x{scale}-s{SEED}-v{GENERATOR_VERSION}"
    stamp = out_dir / "_counts.json"
    if stamp.is_file():
        return out_dir, json.loads(stamp.read_text())
    counts = write_corpus(out_dir, scale, SEED, rows_per_unit)
    stamp.write_text(json.dumps(counts, indent=2))
    return out_dir, counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the benchmark chat corpus (deterministic).")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--scale", type=int, default=1, help=f"multiples of {ROWS_PER_UNIT:,} rows (≈ 110 MB each)")
    args = parser.parse_args(argv)
    print(json.dumps(write_corpus(args.out_dir, args.scale), indent=2))


if __name__ == "__main__":
    main()
