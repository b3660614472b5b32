"""Worker for test_train_ppo_split.py: a split run one step off (1 trainer + 1 rollout rank,
trainer.v1.separate_async.num_warmup_batches=1), whose trainer keeps the weights of every version and checks
which of them sampled each trained batch; then the run resumed from its mid-run checkpoint, killed, and resumed
again by torchrun's restart.

    torchrun --standalone --max-restarts=1 --nproc_per_node=2 tests/dist_split_check.py OUT_JSON RESUME_STEP key=value ...

The runs are train_ppo's own: build_run, then train (serve_rollouts on the rollout rank). Before step t the
trainer keeps its full weights (version t-1) on the host; train_ppo.receive_rollouts, called through, records the
batch it hands to the step. After the run, a plain (unsharded) copy of the model loads each kept version and
computes the log-probs of that batch's response tokens: those of the version one update older than the step's
(t-2; the first batch: version 0) must equal the engine's (float32), and those of the step's own version must not
(or the check could not tell them apart). Then a second run (the same engines, new process groups) resumes from
<trainer.default_local_dir>/global_step_RESUME_STEP into <trainer.default_local_dir>-resumed, saving every step:
the batch the pool had generated ahead and its sampler come from the checkpoint. In step RESUME_STEP + 2, once
that step's weights have landed (trainer 0 sends them after its save of the step before), its rollout rank
SIGKILLs itself; torchrun ends the job and starts it again (its second attempt), which resumes that run from
its own last checkpoint (written by the processes killed, with the batch generated ahead) and finishes it. The first run has the watchdog on (its logs/ show each role's phases).
Writes the gaps, and whether the first and the twice-resumed run's final weights are equal, to OUT_JSON; the
test compares the runs' metrics.jsonl.
"""

import json
import os
import signal
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


def full_weights(run: train_ppo.Run) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in models.iter_full_params(run.actor)}


def main() -> None:
    out_json, resume_step, overrides = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    cfg = load_config("configs/tiny_cpu.yaml", overrides)
    check_supported(cfg)
    env = init_distributed()
    out_dir = Path(cfg.trainer.default_local_dir)
    final_path = out_dir.with_name(out_dir.name + "-final.pt")  # the first run's final weights, across the restart
    resumed_cfg = load_config("configs/tiny_cpu.yaml", [
        *overrides, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={out_dir}/global_step_{resume_step}",
        f"trainer.default_local_dir={out_dir}-resumed", "trainer.save_freq=1"])
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":  # the second attempt, after the kill
        again_cfg = load_config("configs/tiny_cpu.yaml", [  # the killed run resumes from its own last checkpoint
            *overrides, "trainer.resume_mode=auto", f"trainer.default_local_dir={out_dir}-resumed", "trainer.save_freq=1"])
        run = train_ppo.build_run(again_cfg, env)
        assert run.start_step == resume_step + 1, run.start_step
        train_ppo.train(run)
        train_ppo.finish(run)
        if run.pool.is_trainer:
            again, final = full_weights(run), torch.load(final_path)
            result = json.loads(out_json.read_text())
            result["final_weights_max_diff"] = max((again[k] - final[k]).abs().max().item() for k in final)
            out_json.write_text(json.dumps(result))
        rollout.shutdown(run.engine.llm)
        return

    run = train_ppo.build_run(cfg, env, watch=True)  # with the watchdog: each role's phases in logs/
    seen: dict[int, dict[str, torch.Tensor]] = {}
    kept: dict[int, dict[str, torch.Tensor]] = {}
    receive, train_step = train_ppo.receive_rollouts, train_ppo.train_step

    def recording(run_: train_ppo.Run, metrics: dict[str, float]):  # the real hand-off, its batch kept
        rows, extras = receive(run_, metrics)
        seen[len(seen) + 1] = {k: v.clone() for k, v in rows.items()}
        return rows, extras

    def keeping(run_: train_ppo.Run, step: int) -> dict[str, float]:  # the real step, the weights before it kept
        kept[step - 1] = full_weights(run_)  # version step - 1
        return train_step(run_, step)

    train_ppo.receive_rollouts, train_ppo.train_step = recording, keeping
    train_ppo.train(run)
    train_ppo.receive_rollouts, train_ppo.train_step = receive, train_step
    run.progress.stop()
    train_ppo.finish(run)
    if run.pool.is_trainer:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(cfg.actor_rollout_ref.model.path)
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        temperature = cfg.actor_rollout_ref.rollout.temperature
        gaps = {step: {"sampler": engine_gap(plain, kept[max(step - 2, 0)], batch, temperature),
                       "current": engine_gap(plain, kept[step - 1], batch, temperature)}
                for step, batch in seen.items()}
        out_json.write_text(json.dumps({"gaps": gaps}))
        torch.save(full_weights(run), final_path)

    resumed = train_ppo.build_run(resumed_cfg, env, run.engine)
    assert resumed.start_step == resume_step, resumed.start_step
    if not resumed.pool.is_trainer:  # killed in its second step, once the weights landed: trainer 0 sent them
        syncs, receive_weights = [], train_ppo.receive_weights  # after it saved the first step

        def dying(run_: train_ppo.Run) -> None:
            receive_weights(run_)
            syncs.append(None)
            if len(syncs) == 2:
                os.kill(os.getpid(), signal.SIGKILL)

        train_ppo.receive_weights = dying
    train_ppo.train(resumed)
    raise SystemExit("the resumed run's rollout rank was to be killed before its run ended")


if __name__ == "__main__":
    main()
