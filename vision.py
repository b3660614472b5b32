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
from collections.abc import Sequence
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
