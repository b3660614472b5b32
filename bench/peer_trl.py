"""This project against TRL's GRPOTrainer on the same work, side by side: seconds per step, generated
tokens/s per rank and peak RSS per rank of each, and their ratios.

    python bench/peer_trl.py                        # 1m and 25m Llamas; table + outputs/bench/peer_trl.json
    python bench/peer_trl.py --sizes 1m --reps 1 --steps 4

The work, equal on both sides: the demo task's prompts (one-digit additions, 5 tokens each), 16
prompts x 4 samples per step, GRPO (group-normalised advantages, PPO clip 0.2, token-mean loss,
which is TRL's "dapo"), no reference model and no KL, one epoch of one mini batch per step (exactly
on-policy: TRL then skips the old-log-prob forward; ours skips it only with the trainer's on-policy
shortcut, and runs it without), AdamW at lr 1e-6,
weight decay 0.01, grad clip 1.0, fp32, temperature 1 with no top-k / top-p cut, 2 CPU ranks under
torchrun, a randomly initialised Llama from make_assets.py: "1m" (~1.0 M parameters) with 32-token
responses and "25m" (~24 M) with 128-token responses. Responses stop at EOS on both sides.

  ours  train_ppo.py with a config written to <out>/peer_trl/<size>/config.yaml (the settings a
        user picks for speed: use_remove_padding, data.max_prompt_length = the data's real prompt
        length, one micro batch per rank, fsdp_size=1 for a model that fits one rank, the engine's
        compiled model (rollout.enforce_eager=false); trainer.balance_batch is on, as by default) plus
        command-line overrides; the vLLM CPU engine generates.
  TRL   trl==1.16.0 GRPOTrainer under DDP (torchrun, gloo), HF generate on each rank, gradient
        checkpointing off (TRL's default is on: it would trade speed for memory), no vLLM.

What differs and why is written into the report ("differences"). Runs alternate TRL, ours, TRL,
ours, ... so that a shared machine's drift falls on both sides alike; each run's first step pays
one-time costs and is dropped, the rest are averaged, and the reps are averaged.
  step_s            ours: timing_s/step (sync, generate, score, update); TRL: on_step_begin to
                    on_step_end (generate, score, forward, backward, optimizer step)
  gen_tok_s_rank    generated tokens (EOS included, never padding) per rank per second of step
  gen_phase_tok_s   the same per second of generation alone (vLLM / HF generate)
  peak_rss_gb       each rank's peak resident set (getrusage), mean over ranks, max over reps
Peak RSS covers the whole process: ours holds the vLLM engine and its KV cache
(rollout.cpu_kv_cache_space_gb) beside the FSDP actor; TRL's holds one model, its DDP buckets and
HF generate's cache.

TRL is installed into its own venv (default outputs/bench/trl-venv) on first use, never into the
project's: the venv sees the project's site-packages through a .pth file, so pip reuses its torch,
transformers, accelerate and datasets and installs only TRL (and anything it needs newer, which
then shadows the project's copy inside that venv only); `pip freeze` of the project's venv is
compared before and after and the run stops if it changed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
import venv
from pathlib import Path

import bench_common as bc  # first: it puts the repo root on sys.path
import flops
import torch
import yaml

import make_assets
from tracking import read_metrics

TRL_VERSION = "1.16.0"
RESPONSE_LENGTHS = {"1m": 32, "25m": 128}  # tokens per response, per model size
PROMPTS, N, WORLD = 16, 4, 2  # prompts per step, samples per prompt, ranks
LR, WEIGHT_DECAY, GRAD_CLIP, CLIP_RATIO, SEED = 1e-6, 0.01, 1.0, 0.2, 1
KV_CACHE_GIB = 1  # our engine's KV cache (rollout.cpu_kv_cache_space_gb): the RSS target's allowance
DIFFERENCES = [
    "generation: ours vLLM's CPU engine (continuous batching, paged KV cache, per-request stop at EOS); "
    "TRL HF generate on the whole per-rank batch (a static batch that runs until its longest response ends)",
    "weight sync: ours copies the updated actor into the engine every step; TRL generates with the "
    "training model itself (nothing to sync)",
    "sharding: ours FSDP2 with fsdp_size=1 (HSDP of one-rank shard groups: a full copy per rank, no "
    "all-gathers, gradients all-reduced per block; the model fits one rank, so sharding it only adds "
    "collectives); TRL DDP (a full copy per rank, gradients all-reduced in buckets)",
    "sampled tokens: both sample at temperature 1 from the same initial weights, but with different random "
    "streams, so response lengths (and so generated tokens) differ per step; tokens/s counts each side's own",
    "memory: ours holds a vLLM engine and its KV cache beside the actor",
    "gradient checkpointing: off on both (TRL's GRPOConfig defaults it on); TRL's DDP without "
    "find_unused_parameters (transformers turns it on when checkpointing is off; it costs a graph walk per step)",
    "old log-probs: TRL skips their forward when exactly on-policy; ours runs it (timing_s/old_log_prob) "
    "unless the trainer takes the on-policy shortcut",
    "prompt length: ours pads prompts to data.max_prompt_length (set to the data's real length); TRL pads "
    "to the batch's longest (the same here: every prompt has the same length)",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1m,25m", help=f"comma list of {list(RESPONSE_LENGTHS)}")
    ap.add_argument("--steps", type=int, default=5, help="steps per run; the first is dropped")
    ap.add_argument("--reps", type=int, default=2, help="runs per side and size, alternating TRL and ours")
    ap.add_argument("--venv", type=Path, default=bc.DEFAULT_OUT / "trl-venv", help="TRL's venv (made on first use)")
    ap.add_argument("--assets", type=Path, default=bc.DEFAULT_ASSETS)
    ap.add_argument("--out", type=Path, default=bc.DEFAULT_OUT / "peer_trl.json")
    # the TRL side, run by torchrun with the TRL venv's python
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--train-file", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--response-length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Set-up: TRL's venv, the models, the data's prompt length


def pip_freeze() -> str:
    return subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                          check=True).stdout


def ensure_trl_venv(path: Path) -> Path:
    """TRL's own venv over the project's site-packages (see the module docstring); its python."""
    python = path / "bin" / "python"
    check = [str(python), "-c", f"import trl; assert trl.__version__ == {TRL_VERSION!r}, trl.__version__"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"installing trl=={TRL_VERSION} into {path} (once)", flush=True)
    before = pip_freeze()
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the project's packages, visible (after the venv's own) to the TRL venv's python and pip
    (site / "project_site_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    log = path / "pip-install.log"
    with open(log, "w") as f:
        proc = subprocess.run([str(python), "-m", "pip", "install", f"trl=={TRL_VERSION}"], stdout=f,
                              stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"pip install trl=={TRL_VERSION} into {path} failed (exit {proc.returncode}); "
                         f"its output: {log}\n{log.read_text()[-3000:]}")
    if pip_freeze() != before:
        raise SystemExit(f"installing TRL changed the project's venv ({sys.prefix}): compare `pip freeze`; "
                         f"the TRL venv must hold everything it installs ({path})")
    if subprocess.run(check, capture_output=True).returncode != 0:
        raise SystemExit(f"{python} cannot import trl {TRL_VERSION} after installing it; see {log}")
    return python


def build_model(size: str, assets: Path) -> Path:
    path = assets / f"llama-{size}"  # what `make_assets.py --preset <size> --arch llama` writes
    make_assets.build_model(path, make_assets.model_config("llama", **make_assets.PRESETS[size], tied=False), seed=0)
    return path


def prompt_length(model: Path, train_file: Path) -> int:
    """The longest prompt of the data set, in tokens, as the chat template renders it."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = datasets.load_dataset("parquet", data_files=str(train_file), split="train")
    return max(len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)) for p in rows["prompt"])


# ---------------------------------------------------------------------------------------------
# Ours: train_ppo.py


def our_config(model: Path, data: dict[str, Path], prompt_len: int, response_length: int) -> dict:
    """The run's config, in verl's keys: the equal work plus the settings a user picks for speed."""
    per_rank = PROMPTS * N // WORLD
    return {
        "data": {"train_files": str(data["train"]), "val_files": str(data["val"]), "train_batch_size": PROMPTS,
                 "max_prompt_length": prompt_len, "max_response_length": response_length},
        "actor_rollout_ref": {
            "model": {"path": str(model), "use_remove_padding": True},
            # a full copy per rank (HSDP of one-rank groups): no all-gather per block in forward and
            # backward, a local gather at the weight sync (25m, 2 CPU ranks: the update of 2 samples per
            # rank 1.40 -> 1.13 s, the sync 0.36-0.46 -> 0.11-0.18 s; numbers within 2e-7 relative)
            "actor": {"fsdp_config": {"fsdp_size": 1},
                      "ppo_mini_batch_size": PROMPTS, "ppo_micro_batch_size_per_gpu": per_rank, "ppo_epochs": 1,
                      "clip_ratio": CLIP_RATIO, "loss_agg_mode": "token-mean", "use_kl_loss": False,
                      "entropy_coeff": 0.0, "grad_clip": GRAD_CLIP,
                      "optim": {"lr": LR, "lr_warmup_steps": 0, "weight_decay": WEIGHT_DECAY}},
            # enforce_eager=false: vLLM compiles its model (inductor) at start-up: 25m, 2 CPU ranks: generation
            # 3.68 -> 3.20 s a step with the same samples, for about 25 s more engine start-up (the compiled
            # graph is cached under ~/.cache/vllm for the next start)
            "rollout": {"n": N, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "tensor_model_parallel_size": 1,
                        "log_prob_micro_batch_size_per_gpu": per_rank, "cpu_kv_cache_space_gb": KV_CACHE_GIB,
                        "gpu_memory_utilization": 0.3, "max_num_seqs": 256, "enforce_eager": False},
        },
        "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False},
        "trainer": {"nnodes": 1, "n_gpus_per_node": WORLD, "val_before_train": False, "test_freq": -1,
                    "save_freq": -1, "seed": SEED, "project_name": "peer_trl"},
    }


def run_ours(size: str, model: Path, config: Path, rep: int, args: argparse.Namespace) -> dict:
    run_dir = args.out.parent / "peer_trl" / size / f"ours_{rep}"
    shutil.rmtree(run_dir, ignore_errors=True)
    # train_ppo.py under step_flops.py: the same run, with each phase's FLOPs and a matmul probe per step
    wall = bc.torchrun(bc.ROOT / "bench" / "step_flops.py", WORLD, [
        "--config", config, f"trainer.total_training_steps={args.steps}", f"trainer.default_local_dir={run_dir}",
        f"trainer.experiment_name={size}_{rep}"], args.out.parent / "logs" / f"peer_trl_{size}_ours_{rep}.log")
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "timing_s/step" in r]
    measured = rows[1:] or rows  # the first step pays one-time costs (compilation, allocator warm-up)
    phases = sorted({k for r in measured for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    return {"step_s": [r["timing_s/step"] for r in measured], "gen_s": [r["timing_s/gen"] for r in measured],
            "phases_s": {k[len("timing_s/"):]: sum(r.get(k, 0.0) for r in measured) / len(measured) for k in phases},
            "mean_len": [r["response_length/mean"] for r in measured],
            "peak_rss_gb": max(r["perf/max_memory_gb"] for r in rows), "wall_s": wall,
            "floor_metrics": [{k: v for k, v in r.items() if k.startswith(("flops/", "timing_s/"))} for r in measured]}


# ---------------------------------------------------------------------------------------------
# TRL: GRPOTrainer (this file with --trl-worker, under torchrun, with the TRL venv's python)


def trl_worker(args: argparse.Namespace) -> None:
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from rewards import gsm8k_score

    if trl.__version__ != TRL_VERSION:
        raise SystemExit(f"trl {trl.__version__} imported from {trl.__file__}; the bench compares {TRL_VERSION}")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    gen_s: list[float] = []
    generate = model.generate

    def timed_generate(*a, **kw):  # the generation phase's time, as ours reports timing_s/gen
        start = time.perf_counter()
        out = generate(*a, **kw)
        gen_s.append(time.perf_counter() - start)
        return out

    model.generate = timed_generate

    def reward(completions: list, reward_model: list[dict], **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [gsm8k_score(t, rm["ground_truth"]) for t, rm in zip(texts, reward_model, strict=True)]

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.mean_len: list[float] = []

        def on_step_begin(self, *_: object, **__: object) -> None:
            self.begin = time.perf_counter()

        def on_step_end(self, *_: object, **__: object) -> None:
            self.step_s.append(time.perf_counter() - self.begin)

        def on_log(self, _args: object, _state: object, _control: object, logs: dict | None = None,
                   **__: object) -> None:
            if logs and "completions/mean_length" in logs:
                self.mean_len.append(logs["completions/mean_length"])

    config = trl.GRPOConfig(
        output_dir=str(args.run_dir), max_steps=args.steps, per_device_train_batch_size=PROMPTS * N // WORLD,
        gradient_accumulation_steps=1, num_generations=N, max_completion_length=args.response_length,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, epsilon=CLIP_RATIO, loss_type="dapo",
        scale_rewards="group", learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=WEIGHT_DECAY, max_grad_norm=GRAD_CLIP, bf16=False, use_cpu=True, gradient_checkpointing=False,
        ddp_find_unused_parameters=False,  # every parameter gets a gradient: skip DDP's extra graph walk
        logging_steps=1, report_to="none", save_strategy="no", seed=SEED, disable_tqdm=True)
    clock = StepClock()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=config, processing_class=tokenizer,
                              train_dataset=datasets.load_dataset("parquet", data_files=str(args.train_file),
                                                                  split="train"), callbacks=[clock])
    trainer.train()
    rank = trainer.accelerator.process_index
    bc.write_json(args.run_dir / f"rank{rank}.json", {
        "step_s": clock.step_s, "gen_s": gen_s, "mean_len": clock.mean_len,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,  # KiB on Linux
        "world": trainer.accelerator.num_processes, "distributed_type": str(trainer.accelerator.distributed_type)})
    # The report is written: leave without the interpreter's teardown, where a TRL 1.16 worker sometimes
    # aborts ("terminate called without an active exception") after a finished run.
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_trl(size: str, model: Path, train_file: Path, python: Path, rep: int, args: argparse.Namespace) -> dict:
    run_dir = args.out.parent / "peer_trl" / size / f"trl_{rep}"
    shutil.rmtree(run_dir, ignore_errors=True)
    wall = bc.torchrun(Path(__file__).resolve(), WORLD, [
        "--trl-worker", "--model", model, "--train-file", train_file, "--response-length", RESPONSE_LENGTHS[size],
        "--steps", args.steps, "--run-dir", run_dir], args.out.parent / "logs" / f"peer_trl_{size}_trl_{rep}.log",
        python=python)
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    if ranks[0]["world"] != WORLD:
        raise RuntimeError(f"TRL ran on {ranks[0]['world']} processes, not {WORLD} ({ranks[0]['distributed_type']})")
    # a step ends when the slowest rank's does: the max over ranks, per step
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    gen_s = [max(r["gen_s"][i] for r in ranks) for i in range(len(ranks[0]["gen_s"]))]
    step_s, gen_s = step_s[1:] or step_s, gen_s[1:] or gen_s
    train_s = sum(step_s) / len(step_s) - sum(gen_s) / len(gen_s)  # score, forward, backward, optimizer step
    return {"step_s": step_s, "gen_s": gen_s, "phases_s": {"gen": sum(gen_s) / len(gen_s), "train": train_s},
            "mean_len": ranks[0]["mean_len"][1:] or ranks[0]["mean_len"],
            "peak_rss_gb": sum(r["peak_rss_gb"] for r in ranks) / WORLD, "wall_s": wall}


# ---------------------------------------------------------------------------------------------
# Report


def side_summary(runs: list[dict]) -> dict:
    """Means over every measured step of every rep; peak RSS the largest of the reps."""
    def mean(key: str) -> float:
        values = [v for r in runs for v in r[key]]
        return sum(values) / len(values)

    step_s, gen_s, mean_len = mean("step_s"), mean("gen_s"), mean("mean_len")
    tokens = PROMPTS * N // WORLD * mean_len  # generated per rank per step
    phases = {k: sum(r["phases_s"].get(k, 0.0) for r in runs) / len(runs) for k in runs[0]["phases_s"]}
    return {"step_s": step_s, "step_s_reps": [sum(r["step_s"]) / len(r["step_s"]) for r in runs], "phases_s": phases,
            "gen_s": gen_s, "mean_len": mean_len, "gen_tokens_per_rank": tokens,
            "gen_tok_s_rank": tokens / step_s, "gen_phase_tok_s": tokens / gen_s,
            "peak_rss_gb": max(r["peak_rss_gb"] for r in runs), "wall_s": sum(r["wall_s"] for r in runs),
            # ours: each phase against its floor (flops.floor_table), over every measured step of every rep
            "floor": flops.floor_table([m for r in runs for m in r["floor_metrics"]]) if "floor_metrics" in runs[0]
            else None}


def compare(size: str, params_m: float, ours_runs: list[dict], trl_runs: list[dict]) -> dict:
    """Both sides' summaries and the ratios, overall and per rep (rep i of ours against rep i of TRL,
    run back to back): a spread of per-rep ratios that straddles a target is noise, not a verdict."""
    ours, trl = side_summary(ours_runs), side_summary(trl_runs)
    reps = [(side_summary([o]), side_summary([t])) for o, t in zip(ours_runs, trl_runs, strict=True)]
    return {"size": size, "model": f"llama-{size}", "params_m": params_m, "response_length": RESPONSE_LENGTHS[size],
            "ours": ours, "trl": trl,
            "step_ratio": ours["step_s"] / trl["step_s"],  # < 1: ours is faster
            "step_ratio_reps": [o["step_s"] / t["step_s"] for o, t in reps],
            "gen_tok_s_ratio": ours["gen_tok_s_rank"] / trl["gen_tok_s_rank"],  # > 1: ours is faster
            "gen_tok_s_ratio_reps": [o["gen_tok_s_rank"] / t["gen_tok_s_rank"] for o, t in reps],
            "floor_reps": [o["floor"] for o, _ in reps],  # per rep, for the floor targets' verdicts
            "rss_excess_gb": ours["peak_rss_gb"] - trl["peak_rss_gb"],
            "kv_cache_gb": KV_CACHE_GIB * 2**30 / 1e9}


COLUMNS = [("model", "model", ""), ("side", "side", ""), ("max_len", "max len", "d"), ("mean_len", "mean len", ".0f"),
           ("step_s", "s/step", ".2f"), ("gen_s", "gen s", ".2f"), ("gen_tok_s_rank", "gen tok/s/rank", ".0f"),
           ("gen_phase_tok_s", "gen-phase tok/s/rank", ".0f"), ("peak_rss_gb", "peak RSS GB/rank", ".2f")]
RATIO_COLUMNS = [("model", "model", ""), ("step_ratio", "s/step ours/TRL", ".2f"),
                 ("gen_tok_s_ratio", "gen tok/s ours/TRL", ".2f"), ("rss_excess_gb", "RSS excess GB", ".2f"),
                 ("kv_cache_gb", "KV cache GB", ".2f")]


def tables(report: dict) -> list[tuple[str, list[dict], list]]:
    """(title, rows, columns) of what this benchmark shows, for the console and results.md."""
    s = report["settings"]
    rows = [{"model": r["model"], "side": side, "max_len": r["response_length"], **r[key]}
            for r in report["results"] for side, key in (("ours", "ours"), (f"TRL {TRL_VERSION}", "trl"))]
    title = (f"this project vs TRL GRPOTrainer: {s['prompts']} prompts x {s['n']}, GRPO, no KL, fp32, {s['world']} "
             f"ranks each; mean of steps 2-{s['steps']} over {s['reps']} alternating runs per side")
    floor = [row for r in report["results"] if r["ours"].get("floor")
             for row in flops.floor_rows(f"{r['model']} ours", r["ours"]["floor"])]
    return [(title, rows, COLUMNS), ("ratios (targets: 25m s/step <= 0.5, gen tok/s >= 2; 1m s/step <= 0.8; "
                                     "RSS excess <= KV cache)", report["results"], RATIO_COLUMNS),
            ("ours, each phase against its floor: model FLOPs per rank (bench/flops.py), achieved FLOP/s, and the "
             "ratio to a square matmul on the same threads (targets: 25m update_actor >= 0.7, gen >= 0.4)",
             floor, flops.FLOOR_COLUMNS)]


def run(args: argparse.Namespace) -> dict:
    from bench_step import param_count  # here: the TRL worker imports this file and needs none of it

    sizes = bc.split_list(args.sizes)
    data = bc.ensure_assets(args.assets)
    python = ensure_trl_venv(args.venv)
    results = []
    for size in sizes:
        model = build_model(size, args.assets)
        prompt_len = prompt_length(model, data["train"])
        config = args.out.parent / "peer_trl" / size / "config.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(yaml.safe_dump(our_config(model, data, prompt_len, RESPONSE_LENGTHS[size]), sort_keys=False))
        print(f"{size}: {model}, prompts {prompt_len} tokens, responses {RESPONSE_LENGTHS[size]}; {config}", flush=True)
        ours, trl = [], []
        for rep in range(args.reps):  # TRL, ours, TRL, ours: drift falls on both alike
            trl.append(run_trl(size, model, data["train"], python, rep, args))
            ours.append(run_ours(size, model, config, rep, args))
            print(f"  rep {rep}: TRL {sum(trl[-1]['step_s']) / len(trl[-1]['step_s']):.2f} s/step, "
                  f"ours {sum(ours[-1]['step_s']) / len(ours[-1]['step_s']):.2f} s/step", flush=True)
        results.append(compare(size, param_count(model) / 1e6, ours, trl))
    settings = {"prompts": PROMPTS, "n": N, "world": WORLD, "steps": args.steps, "reps": args.reps, "lr": LR,
                "trl": TRL_VERSION, "trl_venv": str(args.venv), "kv_cache_gib": KV_CACHE_GIB}
    report = {"benchmark": "peer_trl", "machine": bc.machine_info(), "settings": settings,
              "differences": DIFFERENCES, "results": results}
    bc.write_json(args.out, report)
    bc.print_tables(tables(report))
    print(f"-> {args.out}")
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
    else:
        run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
