"""Packed token shards: the one format the data plane writes and training and evaluation read.

A shard is a Parquet file ``<split>-NNNNN.parquet`` (``train-00000.parquet``, ``eval-00001.parquet``…)
of packed rows. Every row holds several whole chat examples back to back, padded to exactly
``seq_len`` tokens, in four list columns:

- ``input_ids`` (int32): the examples' tokens, then the pad token;
- ``loss_mask`` (int8): 1 on the tokens the model learns to produce (assistant replies and their
  end-of-turn marker), 0 on prompts and padding;
- ``position_ids`` (int32): restart at 0 at every example and at the padding tail, which is what
  gives training its block-diagonal causal mask (no example attends to its neighbour);
- ``seq_lens`` (int32): the example lengths, for inspection (the reader does not load them).

Examples that hold images (a vision-language model's, ``IMAGE_SCHEMA``) have one more column:

- ``images`` (string): the row's images, as references to the stored images (``<sha256>.<format>``,
  ``ft_assets.data.images``), in the order their tokens come. The tokens hold each image as its
  processor expands it (Qwen's ``<|image_pad|>`` x the patches it is cut into, Gemma 3's 256 soft
  tokens, …); the pixels are computed from the stored image by the trainer, never stored per epoch.
  An example is packed whole, so its images never straddle two rows.

Preference pairs (``ft_assets.data.pair_packing``) have their own shards, ``pairs-<split>-NNNNN.parquet``
(``pair_split``), so that a reader of packed chat rows can never pick them up. Each row holds whole
pairs back to back, a pair's chosen sequence (prompt + chosen reply) then its rejected one (prompt +
rejected reply), in the four columns above (``loss_mask`` on the final reply and its end-of-turn
marker only, ``seq_lens`` one entry a sequence) plus

- ``segment_ids`` (int32): which sequence of the row a token belongs to: 2k for pair k's chosen
  side, 2k + 1 for its rejected side, -1 on the padding tail. Training sums each sequence's token
  log-probabilities by it (``ft_assets.training.loss.pair_logps``).

Prompts (``ft_assets.data.prompt_packing``, GRPO) are not packed: a row is one prompt, the model's
turn comes after it and is generated in training. ``prompts-<split>-NNNNN.parquet`` (``prompt_split``):

- ``input_ids`` (int32, as long as the prompt): its turns rendered with the chat template up to the
  assistant's turn (the generation prompt);
- ``source`` (string): the row it came from;
- ``messages`` (string): its turns, as JSON (what the reward functions get as ``prompts``);
- ``columns`` (string): its other columns, as a JSON object (what they get as keyword arguments).

The data plane writes one shard a packing window (``ft_assets.data.tokenizing``: 16,384 examples, ~2,000
rows of 1,024 tokens on the benchmark corpus; 16,384 prompts), each built by ``packed_table`` in the
worker that packed it; readers take a split's shards in the order of their numbers. ``load_packed_rows``
reads a whole split into memory as three int32 tensors, 12 bytes/token (0.6 GB per 50M tokens): any
shuffle order costs no I/O per step, at the price of
memory that grows with the dataset; batches are widened to int64 only when they are taken.
``load_pair_rows`` does the same for pairs, with the segment ids as a fourth tensor (16 bytes/token);
``load_prompt_rows`` reads prompts as a list of token tensors with their texts.

pyarrow and numpy only at import: the data plane writes shards without paying for torch, which the
reader side imports when it runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

if TYPE_CHECKING:
    import torch

SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("position_ids", pa.list_(pa.int32())),
        ("seq_lens", pa.list_(pa.int32())),
    ]
)
TRAINING_COLUMNS = (
    "input_ids",
    "loss_mask",
    "position_ids",
)  # what the reader loads: seq_lens is implied by position_ids
# Rows of examples that hold images: each row's images, as references to the stored images (ft_assets.data.images), in
# the order their tokens appear; an example's images always lie in the row that holds its tokens.
IMAGE_SCHEMA = pa.schema([*SCHEMA, ("images", pa.list_(pa.string()))])
IMAGES_DIR = "images"  # where, beside a split's shards on the trainer's disk, their images are (fetch_images)
# in the shards' artifact: the stored images the shards name, per split ({"prefix", "train", "eval"}); lineage lists them
IMAGES_FILE = "images.json"
PAIR_SCHEMA = pa.schema([*SCHEMA, ("segment_ids", pa.list_(pa.int32()))])
PAIR_COLUMNS = (*TRAINING_COLUMNS, "segment_ids")
PAIRS = "pairs"  # file name prefix of preference-pair shards
PROMPT_SCHEMA = pa.schema(
    [("input_ids", pa.list_(pa.int32())), ("source", pa.string()), ("messages", pa.string()), ("columns", pa.string())]
)
PROMPTS = "prompts"  # file name prefix of prompt shards
IGNORE_INDEX = -100  # label value the HF loss skips


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.parquet"


def shard_files(shards_dir: Path, split: str) -> list[Path]:
    """The shards of ``split`` in ``shards_dir``, in the order their rows are numbered (by their numbers, which
    outgrow 5 digits past 99,999 windows)."""
    numbers = {
        path: path.name[len(split) + 1 : -len(".parquet")] for path in Path(shards_dir).glob(f"{split}-*.parquet")
    }
    return sorted((path for path, number in numbers.items() if number.isdigit()), key=lambda path: int(numbers[path]))


def pair_split(split: str) -> str:
    """The file split name of preference-pair shards: ``pairs-train``, ``pairs-eval``."""
    return f"{PAIRS}-{split}"


def prompt_split(split: str) -> str:
    """The file split name of prompt shards: ``prompts-train``, ``prompts-eval``."""
    return f"{PROMPTS}-{split}"


# --- writer ----------------------------------------------------------------------------------------


def packed_table(rows: list[dict], schema: pa.Schema = SCHEMA) -> pa.Table:
    """Shard rows (dicts: a 1-D array or list for each list column of ``schema``, a string for each other column) as
    one table, a column at a time: one flat numpy array and its offsets per list column, no conversion row by row."""
    columns = []
    for column in schema:
        values = [row[column.name] for row in rows]
        if not pa.types.is_list(column.type) or pa.types.is_string(column.type.value_type):  # texts, image references
            columns.append(pa.array(values, type=column.type))
            continue
        offsets = np.zeros(len(values) + 1, dtype=np.int32)
        np.cumsum([len(v) for v in values], out=offsets[1:])
        flat = pa.array(np.concatenate(values) if values else np.empty(0), type=column.type.value_type)
        columns.append(pa.ListArray.from_arrays(pa.array(offsets), flat, type=column.type))
    return pa.Table.from_arrays(columns, schema=schema)


# --- reader ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedRows:
    input_ids: torch.Tensor  # (rows, seq_len) int32; batches are widened to int64
    labels: torch.Tensor  # input_ids where loss_mask is 1 (never an example's first token), else IGNORE_INDEX
    position_ids: torch.Tensor  # restart at 0 at every packed example (and the padding tail)
    # a vision-language model's rows: each row's images (the files, in token order), or None for text rows
    images: list[list[str]] | None = field(default=None, kw_only=True)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def batch(self, indices: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        import torch

        index = torch.tensor(indices)
        batch = {
            "input_ids": self.input_ids[index].to(device, torch.long),
            "labels": self.labels[index].to(device, torch.long),
            "position_ids": self.position_ids[index].to(device, torch.long),
        }
        if self.images is not None:  # the files; the trainer turns them into its model's pixel inputs
            batch["images"] = [self.images[i] for i in np.asarray(indices).tolist()]
        return batch


def _fixed_width(path: Path, table: pa.Table, column: str) -> np.ndarray:
    values = table.column(column).combine_chunks()
    lengths = pc.unique(pc.list_value_length(values)).to_pylist()
    if len(lengths) != 1 or lengths[0] is None:
        raise ValueError(
            f"{path}: column {column!r} has rows of lengths {sorted(x for x in lengths if x is not None)}; every "
            "packed row must hold exactly seq_len tokens (rebuild the shards with the data plane's packer)"
        )
    return values.flatten().to_numpy(zero_copy_only=False).reshape(len(values), lengths[0])


def _load_columns(shards_dir: Path, split: str, columns: tuple[str, ...], max_seq_len: int) -> list[np.ndarray] | None:
    """Every row of ``<split>-*.parquet`` as one (rows, seq_len) int32 array per column; None without shards."""
    files = shard_files(shards_dir, split)
    if not files:
        return None
    parts = {column: [] for column in columns}
    for path in files:
        table = pq.read_table(path, columns=list(columns))
        widths = set()
        for column in columns:
            parts[column].append(_fixed_width(path, table, column))
            widths.add(parts[column][-1].shape[1])
        if len(widths) != 1 or widths != {parts[columns[0]][0].shape[1]}:
            raise ValueError(f"{path}: columns or files disagree on seq_len ({sorted(widths)}); repack the shards")
    arrays = [np.concatenate(parts[column]).astype(np.int32) for column in columns]
    if arrays[0].shape[1] > max_seq_len:
        raise ValueError(
            f"{shards_dir}: shards are packed at {arrays[0].shape[1]} tokens, above max_seq_len={max_seq_len}; "
            "repack them shorter or raise max_seq_len if the GPU has the memory"
        )
    return arrays


def _labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    import torch

    # A label at the first token of an example would be predicted from the previous example's last
    # token; the mask should never ask for that, and this makes sure it cannot.
    return torch.where(loss_mask.bool() & (position_ids != 0), input_ids, torch.tensor(IGNORE_INDEX, dtype=torch.int32))


def load_packed_rows(shards_dir: Path, split: str, max_seq_len: int) -> PackedRows | None:
    """All rows of ``<split>-*.parquet`` in memory: 3 int32 tensors, 12 bytes/token (0.6 GB per 50M tokens); rows that
    hold images (``IMAGE_SCHEMA``) also with their image files (``fetch_images`` put them in ``IMAGES_DIR``)."""
    import torch

    arrays = _load_columns(shards_dir, split, TRAINING_COLUMNS, max_seq_len)
    if arrays is None:
        return None
    input_ids, loss_mask, position_ids = (torch.from_numpy(array) for array in arrays)
    images = None
    if image_shards(shards_dir, split):
        folder = Path(shards_dir) / IMAGES_DIR
        images = [
            [str(folder / ref) for ref in row]
            for path in shard_files(shards_dir, split)
            for row in pq.read_table(path, columns=["images"]).column("images").to_pylist()
        ]
    return PackedRows(
        input_ids=input_ids, labels=_labels(input_ids, loss_mask, position_ids), position_ids=position_ids,
        images=images,
    )  # fmt: skip


def image_shards(shards_dir: Path, split: str) -> bool:
    """Whether the shards of ``split`` hold images (a vision-language model's, ``IMAGE_SCHEMA``)."""
    files = shard_files(shards_dir, split)
    return bool(files) and "images" in pq.read_schema(files[0]).names


def fetch_images(store, prefix: str, shards_dir: Path) -> int:
    """Download the images the shards in ``shards_dir`` hold, from ``prefix`` (the dataset's images in ``store``, an
    ``ft_assets.storage.ObjectStore``) into ``shards_dir/IMAGES_DIR``, each checked against the sha256 its name
    gives; one already there is kept. Only the images of these shards are fetched. Returns how many it holds (none
    without ``prefix``: a text model's shards)."""
    if not prefix:
        return 0
    refs = sorted(
        {
            ref
            for path in Path(shards_dir).glob("*.parquet")
            if "images" in pq.read_schema(path).names
            for row in pq.read_table(path, columns=["images"]).column("images").to_pylist()
            for ref in row
        }
    )
    folder = Path(shards_dir) / IMAGES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for ref in refs:
        local = folder / ref
        if local.is_file() and hashlib.sha256(local.read_bytes()).hexdigest() == ref.split(".")[0]:
            continue
        data = store.get_bytes(f"{prefix}/{ref}")
        if hashlib.sha256(data).hexdigest() != ref.split(".")[0]:
            raise ValueError(f"{store.uri(prefix)}/{ref}: the stored image does not hash to its name (changed?)")
        local.write_bytes(data)
    return len(refs)


@dataclass(frozen=True)
class PairRows(PackedRows):
    """Rows of packed preference pairs (``pair_split`` shards): packed rows plus which sequence is which.

    ``labels`` are the input ids on each final reply (and its end-of-turn marker); ``position_ids``
    restart at every sequence (chosen and rejected alike).
    """

    segment_ids: torch.Tensor  # 2k: pair k's chosen sequence, 2k + 1: its rejected one, -1: padding
    pair_mask: torch.Tensor  # (rows, pairs_per_row) bool: which pair slots of a row hold a pair

    @property
    def pairs(self) -> int:
        return int(self.pair_mask.sum())

    def batch(self, indices: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        import torch

        index = torch.tensor(indices)
        return {
            **super().batch(indices, device),
            "segment_ids": self.segment_ids[index].to(device, torch.long),
            "pair_mask": self.pair_mask[index].to(device),
        }


def load_pair_rows(shards_dir: Path, split: str, max_seq_len: int) -> PairRows | None:
    """All preference pairs of ``pairs-<split>-*.parquet`` in memory: 4 int32 tensors, 16 bytes/token."""
    import torch

    arrays = _load_columns(shards_dir, pair_split(split), PAIR_COLUMNS, max_seq_len)
    if arrays is None:
        return None
    input_ids, loss_mask, position_ids, segment_ids = (torch.from_numpy(array) for array in arrays)
    pairs = (segment_ids.max(dim=1).values + 1) // 2  # sequences come in (chosen, rejected) twos
    pair_mask = torch.arange(int(pairs.max())) < pairs[:, None]
    return PairRows(
        input_ids=input_ids,
        labels=_labels(input_ids, loss_mask, position_ids),
        position_ids=position_ids,
        segment_ids=segment_ids,
        pair_mask=pair_mask,
    )


@dataclass(frozen=True)
class Prompt:
    """One prompt of a prompt shard: what generation starts from and what its reward functions read."""

    input_ids: torch.Tensor  # (tokens,) int64: the turns rendered up to the model's turn
    source: str
    messages: list[dict]  # the turns (the reward functions' ``prompts``)
    columns: dict  # the row's other columns (the reward functions' keyword arguments)


@dataclass(frozen=True)
class PromptRows:
    """The prompts of ``prompts-<split>-*.parquet``, in file order: one row a prompt, not packed."""

    prompts: list[Prompt]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def seq_len(self) -> int:
        """The longest prompt, in tokens."""
        return max(len(prompt.input_ids) for prompt in self.prompts)

    def batch(self, indices: np.ndarray, device: torch.device) -> dict[str, list[Prompt]]:
        """The prompts at ``indices`` (a GRPO step generates from them before anything goes to ``device``)."""
        return {"prompts": [self.prompts[i] for i in np.asarray(indices).tolist()]}


def load_prompt_rows(shards_dir: Path, split: str, max_seq_len: int) -> PromptRows | None:
    """All prompts of ``prompts-<split>-*.parquet``; None without shards. A prompt longer than ``max_seq_len``
    tokens is refused (it leaves no room for the reply)."""
    import json

    import torch

    files = shard_files(shards_dir, prompt_split(split))
    if not files:
        return None
    prompts = []
    for path in files:
        table = pq.read_table(path, columns=[field.name for field in PROMPT_SCHEMA])
        for ids, source, messages, columns in zip(*(table.column(field.name).to_pylist() for field in PROMPT_SCHEMA)):
            prompts.append(
                Prompt(torch.tensor(ids, dtype=torch.long), source, json.loads(messages), json.loads(columns))
            )
    rows = PromptRows(prompts)
    if rows.seq_len > max_seq_len:
        raise ValueError(
            f"{shards_dir}: the longest prompt has {rows.seq_len} tokens, above max_seq_len={max_seq_len}; tokenize the prompts "
            "with a shorter seq_len or raise max_seq_len"
        )
    return rows
