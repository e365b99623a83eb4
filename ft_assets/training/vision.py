"""A vision-language model's forward inputs for packed rows: pixels from the stored images, and its packed positions.

A packed row of a vision-language model holds whole examples, each with its image tokens as its
processor expanded them (``ft_assets.data.chat_encoding``) and the row's image files in token order
(``ft_assets.shards``). What the model needs beyond the token ids is made here, on the trainer, for each
micro-batch: the pixels, computed from the stored images by the model's own image processor (the same
resize rules that counted the tokens), and what keeps the row's examples apart, which differs by family
(``PIXEL_INPUTS``, one class a family, chosen by config.json's ``model_type``). Each was checked against the
examples' separate forwards (``test_vision_training.py``: logits equal to ~1e-5 in fp32):

- Qwen2.5-VL / Qwen3-VL (``QwenPixels``): M-RoPE gives image tokens 3-D positions, so each example's are
  computed by the model's own ``get_rope_index`` and concatenated, under a first row of plain positions that
  restart at every example: transformers 5 reads packing from that row (``position_ids`` of shape (4, B, L)).
  The 2-D positions of a text model's packed rows would let examples attend to each other (Qwen2.5-VL expands
  them to 3 rows and loses the boundaries), so text-only rows of these models go the same way.
- Gemma 3 (``GemmaPixels``): image tokens attend to each other both ways within their image
  (``token_type_ids``). transformers 5.25 builds that overlay wrongly on packed rows in its sliding-window
  layers (every example after the first reads the first one's image layout, and attends to future tokens), so
  both layer types' masks are built here: causal within an example, bidirectional within an image, the sliding
  window on top. They are dense (rows x L x L), so Gemma 3 trains with sdpa or eager attention.
- Idefics3 / SmolVLM (``TiledPixels``): each image is cut into tiles; a row's tiles go together, padded with
  all-zero tiles the model drops; the 2-D restarting positions suffice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft_assets.vision import FAMILIES, image_token_id, load_processor


def _pictures(files: list[str]) -> list:
    from PIL import Image

    pictures = []
    for path in files:
        with Image.open(path) as image:
            pictures.append(image.convert("RGB"))
    return pictures


def _segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """The [start, end) spans of a packed row's examples (and its padding tail): where the positions restart at 0."""
    starts = torch.nonzero(position_ids == 0).flatten().tolist()
    ends = starts[1:] + [position_ids.shape[0]]
    return list(zip(starts, ends))


@dataclass
class PixelInputs:
    """A family's forward inputs for a batch of packed rows (``batch["images"]``: each row's image files)."""

    image_processor: object
    image_token: int
    model_config: object

    def __call__(self, model, batch: dict) -> dict:
        """``batch`` (a host copy: changed in place) with ``images`` replaced by the family's pixel inputs."""
        raise NotImplementedError


def _model_with(model, method: str):
    """The module under ``model`` (a PEFT or DDP wrapper, the ForConditionalGeneration class) that has ``method``."""
    for module in model.modules():
        if hasattr(module, method):
            return module
    raise AttributeError(f"{type(model).__name__} has no module with {method}")


class QwenPixels(PixelInputs):
    def __call__(self, model, batch: dict) -> dict:
        files = batch.pop("images")
        pictures = [picture for row in files for picture in _pictures(row)]
        ids, positions = batch["input_ids"], batch["position_ids"]
        grids = None
        if pictures:
            pixels = self.image_processor(images=pictures, return_tensors="pt")
            batch["pixel_values"], grids = pixels["pixel_values"], pixels["image_grid_thw"]
            batch["image_grid_thw"] = grids
        merge = self.image_processor.merge_size**2
        rope_index = _model_with(model, "get_rope_index").get_rope_index
        image_tokens = ids == self.image_token
        rows, taken = [], 0
        for b in range(ids.shape[0]):
            parts = []
            for start, end in _segments(positions[b]):
                tokens = int(image_tokens[b, start:end].sum())
                own, counted = [], 0
                while counted < tokens:  # this example's images, in token order
                    own.append(taken)
                    counted += int(grids[taken].prod()) // merge
                    taken += 1
                rope, _ = rope_index(
                    ids[b : b + 1, start:end],
                    mm_token_type_ids=image_tokens[b : b + 1, start:end].long(),
                    image_grid_thw=grids[own] if own else None,
                )
                parts.append(torch.cat([positions[b : b + 1, start:end].view(1, 1, -1), rope.to(positions)], 0))
            rows.append(torch.cat(parts, 2))
        batch["position_ids"] = torch.cat(rows, 1)  # (4, B, L): restarting positions, then M-RoPE's three
        return batch


class GemmaPixels(PixelInputs):
    def __call__(self, model, batch: dict) -> dict:
        files = batch.pop("images")
        pictures = [picture for row in files for picture in _pictures(row)]
        if pictures:
            batch["pixel_values"] = self.image_processor(images=pictures, return_tensors="pt")["pixel_values"]
        token_type_ids = (batch["input_ids"] == self.image_token).long()
        batch["token_type_ids"] = token_type_ids
        text = self.model_config.get_text_config()
        batch["attention_mask"] = packed_masks(
            token_type_ids, batch["position_ids"], text.sliding_window, text._attn_implementation
        )
        return batch


def packed_masks(
    token_type_ids: torch.Tensor, position_ids: torch.Tensor, sliding_window: int, attention: str
) -> dict[str, torch.Tensor]:
    """Gemma 3's two masks of packed rows, (rows, 1, L, L): causal within each example, bidirectional within each image
    (a run of image tokens), and for the sliding layers only keys within ``sliding_window`` behind the query."""
    length = token_type_ids.shape[1]
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    image = token_type_ids == 1
    starts = image & ~torch.nn.functional.pad(image, (1, 0))[:, :-1]
    group = torch.where(image, starts.cumsum(-1), -1)  # one id per image, -1 on text
    same_image = (group[:, :, None] == group[:, None, :]) & (group[:, :, None] >= 0)
    example = (position_ids == 0).cumsum(-1)
    same_example = example[:, :, None] == example[:, None, :]
    full = same_example & ((key <= query) | same_image)
    sliding = full & (key > query - sliding_window)
    if attention == "sdpa":
        return {"full_attention": full[:, None], "sliding_attention": sliding[:, None]}
    lowest = torch.finfo(torch.float32).min

    def additive(mask):
        return torch.zeros(mask.shape).masked_fill(~mask, lowest)[:, None]

    return {"full_attention": additive(full), "sliding_attention": additive(sliding)}


class TiledPixels(PixelInputs):
    def __call__(self, model, batch: dict) -> dict:
        files = batch.pop("images")
        rows = [_pictures(row) for row in files]
        if not any(rows):
            return batch
        tiles = [self.image_processor(images=[row], return_tensors="pt") if row else None for row in rows]
        shape = next(t for t in tiles if t is not None)["pixel_values"].shape[2:]
        most = max(t["pixel_values"].shape[1] for t in tiles if t is not None)
        pixels = torch.zeros(len(rows), most, *shape)
        mask = torch.zeros(len(rows), most, *shape[1:], dtype=torch.long)
        for b, t in enumerate(tiles):
            if t is not None:  # all-zero tiles pad the other rows: the model drops them
                count = t["pixel_values"].shape[1]
                pixels[b, :count] = t["pixel_values"][0]
                mask[b, :count] = t["pixel_attention_mask"][0]
        batch["pixel_values"], batch["pixel_attention_mask"] = pixels, mask
        return batch


PIXEL_INPUTS: dict[str, type[PixelInputs]] = {
    "qwen2_5_vl": QwenPixels,
    "qwen3_vl": QwenPixels,
    "gemma3": GemmaPixels,
    "idefics3": TiledPixels,
    "smolvlm": TiledPixels,
}


def pixel_inputs(base_model_dir, model_config) -> PixelInputs:
    """The forward inputs of ``model_config``'s family (its ``model_type``), with the base's image processor."""
    family = PIXEL_INPUTS.get(model_config.model_type)
    if family is None:
        raise ValueError(
            f"vision-language models of type {model_config.model_type!r} do not train here yet; these do: "
            f"{', '.join(FAMILIES)}"
        )
    image_processor = load_processor(base_model_dir).image_processor
    return family(image_processor, image_token_id(model_config.to_dict()), model_config)
