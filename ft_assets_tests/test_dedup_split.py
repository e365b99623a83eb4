from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from ft_assets.data.dedup import DedupRules, MinHasher, deduplicate_dataset, exact_key, row_features
from ft_assets.data.parts import Artifact
from ft_assets.data.rows import ROW_SCHEMA
from ft_assets.data.shuffle import band_pairs, band_records, cluster_roots, unique_pairs
from ft_assets.data.split import EVAL, TRAIN, split_dataset, split_of

LONG = (
    "Please book a table for four people at the Italian restaurant on Main Street tomorrow evening "
    "at seven and ask them for a quiet table near the window"
)

LONG2 = "they also want a birthday cake brought out after dessert with candles and the staff singing for the guest of honour"


def conv(user, assistant="ok", system=None):
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


EXACT_CASES = [
    ("case", conv("Hello There"), conv("hello there"), True),
    ("whitespace", conv("hello   there\n"), conv("hello there"), True),
    ("nfkc", conv("\uff21BC"), conv("abc"), True),
    ("word", conv("hello there"), conv("hello here"), False),
    (
        "role-matters",
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        [{"role": "user", "content": "b"}, {"role": "assistant", "content": "a"}],
        False,
    ),
]


@pytest.mark.parametrize("name,a,b,same", EXACT_CASES, ids=[c[0] for c in EXACT_CASES])
def test_exact_key(name, a, b, same):
    assert (exact_key(a) == exact_key(b)) is same


NEAR_CASES = [
    ("one-word-appended", conv(LONG), conv(LONG + " thanks"), True),
    # one inserted word rewrites n-1 shingles: Jaccard ≈ 0.87 on this 66-word row (0.74 on a 33-word one)
    (
        "filler-inserted",
        conv(LONG + " " + LONG2),
        conv(LONG.replace("tomorrow evening", "tomorrow evening please") + " " + LONG2),
        True,
    ),
    ("short-numbers-differ", conv("Convert 12 km to m."), conv("Convert 19 km to m."), False),
    (
        "short-identical-words",
        conv("Convert 12 km to m."),
        conv("Convert 12 km to m!"),
        False,
    ),  # too short to judge: exact only
    ("long-number-differs", conv(LONG), conv(LONG.replace("four", "4").replace("seven", "7")), False),
    ("long-number-changed", conv(LONG + " 12"), conv(LONG + " 19"), False),
    (
        "unrelated",
        conv(LONG),
        conv("What is the weather in Paris today and should I take an umbrella with me to work"),
        False,
    ),
    (
        "system-prompt-ignored",
        conv("a b c d e f g h i j k l", system=LONG),
        conv("m n o p q r s t u v w x", system=LONG),
        False,
    ),
]


@pytest.mark.parametrize("name,a,b,near", NEAR_CASES, ids=[c[0] for c in NEAR_CASES])
def test_near_duplicates(name, a, b, near):
    assert clusters_of([a, b]) == ([0, 0] if near else [0, 1])


def clusters_of(conversations, rules=DedupRules()):
    """Each row's near-duplicate cluster root: band collisions, verified pairs, union-find (no exact dedup)."""
    hasher = MinHasher(rules)
    hashes, eligible = hasher.band_hashes([row_features(messages, rules) for messages in conversations])
    pairs = unique_pairs(band_pairs(band_records(hashes, eligible, 0), np.empty(0, dtype=np.int64)), len(conversations))
    candidates = np.unique(pairs)
    signatures = np.array([hasher.signature(conversations[i]) for i in candidates]).reshape(
        len(candidates), rules.num_perm
    )
    roots = np.arange(len(conversations))
    roots[candidates] = cluster_roots(pairs, candidates, signatures, rules.threshold)
    return roots.tolist()


def test_lsh_candidates_are_verified_against_the_threshold():
    # Same pair, J ≈ 0.82: a near-duplicate at threshold 0.8, not at 0.9 even though it may collide.
    pair = [conv(LONG + " " + LONG2), conv(LONG.replace("tomorrow evening", "tomorrow evening please") + " " + LONG2)]
    assert clusters_of(pair, DedupRules(threshold=0.9)) == [0, 1]


def test_clusters_are_transitive_and_keep_first_row():
    rows = [
        conv("unrelated row number one about cats and dogs and birds"),
        conv(LONG),
        conv(LONG + " thanks"),
        conv(LONG + " thanks a lot"),
    ]
    assert clusters_of(rows) == [0, 1, 1, 1]


def write_rows(folder, conversations, clusters=None, numbers=None) -> Artifact:
    """The rows as one ``rows`` part of an artifact in ``folder`` (sources ``f:<number>``, from 1 by default)."""
    numbers = numbers or range(1, len(conversations) + 1)
    records = [
        {"source": f"f:{n}", "cluster": c, "messages": m}
        for n, c, m in zip(numbers, clusters or [""] * len(conversations), conversations)
    ]
    artifact = Artifact.folder(folder)
    artifact.add(
        artifact.target().put_table("rows-00000.parquet", pa.Table.from_pylist(records, schema=ROW_SCHEMA), ROW_SCHEMA)
    )
    return artifact


@pytest.mark.parametrize("mode,kept,near", [("drop", 3, 1), ("keep", 4, 0)])
def test_deduplicate_dataset_records_every_removed_row(tmp_path, mode, kept, near):
    rows = write_rows(
        tmp_path / "in",
        [
            conv("Convert 12 km to m."),
            conv("convert 12  KM to m."),
            conv("Convert 19 km to m."),
            conv(LONG),
            conv(LONG + " thanks"),
        ],
    )
    stats = deduplicate_dataset(rows, out := Artifact.folder(tmp_path / "out"), DedupRules(near_duplicates=mode))
    assert (stats["rows_kept"], stats["exact_duplicates"], stats["near_duplicates"]) == (kept, 1, near)
    duplicates = [(d["source"], d["kind"], d["duplicate_of"]) for d in out.records("duplicates")]
    expected = [("f:2", "exact", "f:1")] + ([("f:5", "near", "f:4")] if mode == "drop" else [])
    assert duplicates == expected
    rows = list(out.records("rows"))
    clusters = {r["source"]: r["cluster"] for r in rows}
    if mode == "keep":
        assert clusters["f:4"] == clusters["f:5"] != clusters["f:1"]
    assert len(set(clusters.values())) == 3


DUPLICATE_CASES = [
    # (name, a, b, what deduplicate_dataset makes of the pair: "exact", "near" or None = two rows)
    ("case", conv("Set a timer for 5 minutes."), conv("SET A TIMER FOR 5 MINUTES."), "exact"),
    ("spacing", conv("Set a timer for 5 minutes."), conv(" Set a  timer\tfor 5\nminutes. "), "exact"),
    ("punctuation-short", conv("Convert 12 km to m."), conv("Convert 12 km to m!"), "exact"),
    ("apostrophe", conv("What's the time in Oslo?"), conv("whats the time in oslo"), "exact"),
    ("space-after-comma", conv("Hello,world"), conv("Hello, world"), "exact"),
    ("nfkc-full-width", conv("Ｃａｆé ５ km"), conv("café 5 km"), "exact"),
    ("answer-punctuation", conv("Say hi.", "Hi!"), conv("Say hi", "Hi."), "exact"),
    ("short-numbers-differ", conv("Convert 12 km to m."), conv("Convert 19 km to m."), None),
    ("5-km-vs-6-km", conv("Run 5 km."), conv("Run 6 km."), None),
    ("decimal-vs-integer", conv("Add 5.5 kg."), conv("Add 55 kg."), None),
    ("decimal-vs-two-numbers", conv("Add 5.5 kg."), conv("Add 5 5 kg."), None),
    ("decimal-point-vs-comma", conv("Add 5.5 kg."), conv("Add 5,5 kg."), None),
    ("math-symbol", conv("Solve x + 1 = 3"), conv("Solve x = 1 = 3"), None),
    ("currency-symbol", conv("It costs $5"), conv("It costs €5"), None),
    ("one-word-differs", conv("hello there"), conv("hello here"), None),
    ("answer-differs", conv("Say hi.", "Hi!"), conv("Say hi.", "Bye!"), None),
    ("long-word-appended", conv(LONG), conv(LONG + " thanks"), "near"),
    ("long-case-and-punctuation-and-word", conv(LONG + "."), conv(LONG.upper() + " -- thanks!!"), "near"),
    ("long-number-changed", conv(LONG + " 12"), conv(LONG + " 19"), None),
]


@pytest.mark.parametrize("name,a,b,kind", DUPLICATE_CASES, ids=[c[0] for c in DUPLICATE_CASES])
def test_what_is_a_duplicate(tmp_path, name, a, b, kind):
    deduplicate_dataset(write_rows(tmp_path / "in", [a, b]), out := Artifact.folder(tmp_path / "out"), DedupRules())
    duplicates = [(d["source"], d["kind"], d["duplicate_of"]) for d in out.records("duplicates")]
    assert duplicates == ([("f:2", kind, "f:1")] if kind else [])


def test_duplicate_clusters_never_straddle_the_split(tmp_path):
    """Near-duplicates kept (``keep``) share their cluster, so each pair lands on one side of the split."""
    pairs = [(conv(f"{LONG} for table {i}"), conv(f"{LONG.upper()} for table {i}, thanks!")) for i in range(200)]
    rows = write_rows(tmp_path / "in", [row for pair in pairs for row in pair])
    stats = deduplicate_dataset(rows, dedup := Artifact.folder(tmp_path / "dedup"), DedupRules(near_duplicates="keep"))
    assert (stats["rows_kept"], stats["near_clusters"]) == (400, 200)
    split_dataset(dedup, split := Artifact.folder(tmp_path / "split"), 0.25)
    where = {r["source"]: (name, r["cluster"]) for name in (TRAIN, EVAL) for r in split.records(name)}
    assert all(where[f"f:{2 * i + 1}"] == where[f"f:{2 * i + 2}"] for i in range(200))
    assert {split for split, _ in where.values()} == {TRAIN, EVAL}


def test_split_is_deterministic_by_hash_and_respects_fraction():
    keys = [f"cluster-{i}" for i in range(5000)]
    first = [split_of(k, 0.2) for k in keys]
    assert first == [split_of(k, 0.2) for k in keys]
    assert 0.17 < first.count(EVAL) / len(keys) < 0.23
    assert [split_of(k, 0.0) for k in keys[:50]] == [TRAIN] * 50
    assert first != [split_of(k, 0.2, salt="other") for k in keys]
    with pytest.raises(ValueError, match="eval_fraction"):
        split_of("x", 1.0)


def test_split_keeps_clusters_together_and_is_independent_of_position(tmp_path):
    conversations = [conv(f"question {i}") for i in range(400)]
    rows = write_rows(tmp_path / "in", conversations, [f"c{i // 4}" for i in range(400)], range(400))
    stats = split_dataset(rows, out := Artifact.folder(tmp_path / "out"), 0.25)
    assert stats["train_rows"] + stats["eval_rows"] == 400
    where = {}
    for split in ("train", "eval"):
        for record in out.records(split):
            where.setdefault(record["cluster"], set()).add(split)
    assert all(len(s) == 1 for s in where.values()), "a near-duplicate cluster straddles train and eval"
    assert Counter(next(iter(s)) for s in where.values())[EVAL] > 0
    # Reordering the input changes nothing: the split is a function of content, not position.
    backwards = list(reversed(range(400)))
    rows = write_rows(
        tmp_path / "rev", [conversations[i] for i in backwards], [f"c{i // 4}" for i in backwards], backwards
    )
    split_dataset(rows, out2 := Artifact.folder(tmp_path / "out2"), 0.25)
    assert sorted(r["source"] for r in out.records("eval")) == sorted(r["source"] for r in out2.records("eval"))


def test_batched_signatures_are_datasketchs_for_every_turn_shape():
    """Long, short (< n words) and empty turns, in batches: the index's values equal datasketch's MinHash
    with the index's shingle hash, fed the shingle texts one by one."""
    import random

    from datasketch import MinHash

    from ft_assets.data.dedup import _shingle_texts, shingle_hash, word_hashes, words_of

    rules = DedupRules()
    index = MinHasher(rules)
    rng = random.Random(3)
    vocabulary = [f"w{i}".encode() for i in range(40)] + words_of("çà et là, l'été")
    rows = [[[rng.choice(vocabulary) for _ in range(rng.choice([0, 1, 3, 5, 6, 30]))] for _ in range(rng.randint(1, 4))]
            for _ in range(70)]  # fmt: skip
    values = index.minhashes([[word_hashes(turn) for turn in row] for row in rows])
    for row, got in zip(rows, values):
        expected = MinHash(num_perm=rules.num_perm, seed=rules.seed, hashfunc=lambda b: shingle_hash(b, rules.ngram))
        expected.update_batch([s for turn in row for s in _shingle_texts(turn, rules.ngram)])
        assert list(got) == list(expected.hashvalues), row


def test_an_artifact_of_the_single_file_layout_is_refused_naming_it(tmp_path):
    """Data artifacts were one rows.parquet (train.parquet, eval.parquet) before part files: read as parts they would
    look empty, so a stage refuses them, saying what to rebuild."""
    from ft_assets.manifests import ArtifactCorrupt, publish_dir
    from ft_assets.storage import LocalStore

    store, folder = LocalStore(tmp_path / "store"), tmp_path / "old"
    folder.mkdir()
    (folder / "rows.parquet").write_bytes(b"PAR1")
    publish_dir(store, "runs/x/v1/data/cleaned", folder)
    with pytest.raises(
        ArtifactCorrupt, match=r"runs/x/v1/data/cleaned holds rows\.parquet: .*\(ft-assets run --until data --force\)"
    ):
        Artifact.committed(store, "runs/x/v1/data/cleaned")
