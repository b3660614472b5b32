"""torchrun target of the step benchmarks (bench_step.py, peer_trl.py): train_ppo.py as it is, with each
step's FLOPs per phase and a matmul-rate probe added to its metrics.

    torchrun --standalone --nproc_per_node=2 bench/step_flops.py --config configs/tiny_cpu.yaml ...

Every rank runs train_ppo.main() unchanged; at the end of each step (after timing_s/step is taken,
before the metrics are reduced over ranks) every rank counts the FLOPs of its own samples
(bench/flops.py: flops/<phase> for gen, old_log_prob, ref, values, update_critic, update_actor, the
phases that ran) and then, all ranks at once, times a square matmul on the same threads
(flops/matmul_rate: the median FLOP/s; flops/matmul_rate_best) and the model's own decode-step
matmuls at the step's mean decode batch with the engine's kernel (flops/decode_matmul_rate,
flops.decode_matmul_rate with flops.engine_linear: what generation's skinny products reach). The
probes run outside the step's timers. The bench divides each phase's FLOPs by its timing_s/<phase>:
flops.floor_table. With trainer.balance_batch a rank's rows after the deal are not all the ones its
engine generated: its gen count (and decode batch) is then of the rows it trains on, and only the mean
over ranks, which the bench reads, is the generation's. Under Ulysses each rank counts 1/sp of its
group's tokens; generation is counted for single-turn rollouts only (a multi-turn one re-prefills its turns) and for the samples kept (dynamic sampling's
discarded groups are not counted).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flops  # noqa: E402
import torch.distributed as dist  # noqa: E402

import train_ppo  # noqa: E402


def phase_flops(run: train_ppo.Run, batch: train_ppo.Batch) -> dict[str, float]:
    """flops/<phase> of this rank's share of the step's samples."""
    response_len = batch["responses"].shape[1]
    mask = batch["attention_mask"]
    prompt_lens = mask[:, :-response_len].sum(-1).tolist()
    response_lens = mask[:, -response_len:].sum(-1).tolist()
    critic = None if run.critic is None else flops.decoder_shape(run.critic.config, head_width=1)
    phases = flops.step_flops(flops.decoder_shape(run.actor.config), prompt_lens, response_lens,
                              actor_epochs=run.plan.actor_update.epochs,
                              old_log_prob=run.old_log_probs_from == "forward", ref=run.ref is not None,
                              critic=critic, critic_epochs=run.plan.critic_update.epochs if critic else 1,
                              frozen_actor_weights=run.lora_spec is not None)
    if "num_turns" in batch:
        phases.pop("gen")
    return {f"flops/{name}": f.total / run.dims.sp for name, f in phases.items()}


def decode_batch(batch: train_ppo.Batch) -> int:
    """The mean number of sequences in this rank's decode steps: its generated tokens over its longest
    response (the engine decodes them together, each until its own end)."""
    lens = batch["response_mask"].sum(-1)
    return max(1, round(lens.sum().item() / max(lens.max().item(), 1)))


def main(argv: list[str]) -> None:
    step_metrics = train_ppo.step_metrics

    def with_flops(run: train_ppo.Run, batch: train_ppo.Batch, step_seconds: float) -> dict[str, float]:
        metrics = step_metrics(run, batch, step_seconds)
        metrics.update(phase_flops(run, batch))
        dist.barrier()  # every rank probes at once, as every rank computes at once in a phase
        rate = flops.matmul_rate(run.env.device)
        metrics["flops/matmul_rate"], metrics["flops/matmul_rate_best"] = rate["median"], rate["best"]
        metrics["flops/matmul_threads"] = rate["threads"]
        if rate["cpu_share"] is not None:
            metrics["flops/matmul_cpu_share"] = rate["cpu_share"]
        if "flops/gen" in metrics:  # the same threads' rate at the step's mean decode batch
            decode = flops.decode_matmul_rate(flops.decoder_shape(run.actor.config), decode_batch(batch), run.env.device,
                                              linear=flops.engine_linear)
            metrics["flops/decode_matmul_rate"] = decode["rate"]
        return metrics

    train_ppo.step_metrics = with_flops
    sys.argv = ["train_ppo.py", *argv]
    train_ppo.main()


if __name__ == "__main__":
    main(sys.argv[1:])
