"""Build the tokenizer, tiny models and demo data set that tests and the CPU demo use, with no downloads.

    python make_assets.py                       # ./assets/{tokenizer,tiny-qwen2,tiny-llama-tied}
    python make_assets.py --out /tmp/assets --force
    python make_assets.py --preset 50m          # also ./assets/qwen2-50m, for benchmarks
    python make_assets.py --preset 25m --arch llama   # ./assets/llama-25m (bench/peer_trl.py's larger model)
    python make_assets.py --preset tiny --hidden 256 --layers 4 --name my-qwen2
    python make_assets.py --moe                 # also ./assets/tiny-{qwen3-moe,qwen2-moe,mixtral}
    python make_assets.py --vl                  # also ./assets/tiny-{qwen2-vl,qwen2.5-vl}

The tokenizer is character level: every printable ASCII character and "\\n" is one token, so
"What is 12+7?" encodes to exactly its 13 characters. Models are randomly initialised from a
transformers config with a fixed seed and saved in float32 safetensors with the tokenizer beside
them, so any of them loads with `from_pretrained(path)` and with vLLM. The demo task is one-digit
addition in verl's row format (data_source `arithmetic`), answered as `#### N` like GSM8K; the
tool-use demo's is two-digit multiplication (`37*48=`) with the calculator tool (data/tools_*.parquet).
`tiny-chatml-tokenizer` is the same characters with Qwen2.5's special tokens and a tool-calling
ChatML template (CHATML_TEMPLATE), for testing multi-turn rendering and hermes tool calls offline.
"""

import argparse
import math
import os
import random
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    PreTrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen2VLConfig,
    Qwen3MoeConfig,
)

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
# vLLM pads the embedding to a multiple of 64 anyway; choosing it up front keeps HF and vLLM alike.
VOCAB_SIZE = 128
MAX_POSITION_EMBEDDINGS = 512

# A user turn is its text and a newline; the assistant turn follows directly and ends with <eos>.
# add_generation_prompt needs no extra text because the prompt already ends where the answer starts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}<eos>"
    "{% else %}{{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
)

# Qwen2.5-style ChatML with tools, written for this repo: tool schemas in the system turn, assistant
# tool calls as hermes <tool_call> blocks, and consecutive `tool` messages grouped into one user turn
# of <tool_response> blocks. Every turn ends with <|im_end|> and a newline; the model samples the
# <|im_end|>, the newline belongs to whatever follows.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou can call these functions (one JSON signature per line):\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, write a JSON object with its name and arguments between tags:\\n"
    "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2.5's specials, first so that ids 0/1/2 line up with model_config's pad/eos/bos: <|endoftext|>
# is the tokenizer's eos and pad (as in a Qwen base model), <|im_end|> ends a turn (the eos of
# Qwen's generation_config). The tool tags are ordinary added tokens (not special), as in Qwen2.5,
# so decoding with skip_special_tokens keeps them for the tool-call parser.
CHATML_SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", UNK]
CHATML_TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# head_dim stays >= 32: vLLM's CPU attention supports head sizes 32, 64, 80, ... only.
PRESETS = {
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256),  # ~0.3 M parameters
    "50m": dict(hidden=768, layers=8, heads=12, kv_heads=4, intermediate=2048),  # ~50 M parameters
    # the peer comparison's two sizes (bench/peer_trl.py builds them as Llamas)
    "1m": dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=512),  # ~1.0 M parameters
    "25m": dict(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408),  # ~24 M parameters
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: specials first, then printable ASCII and newline."""
    specials = [PAD, EOS, BOS, UNK]
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # printable ASCII, space, \n
    # Tokens are spelled in the GPT-2 byte-level alphabet (space is "\u0120", newline "\u010a") so
    # that transformers' Qwen2Tokenizer, which AutoTokenizer forces on qwen2 model directories and
    # which rebuilds a byte-level pipeline from vocab and merges, encodes exactly as this one does.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [byte_level.pre_tokenize_str(c)[0][0] for c in chars]
    vocab = {tok: i for i, tok in enumerate(specials + symbols)}
    # BPE with no merges splits every word into single characters.
    core = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.pre_tokenizer = byte_level
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_chatml_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer with Qwen2.5's ChatML special tokens and a tool template."""
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [byte_level.pre_tokenize_str(c)[0][0] for c in chars]
    vocab = {tok: i for i, tok in enumerate(CHATML_SPECIALS + CHATML_TOOL_TAGS + symbols)}
    assert len(vocab) <= VOCAB_SIZE  # fits the tiny models' embedding, so one can be built beside it
    core = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.pre_tokenizer = byte_level
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=UNK,
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
        padding_side="left",
    )
    tokenizer.add_tokens(CHATML_TOOL_TAGS, special_tokens=False)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_chatml_tokenizer_dir(out_dir: Path, force: bool = False) -> bool:
    """Write build_chatml_tokenizer() to out_dir; False if it existed."""
    return _write_tokenizer(build_chatml_tokenizer, out_dir, force)


def _write_tokenizer(build: Callable[[], PreTrainedTokenizerFast], out_dir: Path, force: bool) -> bool:
    if (out_dir / "tokenizer.json").exists() and not force:
        return False
    build().save_pretrained(out_dir)
    print(f"wrote {out_dir}")
    return True


def model_config(
    arch: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, tied: bool
) -> PreTrainedConfig:
    """A transformers config for Qwen2 ('qwen2') or Llama ('llama') with this repo's vocabulary."""
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    return config_cls(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=tied,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        dtype="float32",
    )


# Tiny mixture-of-experts models: 4 experts, top-2, 2 layers. vLLM's CPU MoE kernel wants the hidden and
# the expert width multiples of 32 (per TP rank: 64 serves TP 1 and 2); heads of 32 as above.
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")


def moe_config(arch: str, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               experts: int = 4, top_k: int = 2, expert_intermediate: int = 64) -> PreTrainedConfig:
    """A transformers config for Qwen3-MoE, Qwen2-MoE (with its shared expert, twice as wide) or Mixtral
    with this repo's vocabulary."""
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=MAX_POSITION_EMBEDDINGS,
                  num_experts_per_tok=top_k, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                  bos_token_id=2, dtype="float32")
    if arch == "mixtral":
        return MixtralConfig(**common, intermediate_size=expert_intermediate, num_local_experts=experts)
    moe = dict(moe_intermediate_size=expert_intermediate, num_experts=experts, norm_topk_prob=True,
               intermediate_size=4 * expert_intermediate)  # the dense MLP's, for mlp_only_layers: unused
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, head_dim=hidden // heads)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=2 * expert_intermediate)
    raise ValueError(f"unknown MoE architecture {arch!r}; one of {MOE_ARCHS}")


def build_moe_assets(out: Path, force: bool = False, seed: int = 0) -> dict[str, Path]:
    """tiny-qwen3-moe, tiny-qwen2-moe and tiny-mixtral (random weights) under `out`."""
    paths = {}
    for i, arch in enumerate(MOE_ARCHS):
        paths[arch] = out / f"tiny-{arch.replace('_', '-')}"
        build_model(paths[arch], moe_config(arch), seed + 10 + i, force)
    return paths


# Tiny vision-language models (Qwen2-VL, Qwen2.5-VL): the text part is the tiny preset with mrope (sections sum to
# head_dim / 2), the vision part one or two blocks of 64 wide with 14-pixel patches merged 2x2 into one image token.
# The tokenizer is the ChatML characters plus Qwen-VL's vision tokens; the image processor resizes every image to
# between 56x56 and 112x112 pixels (4 to 16 image tokens), so prompts stay short.
VL_ARCHS = ("qwen2_vl", "qwen2_5_vl")
VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
               "<|video_pad|>", UNK]
VL_TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vision_start_token_id=3, vision_end_token_id=4,
                    image_token_id=5, video_token_id=6)
# Qwen-VL's ChatML, written for this repo: a message's content is a string or a list of {"type": "image"} and
# {"type": "text", "text": ...} items; each image is one <|image_pad|> between the vision tags, which the
# processor expands to the image's number of tokens.
VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for item in message.content %}"
    "{%- if item.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item.type == 'text' %}{{- item.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_vl_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer with Qwen-VL's ChatML and vision special tokens (ids 0-6) and template."""
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [byte_level.pre_tokenize_str(c)[0][0] for c in chars]
    vocab = {tok: i for i, tok in enumerate(VL_SPECIALS + symbols)}
    assert len(vocab) <= VOCAB_SIZE
    core = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.pre_tokenizer = byte_level
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>",
        unk_token=UNK, extra_special_tokens=VL_SPECIALS[3:7], padding_side="left",
    )
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def vl_config(arch: str) -> PreTrainedConfig:
    """A transformers config for a tiny Qwen2-VL ('qwen2_vl') or Qwen2.5-VL ('qwen2_5_vl') with this repo's
    vocabulary; head_dim 32 (vLLM's CPU attention) and mrope sections [4, 6, 6]."""
    tiny = PRESETS["tiny"]
    text = dict(vocab_size=VOCAB_SIZE, hidden_size=tiny["hidden"], num_hidden_layers=tiny["layers"],
                num_attention_heads=tiny["heads"], num_key_value_heads=tiny["kv_heads"],
                intermediate_size=tiny["intermediate"], max_position_embeddings=MAX_POSITION_EMBEDDINGS,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "qwen2_vl":
        vision = dict(depth=1, embed_dim=64, hidden_size=tiny["hidden"], num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        config_cls = Qwen2VLConfig
    elif arch == "qwen2_5_vl":  # block 1 attends to the whole image, block 0 within 56-pixel windows
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=tiny["hidden"],
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1])
        config_cls = Qwen2_5_VLConfig
    else:
        raise ValueError(f"unknown vision-language architecture {arch!r}; one of {VL_ARCHS}")
    return config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False, dtype="float32",
                      **{k: v for k, v in VL_TOKEN_IDS.items() if k.startswith(("vision", "image", "video"))})


def vl_image_processor() -> Any:
    """Qwen2-VL's PIL image processor (no torchvision): 14-pixel patches, 2x2 merged, 56..112 pixels a side."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}, patch_size=14,
                                    merge_size=2, temporal_patch_size=2)


def build_vl_model(out_dir: Path, arch: str, seed: int, force: bool = False) -> bool:
    """Random-init a tiny VLM and save it with its tokenizer, chat template and image processor (each written on
    its own: saving a whole processor needs torchvision's video processor); False if it existed."""
    from transformers import AutoModelForImageTextToText

    if (out_dir / "config.json").exists() and not force:
        return False
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(vl_config(arch), dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = build_vl_tokenizer()
    tokenizer.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE)
    vl_image_processor().save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out_dir} ({type(model).__name__}, {n_params / 1e6:.2f} M parameters)")
    return True


def build_vl_assets(out: Path, force: bool = False, seed: int = 0) -> dict[str, Path]:
    """tiny-qwen2-vl and tiny-qwen2.5-vl (random weights) under `out`."""
    paths = {}
    for i, arch in enumerate(VL_ARCHS):
        paths[arch] = out / {"qwen2_vl": "tiny-qwen2-vl", "qwen2_5_vl": "tiny-qwen2.5-vl"}[arch]
        build_vl_model(paths[arch], arch, seed + 20 + i, force)
    return paths


COLOURS = {"1": (220, 40, 40), "2": (40, 200, 40), "3": (40, 40, 220)}  # the answer's digit: red, green, blue


def shape_rows(num: int, seed: int, size: int = 56) -> list[dict[str, Any]]:
    """`num` rows of a task a VLM must look to answer: a square in one of three colours drawn with PIL on a
    grey image, at a random place and size, and the same question in every row, "<image>Colour? 1 red 2
    green 3 blue", answered `#### N` (the arithmetic rule scores it; a blind model gets 1/3). Images are
    stored as PNG bytes."""
    from PIL import Image, ImageDraw

    from vision import encode_image

    rng = random.Random(seed)
    rows = []
    for i in range(num):
        answer = rng.choice(sorted(COLOURS))
        image = Image.new("RGB", (size, size), (128, 128, 128))
        side = rng.randint(size // 2, size - 4)
        x, y = rng.randint(0, size - side), rng.randint(0, size - side)
        ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[answer])
        rows.append({"data_source": "arithmetic",
                     "prompt": [{"role": "user", "content": "<image>Colour? 1 red 2 green 3 blue"}],
                     "images": [encode_image(image)], "ability": "vision",
                     "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"index": i}})
    return rows


def write_shapes_dataset(out_dir: str | Path, num_train: int = 512, num_val: int = 64, seed: int = 0) -> dict:
    """Write train/val parquet files of the colour task (shape_rows; disjoint seeds); skip if present."""
    return write_splits(out_dir, shape_rows, num_train, num_val, seed)


def build_model(out_dir: Path, config: PreTrainedConfig, seed: int, force: bool = False) -> bool:
    """Random-init a causal LM from `config` and save it with the tokenizer; False if it existed."""
    if (out_dir / "config.json").exists() and not force:
        return False
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer().save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out_dir} ({type(model).__name__}, {n_params / 1e6:.2f} M parameters)")
    return True


def build_tokenizer_dir(out_dir: Path, force: bool = False) -> bool:
    return _write_tokenizer(build_tokenizer, out_dir, force)


# -----------------------------------------------------------------------------
# The demo task: short arithmetic a tiny model can learn, with a `#### answer` like GSM8K


def arithmetic_rows(num: int, seed: int, max_operand: int = 9) -> list[dict[str, Any]]:
    """`num` rows of `a+b` questions (a, b <= max_operand) in verl's row format; the answer follows `####`."""
    ops = "+"
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice(ops)
        answer = a + b if op == "+" else a - b
        rows.append({
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"index": i},
        })
    return rows


def write_arithmetic_dataset(out_dir: str | Path, num_train: int = 2000, num_val: int = 128, seed: int = 0) -> dict:
    """Write train/val parquet files of the demo task (disjoint seeds); skip if present."""
    return write_splits(out_dir, arithmetic_rows, num_train, num_val, seed)


def write_splits(out_dir: str | Path, rows: Callable[[int, int], list[dict[str, Any]]], num_train: int, num_val: int,
                 seed: int) -> dict:
    """out_dir/{train,val}.parquet of rows(num, seed) (val with seed + 1: disjoint draws); skip if present."""
    import datasets

    out = Path(out_dir)
    paths = {"train": out / "train.parquet", "val": out / "val.parquet"}
    if all(p.is_file() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    for split, num, split_seed in (("train", num_train, seed), ("val", num_val, seed + 1)):
        datasets.Dataset.from_list(rows(num, split_seed)).to_parquet(str(paths[split]))
    return paths


# -----------------------------------------------------------------------------
# The tool-use demo's task: two-digit multiplication, which the tiny model cannot do in its head but
# can with the calculator (agent.Calculator, tool `calc`): `37*48=` -> `calc(37*48)`, the tool answers
# `1776`, then `#### 1776`. data_source `arithmetic`, so the built-in `#### N` rule scores it.


def multiplication_rows(pairs: list[tuple[int, int]], start_index: int = 0) -> list[dict[str, Any]]:
    """`a*b=` rows in verl's multi-turn row format: agent_name tool_agent and extra_info.tools_kwargs for
    the `calc` tool (create_kwargs carries the ground truth, as verl's gsm8k tool example does: parquet
    cannot store an empty mapping), plus extra_info.expression for sft_warmup.py --tools."""
    rows = []
    for i, (a, b) in enumerate(pairs, start_index):
        answer = str(a * b)
        rows.append({
            "data_source": "arithmetic",
            "agent_name": "tool_agent",
            "prompt": [{"role": "user", "content": f"{a}*{b}="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"index": i, "expression": f"{a}*{b}", "need_tools_kwargs": True,
                           "tools_kwargs": {"calc": {"create_kwargs": {"ground_truth": answer}}}},
        })
    return rows


def write_tools_dataset(out_dir: str | Path, num_train: int = 2000, num_val: int = 128, seed: int = 0) -> dict:
    """Write tools_train/tools_val parquet files of the tool-use demo (disjoint operand pairs, both in
    10..99); skip if present."""
    import datasets

    out = Path(out_dir)
    paths = {"tools_train": out / "tools_train.parquet", "tools_val": out / "tools_val.parquet"}
    if all(p.is_file() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    splits = {"tools_train": (pairs[:num_train], 0), "tools_val": (pairs[num_train:num_train + num_val], num_train)}
    for split, (split_pairs, start) in splits.items():
        datasets.Dataset.from_list(multiplication_rows(split_pairs, start)).to_parquet(str(paths[split]))
    return paths


def build_default_assets(out: Path, force: bool = False, seed: int = 0) -> dict[str, Path]:
    """The tokenizer, tiny-qwen2 (untied), tiny-llama-tied (a second architecture, tied), the ChatML
tokenizer (tiny-chatml-tokenizer), the demo data set (data/train.parquet, data/val.parquet) and the
tool-use demo's (data/tools_train.parquet, data/tools_val.parquet)."""
    tiny = PRESETS["tiny"]
    paths = {name: out / name for name in ("tokenizer", "tiny-qwen2", "tiny-llama-tied", "tiny-chatml-tokenizer")}
    build_tokenizer_dir(paths["tokenizer"], force)
    build_chatml_tokenizer_dir(paths["tiny-chatml-tokenizer"], force)
    build_model(paths["tiny-qwen2"], model_config("qwen2", **tiny, tied=False), seed, force)
    build_model(paths["tiny-llama-tied"], model_config("llama", **tiny, tied=True), seed + 1, force)
    # The demo task's prompts, in verl's row format (data.py): train/val parquet under data/.
    paths.update(write_arithmetic_dataset(out / "data"))
    paths.update(write_tools_dataset(out / "data"))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("ASSETS_DIR", "assets")))
    parser.add_argument("--force", action="store_true", help="rebuild even if the files exist")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="also build one model of this size")
    parser.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2", help="the --preset model's architecture")
    parser.add_argument("--hidden", type=int, help="override the preset's hidden size (head_dim kept)")
    parser.add_argument("--layers", type=int, help="override the preset's number of layers")
    parser.add_argument("--name", help="directory name for --preset (default qwen2-<preset>)")
    parser.add_argument("--moe", action="store_true", help="also build tiny-qwen3-moe, tiny-qwen2-moe, tiny-mixtral")
    parser.add_argument("--vl", action="store_true", help="also build tiny-qwen2-vl, tiny-qwen2.5-vl")
    args = parser.parse_args()

    build_default_assets(args.out, args.force, args.seed)
    if args.moe:
        build_moe_assets(args.out, args.force, args.seed)
    if args.vl:
        build_vl_assets(args.out, args.force, args.seed)
    if args.preset is None:
        if args.hidden or args.layers:
            parser.error("--hidden/--layers modify a --preset; add e.g. --preset tiny")
        return
    dims = dict(PRESETS[args.preset])
    head_dim = dims["hidden"] // dims["heads"]
    if args.hidden:
        if args.hidden % head_dim:
            parser.error(f"--hidden {args.hidden} must be a multiple of head_dim {head_dim}")
        dims["heads"] = args.hidden // head_dim
        dims["kv_heads"] = math.gcd(dims["kv_heads"], dims["heads"])
        dims["intermediate"] = dims["intermediate"] * args.hidden // dims["hidden"]
        dims["hidden"] = args.hidden
    if args.layers:
        dims["layers"] = args.layers
    name = args.name or f"{args.arch}-{args.preset}"
    build_model(args.out / name, model_config(args.arch, **dims, tied=False), args.seed, args.force)


if __name__ == "__main__":
    main()
