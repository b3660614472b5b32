"""Worker for test_vision.py: a vision-language model's vLLM engine against the HF forward on image prompts,
after syncs that changed the vision tower. One engine start-up serves every check.

    torchrun --standalone --nproc_per_node=N tests/dist_vl_check.py OUT_DIR MODEL_PATH TP

(The torchvision stand-in must be on PYTHONPATH on the CPU set-up: conftest.vl_env.) Each rank writes
OUT_DIR/rank{r}.json. In order:
  1. the first sync replaces the dummy weights; the engine samples from image prompts (images of different
     sizes, one prompt with two), the image/video pads banned; the HF forward with pixels, grids, explicit
     4-row positions and the same ban gives the engine's log-probs ("synced"); controls that must not:
     no pixels ("no_pixels"), 1-D positions ("positions_1d"), no ban ("no_ban", reported only);
  2. the vision tower moves (noise on every tensor), a sync, the same prompts again: parity holds
     ("tower_synced"), and the tower before the move is far off ("tower_stale"); an engine error there is
     recorded ("tower_error", both gaps inf) rather than raised, so a broken sync fails the test, not its launch;
  3. the tower moves again, a sync without the encoder cache reset: the same images again fail ("no_reset").
"""

import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402

import rollout  # noqa: E402
import vision  # noqa: E402
from mesh_utils import ParallelDims, build_meshes, init_distributed  # noqa: E402

# (question, image sizes): a row of two images of different sizes, and sizes below and above the pixel bounds
QUESTIONS = [("<image>What colour is the square?", [(56, 84)]),
             ("Left <image>, right <image>. Same shape?", [(112, 56), (84, 84)]),
             ("<image>Count the dots.", [(30, 200)]),
             ("How many? <image>", [(300, 300)])]
MAX_TOKENS, N_SAMPLES = 10, 2


def image(height: int, width: int, seed: int) -> dict:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return vision.encode_image(Image.fromarray(pixels))


def hf_log_probs(model, processor, batch, images, banned, positions: str = "4-row", pixels: bool = True):
    """(B, R) the HF model's log-probs of the batch's responses, one sample at a time (unpadded)."""
    out = torch.zeros_like(batch.rollout_log_probs)
    image_id = processor.image_token_id
    for i in range(len(batch)):
        keep = batch.attention_mask[i].bool()
        ids = batch.input_ids[i][keep]
        inputs = vision.pixel_inputs(images[i], processor.image_processor)
        pos = vision.rope_positions(model, ids, inputs["image_grid_thw"], image_id)  # (4, L)
        if positions == "1-D":
            pos = pos[0]
        kwargs = dict(inputs) if pixels else {}
        with torch.no_grad():
            logits = model(input_ids=ids[None], position_ids=pos[:, None] if pos.ndim == 2 else pos[None],
                           **kwargs).logits[0].float()  # (L, V)
        logits = vision.ban_tokens(logits, banned)
        num = int(batch.response_mask[i].sum())
        prompt_len = len(ids) - num
        lp = torch.log_softmax(logits[prompt_len - 1:-1], dim=-1)  # predicts tokens prompt_len .. L-1
        out[i, :num] = lp.gather(-1, ids[prompt_len:, None])[:, 0]
    return out


def gap(a, b, mask) -> float:
    return (a - b).abs()[mask.bool()].max().item()


@torch.no_grad()
def move_tower(model, seed: int) -> int:
    g = torch.Generator().manual_seed(seed)
    moved = 0
    for param in model.model.visual.parameters():
        param.add_(0.3 * torch.randn(param.shape, generator=g))
        moved += 1
    return moved


def main() -> None:
    out_dir, model_path, tp = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    env = init_distributed()
    world = env.world_size
    meshes = build_meshes(ParallelDims(world, 1, world, fsdp=world, infer_tp=tp, sp=1), env.device_type)
    processor = vision.load_processor(model_path)
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32).eval()
    banned = vision.pad_token_ids(model.config)
    prompts, rows = [], []
    for q, (text, sizes) in enumerate(QUESTIONS):
        images = [image(h, w, 10 * q + j) for j, (h, w) in enumerate(sizes)]
        messages = vision.image_messages([{"role": "user", "content": text}], len(images), f"question {q}")
        rendered = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = processor.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        counts = [vision.image_tokens(vision.image_size(im), processor.image_processor) for im in images]
        prompts.append(vision.expand_image_pads(ids, counts, processor.image_token_id))
        rows.append(images)
    requests = [vision.engine_prompt(p, im, processor.image_token_id) for p, im in zip(prompts, rows, strict=True)]
    sample_images = [im for im in rows for _ in range(N_SAMPLES)]
    start = time.perf_counter()
    llm = rollout.build_rollout_engine(model_path, meshes.rollout, max_model_len=256, gpu_memory_utilization=0.3,
                                       dtype="float32", enforce_eager=True, images_per_prompt=2)
    result: dict = {"rank": env.rank, "engine_start_s": time.perf_counter() - start, "banned": list(banned),
                    "image_tokens": [p.count(processor.image_token_id) for p in prompts]}
    sampling = rollout.Sampling(n=N_SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS,
                                stop_token_ids=(processor.tokenizer.eos_token_id,),
                                pad_token_id=processor.tokenizer.pad_token_id, seed=3, banned_token_ids=banned)

    def sync() -> None:
        rollout.sync_weights(llm, ((n, p.detach()) for n, p in model.named_parameters()))

    def sample(step: int):
        return rollout.generate(llm, prompts, sampling, step=step, engine_prompts=requests)

    sync()
    batch = sample(0)
    mask = batch.response_mask
    result["tokens"] = int(mask.sum())
    result["sampled_banned"] = int(sum((batch.responses == b)[mask.bool()].sum() for b in banned))
    result["synced"] = gap(batch.rollout_log_probs, hf_log_probs(model, processor, batch, sample_images, banned), mask)
    result["no_pixels"] = gap(batch.rollout_log_probs,
                              hf_log_probs(model, processor, batch, sample_images, banned, pixels=False), mask)
    result["positions_1d"] = gap(batch.rollout_log_probs,
                                 hf_log_probs(model, processor, batch, sample_images, banned, positions="1-D"), mask)
    result["no_ban"] = gap(batch.rollout_log_probs, hf_log_probs(model, processor, batch, sample_images, ()), mask)

    before = copy.deepcopy(model)
    result["tower_tensors_moved"] = move_tower(model, seed=1)
    sync()
    try:
        batch = sample(0)  # the same images: served from the encoder cache unless it was reset
    except Exception as e:  # noqa: BLE001 - a sync that broke the engine is a result the test reads
        result["tower_error"] = f"{type(e).__name__}: {e}"[:300]
        result["tower_synced"] = result["tower_stale"] = float("inf")
        (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result))
        rollout.shutdown(llm)
        return
    mask = batch.response_mask
    result["tower_synced"] = gap(batch.rollout_log_probs,
                                 hf_log_probs(model, processor, batch, sample_images, banned), mask)
    result["tower_stale"] = gap(batch.rollout_log_probs,
                                hf_log_probs(before, processor, batch, sample_images, banned), mask)

    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result))
    move_tower(model, seed=2)
    reset = rollout._reset_encoder_cache
    rollout._reset_encoder_cache = lambda llm: None  # the sync as vLLM leaves it
    try:
        sync()
        sample(0)
        result["no_reset"] = "no error"
    except Exception as e:  # noqa: BLE001 - the engine's error is what is checked
        result["no_reset"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        rollout._reset_encoder_cache = reset
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result))
    print(json.dumps(result), flush=True)
    rollout.shutdown(llm)


if __name__ == "__main__":
    main()
