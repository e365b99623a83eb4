"""Prompts (GRPO data) through the data plane's own functions: layouts and their extra columns, one kind per
version, bad prompts, the whole plane from files to prompt shards, the columns arriving intact, and the same
bytes whatever the executor (the workers write every part and shard, texts included)."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ft_assets import objectives
from ft_assets.data.chat_encoding import ChatEncoder, TokenizerFiles, fixed_template_date
from ft_assets.data.cleaning import CleaningRules, clean_dataset
from ft_assets.data.decoding import parse_line
from ft_assets.data.dedup import DedupRules, deduplicate_dataset
from ft_assets.data.kinds import CHAT, PREFERENCE, PROMPT
from ft_assets.data.parallel import InProcess, ProcessPool, RayTasks, sigterm_handler_kept
from ft_assets.data.parts import Artifact
from ft_assets.data.prompt_packing import PROMPTS
from ft_assets.data.prompts import split_prompt
from ft_assets.data.readers import read_dataset
from ft_assets.data.rows import DatasetFileError
from ft_assets.data.split import split_dataset
from ft_assets.data.tokenizing import tokenize_splits
from ft_assets.shards import load_prompt_rows, prompt_split, shard_files
from ft_assets_tests.support import timer_call, timer_prompts, write_jsonl


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def columns(**values) -> dict:
    return turn("columns", json.dumps(values, sort_keys=True))


CALL = timer_call(5)
LAYOUT_CASES = [
    ("prompt-string", {"prompt": "Hi?"}, [turn("user", "Hi?")]),
    ("prompt-with-system", {"prompt": "Hi?", "system": "Be kind."}, [turn("system", "Be kind."), turn("user", "Hi?")]),
    ("prompt-with-answer", {"prompt": "Set a timer.", "answer": CALL}, [turn("user", "Set a timer."), columns(answer=CALL)]),
    ("trl-conversational", {"prompt": [turn("system", "Be kind."), turn("user", "Hi?")], "answer": "42", "id": 7},
     [turn("system", "Be kind."), turn("user", "Hi?"), columns(answer="42", id=7)]),
    ("chat-ending-in-the-user", {"messages": [turn("user", "Hi?"), turn("assistant", "Hey."), turn("user", "Time?")], "answer": "noon"},
     [turn("user", "Hi?"), turn("assistant", "Hey."), turn("user", "Time?"), columns(answer="noon")]),
    ("chat-ending-in-the-user-alone", {"messages": [turn("user", "Hi?")]}, [turn("user", "Hi?")]),
    ("chat-reply-drops-other-columns", {"messages": [turn("user", "Hi?"), turn("assistant", "Hey.")], "id": 3},
     [turn("user", "Hi?"), turn("assistant", "Hey.")]),
]  # fmt: skip


@pytest.mark.parametrize("name,row,messages", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_prompt_layouts_keep_their_other_columns(name, row, messages):
    assert parse_line(json.dumps(row).encode()) == messages


def test_a_table_of_prompts_keeps_every_other_column(tmp_path):
    path = tmp_path / "prompts.parquet"
    pq.write_table(
        pa.table({"prompt": ["Set a timer for 5 minutes."], "answer": [json.dumps(CALL)], "level": [2]}), path
    )
    read_dataset([("prompts.parquet", path)], raw := Artifact.folder(tmp_path / "raw"))
    [row] = raw.records("rows")
    assert split_prompt(row["messages"]) == (
        [turn("user", "Set a timer for 5 minutes.")],
        {"answer": json.dumps(CALL), "level": 2},
    )


GOOD_CHAT = {"messages": [turn("user", "Hi?"), turn("assistant", "Hey.")]}
PAIR = {"prompt": "Hi?", "chosen": "Hey.", "rejected": "Go away."}
KIND_CASES = [
    ("prompts", {"a.jsonl": [{"prompt": "Hi?"}, {"messages": [turn("user", "Time?")], "answer": "noon"}]}, PROMPT),
    ("chat-with-replies-missing", {"a.jsonl": [GOOD_CHAT, {"messages": [turn("user", "Time?")]}, {"prompt": "x", "answer": 1}]}, CHAT),
    ("pairs", {"a.jsonl": [PAIR]}, PREFERENCE),
    ("prompt-and-chat-files", {"a.jsonl": [GOOD_CHAT], "b.jsonl": [{"prompt": "Hi?"}]},
     "the version mixes chat files (a.jsonl) and prompt files (b.jsonl); a dataset version holds one kind"),
    ("prompt-and-pair-files", {"a.jsonl": [PAIR], "b.jsonl": [{"prompt": "Hi?"}]}, "the version mixes preference files (a.jsonl) and prompt files"),
    ("pairs-and-prompts-in-a-file", {"a.jsonl": [PAIR, {"prompt": "Hi?"}]},
     "a.jsonl mixes prompts (rows that end in a user turn) (a.jsonl:2) and preference pairs with 'chosen' and 'rejected' (a.jsonl:1)"),
    ("pairs-and-chat-in-a-file", {"a.jsonl": [GOOD_CHAT, PAIR]},
     "a.jsonl mixes chat rows (a.jsonl:1) and preference pairs with 'chosen' and 'rejected' (a.jsonl:2)"),
]  # fmt: skip


@pytest.mark.parametrize("name,files,expected", KIND_CASES, ids=[c[0] for c in KIND_CASES])
def test_one_kind_per_version(name, files, expected, tmp_path):
    inputs = [(file, write_jsonl(tmp_path / file, rows)) for file, rows in files.items()]
    if expected in (CHAT, PREFERENCE, PROMPT):
        assert read_dataset(inputs, Artifact.folder(tmp_path / "raw"))["data_kind"] == expected
        return
    with pytest.raises(DatasetFileError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        read_dataset(inputs, Artifact.folder(tmp_path / "raw"))


def test_prompts_among_conversations_are_conversations_without_their_reply(tmp_path):
    """As before prompts existed: a chat row that lost its reply is quarantined, whatever other columns it has."""
    rows = [GOOD_CHAT, {"messages": [turn("user", "Time?")]}, {"messages": [turn("user", "Date?")], "id": 9}]
    read_dataset([("a.jsonl", write_jsonl(tmp_path / "a.jsonl", rows))], raw := Artifact.folder(tmp_path / "raw"))
    clean_dataset(raw, clean := Artifact.folder(tmp_path / "clean"), CleaningRules(), clean=objectives.SFT.clean_row)
    reasons = [(q["source"], q["reason"], q["detail"]) for q in clean.records("quarantine")]
    assert reasons == [
        (f"a.jsonl:{n}", "no_assistant_reply", "the conversation does not end with an assistant reply") for n in (2, 3)
    ]


BAD_PROMPTS = [
    ("empty-request", {"prompt": " \n", "answer": CALL}, "empty_message", "user message 0 has 0 characters"),
    ("starts-with-the-assistant", {"messages": [turn("assistant", "Hey."), turn("user", "Hi?")]}, "bad_role_order",
     "message 0 is 'assistant' where 'user' was expected"),
    ("two-users-in-a-row", {"prompt": [turn("user", "Hi?"), turn("user", "Hello?")]}, "bad_role_order", "message 1 is 'user'"),
    ("unknown-role", {"prompt": [turn("narrator", "{}"), turn("user", "Hi?")]}, "unknown_role", "message 0 has role 'narrator'"),
    ("tool-first", {"prompt": [turn("tool", "{}"), turn("user", "Hi?")]}, "bad_role_order", "message 0 is 'tool' where 'user' was expected"),
    ("too-long", {"prompt": "x" * 40_000}, "too_long", "40000 characters in total"),
]  # fmt: skip


@pytest.mark.parametrize("name,row,reason,detail", BAD_PROMPTS, ids=[c[0] for c in BAD_PROMPTS])
def test_bad_prompts_are_quarantined_with_a_reason(name, row, reason, detail, tmp_path):
    good = {
        "prompt": "  Set a timer\u00a0for 5 minutes.  ",
        "answer": {"name": " set_timer ", "arguments": {"minutes": 5}},
    }
    read_dataset(
        [("p.jsonl", write_jsonl(tmp_path / "p.jsonl", [good, row]))], raw := Artifact.folder(tmp_path / "raw")
    )
    cleaned = clean_dataset(
        raw, clean := Artifact.folder(tmp_path / "clean"), CleaningRules(), clean=objectives.GRPO.clean_row
    )
    quarantined = [*raw.records("quarantine"), *clean.records("quarantine")]
    assert [(q["source"], q["reason"]) for q in quarantined] == [("p.jsonl:2", reason)]
    assert detail in quarantined[0]["detail"]
    [kept] = clean.records("rows")
    turns, extra = split_prompt(kept["messages"])
    assert turns == [turn("user", "Set a timer for 5 minutes.")]  # the request cleaned ...
    assert extra == {"answer": good["answer"]} and cleaned["rows_modified"] == 1  # ... its reference as written


def test_prompts_flow_from_files_to_prompt_shards(tiny_model_dir, tmp_path):
    rows = timer_prompts(40)
    rows += [
        rows[3],
        {**rows[4], "answer": timer_call(99)},
    ]  # an exact duplicate; the same request with another reference
    rows.append(
        {"prompt": "Set a timer " + "for ever and ever " * 30 + "minutes.", "answer": timer_call(1)}
    )  # too long for seq_len 64
    stage = {name: Artifact.folder(tmp_path / name) for name in ("raw", "clean", "dedup", "split", "shards")}
    raw = read_dataset([("p.jsonl", write_jsonl(tmp_path / "p.jsonl", rows))], stage["raw"])
    objective = objectives.for_data_kind(raw["data_kind"])
    assert objective is objectives.GRPO
    clean_dataset(stage["raw"], stage["clean"], CleaningRules(), clean=objective.clean_row)
    dedup = deduplicate_dataset(stage["clean"], stage["dedup"], DedupRules())
    split = split_dataset(stage["dedup"], stage["split"], 0.25, "ft-assets")
    packed = tokenize_splits(
        stage["split"], ("train", "eval"), TokenizerFiles.from_dir(tiny_model_dir), 64, stage["shards"], kind=PROMPTS
    )
    assert (raw["rows_in"], dedup["exact_duplicates"]) == (43, 1)
    assert [(row_id, error.reason) for p in packed.values() for row_id, error in p.rejected] == [
        ("p.jsonl:43", "too_long_tokens")
    ]
    assert packed["train"].examples + packed["eval"].examples == 41 == split["train_rows"] + split["eval_rows"] - 1
    assert packed["train"].loss_tokens == 0 and shard_files(tmp_path / "shards", prompt_split("train"))
    assert not shard_files(tmp_path / "shards", "train")  # no chat shards a chat reader could pick up
    written = sorted(path.name for path in (tmp_path / "shards").rglob("*") if path.is_file())
    quarantine = [
        name for name in written if name.startswith("quarantine-")
    ]  # the refused rows, written by their encode task
    assert (
        written == sorted(stage["shards"].files) == sorted(packed["train"].files + packed["eval"].files + quarantine)
    )  # encoded parts deleted
    assert [
        (q["source"], q["reason"]) for name in quarantine for q in pq.read_table(tmp_path / "shards" / name).to_pylist()
    ] == [("p.jsonl:43", "too_long_tokens")]

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    by_source = {f"p.jsonl:{i + 1}": row for i, row in enumerate(rows)}
    loaded = [
        prompt
        for split_name in ("train", "eval")
        for prompt in load_prompt_rows(tmp_path / "shards", split_name, 64).prompts
    ]
    assert len(loaded) == 41 and len({p.source for p in loaded}) == 41
    for prompt in loaded:
        row = by_source[prompt.source]
        assert prompt.columns == {"answer": row["answer"]}
        assert prompt.messages == [turn("system", row["system"]), turn("user", row["prompt"])]
        text = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
        assert prompt.input_ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="the longest prompt has .* tokens, above max_seq_len=8"):
        load_prompt_rows(tmp_path / "shards", "train", 8)


def test_prompts_render_with_each_familys_template(tmp_path):
    """The prompt ends where the model's turn begins, in every chat template of the family matrix."""
    from transformers import AutoTokenizer

    from ft_assets_tests.families import FAMILIES, build_family_tokenizer

    messages = [turn("system", "Reply with one JSON tool call."), turn("user", "Set a timer for 5 minutes.")]
    for family in FAMILIES:
        folder = tmp_path / family.name
        build_family_tokenizer(family.tokens).save_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        [ids] = ChatEncoder(tokenizer).encode_prompts([messages])
        with fixed_template_date():  # the data plane's date (gpt-oss's template writes it)
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"], family.name


def prompt_plane(path, work, tokenizer: TokenizerFiles, executor) -> tuple[dict, dict[str, str]]:
    """Every stage on ``executor``, in parts of 50 input rows, windows of 30 prompts: the counts and every file's sha256."""
    stage = {name: Artifact.folder(work / name) for name in ("raw", "clean", "dedup", "split", "shards")}
    read_dataset([("p.jsonl", path)], stage["raw"], None, executor, part_rows=50)
    clean_dataset(stage["raw"], stage["clean"], CleaningRules(), executor, objectives.GRPO.clean_row)
    deduplicate_dataset(stage["clean"], stage["dedup"], DedupRules(), executor)
    split_dataset(stage["dedup"], stage["split"], 0.25, "ft-assets", executor)
    packed = tokenize_splits(
        stage["split"], ("train", "eval"), tokenizer, 64, stage["shards"], 30, executor, kind=PROMPTS
    )
    counts = {
        split: (p.examples, p.tokens, p.rows, p.files, [(row, e.reason) for row, e in p.rejected])
        for split, p in packed.items()
    }
    digests = {
        str(p.relative_to(work)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(work.rglob("*"))
        if p.is_file()
    }
    listed = {
        f"{name}/{file}": info["sha256"] for name, artifact in stage.items() for file, info in artifact.files.items()
    }
    assert listed == digests  # every file was written by a worker and is described; no encoded part is left
    return counts, digests


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["2 processes", "ray, as if on other machines"])
def test_prompt_shards_are_the_same_bytes_whatever_the_executor(mode, tiny_model_dir, tmp_path):
    """The prompts' texts travel with their tokens through the encoded parts (through Ray's object store, as if on
    other machines), and the workers write the prompt shards: the same files as one process writing every part."""
    rows = timer_prompts(180) + [
        {"prompt": "Set a timer " + "for ever and ever " * 30, "answer": timer_call(1)}
    ]  # one too long
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    tokenizer = TokenizerFiles.from_dir(tiny_model_dir)
    with InProcess(1, 1_000_000) as executor:
        reference = prompt_plane(path, tmp_path / "reference", tokenizer, executor)
    if mode.startswith("ray"):
        import ray

        with sigterm_handler_kept():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            with RayTasks(2, 50, remote=True) as executor:
                counts, digests = prompt_plane(path, tmp_path / "mode", tokenizer, executor)
        finally:
            ray.shutdown()
    else:
        with ProcessPool(2, 50) as executor:
            counts, digests = prompt_plane(path, tmp_path / "mode", tokenizer, executor)
    assert len(reference[0]["train"][3]) > 2 and reference[0]["train"][4] + reference[0]["eval"][4] == [
        ("p.jsonl:181", "too_long_tokens")
    ]
    assert (counts, {name.removeprefix("mode/"): d for name, d in digests.items()}) == (
        reference[0],
        {name.removeprefix("reference/"): d for name, d in reference[1].items()},
    )
