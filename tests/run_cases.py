"""Several train_ppo runs in one torchrun launch, one after another in each process.

    torchrun --nproc_per_node=2 tests/run_cases.py '[["name", ["--config", "configs/tiny_cpu.yaml", "k=v", ...], false], ...]'

Each case is what `train_ppo.py ARGV` would run (its own trainer.default_local_dir, metrics, checkpoints),
but the cases share one process group and one vLLM engine (train_ppo.build_run(engine_of=...): the
engine must be able to serve the run), so the launch pays the imports and the engine start-up once,
which is most of a short run's time on a CPU. Prints "case NAME done" after each. A case whose third
field is true is expected to stop with an error (raised on every rank at the same point, as
mesh_utils.failing_together makes a reward error): each rank writes it, with its traceback, to
<trainer.default_local_dir>/error.rank<r>.txt and the launch goes on; if it does not raise, the launch
fails.
"""

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rollout  # noqa: E402
import train_ppo  # noqa: E402
from config import check_supported, load_config  # noqa: E402
from mesh_utils import init_distributed  # noqa: E402


def main() -> None:
    previous, env = None, None
    for name, argv, expect_error in json.loads(sys.argv[1]):
        args = train_ppo.parse_args(argv)
        cfg = load_config(args.config, args.overrides)
        check_supported(cfg)
        env = env or init_distributed(timeout_s=cfg.actor_rollout_ref.nccl_timeout)
        run = train_ppo.build_run(cfg, env, engine_of=previous)
        previous = run
        if not expect_error:
            train_ppo.train(run)
            train_ppo.finish(run)
            print(f"case {name} done", flush=True)
            continue
        try:
            train_ppo.train(run)
        except Exception as e:
            run.tracker.close()
            error = f"{type(e).__module__}.{type(e).__qualname__}: {e}\n\n{traceback.format_exc()}"
            (run.out_dir / f"error.rank{env.rank}.txt").write_text(error)
            print(f"case {name} stopped, as expected: {type(e).__name__}", flush=True)
        else:
            raise SystemExit(f"case {name} was expected to stop with an error, and it ran to the end")
    rollout.shutdown(previous.llm)


if __name__ == "__main__":
    main()
