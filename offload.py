"""Where the actor, the critic, the frozen models and the engine live in each phase of a step, given the
offload flags, and the moves between two phases: the runtime placement policy. Pure and torch-free, so
that the planner (memory_plan.py, before any device is touched) and the trainer (train_ppo.py, which
hands `plan_moves`' list to models.apply_moves at each phase boundary) read the same rules.

One offload mechanism per model, as verl does it:
  actor, critic  plain FSDP2 modules; with fsdp_config.param_offload their shards are moved to the
                 host while the engine generates and back for the forwards and updates; with
                 fsdp_config.optimizer_offload Adam's moments live on the host except in the update.
                 Gradients exist only inside the update (zero_grad(set_to_none=True) frees them).
  reference      never stepped: ref.fsdp_config.param_offload builds it with FSDP2's
                 CPUOffloadPolicy, which streams one block at a time to the device in its forward.
                 The reward model and distillation's teacher are frozen models too, with their own
                 param_offload keys.
  LoRA           (actor_rollout_ref.model.lora_rank > 0) the actor's base weights are frozen: gradients
                 and AdamW state exist for the adapter only, and the reference model is the actor
                 with its adapter disabled, so it holds no memory of its own.
  engine         rollout.free_cache_engine puts vLLM to sleep after generating (KV cache freed;
                 weights discarded, as the next sync overwrites them all, or with LoRA, whose later
                 syncs send the adapted modules only, copied to the host); rollout.sync_weights wakes
                 it again. Without vLLM sleep mode (the CPU) nothing moves, and everything is in host
                 memory anyway. The engine's moves back to the device are not applied by
                 models.apply_moves: rollout.sync_weights wakes the engine itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from config import Config

PHASES = ("sync", "generate", "log_prob", "update")
DEVICE, HOST, FREED, NONE = "device", "host", "freed", "-"
# What the placement plan covers, in table order.
ITEMS = ("actor.params", "actor.grads", "actor.optimizer", "critic.params", "critic.grads", "critic.optimizer",
         "ref.params", "reward_model.params", "teacher.params", "engine.weights", "engine.kv_cache")


# -----------------------------------------------------------------------------
# Placement: where each thing lives in each phase


@dataclass(frozen=True)
class OffloadFlags:
    """The config's offload switches (keys in the comments)."""

    actor_param: bool = False  # actor_rollout_ref.actor.fsdp_config.param_offload
    actor_optimizer: bool = False  # actor_rollout_ref.actor.fsdp_config.optimizer_offload
    critic_param: bool = False  # critic.fsdp_config.param_offload
    critic_optimizer: bool = False  # critic.fsdp_config.optimizer_offload
    ref_param: bool = False  # actor_rollout_ref.ref.fsdp_config.param_offload
    reward_model_param: bool = False  # reward_model.model.fsdp_config.param_offload (true in the config)
    teacher_param: bool = False  # distillation.teacher_models.teacher_model.fsdp_config.param_offload
    free_cache_engine: bool = True  # actor_rollout_ref.rollout.free_cache_engine
    # actor_rollout_ref.model.lora_rank > 0: later syncs send only the adapted modules, so the sleeping engine
    # keeps its weights on the host (vLLM sleep level 1); otherwise they are discarded (level 2), as the next
    # sync overwrites every one (rollout.sleep_level)
    partial_sync: bool = False

    @classmethod
    def from_config(cls, cfg: Config) -> OffloadFlags:
        roles = cfg.actor_rollout_ref
        return cls(actor_param=roles.actor.fsdp_config.param_offload,
                   actor_optimizer=roles.actor.fsdp_config.optimizer_offload,
                   critic_param=cfg.critic.fsdp_config.param_offload,
                   critic_optimizer=cfg.critic.fsdp_config.optimizer_offload,
                   ref_param=roles.ref.fsdp_config.param_offload,
                   reward_model_param=cfg.reward_model.model.fsdp_config.param_offload,
                   teacher_param=cfg.distillation.teacher_models.teacher_model.fsdp_config.param_offload,
                   free_cache_engine=roles.rollout.free_cache_engine, partial_sync=roles.model.lora_rank > 0)


def placement(flags: OffloadFlags, phase: str) -> dict[str, str]:
    """Where each of ITEMS lives during `phase` (device, host, freed, or '-' for does not exist).

    sync      the actor's shards are gathered into the engine, which is awake (weights, then KV cache)
    generate  the engine generates; offloaded actor/critic shards wait on the host
    log_prob  no-grad forwards of actor, reference and critic; a sleeping engine holds no device memory
    update    forward + backward + AdamW step of critic and actor: the only phase with gradients
              and with the optimizer state on the device
    """
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r} is not one of {PHASES}")
    training = phase in ("log_prob", "update")
    engine_asleep = training and flags.free_cache_engine
    return {
        "actor.params": HOST if phase == "generate" and flags.actor_param else DEVICE,
        "actor.grads": DEVICE if phase == "update" else NONE,
        "actor.optimizer": HOST if phase != "update" and flags.actor_optimizer else DEVICE,
        "critic.params": HOST if not training and flags.critic_param else DEVICE,
        "critic.grads": DEVICE if phase == "update" else NONE,
        "critic.optimizer": HOST if phase != "update" and flags.critic_optimizer else DEVICE,
        "ref.params": HOST if flags.ref_param else DEVICE,  # CPUOffloadPolicy: streamed per block
        "reward_model.params": HOST if flags.reward_model_param else DEVICE,  # the same
        "teacher.params": HOST if flags.teacher_param else DEVICE,  # the same
        "engine.weights": (HOST if flags.partial_sync else FREED) if engine_asleep else DEVICE,
        "engine.kv_cache": FREED if engine_asleep else DEVICE,
    }


# As loaded: every model on the device, the engine awake, optimizer state (empty) on the device.
LOADED = "loaded"


def plan_moves(flags: OffloadFlags, src: str, dst: str) -> list[tuple[str, str]]:
    """The moves (item, destination) that take `src`'s placement to `dst`'s, in ITEMS order.
    `src` may be LOADED (right after the models and the engine are built). Gradients never move:
    they are created in the update and freed at its end. The frozen models (reference, reward model,
    teacher) never move: they live where they were built (models.load_frozen_model)."""
    frozen = ("ref.params", "reward_model.params", "teacher.params")
    before = ({item: DEVICE for item in ITEMS} | {item: placement(flags, dst)[item] for item in frozen}
              if src == LOADED else placement(flags, src))
    after = placement(flags, dst)
    return [(item, after[item]) for item in ITEMS
            if before[item] != after[item] and not item.endswith(".grads") and item not in frozen]


def flag_combinations() -> list[tuple[str, OffloadFlags]]:
    """The README table's rows: the actor's flags (the critic's behave the same), with and without
    the reference offloaded and the engine sleeping."""
    return [
        ("no offload, free_cache_engine=false", OffloadFlags(free_cache_engine=False)),
        ("no offload", OffloadFlags()),
        ("param_offload", OffloadFlags(actor_param=True, critic_param=True)),
        ("optimizer_offload", OffloadFlags(actor_optimizer=True, critic_optimizer=True)),
        ("param_offload + optimizer_offload + ref param_offload",
         OffloadFlags(actor_param=True, actor_optimizer=True, critic_param=True, critic_optimizer=True,
                      ref_param=True)),
    ]


def placement_table() -> str:
    """The README's table, rendered from `placement` (tests check the README holds this text)."""
    items = ("actor.params", "actor.grads", "actor.optimizer", "ref.params", "engine.weights", "engine.kv_cache")
    lines = ["| flags | phase | " + " | ".join(items) + " |", "|---|---|" + "---|" * len(items)]
    for label, flags in flag_combinations():
        for phase in PHASES:
            where = placement(flags, phase)
            lines.append(f"| {label} | {phase} | " + " | ".join(where[i] for i in items) + " |")
    return "\n".join(lines)
