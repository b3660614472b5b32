"""A vision-language model learns from images with GRPO on 2 ranks (what `make demo-vl` runs).

    python bench/bench_vl.py                      # warm-up, then GRPO; writes outputs/bench/vl/result.json
    python bench/bench_vl.py --steps 20 --tp 2    # shorter, the engine at TP 2

The task (make_assets.shape_rows): a 56x56 grey image with a red, green or blue square, "<image>Colour? 1 red
2 green 3 blue", answered `#### N` and scored by the demo's rule; the text is the same in every row, so a
model must look to answer (a blind one gets 1/3). The tiny Qwen2-VL (make_assets.py --vl) gets a short
supervised warm-up here (the response teacher-forced on the image rows, a few steps: it learns the format
and barely the colours; 60 steps would learn them all), then
GRPO with the real vLLM CPU engine. From the run's metrics.jsonl: the training score's rise by its
least-squares trend over the steps and the trend's standard error from its residuals (tests/noise.py: the
steps are the units), the margin in standard errors, the greedy validation score before and after, the
sync check's largest engine-vs-actor log-prob gap (float32), seconds per step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from bench_common import DEFAULT_ASSETS, DEFAULT_OUT, ROOT, torchrun

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import noise  # noqa: E402

import make_assets  # noqa: E402
from tracking import read_metrics  # noqa: E402

CPU_COMPAT = ROOT / "tests" / "cpu_compat"  # the CPU set-up's torchvision stand-in (steps aside on a real one)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", type=Path, default=DEFAULT_ASSETS)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT / "vl")
    ap.add_argument("--tp", type=int, default=1, help="rollout tensor_model_parallel_size")
    ap.add_argument("--steps", type=int, default=60, help="GRPO steps")
    ap.add_argument("--warmup-steps", type=int, default=30, help="supervised warm-up steps")
    ap.add_argument("overrides", nargs="*", help="more train_ppo overrides, key=value")
    return ap.parse_args(argv)


def use_cpu_compat() -> None:
    """Without torchvision (the CPU set-up), its stand-in for this process and the launched ranks."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_COMPAT), os.environ.get("PYTHONPATH")) if p)
    spec = importlib.util.spec_from_file_location("cpu_compat_sitecustomize", CPU_COMPAT / "sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def warm_up(model_dir: Path, train: Path, out: Path, steps: int, batch: int = 32, lr: float = 3e-3,
            seed: int = 0) -> dict:
    """Teacher-force `#### N<|im_end|>` after each image prompt (HF model, one process, batches of `batch`
    rows of one length: the task's prompts are alike) for `steps` steps; saves the model with the asset's
    tokenizer and processor files into `out`. Returns the first and last losses."""
    import torch
    from transformers import AutoModelForImageTextToText

    import vision
    from data import load_prompts

    torch.manual_seed(seed)
    proc = vision.load_processor(str(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    prompts, _ = load_prompts(str(train), proc.tokenizer, key="train", prompt_key="prompt", max_prompt_length=128,
                              filter_overlong=False, truncation="error", processor=proc)
    end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = torch.tensor([p.token_ids + proc.tokenizer(f"#### {p.ground_truth}", add_special_tokens=False)["input_ids"]
                        + [end] for p in prompts])  # (N, L): one length, or torch.tensor fails
    pixels = [vision.pixel_inputs(p.images, proc.image_processor) for p in prompts]
    positions = torch.stack([vision.rope_positions(model, ids[i], pixels[i]["image_grid_thw"], proc.image_token_id)
                             for i in range(len(prompts))], dim=1)  # (4, N, L)
    start = len(prompts[0].token_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        rows = torch.randint(len(prompts), (batch,), generator=g).tolist()
        logits = model(input_ids=ids[rows], position_ids=positions[:, rows],
                       pixel_values=torch.cat([pixels[i]["pixel_values"] for i in rows]),
                       image_grid_thw=torch.cat([pixels[i]["image_grid_thw"] for i in rows])).logits  # (b, L, V)
        loss = torch.nn.functional.cross_entropy(logits[:, start - 1:-1].flatten(0, 1), ids[rows, start:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in model_dir.iterdir():  # tokenizer, chat template, image processor
        if not f.name.startswith(("model", "config.json", "generation_config")):
            shutil.copy(f, out / f.name)
    return {"first5": sum(losses[:5]) / 5, "last5": sum(losses[-5:]) / 5}


def summary(rows: list[dict], wall_s: float) -> dict:
    steps = [r for r in rows if r["step"] > 0 and "critic/score/mean" in r]
    score = [r["critic/score/mean"] for r in steps]
    rise, se = noise.trend(score)
    val = [r["val/score"] for r in rows if "val/score" in r]
    return {"steps": len(steps), "score_rise": rise, "score_rise_se": se,
            "margin_se": rise / se if se > 0 else float("nan"),
            "score_first5": sum(score[:5]) / 5, "score_last5": sum(score[-5:]) / 5,
            "val_score_before": val[0] if val else None, "val_score_after": val[-1] if len(val) > 1 else None,
            "logprob_diff_max": max(r["rollout/logprob_diff_max"] for r in steps),
            "s_per_step": sum(r["timing_s/step"] for r in steps) / len(steps), "wall_s": wall_s}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    use_cpu_compat()
    base = make_assets.build_vl_assets(args.assets)["qwen2_vl"]
    data = make_assets.write_shapes_dataset(args.assets / "data_shapes")
    model = args.assets / "tiny-qwen2-vl-sft"
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"model": str(model), "steps": args.steps, "tp": args.tp, "overrides": args.overrides}
    if not (model / "config.json").is_file():
        result["warm_up_loss"] = warm_up(base, data["train"], model, args.warmup_steps)
    run_dir = args.out / f"tp{args.tp}"
    shutil.rmtree(run_dir, ignore_errors=True)
    wall = torchrun(ROOT / "train_ppo.py", 2, [
        "--config", ROOT / "configs" / "tiny_cpu.yaml", f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data['train']}", f"data.val_files={data['val']}", "algorithm.adv_estimator=grpo",
        "data.max_prompt_length=64", "data.max_response_length=8", "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.optim.lr=1e-3",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={args.tp}",
        f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.steps}",
        f"trainer.default_local_dir={run_dir}", "trainer.experiment_name=vl", *args.overrides],
        run_dir.with_suffix(".log"), timeout=7200)
    result["run"] = summary(read_metrics(run_dir / "metrics.jsonl"), wall)
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    run = result["run"]
    print(f"training score {run['score_first5']:.3f} -> {run['score_last5']:.3f} (first/last 5 steps); trend "
          f"{run['score_rise']:+.3f} +- {run['score_rise_se']:.3f} = {run['margin_se']:.1f} standard errors; "
          f"val/score {run['val_score_before']} -> {run['val_score_after']}; logprob_diff_max "
          f"{run['logprob_diff_max']:.1e}; {run['s_per_step']:.2f} s/step")
    print(f"written to {args.out / 'result.json'}")


if __name__ == "__main__":
    main()
