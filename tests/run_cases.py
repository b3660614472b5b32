"""Several train_ppo runs in one torchrun launch, one after another in each process.

    torchrun --nproc_per_node=2 tests/run_cases.py '[["name", ["--config", "configs/tiny_cpu.yaml", "k=v", ...], false], ...]'

Each case is what `train_ppo.py ARGV` would run (its own trainer.default_local_dir, metrics, checkpoints),
but the cases share one process group and one vLLM engine (train_ppo.build_run(cfg, env, engine): the
engine must be able to serve the run, check_engine_serves), so the launch pays the imports and the engine start-up once,
which is most of a short run's time on a CPU. A case of another rollout TP size releases the engine
(rollout.release) and builds its own: a second engine costs less than a second launch (a few seconds against a
minute on 4 ranks). Prints "case NAME done" after each. A case whose third field is true is expected to stop
with an error (raised on every rank at the same point, as collectives.failing_together makes a reward error):
each rank writes it, with its traceback, to <trainer.default_local_dir>/error.rank<r>.txt and the launch goes
on; if it does not raise, the launch fails.
"""

import gc
import json
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rollout  # noqa: E402
import train_ppo  # noqa: E402
from config import ConfigError, check_supported, load_config  # noqa: E402
from mesh_utils import init_distributed, validate  # noqa: E402

# an engine built for longer sequences serves shorter ones; every other setting must be equal
AT_MOST = ("max_model_len", "max_num_batched_tokens")
TP = "tensor_model_parallel_size"  # another TP size: a new engine


def same_architecture(path: str, other: str, trust_remote_code: bool) -> bool:
    """Whether two checkpoints' configs describe the same model (only weights may differ)."""
    from transformers import AutoConfig

    def shape(p: str) -> dict[str, Any]:
        config = AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code).to_dict()
        return {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version", "dtype")}

    return shape(path) == shape(other)


def check_engine_serves(built: dict[str, Any], wanted: dict[str, Any]) -> None:
    """An engine built with `built` (train_ppo.engine_settings) can serve a run that wants `wanted`: another
    checkpoint of the same architecture is fine (the first sync replaces every weight)."""

    def serves(key: str, was: Any, now: Any) -> bool:
        if key in AT_MOST:
            return now <= was
        return now == was or (key == "model_path" and same_architecture(now, was, wanted["trust_remote_code"]))

    differ = {k: (built[k], v) for k, v in wanted.items() if not serves(k, built[k], v)}
    if differ:
        raise ConfigError("cannot reuse the earlier run's rollout engine; these settings differ (then, now): "
                          + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in differ.items())
                          + f" (the engine serves a run whose {' and '.join(AT_MOST)} are at most its own)")


def main() -> None:
    previous, env = None, None
    for name, argv, expect_error in json.loads(sys.argv[1]):
        args = train_ppo.parse_args(argv)
        cfg = load_config(args.config, args.overrides)
        check_supported(cfg)
        env = env or init_distributed(timeout_s=cfg.actor_rollout_ref.nccl_timeout)
        engine = None
        if previous is not None:
            dims, _ = validate(cfg, env.world_size)
            wanted = train_ppo.engine_settings(cfg, dims, env.device_type)
            if wanted[TP] != previous.engine.settings[TP]:
                rollout.release(previous.engine.llm)
                previous = run = None
                gc.collect()
            else:
                check_engine_serves(previous.engine.settings, wanted)
                train_ppo.move_to(previous, "generate")  # the engine awake, as a new run (placed LOADED) assumes
                engine = previous.engine
        run = train_ppo.build_run(cfg, env, engine)
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
    rollout.shutdown(previous.engine.llm)


if __name__ == "__main__":
    main()
