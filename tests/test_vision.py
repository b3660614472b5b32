"""Vision-language models: the tiny Qwen2-VL / Qwen2.5-VL assets, the torchvision stand-in (tests/cpu_compat),
image rows in verl's format (data.py, vision.py), geo3k through prepare_data.py, the engine on image prompts,
the trainer's forward on image rows (packed == padded == HF per sample), the dummy image on 2 FSDP ranks,
freeze_vision_tower, the refusals of check_vision_run, and a GRPO run at TP 2 (slow).

References are computed another way: the HF processor's own output (ids with the image pads expanded, the
grids) for what data.py derives from image headers alone."""

import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from conftest import CPU_COMPAT, clean_env, run, vl_env
from PIL import Image

import rewards
import vision
from config import ConfigError
from data import load_prompts

SIZES = [(56, 84), (120, 90), (30, 200), (300, 300)]  # below, inside and above the processor's pixel bounds


def random_image(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def processors(vl_assets) -> dict:
    return {arch: vision.load_processor(str(path)) for arch, path in vl_assets.items()}


# -----------------------------------------------------------------------------
# The assets and the torchvision stand-in


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_vl_assets_load_offline_and_run_an_image_prompt(arch, vl_assets, processors):
    from transformers import AutoConfig, AutoModelForImageTextToText

    path, proc = vl_assets[arch], processors[arch]
    config = AutoConfig.from_pretrained(path)
    assert vision.is_vision_config(config) and config.model_type == arch
    assert (proc.image_token_id, config.image_token_id, proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")) == (
        5, 5, config.video_token_id)
    assert config.text_config.eos_token_id == proc.tokenizer.eos_token_id
    image = random_image(56, 84, 0)
    messages = vision.image_messages([{"role": "user", "content": "<image>What colour?"}], 1, "row 0")
    text = proc.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], images=[image], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert (inputs["input_ids"] == 5).sum().item() == 6  # 24 patches, merged 2 x 2
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        with_image = model(**inputs).logits
        grey = proc(text=[text], images=[Image.new("RGB", (84, 56), (128, 128, 128))], return_tensors="pt")
        other = model(**grey).logits
    assert with_image.shape == (1, inputs["input_ids"].shape[1], 128)
    assert (with_image - other).abs().max() > 1e-3  # the logits see the image


def test_the_torchvision_stand_in_steps_aside_when_torchvision_is_installed(tmp_path):
    """Python loads tests/cpu_compat/sitecustomize.py from PYTHONPATH in every process (vLLM's too); it acts only
    where torchvision is absent, and patches nothing until transformers' modules are imported."""
    probe = ("import sys, sitecustomize; print(sitecustomize.ACTIVE, "
             "any(getattr(f, 'torchvision_stand_in', False) for f in sys.meta_path), 'transformers' in sys.modules)")
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    absent = run([sys.executable, "-c", probe], env=vl_env()).stdout.split()
    present = run([sys.executable, "-c", probe],
                  env=clean_env(PYTHONPATH=f"{CPU_COMPAT}:{tmp_path}")).stdout.split()
    assert absent == ["True", "True", "False"]
    assert present == ["False", "False", "False"]


def test_without_the_stand_in_a_vl_processor_does_not_load(vl_assets):
    """Why the stand-in exists: on the CPU set-up (no torchvision) AutoProcessor fails on a Qwen2-VL folder."""
    if not vision_stand_in_needed():
        pytest.skip("torchvision is installed here: the stand-in steps aside")
    code = f"from transformers import AutoProcessor; AutoProcessor.from_pretrained({str(vl_assets['qwen2_vl'])!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "orchvision" in proc.stderr, proc.stderr[-2000:]


def vision_stand_in_needed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is None


@pytest.mark.parametrize("override", [
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.lora_rank=8",
    "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.multi_turn.enable=true",
    "trainer.v1.trainer_mode=colocate_async", "reward_model.enable=true"])
def test_what_a_vl_run_does_not_support_is_refused_by_key(override, vl_assets):
    """check_model passes a VLM (its language model's sizes); each feature not run on images is one ConfigError
    naming its key and the value to use."""
    import models
    from config import check_vision_run, load_config

    models.check_model(str(vl_assets["qwen2_vl"]), 128, False, "cpu")
    base = ["data.train_files=t.parquet", "algorithm.adv_estimator=grpo"]
    check_vision_run(load_config(None, base), "qwen2_vl")  # GRPO with the other defaults runs
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}=.*not supported with a vision-language model .*qwen2_vl"):
        check_vision_run(load_config(None, [*base, override]), "qwen2_vl")


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_the_planner_sizes_a_vl_model_with_its_vision_tower(arch, vl_assets):
    import math

    from transformers import AutoConfig, AutoModelForImageTextToText

    import memory_plan

    shape = memory_plan.model_shape(str(vl_assets[arch]))
    model = AutoModelForImageTextToText.from_pretrained(vl_assets[arch], dtype=torch.float32)
    text = AutoConfig.from_pretrained(vl_assets[arch]).text_config
    assert sum(math.prod(s) for s in shape.param_shapes) == sum(p.numel() for p in model.parameters())
    assert sum(shape.unit_numels) + shape.root_numel == sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for p in model.model.visual.blocks.parameters())
    assert tower > 0 and sum(shape.unit_numels[1:-1]) == tower + sum(
        p.numel() for p in model.model.language_model.layers.parameters())  # vision blocks are units too
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab) == (
        text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads, 32, 128)
    with pytest.raises(ConfigError, match="a critic on one is not implemented"):
        memory_plan.model_shape(str(vl_assets[arch]), value_head=True)
    v = shape.vision  # the tower's widths, and its parameters: patch embedding, blocks, merger
    assert sum(math.prod(s) for s in v.param_shapes) == sum(p.numel() for p in model.model.visual.parameters())
    assert (v.depth, v.patch_dim, v.merge, v.swiglu, v.rms_norm) == (
        len(model.model.visual.blocks), 3 * 2 * 14 * 14, 2, arch == "qwen2_5_vl", arch == "qwen2_5_vl")
    # actor.freeze_vision_tower: the tower's shards leave the gradients and AdamW's state, and its activations go
    import offload

    images = memory_plan.ImageLoad(patches=64, images=1, tokens=16, source="test")
    base = dict(actor=shape, critic=None, use_ref=False, flags=offload.OffloadFlags(), fsdp=2, infer_tp=1,
                compute_bytes=2, engine_bytes=2, prompt_len=64, response_len=16, ppo_micro=4, log_prob_micro=4,
                critic_micro=None, actor_checkpointing=False, critic_checkpointing=False, gpu_memory_utilization=0.5,
                gpu_memory_bytes=80 * memory_plan.GIB, actor_packed=True, samples_per_rank=8, images=images)
    trained = memory_plan.phase_bytes(memory_plan.MemoryInputs(**base), 0)["update"]
    frozen = memory_plan.phase_bytes(memory_plan.MemoryInputs(**base, freeze_vision_tower=True), 0)["update"]
    tower_shard = sum(memory_plan.shard_numel(s, 2, 0) for s in v.param_shapes) * 4
    assert trained["actor.grads"] - frozen["actor.grads"] == tower_shard
    assert trained["actor.optimizer"] - frozen["actor.optimizer"] == 2 * tower_shard + 4 * len(v.param_shapes)
    assert trained["activations"] - frozen["activations"] == memory_plan.vision_activation_bytes(v, 4 * 64, 2, False)
    assert trained["pixels"] == frozen["pixels"] == (8 * 4 + 4 * 6) * 64 * 1176


# -----------------------------------------------------------------------------
# Image rows (verl's format) -> prompts


def image_rows(num: int, seed: int = 0, images_per_row=lambda i: 1 + i % 2) -> list[dict]:
    rows = []
    for i in range(num):
        k = images_per_row(i)
        images = [vision.encode_image(random_image(*SIZES[(i + j) % len(SIZES)], seed + 10 * i + j)) for j in range(k)]
        rows.append({"data_source": "hiyouga/geometry3k", "images": images,
                     "prompt": [{"role": "user", "content": "".join(f"Figure {j}: <image>. " for j in range(k))
                                 + f"Find x{i}."}],
                     "reward_model": {"style": "rule", "ground_truth": str(i)}})
    return rows


def test_image_tokens_from_the_header_equal_the_processors_grid(processors):
    proc = processors["qwen2_vl"]
    for height, width in SIZES + [(14, 14), (1000, 20)]:
        image = random_image(height, width, 1)
        grid = proc.image_processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
        stored = vision.encode_image(image)
        assert vision.image_size(stored) == (height, width)
        assert list(vision.image_grid((height, width), proc.image_processor)) == grid, (height, width)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_image_rows_load_as_the_processors_ids_with_the_images_undecoded(arch, processors, tmp_path):
    proc = processors[arch]
    path = tmp_path / "images.parquet"
    rows = image_rows(4)
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    prompts, dropped = load_prompts(str(path), proc.tokenizer, key="data.train_files", prompt_key="prompt",
                                    max_prompt_length=512, filter_overlong=False, truncation="error", processor=proc)
    assert dropped == 0 and len(prompts) == 4
    for prompt, row in zip(prompts, rows, strict=True):
        assert [set(image) for image in prompt.images] == [{"bytes", "path"}] * len(row["images"])  # still bytes
        images = [vision.decode_image(image) for image in prompt.images]
        expected = proc(text=[prompt.text], images=images, return_tensors="pt")["input_ids"][0].tolist()
        assert prompt.token_ids == expected
        assert prompt.messages == row["prompt"]  # the row's own chat, placeholders kept


def test_image_rows_written_by_datasets_image_feature_are_read_undecoded(processors, tmp_path):
    """verl's files store images with datasets' Image feature (decoded to PIL by default): data.py reads them
    as bytes, and both layouts give the same prompts."""
    proc = processors["qwen2_vl"]
    rows = image_rows(3)
    as_pil = [{**row, "images": [vision.decode_image(i) for i in row["images"]]} for row in rows]
    feature_path, bytes_path = tmp_path / "feature.parquet", tmp_path / "bytes.parquet"
    datasets.Dataset.from_list(as_pil).to_parquet(str(feature_path))
    datasets.Dataset.from_list(rows).to_parquet(str(bytes_path))
    assert isinstance(datasets.load_dataset("parquet", data_files=str(feature_path), split="train")[0]["images"][0],
                      Image.Image)
    kwargs = dict(key="data.train_files", prompt_key="prompt", max_prompt_length=512, filter_overlong=False,
                  truncation="error", processor=proc)
    from_feature, _ = load_prompts(str(feature_path), proc.tokenizer, **kwargs)
    from_bytes, _ = load_prompts(str(bytes_path), proc.tokenizer, **kwargs)
    assert [p.token_ids for p in from_feature] == [p.token_ids for p in from_bytes]
    assert all(isinstance(image, dict) and image["bytes"] for p in from_feature for image in p.images)


def test_image_row_errors_name_the_row_and_the_key(processors, tmp_path):
    proc = processors["qwen2_vl"]
    kwargs = dict(key="data.train_files", prompt_key="prompt", filter_overlong=False, truncation="left")
    rows = image_rows(2)
    rows[1]["prompt"] = [{"role": "user", "content": "No placeholder here."}]
    path = tmp_path / "bad.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    with pytest.raises(ConfigError, match=r"bad.parquet row 1 has 2 image\(s\) .* 0 <image>"):
        load_prompts(str(path), proc.tokenizer, max_prompt_length=512, processor=proc, **kwargs)
    good = tmp_path / "good.parquet"
    datasets.Dataset.from_list(image_rows(2)).to_parquet(str(good))
    with pytest.raises(ConfigError, match="not a vision-language model"):
        load_prompts(str(good), proc.tokenizer, max_prompt_length=512, **kwargs)
    with pytest.raises(ConfigError, match="cannot be truncated"):  # data.truncation=left would cut image tokens
        load_prompts(str(good), proc.tokenizer, max_prompt_length=20, processor=proc, **kwargs)
    lengths = [len(p.token_ids) for p in load_prompts(str(good), proc.tokenizer, max_prompt_length=512,
                                                      processor=proc, **kwargs)[0]]
    assert lengths[0] < lengths[1]  # 1 image, then 2
    kept, dropped = load_prompts(str(good), proc.tokenizer, max_prompt_length=lengths[0], processor=proc,
                                 **{**kwargs, "filter_overlong": True})
    assert (len(kept), dropped) == (1, 1)


def test_text_rows_load_as_before_beside_an_empty_image_column(tiny_assets, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["tiny-qwen2"])
    plain = datasets.load_dataset("parquet", data_files=str(tiny_assets["val"]), split="train").to_list()[:8]
    path = tmp_path / "with_images.parquet"
    datasets.Dataset.from_list([{**row, "images": []} for row in plain]).to_parquet(str(path))
    kwargs = dict(key="k", prompt_key="prompt", max_prompt_length=64, filter_overlong=False, truncation="error")
    before, _ = load_prompts(str(tiny_assets["val"]), tokenizer, **kwargs)
    after, _ = load_prompts(str(path), tokenizer, **kwargs)
    assert [p.token_ids for p in after] == [p.token_ids for p in before[:8]]
    assert all(p.images == () for p in after)


# -----------------------------------------------------------------------------
# geo3k (hiyouga/geometry3k's layout) through prepare_data.py, offline

GEO3K_TRAIN = [("<image>Find x.", "3"), ("<image>Find the area of the figure. Round to the nearest tenth.", "52.5"),
               ("Find y.", "7"), ("<image><image>Find m \\angle 2.", "34")]
GEO3K_TEST = [("<image>Find z.", "\\frac{1}{2}")]


def write_geo3k(root: Path) -> None:
    for split, items in (("train", GEO3K_TRAIN), ("test", GEO3K_TEST)):
        rows = [{"images": [random_image(*SIZES[i % len(SIZES)], i)], "problem": problem, "answer": answer}
                for i, (problem, answer) in enumerate(items)]
        (root / "data").mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(rows).to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))


def test_geo3k_converts_offline_to_verls_rows_with_image_bytes(processors, tmp_path):
    from prepare_data import GEO3K_INSTRUCTION

    write_geo3k(tmp_path / "raw")
    env = clean_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    out = run([sys.executable, "prepare_data.py", "geo3k", "--local-dir", str(tmp_path / "raw"), "--out",
               str(tmp_path / "geo3k")], env=env, timeout=300).stdout
    assert "train: 4 rows read" in out and "2 skipped" in out, out
    assert "the number of <image> placeholders differs from the number of images: rows 2, 3" in out, out
    train = datasets.load_dataset("parquet", data_files=str(tmp_path / "geo3k" / "train.parquet"), split="train",
                                  ).cast_column("images", datasets.Sequence(datasets.Image(decode=False)))
    assert len(train) == 2
    row = train[1]
    assert row["data_source"] == "hiyouga/geometry3k" and row["reward_model"]["ground_truth"] == "52.5"
    assert row["prompt"] == [{"role": "user", "content": GEO3K_TRAIN[1][0] + " " + GEO3K_INSTRUCTION}]
    assert row["extra_info"] == {"split": "train", "index": 1, "answer": "52.5", "question": GEO3K_TRAIN[1][0]}
    assert np.array_equal(np.asarray(vision.decode_image(row["images"][0])), np.asarray(random_image(*SIZES[1], 1)))
    proc = processors["qwen2_5_vl"]
    prompts, _ = load_prompts(str(tmp_path / "geo3k" / "test.parquet"), proc.tokenizer, key="data.val_files",
                              prompt_key="prompt", max_prompt_length=512, filter_overlong=False, truncation="error",
                              processor=proc)
    assert prompts[0].token_ids.count(proc.image_token_id) == 6  # 56 x 84 -> 4 x 6 patches -> 6 tokens


def test_geo3k_without_a_local_copy_or_internet_says_how_to_get_one(tmp_path):
    env = clean_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    proc = run([sys.executable, "prepare_data.py", "geo3k", "--out", str(tmp_path / "out")], env=env, timeout=300,
               check=False)
    assert proc.returncode == 1
    assert "huggingface-cli download hiyouga/geometry3k --repo-type dataset --local-dir" in proc.stderr, proc.stderr


def test_geo3k_rule_scores_as_verls():
    truth = "52.5"
    assert rewards.default_compute_score("hiyouga/geometry3k", "<think>area</think> so \\boxed{52.5}", truth) == 1.0
    assert rewards.default_compute_score("hiyouga/geometry3k", "<think>a</think> \\boxed{50}", truth) == 0.1
    assert rewards.default_compute_score("hiyouga/geometry3k", "The area is \\boxed{52.5}", truth) == 0.9
    assert rewards.default_compute_score("hiyouga/geometry3k", "52.5", truth) == 0.0


# -----------------------------------------------------------------------------
# The engine: vLLM against the HF forward on image prompts (tests/dist_vl_check.py, one launch per model)


@pytest.fixture(scope="module", params=["qwen2_vl", pytest.param("qwen2_5_vl", marks=pytest.mark.slow)])
def engine_check(request, vl_assets, tmp_path_factory) -> dict:
    import json

    from conftest import torchrun

    out = tmp_path_factory.mktemp(f"vl_engine_{request.param}")
    torchrun(1, ROOT_TESTS / "dist_vl_check.py", str(out), str(vl_assets[request.param]), "1", timeout=1800,
             env=vl_env())
    return json.loads((out / "rank0.json").read_text())


ROOT_TESTS = Path(__file__).resolve().parent


def test_engine_log_probs_on_image_prompts_equal_the_hf_forward_after_syncs(engine_check):
    """vLLM's log-probs of its own samples on image prompts (two images of different sizes in one, sizes below
    and above the pixel bounds) equal the HF forward given pixels, grids and 4-row positions, with the image
    pads banned on both sides; also after a sync that moved the vision tower, on the same images (served
    from the encoder cache unless the sync reset it)."""
    r = engine_check
    assert r["image_tokens"][:2] == [6, 8 + 9], r  # 56x84: 4x6 patches merged 2x2; 112x56 and 84x84
    assert r["tokens"] > 0 and r["sampled_banned"] == 0, r
    assert r["synced"] < 1e-5, r
    assert r["no_pixels"] > 1e-2 and r["positions_1d"] > 1e-4, r  # the controls: each input matters
    assert r["tower_tensors_moved"] > 0 and r["tower_synced"] < 1e-5, r
    assert r["tower_stale"] > 1e-2, r  # the engine serves the moved tower, not the old image embeddings
    assert "Encoder cache miss" in r["no_reset"], r  # why sync_weights resets the encoder cache


# -----------------------------------------------------------------------------
# The trainer's multimodal forward (models.compute_log_probs on a VLM's rows)

# (question, image sizes) per row: two images of different sizes in one row, a text-only row, one image each
TRAIN_ROWS = [("Left <image>, right <image>. Same?", [(56, 84), (112, 56)]), ("No image here: 2+3?", []),
              ("<image>Colour?", [(84, 84)]), ("<image>Count.", [(30, 200)])]
RESPONSE_LENS = [5, 3, 6, 1]


def vl_training_batch(proc, model, seed: int = 0) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """TRAIN_ROWS as the trainer's batch: prompts left-padded, random responses (no pad ids) right-padded,
    4-row positions and the rows' pixels; and each row's pixel_inputs, for a reference."""
    g = torch.Generator().manual_seed(seed)
    prompts, pixels = [], []
    for q, (text, sizes) in enumerate(TRAIN_ROWS):
        images = [vision.encode_image(random_image(h, w, 10 * q + j)) for j, (h, w) in enumerate(sizes)]
        messages = vision.image_messages([{"role": "user", "content": text}], len(images), f"row {q}")
        rendered = proc.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = proc.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        counts = [vision.image_tokens(vision.image_size(im), proc.image_processor) for im in images]
        prompts.append(vision.expand_image_pads(ids, counts, proc.image_token_id))
        pixels.append(vision.pixel_inputs(images, proc.image_processor) if images else {})
    P, R = max(map(len, prompts)), max(RESPONSE_LENS)
    pad = proc.tokenizer.pad_token_id
    ids = torch.full((len(prompts), P + R), pad)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, RESPONSE_LENS, strict=True)):
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:P + r] = torch.randint(7, model.config.text_config.vocab_size, (r,), generator=g)
        mask[i, P - len(p):P + r] = 1
    patch_dim = next(p["pixel_values"].shape[1] for p in pixels if p)
    rows = vision.pixel_rows(pixels, patch_dim)
    positions = vision.sample_positions(model, ids, mask, rows["image_grid_thw"], proc.image_token_id)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "responses": ids[:, P:], **rows}, pixels


def hf_reference(model, batch, pixels, banned, image_token_id, text_positions: bool = False,
                 with_pixels: bool = True) -> torch.Tensor:
    """(B, R) log-probs of each row alone, unpadded, the HF model computing its own mrope positions (from
    mm_token_type_ids); text_positions: plain 0..L-1 positions instead (a control)."""
    R = batch["responses"].shape[1]
    out = torch.zeros(batch["responses"].shape)
    for i in range(len(pixels)):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep][None]
        kwargs = dict(pixels[i]) if with_pixels else {}
        if text_positions:
            kwargs["position_ids"] = torch.arange(ids.shape[1])[None]
        elif pixels[i]:
            kwargs["mm_token_type_ids"] = (ids == image_token_id).int()
        with torch.no_grad():
            logits = vision.ban_tokens(model(input_ids=ids, **kwargs).logits[0].float(), banned)  # (L, V)
        num = int(keep[-R:].sum())
        lp = torch.log_softmax(logits[-num - 1:-1], dim=-1)
        out[i, :num] = lp.gather(-1, ids[0, -num:, None])[:, 0]
    return out


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_packed_and_padded_vl_forwards_equal_hf_per_sample(arch, vl_assets, processors):
    """models.compute_log_probs on a tiny Qwen2-VL or Qwen2.5-VL (whose tower attends within windows in one block
    and over the whole image in the other) (FSDP2, one rank), padded and packed, in fixed and token-budget
    micro batches (a text-only micro batch among them, which runs the dummy image), equals the HF model run on
    each row alone with its own mrope positions, to 1e-5, with the image pads banned; a row holds two images
    of different sizes. Controls: without pixels, or with plain text positions, the reference is far off; and
    a batch with 1-D or 3-row positions or without pixels is refused."""
    from conftest import one_rank_process_group
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForImageTextToText

    import models

    path, proc = str(vl_assets[arch]), processors[arch]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    banned = vision.pad_token_ids(hf.config)
    batch, pixels = vl_training_batch(proc, hf)
    assert batch["image_grid_thw"][0].tolist() == [[1, 4, 6], [1, 8, 4]] and not pixels[1]
    mask = (torch.arange(batch["responses"].shape[1])[None] < torch.tensor(RESPONSE_LENS)[:, None])
    reference = hf_reference(hf, batch, pixels, banned, proc.image_token_id)
    with one_rank_process_group():
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        actor = models.load_causal_lm(path, mesh, device=torch.device("cpu"), param_dtype=torch.float32,
                                      reduce_dtype=torch.float32).eval()
        assert type(actor).__name__.endswith(type(hf).__name__)
        runs = {"padded": dict(micro_batch_size=3), "padded_one_row": dict(micro_batch_size=1),
                "packed": dict(micro_batch_size=4, use_remove_padding=True),
                "packed_budget": dict(micro_batch_size=1, use_remove_padding=True, max_token_len=80)}
        gaps = {}
        with torch.no_grad():
            for name, options in runs.items():
                ours = models.compute_log_probs(actor, batch, 1.0, **options).log_probs
                gaps[name] = (ours - reference).abs()[mask].max().item()
            refusals = {"positions_1d": {**batch, "position_ids": batch["position_ids"][:, 0]},
                        "positions_3_rows": {**batch, "position_ids": batch["position_ids"][:, 1:]},
                        "no_pixels": {k: v for k, v in batch.items() if k != "pixel_values"}}
            for bad in refusals.values():
                with pytest.raises(ValueError, match="vision-language model"):
                    models.compute_log_probs(actor, bad, 1.0, micro_batch_size=4, use_remove_padding=True)
    assert max(gaps.values()) < 1e-5, gaps
    controls = {"no_pixels": hf_reference(hf, batch, pixels, banned, proc.image_token_id, with_pixels=False),
                "text_positions": hf_reference(hf, batch, pixels, banned, proc.image_token_id, text_positions=True)}
    image_rows = mask.clone()
    image_rows[1] = False
    for name, control in controls.items():
        assert (control - reference).abs()[image_rows].max().item() > 1e-3, name


def _mixed_ranks_worker(rank: int, path: str, init_file: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForImageTextToText

    import models

    sys.path.insert(0, str(CPU_COMPAT))
    import sitecustomize  # noqa: F401  the torchvision stand-in, for the processor (a spawned process)

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        proc = vision.load_processor(path)
        hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        batch, _ = vl_training_batch(proc, hf)
        rows = torch.tensor([0, 2, 3] if rank == 0 else [1])  # rank 1: a micro batch without an image
        batch = {key: value[rows] for key, value in batch.items()}
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
        actor = models.load_causal_lm(path, mesh, device=torch.device("cpu"), param_dtype=torch.float32,
                                      reduce_dtype=torch.float32)
        log_probs = models.compute_log_probs(actor, batch, 1.0, micro_batch_size=4, use_remove_padding=True).log_probs
        log_probs.sum().backward()  # the tower's reduce-scatters run on both ranks
        tower = vision.vision_tower(actor)
        grads = [p.grad.full_tensor().abs().sum().item() for p in tower.parameters()]
        if rank == 0:
            Path(out).write_text(f"{min(grads)} {len(grads)}")
    finally:
        dist.destroy_process_group()


def test_a_rank_without_images_runs_the_tower_on_a_dummy_image(vl_assets, tmp_path):
    """Two FSDP ranks, one whose micro batch has images and one whose has none: the forward and backward
    finish (without the dummy image the text-only rank skips the tower's all-gathers and gloo aborts on the
    mismatched collective), and every tower parameter gets its gradient from the images."""
    from conftest import run_gloo

    out = tmp_path / "grads.txt"
    run_gloo(_mixed_ranks_worker, 2, str(vl_assets["qwen2_vl"]), str(tmp_path / "init"), str(out), timeout_s=120)
    smallest, count = out.read_text().split()
    assert int(count) > 10 and float(smallest) > 0, (smallest, count)


def test_a_frozen_vision_tower_takes_no_gradient_and_no_optimizer_state(vl_assets, processors, tiny_assets):
    """actor.freeze_vision_tower: after an update on image rows the tower's tensors are unchanged, without
    gradients or AdamW state, while the language model's moved; on a text model the key is refused."""
    from conftest import one_rank_process_group
    from torch.distributed.device_mesh import init_device_mesh

    import models

    path, proc = str(vl_assets["qwen2_vl"]), processors["qwen2_vl"]
    optim = {"lr": 1e-2, "betas": [0.9, 0.999], "weight_decay": 0.0, "total_training_steps": -1,
             "lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.0, "warmup_style": None,
             "lr_scheduler_type": "constant", "min_lr_ratio": 0.0}
    with one_rank_process_group():
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        kwargs = dict(device=torch.device("cpu"), param_dtype=torch.float32, reduce_dtype=torch.float32)
        actor = models.load_causal_lm(path, mesh, **kwargs)
        frozen = models.freeze_vision_tower(actor)
        optimizer, _ = models.make_optimizer(actor, optim, total_steps=1)
        tower = list(vision.vision_tower(actor).parameters())
        before = {id(p): p.full_tensor().clone() for p in actor.parameters()}
        batch, _ = vl_training_batch(proc, actor)
        models.compute_log_probs(actor, batch, 1.0, micro_batch_size=4, use_remove_padding=True).log_probs.sum().backward()
        optimizer.step()
        in_tower = {id(p) for p in tower}
        moved = {id(p): not torch.equal(p.full_tensor(), before[id(p)]) for p in actor.parameters()}
        state = {id(p) for p in optimizer.state}
        text = models.load_causal_lm(str(tiny_assets["tiny-qwen2"]), mesh, **kwargs)
        with pytest.raises(ConfigError, match="freeze_vision_tower=true.*not a vision-language model"):
            models.freeze_vision_tower(text)
    assert frozen == len(tower) > 10
    assert all(p.grad is None for p in tower) and not state & in_tower
    assert not any(moved[i] for i in in_tower)
    assert all(moved[i] for i in moved if i not in in_tower) and len(state) == len(moved) - len(in_tower)


VL_RUN = ["algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=2", "data.max_prompt_length=64",
          "data.max_response_length=8", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
          "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.optim.lr=1e-2",
          "actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "trainer.total_training_steps=3",
          "trainer.val_before_train=false", "trainer.test_freq=3", "data.max_val_samples=8", "trainer.save_freq=-1"]


@pytest.mark.slow
def test_grpo_on_image_rows_at_tp2_keeps_the_engine_and_trainer_equal(vl_assets, tmp_path):
    """Two ranks, the engine at TP 2, GRPO on image rows (make_assets.shape_rows) for 3 steps with a dense
    reward (tests/vl_reward.py), so every update moves the vision tower: after each sync the trainer's old
    log-probs equal the engine's on the step's image samples (< 1e-5, float32), and validation runs."""
    import json

    from conftest import torchrun

    import make_assets

    data = make_assets.write_shapes_dataset(tmp_path / "data", num_train=64, num_val=8)
    out = tmp_path / "run"
    torchrun(2, ROOT_TESTS.parent / "train_ppo.py", "--config", "configs/tiny_cpu.yaml", *VL_RUN,
             f"actor_rollout_ref.model.path={vl_assets['qwen2_vl']}", f"data.train_files={data['train']}",
             f"data.val_files={data['val']}", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
             f"custom_reward_function.path={ROOT_TESTS / 'vl_reward.py'}", "custom_reward_function.name=digit_share",
             f"trainer.default_local_dir={out}", timeout=600, env=vl_env())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["rollout/logprob_diff_max"] < 1e-5 for s in steps), [s["rollout/logprob_diff_max"] for s in steps]
    assert all(s["actor/grad_norm"] > 0 for s in steps), [s["actor/grad_norm"] for s in steps]
    assert "val-core/arithmetic/reward/mean@1" in steps[-1] or any(k.startswith("val") for k in steps[-1])
