"""Images in prompts, for vision-language models (Qwen2-VL, Qwen2.5-VL): rows, placeholders, image tokens.

A row is verl's, plus a list of images in the column data.image_key (default `images`), each stored as
parquet's {"bytes": ..., "path": ...} struct (what `datasets.Image` writes), raw bytes, or a file path. The
message text marks where each image goes with `<image>`, one per image, in order:

    {"prompt": [{"role": "user", "content": "<image>What colour is the square?"}],
     "images": [{"bytes": b"\\x89PNG...", "path": None}], ...}

`image_messages` turns such messages into the content lists a VLM's chat template renders
(`[{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]`); the template writes one
`<|image_pad|>` per image, and `expand_image_pads` widens each to the image's number of tokens, which
`image_tokens` reads from the image's size alone: images are decoded (`decode_image`) only when their
pixels are needed, not when the rows are loaded.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config import ConfigError

IMAGE_PLACEHOLDER = "<image>"


def load_processor(path: str, trust_remote_code: bool = False) -> Any:
    """A VLM's processor (tokenizer, chat template and image processor): transformers' AutoProcessor."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)


def is_vision_config(config: Any) -> bool:
    """Whether a transformers model config is a vision-language model's (it has a vision tower config)."""
    return getattr(config, "vision_config", None) is not None


def _image_file(entry: Any) -> Any:
    """A file-like object or path PIL can open, from one stored image (struct, bytes or path)."""
    if hasattr(entry, "getexif"):  # already a PIL image (a data set read with its images decoded)
        return entry
    if isinstance(entry, dict):
        if entry.get("bytes"):
            return io.BytesIO(entry["bytes"])
        if entry.get("path"):
            return entry["path"]
        raise ValueError(f"an image entry has neither bytes nor a path: keys {sorted(entry)}")
    if isinstance(entry, bytes | bytearray):
        return io.BytesIO(entry)
    if isinstance(entry, str | Path):
        return str(entry)
    raise ValueError(f"an image must be a {{bytes, path}} mapping, bytes or a path, not {type(entry).__name__}")


def image_size(entry: Any) -> tuple[int, int]:
    """(height, width) of a stored image, from its header only (no pixels decoded)."""
    from PIL import Image

    source = _image_file(entry)
    if hasattr(source, "getexif"):
        width, height = source.size
        return height, width
    with Image.open(source) as image:
        width, height = image.size
    return height, width


def decode_image(entry: Any) -> Any:
    """A stored image as an RGB PIL image (decoded now)."""
    from PIL import Image

    source = _image_file(entry)
    if hasattr(source, "getexif"):
        return source.convert("RGB")
    with Image.open(source) as image:
        return image.convert("RGB")


def encode_image(image: Any, fmt: str = "PNG") -> dict[str, Any]:
    """A PIL image as the {bytes, path} struct rows store (what datasets.Image writes)."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return {"bytes": buffer.getvalue(), "path": None}


def image_grid(size: tuple[int, int], image_processor: Any) -> tuple[int, int, int]:
    """(t, h, w) patches the image processor cuts an image of `size` (height, width) into, as
    `image_grid_thw` reports: the image is resized to multiples of patch_size x merge_size within the
    processor's pixel bounds (Qwen2-VL's smart_resize), then cut into patch_size squares."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    patch, merge = image_processor.patch_size, image_processor.merge_size
    bounds = image_processor.size
    min_pixels = bounds.get("shortest_edge") if hasattr(bounds, "get") else bounds.shortest_edge
    max_pixels = bounds.get("longest_edge") if hasattr(bounds, "get") else bounds.longest_edge
    height, width = smart_resize(*size, factor=patch * merge, min_pixels=min_pixels, max_pixels=max_pixels)
    return 1, height // patch, width // patch


def image_tokens(size: tuple[int, int], image_processor: Any) -> int:
    """How many <|image_pad|> tokens an image of `size` (height, width) takes in the prompt."""
    t, h, w = image_grid(size, image_processor)
    return t * h * w // image_processor.merge_size ** 2


def image_messages(messages: list[dict[str, Any]], num_images: int, where: str) -> list[dict[str, Any]]:
    """verl's rule: the messages' text holds one `<image>` per image, in order; each message's content becomes
    a list of {"type": "image"} and {"type": "text", "text": ...} items. `where` names the row, for errors."""
    found = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m.get("content"), str))
    if found != num_images:
        raise ConfigError(f"{where} has {num_images} image(s) in data.image_key but {found} {IMAGE_PLACEHOLDER} "
                          f"placeholder(s) in its prompt; write one {IMAGE_PLACEHOLDER} where each image goes.")
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
            out.append(dict(message))
            continue
        items: list[dict[str, Any]] = []
        for i, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if i:
                items.append({"type": "image"})
            if piece:
                items.append({"type": "text", "text": piece})
        out.append({**message, "content": items})
    return out


def expand_image_pads(ids: Sequence[int], counts: Sequence[int], image_token_id: int) -> list[int]:
    """The prompt ids with the i-th <|image_pad|> repeated counts[i] times (what the processor writes)."""
    pads = [j for j, t in enumerate(ids) if t == image_token_id]
    if len(pads) != len(counts):
        raise ValueError(f"the rendered prompt has {len(pads)} image pad tokens (id {image_token_id}) for "
                         f"{len(counts)} images: the chat template must write one per image")
    out: list[int] = []
    counts_left = iter(counts)
    for t in ids:
        out.extend([t] * next(counts_left) if t == image_token_id else [t])
    return out


# -----------------------------------------------------------------------------
# The engine's prompts and the trainer's inputs


def pad_token_ids(config: Any) -> tuple[int, ...]:
    """The image and video pad ids of a VLM's config: never sampled (a sampled pad has no image behind it,
    and the next forward fails on the count of image tokens), so the engine bans them and the trainer's
    log-probs mask them alike (ban_tokens)."""
    return tuple(i for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
                 if i is not None)


def ban_tokens(logits: Any, banned: Sequence[int]) -> Any:
    """logits (..., V) with the banned ids at -inf: the distribution the engine samples from when it bans them."""
    if not banned:
        return logits
    logits = logits.clone()
    logits[..., list(banned)] = float("-inf")
    return logits


def engine_prompt(token_ids: Sequence[int], images: Sequence[Any], image_token_id: int) -> dict[str, Any]:
    """vLLM's request for a prompt with images: the ids with each run of image pads collapsed to one (the
    engine expands it again from the image) and the decoded images."""
    collapsed = [t for j, t in enumerate(token_ids) if t != image_token_id or j == 0 or token_ids[j - 1] != t]
    request: dict[str, Any] = {"prompt_token_ids": collapsed}
    if images:
        request["multi_modal_data"] = {"image": [decode_image(image) for image in images]}
    return request


def pixel_inputs(images: Sequence[Any], image_processor: Any) -> dict[str, Any]:
    """{"pixel_values": (patches, C*T*P*P), "image_grid_thw": (num_images, 3)} of one sample's images, as the
    HF processor makes them (resized and normalised on the host)."""
    out = image_processor(images=[decode_image(image) for image in images], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def rope_positions(model: Any, token_ids: Any, image_grid_thw: Any, image_token_id: int) -> Any:
    """(4, L) positions of one sample, once: the text row 0..L-1 over the model's 3-row mrope positions (t, h,
    w; image tokens at their patch coordinates). Packed rows need the text row: it marks where each sample
    starts; with the 3 mrope rows alone, a packed forward is silently wrong."""
    import torch

    ids = torch.as_tensor(token_ids).reshape(1, -1)
    types = (ids == image_token_id).int()
    inner = getattr(model, "model", model)
    grid = None if image_grid_thw is None or len(image_grid_thw) == 0 else image_grid_thw
    if grid is None:
        mrope = torch.arange(ids.shape[1]).expand(3, 1, -1)
    else:
        mrope, _ = inner.get_rope_index(input_ids=ids, mm_token_type_ids=types, image_grid_thw=grid)
    text = torch.arange(ids.shape[1]).reshape(1, 1, -1)
    return torch.cat([text, mrope.to(text.dtype)], dim=0)[:, 0]  # (4, L)


# -----------------------------------------------------------------------------
# The trainer's batch: each row's pixels and grids, padded to the batch's widest row, and 4-row positions
#
# A VLM's rows carry two more columns: pixel_values (B, patches, C*T*P*P), each row's images' patches one
# after the other, zero after its last; image_grid_thw (B, images, 3), each row's grids in prompt order,
# (0, 0, 0) after its last. As tensors, they follow the rows wherever the batch's other columns go (micro
# batches, shuffled mini batches, the balance between ranks); micro_batch_pixels unpads a micro batch's
# rows into the model's inputs. position_ids are (B, 4, P+R): the text row, then the 3 mrope rows.


def pixel_rows(samples: Sequence[Mapping[str, Any]], patch_dim: int) -> dict[str, Any]:
    """{"pixel_values": (B, patches, D), "image_grid_thw": (B, images, 3)} from each sample's pixel_inputs
    ({} for a sample without images), zero-padded to the widest row."""
    import torch

    grids = [s["image_grid_thw"] if s else torch.zeros(0, 3, dtype=torch.long) for s in samples]
    pixels = [s["pixel_values"] if s else torch.zeros(0, patch_dim) for s in samples]
    width, count = max([len(p) for p in pixels] + [1]), max([len(g) for g in grids] + [1])
    pixel_values = torch.zeros(len(samples), width, patch_dim)
    image_grid_thw = torch.zeros(len(samples), count, 3, dtype=torch.long)
    for i, (p, g) in enumerate(zip(pixels, grids, strict=True)):
        pixel_values[i, :len(p)] = p
        image_grid_thw[i, :len(g)] = g
    return {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}


def micro_batch_pixels(pixel_values: Any, image_grid_thw: Any) -> dict[str, Any]:
    """The model's pixel inputs of these rows, in row order (the order of their image tokens, padded or
    packed): {"pixel_values": (patches, D), "image_grid_thw": (images, 3)}, or {} when no row has an image."""
    import torch

    real = image_grid_thw.prod(-1) > 0  # (b, images)
    if not bool(real.any()):
        return {}
    patches = image_grid_thw.prod(-1).sum(-1).tolist()  # (b,) patches per row
    pixels = torch.cat([pixel_values[i, :n] for i, n in enumerate(patches)])
    return {"pixel_values": pixels, "image_grid_thw": image_grid_thw[real]}


def sample_positions(model: Any, input_ids: Any, attention_mask: Any, image_grid_thw: Any | None,
                     image_token_id: int) -> Any:
    """(B, 4, T) positions of each row's real tokens (rope_positions, once per sample), 0 on padding."""
    import torch

    out = torch.zeros(input_ids.shape[0], 4, input_ids.shape[1], dtype=torch.long, device=input_ids.device)
    for i in range(input_ids.shape[0]):
        keep = attention_mask[i].bool()
        grid = None
        if image_grid_thw is not None:
            grid = image_grid_thw[i][image_grid_thw[i].prod(-1) > 0]
        out[i][:, keep] = rope_positions(model, input_ids[i][keep], grid, image_token_id).to(out.device)
    return out


def dummy_image(patch_dim: int, merge_size: int, device: Any) -> dict[str, Any]:
    """A zero image of merge_size x merge_size x 4 patches (the smallest grid a tower merges: 4 tokens)."""
    import torch

    side = 2 * merge_size
    return {"pixel_values": torch.zeros(side * side, patch_dim, device=device),
            "image_grid_thw": torch.tensor([[1, side, side]], device=device)}


def vision_tower(model: Any) -> Any:
    """The vision tower of a transformers VLM (Qwen2-VL's model.model.visual), or None for a text model."""
    inner = getattr(model, "model", None)
    return getattr(inner, "visual", None)


@dataclass(frozen=True)
class VisionRun:
    """What a run on a vision-language model needs beside the text path: the processor (its image processor
    makes the trainer's pixels, as the engine's does), the image pad id, and the ids neither side samples."""

    processor: Any
    image_token_id: int
    banned_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, path: str, model_config: Any, trust_remote_code: bool = False) -> VisionRun:
        processor = load_processor(path, trust_remote_code)
        return cls(processor, processor.image_token_id, pad_token_ids(model_config))

    def engine_prompts(self, prompts: Sequence[Any]) -> list[dict[str, Any]] | None:
        """vLLM's requests for data.Prompt-s (engine_prompt), or None when none has an image (plain ids)."""
        if not any(p.images for p in prompts):
            return None
        return [engine_prompt(p.token_ids, p.images, self.image_token_id) for p in prompts]

    def batch_columns(self, model: Any, batch: Mapping[str, Any], prompts: Sequence[Any]) -> dict[str, Any]:
        """The trainer's columns for a batch's rows (their prompts: prompts[prompt_index]): pixel_values and
        image_grid_thw (pixel_rows; each prompt's images decoded and processed once) and (B, 4, P+R)
        position_ids (sample_positions), on the batch's device."""
        device = batch["input_ids"].device
        index = batch["prompt_index"].tolist()
        per_prompt = {i: pixel_inputs(prompts[i].images, self.processor.image_processor) if prompts[i].images else {}
                      for i in set(index)}
        image_processor = self.processor.image_processor
        patch_dim = 3 * image_processor.temporal_patch_size * image_processor.patch_size ** 2
        rows = pixel_rows([per_prompt[i] for i in index], patch_dim)
        positions = sample_positions(model, batch["input_ids"].cpu(), batch["attention_mask"].cpu(),
                                     rows["image_grid_thw"], self.image_token_id)
        return {"pixel_values": rows["pixel_values"].to(device), "image_grid_thw": rows["image_grid_thw"].to(device),
                "position_ids": positions.to(device)}
