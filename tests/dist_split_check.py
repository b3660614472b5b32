"""Worker for test_train_ppo_split.py: a split run one step off (1 trainer + 1 rollout rank,
trainer.v1.separate_async.num_warmup_batches=1), whose trainer keeps the weights of every version and checks
which of them sampled each trained batch.

    torchrun --standalone --nproc_per_node=2 tests/dist_split_check.py OUT_JSON key=value ...

The run is train_ppo's own: build_run, then serve_rollouts on the rollout rank and train_step on the trainer.
Before step t the trainer keeps its full weights (version t-1) on the host; train_ppo.receive_rollouts, called
through, records the batch it hands to the step. After the step, a plain (unsharded) copy of the model loads
each kept version and computes the log-probs of that batch's response tokens: those of the version one update
older than the step's (t-2; the first batch: version 0) must equal the engine's (float32), and those of the
step's own version must not (or the check could not tell them apart). Writes the gaps to OUT_JSON.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models  # noqa: E402
import rollout  # noqa: E402
import train_ppo  # noqa: E402
from config import check_supported, load_config  # noqa: E402
from mesh_utils import init_distributed  # noqa: E402


def engine_gap(model: torch.nn.Module, weights: dict[str, torch.Tensor], batch: dict[str, torch.Tensor],
               temperature: float) -> float:
    """max |engine log-prob - the model's under `weights`| over the batch's response tokens."""
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        log_probs = models.compute_log_probs(model, batch, temperature, len(batch["responses"])).log_probs  # (B, R)
    mask = batch["response_mask"].bool()
    return (log_probs - batch["rollout_log_probs"]).abs()[mask].max().item()


def main() -> None:
    out_json, overrides = Path(sys.argv[1]), sys.argv[2:]
    cfg = load_config("configs/tiny_cpu.yaml", overrides)
    check_supported(cfg)
    env = init_distributed()
    run = train_ppo.build_run(cfg, env)
    if not run.pool.is_trainer:
        train_ppo.train(run)  # serve_rollouts
        rollout.shutdown(run.engine.llm)
        return
    seen: dict[int, dict[str, torch.Tensor]] = {}
    receive = train_ppo.receive_rollouts

    def recording(run_: train_ppo.Run, metrics: dict[str, float]):  # the real hand-off, its batch kept
        rows, extras = receive(run_, metrics)
        seen[len(seen) + 1] = {k: v.clone() for k, v in rows.items()}
        return rows, extras

    train_ppo.receive_rollouts = recording
    kept: dict[int, dict[str, torch.Tensor]] = {}
    rows = []
    for step in range(1, run.total_steps + 1):
        kept[step - 1] = {name: t.clone() for name, t in models.iter_full_params(run.actor)}  # version step - 1
        metrics = train_ppo.train_step(run, step)
        rows.append(metrics)
        if step < run.total_steps:  # the pool's call of the same collective (train_ppo.train)
            assert not train_ppo.stop_requested(run, step)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(cfg.actor_rollout_ref.model.path)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    temperature = cfg.actor_rollout_ref.rollout.temperature
    gaps = {step: {"sampler": engine_gap(plain, kept[max(step - 2, 0)], batch, temperature),
                   "current": engine_gap(plain, kept[step - 1], batch, temperature)}
            for step, batch in seen.items()}
    out_json.write_text(json.dumps({"gaps": gaps, "metrics": rows}))
    train_ppo.finish(run)
    rollout.shutdown(run.engine.llm)


if __name__ == "__main__":
    main()
