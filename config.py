"""Configuration: verl's key names, one YAML file per situation, `a.b.c=value` overrides.

Every key the programs read is declared once in `SCHEMA` below with its type and default, so that

  * a YAML file or an override with a misspelled key is an error that names the key (and the
    closest valid one), never silently ignored;
  * a value of the wrong type (`data.train_batch_size=sixty`) is an error that names the key and
    the expected type;
  * this program's own files have no interpolation and no inheritance: the resolved config is a plain
    nested mapping, printed once at start-up;
  * verl's own files are read as verl reads them (a whole config, or a hydra-style partial file over
    verl's defaults, `${...}` resolved by OmegaConf), and every verl key this program lacks is decided
    by VERL_KEY_RULES: no effect here, or accepted at verl's default only.

The device (CUDA or CPU) is detected at run time, not configured, so one file runs on both.
Keys that verl derives at run time (the normalised per-rank batch sizes) are not config keys here:
`mesh_utils.plan_batches` computes them into a separate dataclass instead of rewriting the config.
"""

from __future__ import annotations

import ast
import difflib
import fnmatch
import functools
import json
import math
import re
import sys
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

# A key's type: a type, or a tuple of types (NoneType where `null` means "derive it").
_NONE = type(None)
_INT_OR_NONE = (int, _NONE)
_STR_OR_NONE = (str, _NONE)
_BOOL_OR_NONE = (bool, _NONE)
_FLOAT_OR_NONE = (float, _NONE)
_FILES = (str, list, _NONE)


def _optim(lr: float) -> dict[str, tuple[Any, Any]]:
    return {
        "lr": (float, lr),
        "lr_warmup_steps": (int, -1),  # <= 0: use lr_warmup_steps_ratio (verl's rule)
        "lr_warmup_steps_ratio": (float, 0.0),
        "lr_scheduler_type": (str, "constant"),  # constant | cosine
        "warmup_style": (_STR_OR_NONE, None),  # verl's older name for lr_scheduler_type; wins when set
        "min_lr_ratio": (float, 0.0),  # cosine floor
        "weight_decay": (float, 0.01),
        "betas": (list, [0.9, 0.999]),
        "total_training_steps": (int, -1),  # the schedule's length; -1: the run's (trainer.total_training_steps)
    }


def _http_scorer(**more: tuple[Any, Any]) -> dict[str, tuple[Any, Any]]:
    """A scorer over HTTP: where, how long an attempt may take, how many requests at once, how many retries,
    and the environment variable whose value is sent as `Authorization: Bearer ...` (null: no header)."""
    return {"url": (_STR_OR_NONE, None), "timeout_s": (float, 60.0), "max_concurrent": (int, 8),
            "max_retries": (int, 3), "api_key_env": (_STR_OR_NONE, None), **more}


def _fsdp_config(fsdp_size: tuple[Any, Any] = (int, -1)) -> dict[str, tuple[Any, Any]]:
    return {
        "fsdp_size": fsdp_size,  # -1: one FSDP group over all ranks; k: HSDP groups of k ranks
        "param_offload": (bool, False),
        "optimizer_offload": (bool, False),
        "reshard_after_forward": (bool, True),
        # This project's own key (verl has none). False: reduce-scatter the gradient after every micro
        # batch, as verl does, so a rank only ever holds its gradient shard. True: keep the full
        # unsharded fp32 gradient between micro batches and reduce-scatter once per mini batch (fewer
        # collectives, 4 bytes x every parameter more memory on every rank; memory_plan counts it).
        "accumulate_unsharded_grads": (bool, False),
    }


# Nested schema: leaves are (type, default). Names and meanings follow verl's ppo_trainer.yaml.
SCHEMA: dict[str, Any] = {
    "data": {
        "tokenizer": (_STR_OR_NONE, None),  # null: the actor model's tokenizer
        "train_files": (_FILES, None),
        "val_files": (_FILES, None),
        "prompt_key": (str, "prompt"),
        "max_prompt_length": (int, 512),
        "max_response_length": (int, 512),
        "train_batch_size": (int, 1024),
        # prompts per generation batch under algorithm.filter_groups (DAPO); null: train_batch_size
        "gen_batch_size": (_INT_OR_NONE, None),
        "val_batch_size": (_INT_OR_NONE, None),  # null: the whole validation set at once
        "filter_overlong_prompts": (bool, False),  # drop prompts over max_prompt_length ...
        "truncation": (str, "error"),  # ... or, when not filtering: error | left | right
        "shuffle": (bool, True),
        "seed": (int, 1),
        "max_val_samples": (_INT_OR_NONE, None),
        # verl: hand the raw chat to the rollout. Accepted, either value: here every Prompt keeps the row's
        # messages, and the prompt ids are always rendered with the chat template
        "return_raw_chat": (bool, True),
    },
    "actor_rollout_ref": {
        "hybrid_engine": (bool, True),
        # seconds a collective may wait for the slowest rank before the job fails (verl's default: 600)
        "nccl_timeout": (int, 1800),
        "model": {
            "path": (str, "assets/tiny-qwen2"),
            "enable_gradient_checkpointing": (bool, False),
            "trust_remote_code": (bool, False),
            # training forwards (actor, reference) on the valid tokens only, packed into one row
            "use_remove_padding": (bool, True),
            # LoRA (lora.py, with peft): 0 = off (full fine-tuning); > 0 = the actor is the frozen model plus
            # an adapter of this rank, and the reference model is the actor with the adapter disabled
            "lora_rank": (int, 0),
            "lora_alpha": (float, 16.0),
            "target_modules": ((str, list), "all-linear"),  # all-linear or a list of module names
            "lora_adapter_path": (_STR_OR_NONE, None),  # start from this peft adapter (its rank/alpha/targets)
        },
        "actor": {
            "strategy": (str, "fsdp2"),
            "router_replay": {"mode": (str, "disabled")},  # MoE: disabled | R2 | R3 (R3 refused: docs/moe.md)
            "freeze_vision_tower": (bool, False),  # a VLM: no gradient nor optimizer state for the vision tower
            "ppo_mini_batch_size": (int, 256),  # in prompts, as in verl; x rollout.n / dp per rank
            "ppo_micro_batch_size_per_gpu": (_INT_OR_NONE, None),  # null: the whole mini batch
            # micro batches cut by token count (at most ppo_max_token_len_per_gpu valid tokens each)
            # instead of ppo_micro_batch_size_per_gpu samples
            "use_dynamic_bsz": (bool, False),
            "ppo_max_token_len_per_gpu": (int, 16384),
            "ppo_epochs": (int, 1),
            "shuffle": (bool, False),
            "grad_clip": (float, 1.0),
            "clip_ratio": (float, 0.2),
            "clip_ratio_low": (_FLOAT_OR_NONE, None),  # null: clip_ratio
            "clip_ratio_high": (_FLOAT_OR_NONE, None),  # null: clip_ratio
            "clip_ratio_c": (float, 3.0),  # dual-clip lower bound for negative advantages (dppo_*: IS truncation)
            "tau_pos": (float, 1.0),  # sapo: the gate's temperature where A > 0 (verl keeps it here, not in policy_loss)
            "tau_neg": (float, 1.05),  # sapo: where A <= 0
            "loss_agg_mode": (str, "token-mean"),
            "entropy_coeff": (float, 0.0),
            # the old-log-prob forward also gives sum_v pi(v)^2 per token (algorithm.adv_estimator=
            # optimal_token_baseline reads it)
            "calculate_sum_pi_squared": (bool, False),
            "use_kl_loss": (bool, False),
            "kl_loss_coef": (float, 0.001),
            "kl_loss_type": (str, "low_var_kl"),
            "policy_loss": {  # the other keys belong to one mode each (its `keys` in ppo_core.POLICY_LOSSES)
                "loss_mode": (str, "vanilla"),  # a name in ppo_core.POLICY_LOSSES
                "clip_cov_ratio": (float, 0.0002),  # clip_cov: fraction of tokens whose gradient is cut
                "clip_cov_lb": (float, 1.0),  # clip_cov: covariance window those tokens are drawn from
                "clip_cov_ub": (float, 5.0),
                "kl_cov_ratio": (float, 0.0002),  # kl_cov: fraction of tokens that get the KL penalty
                "ppo_kl_coef": (float, 0.1),  # kl_cov: that penalty's coefficient
                "dro_beta": (_FLOAT_OR_NONE, None),  # dro: the quadratic log-ratio penalty's weight (> 0, no default)
            },
            "ulysses_sequence_parallel_size": (int, 1),
            "optim": _optim(1e-6),
            "fsdp_config": _fsdp_config(),
        },
        "ref": {
            "log_prob_micro_batch_size_per_gpu": (_INT_OR_NONE, None),  # null: rollout's value
            "log_prob_use_dynamic_bsz": (_BOOL_OR_NONE, None),  # null: actor.use_dynamic_bsz
            "log_prob_max_token_len_per_gpu": (_INT_OR_NONE, None),  # null: actor.ppo_max_token_len_per_gpu
            "ulysses_sequence_parallel_size": (_INT_OR_NONE, None),  # null: the actor's
            "fsdp_config": {"param_offload": (bool, False)},
        },
        "rollout": {
            "name": (str, "vllm"),
            "n": (int, 1),
            "temperature": (float, 1.0),
            "top_k": (int, -1),
            "top_p": (float, 1.0),
            "tensor_model_parallel_size": (int, 2),
            "gpu_memory_utilization": (float, 0.5),
            "enforce_eager": (bool, True),
            "free_cache_engine": (bool, True),
            "max_num_seqs": (int, 1024),
            "max_num_batched_tokens": (int, 8192),
            "log_prob_micro_batch_size_per_gpu": (int, 8),
            "log_prob_use_dynamic_bsz": (_BOOL_OR_NONE, None),  # null: actor.use_dynamic_bsz
            "log_prob_max_token_len_per_gpu": (_INT_OR_NONE, None),  # null: actor.ppo_max_token_len_per_gpu
            "cpu_kv_cache_space_gb": (int, 1),  # VLLM_CPU_KVCACHE_SPACE (whole GiB) on the CPU backend
            # verl: abort the step's remaining requests once (1 - rate) of them completed. Refused above 0 here
            # (check_colocate_async): trainer.v1.trainer_mode=colocate_async cuts the tail and keeps what it cut
            "over_sample_rate": (float, 0.0),
            # verl: the standalone rollout pool (actor_rollout_ref.hybrid_engine=false with trainer.v1.trainer_mode=
            # separate_async): nnodes x n_gpus_per_node ranks of their own, after the trainers' (placement.py);
            # 0 nodes: the engine is collocated with the actor on every rank. n_gpus_per_node null: trainer.n_gpus_per_node
            "nnodes": (int, 0),
            "n_gpus_per_node": (_INT_OR_NONE, None),
            "enable_rollout_routing_replay": (bool, False),  # MoE: the engine returns its routes (refused: docs/moe.md)
            # verl: sync (LLM) | async (AsyncLLM servers). Accepted, either value: the engine here is in-process
            # and a multi-turn rollout runs batched, one generate call per turn
            "mode": (str, "async"),
            "multi_turn": {  # verl 0.9's names and defaults; agent.py has the tools, parsers and environments
                "enable": (bool, False),
                "max_assistant_turns": (_INT_OR_NONE, None),  # null: no limit but the token budget
                "max_user_turns": (_INT_OR_NONE, None),  # tool / user turns appended; null: no limit
                "max_parallel_calls": (int, 1),  # calls executed per assistant turn; the rest are dropped
                "max_tool_response_length": (int, 256),  # in characters of the tool's text, not tokens
                "tool_response_truncate_side": (str, "middle"),  # the side that is cut (verl >= 0.8)
                "tool_config_path": (_STR_OR_NONE, None),  # verl's tool YAML: tools: [{class_name, config, ...}]
                "function_tool_path": (_STR_OR_NONE, None),  # a .py file of typed, docstring'd functions
                "format": (str, "hermes"),  # the tool-call parser: TOOL_CALL_FORMATS
                # project key (no verl equivalent): seconds one tool call may take before it becomes an error
                # observation; far below nccl_timeout, since the TP group waits for the slowest rank's tools
                "tool_timeout_s": (float, 30.0),
                # project key: "module.Class" of an agent.Environment (a game, a simulated user) built with no
                # arguments, one per trajectory; null: the tools above (agent.ToolEnvironment)
                "environment": (_STR_OR_NONE, None),
            },
            "val_kwargs": {
                "n": (int, 1),
                "temperature": (float, 0.0),
                "top_k": (int, -1),
                "top_p": (float, 1.0),
                "do_sample": (bool, False),
            },
        },
    },
    "critic": {
        "model": {
            "path": (_STR_OR_NONE, None),  # null: the actor's model path
            "enable_gradient_checkpointing": (bool, False),
            "use_remove_padding": (bool, True),  # as actor_rollout_ref.model's, for the value forwards
        },
        "optim": _optim(1e-5),
        "ppo_mini_batch_size": (_INT_OR_NONE, None),  # null: the actor's
        "ppo_micro_batch_size_per_gpu": (_INT_OR_NONE, None),
        "forward_micro_batch_size_per_gpu": (_INT_OR_NONE, None),
        "use_dynamic_bsz": (_BOOL_OR_NONE, None),  # null: actor.use_dynamic_bsz
        "ppo_max_token_len_per_gpu": (int, 32768),
        "forward_max_token_len_per_gpu": (_INT_OR_NONE, None),  # null: critic.ppo_max_token_len_per_gpu
        "ppo_epochs": (_INT_OR_NONE, None),  # null: the actor's
        "shuffle": (_BOOL_OR_NONE, None),  # null: the actor's
        "grad_clip": (float, 1.0),
        "cliprange_value": (float, 0.5),
        "loss_agg_mode": (_STR_OR_NONE, None),  # null: the actor's
        "ulysses_sequence_parallel_size": (int, 1),
        "fsdp_config": _fsdp_config(fsdp_size=(_INT_OR_NONE, None)),  # null: the actor's (its FSDP mesh)
    },
    "reward_model": {
        # a learned reward model (reward_model.py): its score at each sample's last real token is the training
        # score, in place of the rule function's (which still scores validation), as verl's reward managers do
        "enable": (bool, False),
        "model": {
            "path": (_STR_OR_NONE, None),  # a sequence-classification checkpoint with one label
            # the tokenizer the rollout's ids are in; null: the actor's (verl's default is the actor's path).
            # Prompt and response are re-rendered as text for the reward model when its tokenizer or chat
            # template differs from this one
            "input_tokenizer": (_STR_OR_NONE, None),
            "trust_remote_code": (bool, False),
            "use_remove_padding": (bool, True),  # its forward on the valid tokens only, packed in one row
            # verl's key; default true here: verl's FSDP2 reward model always streams its shards from the host
            # (CPUOffloadPolicy). false keeps them on the device for the whole run
            "fsdp_config": {"param_offload": (bool, True)},
        },
        "micro_batch_size_per_gpu": (_INT_OR_NONE, None),  # null: rollout.log_prob_micro_batch_size_per_gpu
        # re-rendered inputs are cut (on the right) to this; null: the reward model's max_position_embeddings
        # (verl's null is P + R, which cuts a chat its template spells longer before the score's token)
        "max_length": (_INT_OR_NONE, None),
        "reward_manager": (str, "naive"),  # naive | dapo (the score, an `acc` extra, the overlong buffer)
        "overlong_buffer": {  # DAPO's soft length penalty (reward_manager=dapo)
            "enable": (bool, False),
            "len": (int, 0),  # the last `len` tokens before max_response_length: penalty 0 -> penalty_factor
            "penalty_factor": (float, 1.0),
            "log": (bool, False),  # log reward_extra/overlong_reward and reward_extra/overlong
        },
        # project key (verl has none): seconds a reward function may take on one sample; 0: no limit
        "timeout_s": (float, 300.0),
        "sandbox_fusion": {  # the code data sets' programs (code_reward.py)
            "url": (_STR_OR_NONE, None),  # a SandboxFusion /run_code endpoint; null: the local sandbox
            "max_concurrent": (int, 64),  # programs (requests) at once per rank
            "memory_limit_mb": (int, 1024),  # the memory of each program
            # project keys (verl has none): the attempts after the first (429, 5xx, connection errors), and
            # the environment variable sent as `Authorization: Bearer ...`
            "max_retries": (int, 2),
            "api_key_env": (_STR_OR_NONE, None),
            # project key: the local sandbox's isolation (sandbox.py): full (bubblewrap; refuses to start
            # without it) or basic (the caller's user, weak: only when named)
            "isolation": (str, "full"),
        },
        # project keys (verl has none): scorers over HTTP (reward_remote.py); a url turns one on
        "remote": _http_scorer(),  # POST {"items": [...]} -> {"scores": [...]}
        "judge": _http_scorer(  # an LLM judge behind an OpenAI-compatible chat endpoint (url: .../v1)
            model=(str, "judge"),  # the served model name (vllm serve --served-model-name)
            prompt_template=(_STR_OR_NONE, None),  # a text file with {question} {response} {reference}; null: built-in
            max_tokens=(int, 64),  # the judge's reply length
            response_regex=(_STR_OR_NONE, None),  # vLLM servers: the reply is made to match it; null: free text
            unparsed_score=(_FLOAT_OR_NONE, None),  # the score of a reply without `Score: N`; null: an error
            score_range=(list, [0.0, 10.0]),  # a score outside [low, high] counts as a reply without one
        ),
    },
    "custom_reward_function": {
        "path": (_STR_OR_NONE, None),
        "name": (str, "compute_score"),
    },
    "algorithm": {
        "adv_estimator": (str, "gae"),  # a name in ppo_core.ADV_ESTIMATORS
        "gamma": (float, 1.0),
        "lam": (float, 1.0),
        "norm_adv_by_std_in_grpo": (bool, True),
        # gdpo: the reward function's extras (its returned dict's keys) normalised one by one, and their weights
        # (null: 1 each); verl reads both with config.get (`+algorithm.gdpo_reward_keys=[...]`)
        "gdpo_reward_keys": ((list, _NONE), None),
        "gdpo_reward_weights": ((list, _NONE), None),
        "filter_groups": {  # DAPO's dynamic sampling: train only on groups whose metric differs
            "enable": (bool, False),
            "metric": (str, "reward"),  # reward / seq_reward: the reward (score + overlong penalty); score: the
            # reward function's own; else an extra of the function (acc)
            "max_num_gen_batches": (int, 0),  # <= 0: no limit
        },
        "use_kl_in_reward": (bool, False),
        "kl_penalty": (str, "kl"),
        # rollout correction (rollout_correction.py): the engine's log-probs against the actor's
        "rollout_correction": {
            "rollout_is": (_STR_OR_NONE, None),  # null | token | sequence: truncated IS weights on the policy loss
            "rollout_is_threshold": ((float, str), 2.0),  # upper bound (TIS), or "lower_upper" (zero outside)
            "rollout_is_batch_normalize": (bool, False),  # weights divided by their mean over the step
            "rollout_rs": (_STR_OR_NONE, None),  # rejection: comma list of ROLLOUT_RS_OPTIONS
            "rollout_rs_threshold": ((float, str, _NONE), None),  # one per option, or one for all
            "bypass_mode": (bool, False),  # the engine's log-probs are the old log-probs: no old-log-prob forward
            "loss_type": (str, "ppo_clip"),  # bypass mode's policy loss: ppo_clip | reinforce
        },
        "kl_ctrl": {
            "type": (str, "fixed"),  # fixed | adaptive
            "kl_coef": (float, 0.001),
            "horizon": (int, 10000),
            "target_kl": (float, 0.1),
        },
    },
    "trainer": {
        "project_name": (str, "rl"),
        "experiment_name": (str, "run"),
        "logger": (list, ["console"]),  # console | tensorboard | wandb
        "nnodes": (int, 1),
        "n_gpus_per_node": (int, 1),
        "total_epochs": (int, 1),
        "total_training_steps": (_INT_OR_NONE, None),  # null: epochs x batches per epoch
        "val_before_train": (bool, True),
        "test_freq": (int, -1),
        "save_freq": (int, -1),
        # the actor is not updated while the step (1, 2, ...) is below this: critic_warmup=N gives the
        # critic N - 1 steps alone, as verl's `critic_warmup <= global_steps` (GAE only)
        "critic_warmup": (int, 0),
        # reorder each step's samples over the data-parallel ranks so that each holds about as many tokens
        # (Karmarkar-Karp over attention_mask.sum(-1), as many samples each): the update's all-reduces wait
        # for the rank with the most tokens (train_ppo.balance_batch)
        "balance_batch": (bool, True),
        "resume_mode": (str, "auto"),  # auto | disable | resume_path
        "resume_from_path": (_STR_OR_NONE, None),
        # project key (verl has none): resume although the data, its order, the batch size or the model
        # changed since the checkpoint (run_dir.DANGEROUS); other changes are printed and take effect
        "resume_force": (bool, False),
        "max_actor_ckpt_to_keep": (_INT_OR_NONE, None),
        "max_critic_ckpt_to_keep": (_INT_OR_NONE, None),
        "default_local_dir": (str, "outputs/run"),
        # each training step's samples, advantages and per-token log-prob gaps as <dir>/<step>.jsonl; null: none
        "rollout_data_dir": (_STR_OR_NONE, None),
        # each validation's samples as <dir>/<step>.jsonl; null: <default_local_dir>/val_generations (verl: none)
        "validation_data_dir": (_STR_OR_NONE, None),
        "seed": (int, 1),
        "max_consecutive_skipped_steps": (int, 3),
        # project key: a rank in one phase this long ends the job with a report (watchdog.py); 0: off
        "hang_timeout_s": (float, 600.0),
        # verl 0.9's V1 trainer (its names and defaults; docs/partial_rollout.md). sync: every step waits for
        # its slowest sample. colocate_async: the same ranks still alternate generation and training, but
        # num_warmup_batches extra batches of prompt groups stay in flight, generation stops once a batch's
        # worth of groups is complete, and the unfinished samples are carried to the next step (their tokens
        # and engine log-probs kept, resumed as prompt + tokens so far under the new weights)
        "v1": {
            "trainer_mode": (str, "sync"),  # sync | colocate_async | separate_async (docs/split_placement.md)
            "colocate_async": {
                "num_warmup_batches": (int, 1),  # batches dispatched ahead, beside the step's own
            },
            # the rollout pool on ranks of its own (actor_rollout_ref.hybrid_engine=false, rollout.nnodes > 0)
            "separate_async": {
                # batches the pool generates ahead of the trainers: 0 sequential, 1 one step off (the pool
                # samples step t+1's batch with the weights one update old while the trainers update on step t's)
                "num_warmup_batches": (int, 1),
                # actor updates (mini batches) per weight sync; verl requires data.train_batch_size =
                # parameter_sync_step x actor.ppo_mini_batch_size, and so does this program
                "parameter_sync_step": (int, 4),
            },
            "sampler": {  # read by colocate_async only (verl: a no-op in sync)
                # the most weight versions a group may span from its dispatch to its training step:
                # a group dispatched at step s is trained at a step t with t - s + 1 <= this (1: on policy)
                "max_off_policy_threshold": (int, 8),
                # drop: a group that would pass the threshold is dropped (and a fresh prompt dispatched);
                # wait: generation goes on until the groups at the threshold are complete, and none is dropped
                "max_off_policy_strategy": (str, "drop"),
            },
        },
    },
    # on-policy distillation (verl 0.9's keys and defaults): a frozen teacher's log-probs of the student's own
    # samples give a per-token divergence that the actor's loss adds (ppo_core.distillation_loss)
    "distillation": {
        "enabled": (bool, False),
        # verl's separate teacher pool (its GPUs); here the teacher is sharded on the actor's FSDP mesh, as the
        # reference model is, so the pool must stay empty: nnodes=0
        "n_gpus_per_node": (int, 8),
        "nnodes": (int, 0),
        "distillation_loss": {
            "loss_mode": (str, "k3"),  # ppo_core.DISTILLATION_LOSS_MODES: a KL estimator, or forward_kl_topk
            "topk": (_INT_OR_NONE, 32),  # forward_kl_topk: the teacher's k most likely tokens per position
            # true: the task's policy loss plus distillation_loss_coef x the distillation term; false: that term alone
            "use_task_rewards": (bool, True),
            "distillation_loss_coef": (float, 1.0),
            "loss_max_clamp": (_FLOAT_OR_NONE, None),  # token losses clamped to [-c, c]
            "log_prob_min_clamp": (_FLOAT_OR_NONE, None),  # forward_kl_topk: log-probs clamped below
            # true: minus the token losses are advantages of a clipped surrogate (a per-token reward);
            # false: the token losses are back-propagated as they are
            "use_policy_gradient": (bool, False),
            "policy_loss_mode": (str, "vanilla"),
            "clip_ratio": (float, 0.2),
            "clip_ratio_low": (_FLOAT_OR_NONE, 0.2),  # null: clip_ratio
            "clip_ratio_high": (_FLOAT_OR_NONE, 0.2),  # null: clip_ratio
        },
        "teacher_models": {  # one teacher (verl's single-teacher entry); it must share the actor's tokenizer
            "teacher_model": {
                "model_path": (_STR_OR_NONE, None),
                # project key: the teacher streams its shards from the host in its forward (CPUOffloadPolicy),
                # as actor_rollout_ref.ref.fsdp_config.param_offload does for the reference model
                "fsdp_config": {"param_offload": (bool, False)},
            },
        },
    },
}


# --- the algorithms' names and traits, read from ppo_core.py's text --------------------------------
# ppo_core.py registers each advantage estimator and policy loss with a decorator of literal arguments,
# `@register_adv_estimator("grpo", compares_group=True)`, and writes the KL estimators and the loss
# aggregation modes as literals. They are read here from its source, not imported: the names are
# written once, and the config checks and the planner (`python mesh_utils.py`) never import torch.
# tests/test_config.py checks that this reading equals ppo_core's registries at run time.


@dataclass(frozen=True)
class EstimatorTraits:  # ppo_core.AdvEstimator without its function
    name: str
    needs_critic: bool
    compares_group: bool
    baseline_rollout: str | None


@dataclass(frozen=True)
class PolicyLossTraits:  # ppo_core.PolicyLoss without its function
    name: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class AlgorithmTraits:
    adv_estimators: Mapping[str, EstimatorTraits]  # algorithm.adv_estimator, in registration order
    policy_losses: Mapping[str, PolicyLossTraits]  # actor.policy_loss.loss_mode
    kl_estimators: tuple[str, ...]  # algorithm.kl_penalty, actor.kl_loss_type
    loss_agg_modes: tuple[str, ...]  # actor.loss_agg_mode, critic.loss_agg_mode
    distillation_losses: tuple[str, ...]  # distillation.distillation_loss.loss_mode


_PPO_CORE = Path(__file__).with_name("ppo_core.py")
_REGISTERS = {"register_adv_estimator": EstimatorTraits, "register_policy_loss": PolicyLossTraits}
_CONSTANTS = ("KL_ESTIMATORS", "LOSS_AGG_MODES", "DISTILLATION_LOSS_MODES")


@functools.cache
def algorithm_traits(source: Path = _PPO_CORE) -> AlgorithmTraits:
    """The registrations in ppo_core.py's source: each decorator's literal arguments over the
    register function's keyword defaults, and the keys of the KL_ESTIMATORS, LOSS_AGG_MODES and
    DISTILLATION_LOSS_MODES literals."""
    tree = ast.parse(source.read_text(), filename=str(source))

    def literal(node: ast.expr) -> Any:
        try:
            return ast.literal_eval(node)
        except ValueError:
            raise RuntimeError(f"{source.name}:{node.lineno}: config.algorithm_traits reads only literal "
                               f"arguments here, got {ast.unparse(node)!r}") from None

    defaults: dict[str, dict[str, Any]] = {}  # register function -> its keyword defaults
    registered: dict[str, dict[str, dict[str, Any]]] = {register: {} for register in _REGISTERS}
    constants: dict[str, tuple[str, ...]] = {}
    for node in tree.body:  # module level only, where ppo_core registers
        if isinstance(node, ast.FunctionDef):
            if node.name in _REGISTERS:
                args = node.args
                defaults[node.name] = {a.arg: literal(d) for a, d in zip(args.kwonlyargs, args.kw_defaults,
                                                                          strict=True)}
            for decorator in node.decorator_list:
                if not (isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) in _REGISTERS):
                    continue
                table = registered[decorator.func.id]
                name = literal(decorator.args[0]) if len(decorator.args) == 1 else None
                if not isinstance(name, str) or name in table:
                    raise RuntimeError(f"{source.name}:{decorator.lineno}: {ast.unparse(decorator)} must name "
                                       f"one new string, with the traits as keywords")
                table[name] = {k.arg: literal(k.value) for k in decorator.keywords}
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if isinstance(target, ast.Name) and target.id in _CONSTANTS:
                value = node.value  # a dict: its keys (the values are functions); a tuple: itself
                constants[target.id] = (tuple(literal(k) for k in value.keys) if isinstance(value, ast.Dict)
                                        else tuple(literal(value)))
    missing = [n for n in (*_REGISTERS, *_CONSTANTS) if n not in {**defaults, **constants}]
    if missing:
        raise RuntimeError(f"{source.name} no longer defines {missing} at module level, as config.algorithm_traits "
                           f"reads them")

    def traits(register: str) -> Mapping[str, Any]:
        kind = _REGISTERS[register]
        return MappingProxyType({name: kind(name=name, **{**defaults[register], **kwargs})
                                 for name, kwargs in registered[register].items()})

    return AlgorithmTraits(traits("register_adv_estimator"), traits("register_policy_loss"),
                           constants["KL_ESTIMATORS"], constants["LOSS_AGG_MODES"], constants["DISTILLATION_LOSS_MODES"])


def policy_loss_key(name: str) -> str:
    """The full config key of a policy loss's own key `name` (its `keys` in ppo_core.POLICY_LOSSES):
    under actor.policy_loss, or under actor where verl keeps it (sapo's tau_pos / tau_neg)."""
    actor = "actor_rollout_ref.actor."
    return actor + name if name in SCHEMA["actor_rollout_ref"]["actor"] else f"{actor}policy_loss.{name}"


def adv_estimator_traits(name: str) -> EstimatorTraits:
    """The traits of algorithm.adv_estimator=`name` (needs_critic, compares_group, baseline_rollout)."""
    estimators = algorithm_traits().adv_estimators
    if name not in estimators:
        raise ConfigError(f"algorithm.adv_estimator={name!r} is not implemented; valid: {', '.join(estimators)}.")
    return estimators[name]


_ALGORITHMS = algorithm_traits()

# algorithm.rollout_correction (verl's rollout_corr_helper): "token_k1" rejects tokens whose ratio
# pi_actor / pi_engine leaves [lower, upper]; k2 / k3 reject when that divergence estimate exceeds
# an upper bound; seq_sum / seq_mean / seq_max aggregate it over each sequence and reject the sequence.
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")

# Keys whose value must be one of a few names; checked at load time, before any model loads.
CHOICES: dict[str, tuple[str, ...]] = {
    # verl's default fsdp (FSDP1) runs as FSDP2 here: the same sharded data parallelism, another implementation
    "actor_rollout_ref.actor.strategy": ("fsdp2", "fsdp"),
    "actor_rollout_ref.actor.router_replay.mode": ("disabled", "R2", "R3"),
    "actor_rollout_ref.rollout.name": ("vllm",),
    "actor_rollout_ref.actor.loss_agg_mode": _ALGORITHMS.loss_agg_modes,
    "actor_rollout_ref.actor.policy_loss.loss_mode": tuple(_ALGORITHMS.policy_losses),
    "critic.loss_agg_mode": _ALGORITHMS.loss_agg_modes,
    "actor_rollout_ref.actor.kl_loss_type": _ALGORITHMS.kl_estimators,
    "algorithm.kl_penalty": _ALGORITHMS.kl_estimators,
    "algorithm.adv_estimator": tuple(_ALGORITHMS.adv_estimators),
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "algorithm.rollout_correction.rollout_is": ROLLOUT_IS_LEVELS,
    "algorithm.rollout_correction.loss_type": ("ppo_clip", "reinforce"),
    "data.truncation": ("error", "left", "right"),
    "actor_rollout_ref.actor.optim.lr_scheduler_type": ("constant", "cosine"),
    "actor_rollout_ref.actor.optim.warmup_style": ("constant", "cosine"),
    "critic.optim.lr_scheduler_type": ("constant", "cosine"),
    "critic.optim.warmup_style": ("constant", "cosine"),
    # one score per sample from a rule or custom function; dapo adds `acc` and the overlong buffer
    "reward_model.reward_manager": ("naive", "dapo"),
    "reward_model.sandbox_fusion.isolation": ("full", "basic"),  # sandbox.ISOLATIONS
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
    "trainer.v1.trainer_mode": ("sync", "colocate_async", "separate_async"),
    "trainer.v1.sampler.max_off_policy_strategy": ("drop", "wait"),
    "distillation.distillation_loss.loss_mode": _ALGORITHMS.distillation_losses,
    "distillation.distillation_loss.policy_loss_mode": ("vanilla",),  # verl's only one
}


class ConfigError(ValueError):
    """A config the user must change; the message names the key and a valid alternative."""


class Config(dict):
    """A nested dict whose keys also read as attributes: `cfg.data.train_batch_size`.

    It remembers which leaf keys the program read (`cfg.a.b` or `cfg.a["b"]`; serialising the whole
    config does not count), so a run can tell which keys it never used (`unread_keys`).
    """

    def __init__(self, prefix: str = "", reads: set[str] | None = None) -> None:
        super().__init__()
        self._prefix, self._reads = prefix, set() if reads is None else reads

    def __getitem__(self, name: str) -> Any:
        value = super().__getitem__(name)
        if not isinstance(value, Config):
            self._reads.add(self._prefix + name)
        return value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # _prefix / _reads before __init__ set them (copy, pickle)
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no key {name!r}") from None

    def at(self, path: str) -> Any:
        """The value of a dotted key below this one, `cfg.at("actor_rollout_ref.actor.optim.lr")`; a read."""
        node: Any = self
        for part in path.split("."):
            node = node[part]
        return node

    def section(self, name: str) -> Config:
        """The sub-config `name`, creating it (used while building)."""
        if not dict.__contains__(self, name):
            dict.__setitem__(self, name, Config(f"{self._prefix}{name}.", self._reads))
        return dict.__getitem__(self, name)


def unread_keys(cfg: Config) -> list[str]:
    """The schema's keys that nothing has read from `cfg` so far."""
    return [key for key in _KEYS if key not in cfg._reads]


def _is_leaf(node: Any) -> bool:
    return isinstance(node, tuple)


def flat_keys(schema: dict[str, Any] = SCHEMA, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """All leaf keys of the schema as {'a.b.c': (type, default)}."""
    out: dict[str, tuple[Any, Any]] = {}
    for name, node in schema.items():
        key = f"{prefix}{name}"
        if _is_leaf(node):
            out[key] = node
        else:
            out.update(flat_keys(node, key + "."))
    return out


_KEYS = flat_keys()
_SECTIONS = {k.rsplit(".", i)[0] for k in _KEYS for i in range(1, k.count(".") + 1)}


def _type_name(types: Any) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join("null" if t is _NONE else t.__name__ for t in types)


def _check_value(key: str, value: Any) -> Any:
    """Return `value` if it has the key's type (ints are accepted where floats are expected)."""
    types, _ = _KEYS[key]
    types = types if isinstance(types, tuple) else (types,)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # ("0.5_2" stays text: Python's float() reads it as 0.52, but it is a "lower_upper" threshold)
    if float in types and isinstance(value, str) and "_" not in value:
        # PyYAML follows YAML 1.1, which reads `3e-6` (no dot) as a string; users mean a float.
        try:
            return float(value)
        except ValueError:
            pass  # not a number: reported as a type error below
    # bool is a subclass of int: `train_batch_size=true` must not pass as 1.
    if isinstance(value, bool) and bool not in types:
        ok = False
    else:
        ok = isinstance(value, types)
    if not ok:
        raise ConfigError(
            f"config key {key!r} expects {_type_name(types)}, got {value!r} ({type(value).__name__})."
        )
    if key in CHOICES and value is not None and value not in CHOICES[key]:
        raise ConfigError(f"config key {key!r} is {value!r}; valid values: {', '.join(CHOICES[key])}.")
    return value


# --- verl's own files and keys ----------------------------------------------------------------------
# A verl user's YAML runs as it is: a whole config (verl's generated one, a verl run's saved config) or a
# partial file with hydra's header (`defaults: [ppo_trainer, _self_]`), composed over verl's defaults and
# its `${...}` interpolations resolved by OmegaConf, as verl does. Every leaf key of verl's generated config
# is of one of three kinds: a key of SCHEMA (implemented), or one of VERL_KEY_RULES' two kinds below.
# configs/verl/ppo_trainer-<version>.json holds verl's keys and defaults (tests/make_verl_keys.py writes it
# from verl's wheel); tests/test_config.py checks that the rules classify every one of them.

VERL_VERSION = "0.9.1"
VERL_DEFAULTS_FILE = Path(__file__).with_name("configs") / "verl" / f"ppo_trainer-{VERL_VERSION}.json"
IMPLEMENTED, NO_EFFECT, NOT_IMPLEMENTED = "implemented", "no effect", "not implemented"
_MISSING = "???"  # OmegaConf's mandatory value: verl makes the user set it (rollout.name)


@dataclass(frozen=True)
class VerlKeyRule:
    """verl keys matching `pattern` (fnmatch over the dotted key; the first rule that matches decides).
    NO_EFFECT: any value changes nothing here. NOT_IMPLEMENTED: accepted at verl's default only (where it
    changes nothing here); any other value is refused, with `why` (what verl does, what to use here)."""
    pattern: str
    kind: str
    why: str


def _rules(kind: str, why: str, *patterns: str) -> tuple[VerlKeyRule, ...]:
    return tuple(VerlKeyRule(p, kind, why) for p in patterns)


_ENGINE = "the engine here is set by rollout.tensor_model_parallel_size, gpu_memory_utilization, enforce_eager, " \
          "max_num_seqs, max_num_batched_tokens"
_FSDP = "FSDP2 here shards each decoder layer, then the root, bf16 compute with fp32 master weights on GPU " \
        "(fp32 on CPU); its keys: fsdp_config.{fsdp_size,param_offload,optimizer_offload,reshard_after_forward}"
VERL_KEY_RULES: tuple[VerlKeyRule, ...] = (
    # -- no effect here, whatever the value --
    *_rules(NO_EFFECT, "the class verl builds the section into; this program reads the keys", "*._target_"),
    *_rules(NO_EFFECT, "Ray's start-up and timeouts; there is no Ray here (torchrun starts every rank)",
            "ray_kwargs.*", "trainer.ray_wait_register_center_timeout"),
    *_rules(NO_EFFECT, "verl's worker processes; here each rank loads data, scores and runs its loop in process",
            "*.num_workers", "data.dataloader_num_workers", "data.filter_overlong_prompts_workers"),
    *_rules(NO_EFFECT, "torch.compile of verl's log-prob / entropy functions: speed only; nothing is compiled here",
            "*.use_torch_compile"),
    *_rules(NO_EFFECT, "vLLM's periodic stats lines; library logs go to <default_local_dir>/logs/rank<r>.log",
            "actor_rollout_ref.rollout.disable_log_stats"),
    *_rules(NO_EFFECT, "copies the checkpoint into /dev/shm before loading it: load time only, the same weights",
            "*.use_shm"),
    *_rules(NO_EFFECT, "how vLLM gets its first weights; here it starts with dummy weights and the first sync sends "
            "the actor's full weights (a LoRA run's later syncs send the adapted layers only, which is what "
            "verl's load_format=safetensors is for)", "actor_rollout_ref.rollout.load_format"),
    *_rules(NO_EFFECT, "LoRA syncs gather the FSDP weights layer by layer (less peak memory); here every sync "
            "already gathers a bounded bucket of tensors at a time (models.iter_full_params, lora.iter_sync_params)",
            "actor_rollout_ref.rollout.layered_summon"),
    *_rules(NO_EFFECT, "a margin before verl's ESI scheduler expires the job; no such scheduler here",
            "trainer.esi_redundant_time"),
    # -- accepted at verl's default only --
    *_rules(NOT_IMPLEMENTED, "Liger's fused kernels (the same maths, less activation memory) are not implemented; "
            "set it false (memory_plan.py shows the memory without them)", "*.use_liger"),
    *_rules(NOT_IMPLEMENTED, "a copy of actor_rollout_ref.rollout.n that verl's workers read; set rollout.n",
            "*.rollout_n"),
    *_rules(NOT_IMPLEMENTED, "verl's profilers are not implemented here", "*.profiler.*", "global_profiler.*",
            "actor_rollout_ref.rollout.prometheus.*"),
    *_rules(NOT_IMPLEMENTED, "rollout tracing is not implemented; trainer.rollout_data_dir writes each step's "
            "samples", "actor_rollout_ref.rollout.trace.*"),
    *_rules(NOT_IMPLEMENTED, "verl's data plane and rollout dumps between Ray workers; here each rank holds its "
            "share of the batch", "transfer_queue.*", "skip.*"),
    *_rules(NOT_IMPLEMENTED, "verl's V1 trainer beyond trainer.v1.trainer_mode (sync | colocate_async | "
            "separate_async), {colocate,separate}_async.num_warmup_batches, separate_async.parameter_sync_step and the "
            "sampler's max_off_policy_* (docs/partial_rollout.md, docs/split_placement.md): the hybrid rollout switch, "
            "custom samplers and refills are not implemented", "trainer.v1.*", "trainer.use_v1"),
    *_rules(NOT_IMPLEMENTED, "the device is detected at run time here (CUDA, else CPU)", "trainer.device"),
    *_rules(NOT_IMPLEMENTED, "not implemented here; every validation's samples go to trainer.validation_data_dir",
            "trainer.val_only", "trainer.log_val_generations"),
    *_rules(NOT_IMPLEMENTED, "HDFS copies and checkpoint callbacks are not implemented; checkpoints are "
            "trainer.default_local_dir's, with the model, optimizer and extra state, always",
            "trainer.default_hdfs_dir", "trainer.del_local_ckpt_after_load", "trainer.checkpoint_callback_class",
            "*.checkpoint.*"),
    *_rules(NOT_IMPLEMENTED, "the seed of verl's mini-batch shuffle; here trainer.seed", "*.data_loader_seed"),
    *_rules(NOT_IMPLEMENTED, "the optimizer here is torch.optim.AdamW, cosine over half a cycle, gradients clipped "
            "at actor.grad_clip / critic.grad_clip", "actor_rollout_ref.actor.optim.*", "critic.optim.*"),
    *_rules(NOT_IMPLEMENTED, "verl 0.9.1's critic engine section; set critic.fsdp_config.{fsdp_size,param_offload,"
            "optimizer_offload,reshard_after_forward} here", "critic.fsdp.*"),
    *_rules(NOT_IMPLEMENTED, "quantization-aware training and quantized rollout are not implemented", "*.qat.*",
            "*.qat", "*.quantization", "*.quantization_config_file"),
    *_rules(NOT_IMPLEMENTED, "multi-token prediction is not implemented", "*.mtp.*", "*.mtp"),
    *_rules(NOT_IMPLEMENTED, "memory-saving kernels are not implemented (memory_plan.py shows the memory "
            "without them); activation checkpointing: model.enable_gradient_checkpointing", "*.tiled_mlp.*",
            "*.use_fused_kernels", "*.fused_kernel_options.*", "*.enable_activation_offload", "*.entropy_checkpointing",
            "*.entropy_from_logits_with_chunking", "*.entropy_from_logits_chunk_size", "*.pad_to_length",
            "*.pad_to_length_bucket"),
    *_rules(NOT_IMPLEMENTED, _FSDP, "*.fsdp_config.*"),
    *_rules(NOT_IMPLEMENTED, "Megatron's LoRA section; LoRA here: model.lora_rank, lora_alpha, target_modules, "
            "lora_adapter_path", "actor_rollout_ref.model.lora.*", "actor_rollout_ref.model.exclude_modules"),
    *_rules(NOT_IMPLEMENTED, "the model is the checkpoint as it is, with its own tokenizer (data.tokenizer) and "
            "chat template", "actor_rollout_ref.model.hf_config_path", "actor_rollout_ref.model.tokenizer_path",
            "actor_rollout_ref.model.custom_chat_template", "actor_rollout_ref.model.external_lib",
            "actor_rollout_ref.model.override_config"),
    *_rules(NOT_IMPLEMENTED, "the critic here takes critic.model.path, enable_gradient_checkpointing and "
            "use_remove_padding; its tokenizer and trust_remote_code are the actor's, and it has no LoRA",
            "critic.model.*"),
    *_rules(NOT_IMPLEMENTED, "verl's older global batch sizes; set the *_per_gpu keys",
            "*.ppo_micro_batch_size", "*.log_prob_micro_batch_size", "critic.forward_micro_batch_size"),
    *_rules(NOT_IMPLEMENTED, "the strategy here is FSDP2 for every model (actor_rollout_ref.actor.strategy)",
            "actor_rollout_ref.ref.strategy", "critic.strategy"),
    *_rules(NOT_IMPLEMENTED, "a copy of actor_rollout_ref.model.use_remove_padding; set that key",
            "actor_rollout_ref.actor.use_remove_padding"),
    *_rules(NOT_IMPLEMENTED, "the critic runs when algorithm.adv_estimator needs one (gae)", "critic.enable"),
    *_rules(NOT_IMPLEMENTED, "the loss is scaled as verl's default; other scales are not implemented",
            "*.loss_scale_factor"),
    *_rules(NOT_IMPLEMENTED, "not implemented here", "actor_rollout_ref.actor.calculate_entropy",
            "actor_rollout_ref.actor.use_prefix_grouper",
            "algorithm.use_pf_ppo", "algorithm.pf_ppo.*",
            "algorithm.filter_groups.max_inflight_gen_batches"),
    *_rules(NOT_IMPLEMENTED, "the rollout's mesh ('dp','infer_tp') is set by rollout.tensor_model_parallel_size, "
            "on the actor's ranks or on a separate pool (rollout.nnodes, docs/split_placement.md); no other parallelism",
            "actor_rollout_ref.rollout.data_parallel_size", "actor_rollout_ref.rollout.expert_parallel_size",
            "actor_rollout_ref.rollout.pipeline_model_parallel_size", "actor_rollout_ref.rollout.disaggregation.*",
            "actor_rollout_ref.rollout.checkpoint_engine.*", "actor_rollout_ref.rollout.router_config_path"),
    *_rules(NOT_IMPLEMENTED, "the engine's lengths here are data.max_prompt_length and data.max_response_length",
            "actor_rollout_ref.rollout.prompt_length", "actor_rollout_ref.rollout.response_length",
            "actor_rollout_ref.rollout.max_model_len"),
    *_rules(NOT_IMPLEMENTED, "the engine's dtype is the actor's compute dtype here (bf16 on GPU, fp32 on CPU)",
            "actor_rollout_ref.rollout.dtype"),
    *_rules(NOT_IMPLEMENTED, f"not implemented; {_ENGINE}",
            "actor_rollout_ref.rollout.cudagraph_capture_sizes", "actor_rollout_ref.rollout.enable_chunked_prefill",
            "actor_rollout_ref.rollout.enable_prefix_caching", "actor_rollout_ref.rollout.engine_kwargs.*",
            "actor_rollout_ref.rollout.scheduling_policy", "actor_rollout_ref.rollout.multi_stage_wake_up",
            "actor_rollout_ref.rollout.full_determinism",
            "actor_rollout_ref.rollout.moe_load_balance_metrics_interval"),
    *_rules(NOT_IMPLEMENTED, "the engine samples training responses with their log-probs (processed, after "
            "temperature), stops at EOS, from token ids, with per-request seeds from trainer.seed; validation: "
            "rollout.val_kwargs", "actor_rollout_ref.rollout.calculate_log_probs", "actor_rollout_ref.rollout.do_sample",
            "actor_rollout_ref.rollout.ignore_eos", "actor_rollout_ref.rollout.logprobs_mode",
            "actor_rollout_ref.rollout.skip_tokenizer_init", "actor_rollout_ref.rollout.seed"),
    *_rules(NOT_IMPLEMENTED, "the turn loop here is agent_loop.py: tools from multi_turn.tool_config_path / "
            "function_tool_path, or multi_turn.environment", "actor_rollout_ref.rollout.agent.*",
            "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
            "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode",
            "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts",
            "data.tool_config_path", "data.function_tool_path"),
    *_rules(NOT_IMPLEMENTED, "rows are read in verl's format (prompt_key, data_source, reward_model.ground_truth, "
            "images) by data.py; other row layouts and processors are not implemented; data.max_val_samples "
            "caps validation", "data.apply_chat_template_kwargs", "data.audio_key", "data.video_key",
            "data.image_key", "data.image_patch_size", "data.mm_processor_kwargs", "data.return_multi_modal_inputs",
            "data.custom_cls.*", "data.return_full_prompt", "data.return_raw_input_ids", "data.reward_fn_key",
            "data.train_max_samples", "data.val_max_samples", "data.validation_shuffle", "data.trust_remote_code"),
    *_rules(NOT_IMPLEMENTED, "the teacher here is one FSDP2 model on the actor's mesh: "
            "distillation.teacher_models.teacher_model.model_path", "distillation.teacher_key",
            "distillation.teacher_models.*"),
    *_rules(NOT_IMPLEMENTED, "verl 0.9.1's reward section; set custom_reward_function.{path,name} here",
            "reward.custom_reward_function.*"),
    *_rules(NOT_IMPLEMENTED, "verl 0.9.1's reward section; set reward_model.reward_manager (naive or dapo) here",
            "reward.reward_manager.*"),
    *_rules(NOT_IMPLEMENTED, "verl 0.9.1's reward section; set reward_model.sandbox_fusion.* here",
            "reward.sandbox_fusion.*", "sandbox_fusion.*"),
    *_rules(NOT_IMPLEMENTED, "a reward model here is an FSDP2 model on the actor's mesh, or the rollout "
            "pool's in a split (separate_async): reward_model.enable, reward_model.model.path",
            "reward.reward_model.*", "reward_model.enable_resource_pool",
            "reward_model.n_gpus_per_node", "reward_model.nnodes", "reward_model.reward_loop_*",
            "reward_model.model.external_lib", "reward_model.rollout.*"),
)


@functools.cache
def verl_key_rule(key: str) -> VerlKeyRule | None:
    """The rule that decides verl key `key` (None: no rule matches; a key of SCHEMA needs none)."""
    return next((rule for rule in VERL_KEY_RULES if fnmatch.fnmatchcase(key, rule.pattern)), None)


@functools.cache
def verl_defaults() -> MappingProxyType:
    """verl's generated config's leaf keys -> their defaults as verl writes them (interpolations kept)."""
    return MappingProxyType(json.loads(VERL_DEFAULTS_FILE.read_text())["defaults"])


def verl_key_table() -> list[tuple[str, str, str]]:
    """(key, kind, why) for every leaf of verl's generated config; kind None where no rule decides."""
    rows = []
    for key in verl_defaults():
        rule = None if key in _KEYS else verl_key_rule(key)
        rows.append((key, IMPLEMENTED, "") if key in _KEYS else (key, rule.kind if rule else None,
                                                                 rule.why if rule else ""))
    return rows


@functools.cache
def _verl_sections() -> frozenset[str]:
    return frozenset(k.rsplit(".", i)[0] for k in verl_defaults() for i in range(1, k.count(".") + 1))


def _nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = root
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return root


def _read_yaml(path: Path) -> Any:
    """A YAML file as OmegaConf reads it (interpolations unresolved); a hydra-style partial file (a
    `defaults` list naming ppo_trainer) is composed over verl's defaults in the list's order, as hydra
    does; its `hydra` section (search paths, output dirs) is dropped."""
    try:
        tree = OmegaConf.load(path)
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not OmegaConf.is_dict(tree):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys, not {type(tree).__name__}.")
    defaults = tree.pop("defaults", None)
    tree.pop("hydra", None)
    if defaults is None:
        return tree
    entries = list(defaults) if OmegaConf.is_list(defaults) else [defaults]
    if "_self_" not in entries:
        entries.append("_self_")  # hydra >= 1.1: the file's own values come last unless the list says otherwise
    unknown = [e for e in entries if e not in ("ppo_trainer", "_self_")]
    if unknown:
        raise ConfigError(f"config file {str(path)!r}: defaults {OmegaConf.to_container(defaults)} names "
                          f"{unknown}; only verl's ppo_trainer (and _self_) can be composed here: the other "
                          f"config groups are verl's engines (megatron, ...) that this program does not have.")
    layers = {"ppo_trainer": OmegaConf.create(_nested(verl_defaults())), "_self_": tree}
    return OmegaConf.merge(*(layers[e] for e in entries))


# Keys of older verl versions that 0.9.1 dropped, and what does their job here.
FORMER_VERL_KEYS: dict[str, str] = {
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": (
        "older verl's simulated user (a YAML of BaseInteraction classes, which subclass verl's own class) is gone "
        "from verl 0.9.1; here a simulated user is an agent.Environment (reset / step / close, see "
        "tests/multi_turn_env.py): set actor_rollout_ref.rollout.multi_turn.environment=module.Class"),
}


def _unknown_key(key: str, where: str) -> ConfigError:
    if key in FORMER_VERL_KEYS:
        return ConfigError(f"config key {key!r} in {where} is not a key of verl {VERL_VERSION} or of this program: "
                           f"{FORMER_VERL_KEYS[key]}.")
    known = [*_KEYS, *sorted(_SECTIONS), *verl_defaults(), *sorted(_verl_sections())]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r} in {where} (neither this program's nor verl {VERL_VERSION}'s)."
                       f"{hint} Valid keys: python config.py --keys")


def _flatten_user(tree: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """Flatten a user's nested mapping to dotted keys, rejecting keys that neither SCHEMA nor verl has."""
    out: dict[str, Any] = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if key in _KEYS or key in verl_defaults():
            out[key] = value
        elif (key in _SECTIONS or key in _verl_sections()) and isinstance(value, dict):
            out.update(_flatten_user(value, where, key + "."))
        elif key in _SECTIONS or key in _verl_sections():
            raise ConfigError(f"config key {key!r} in {where} is a section; give its keys, e.g. {key}.<name>.")
        else:
            raise _unknown_key(key, where)
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ('a.b.c', value), the value parsed as YAML (`8`, `true`, `null`, `[a, b]`)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. data.train_batch_size=60).")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("+")  # verl/hydra users write +key=value for new keys
    if key in _SECTIONS or key in _verl_sections():
        raise ConfigError(f"override {text[:80]!r}: {key!r} is a section; give its keys one by one, e.g. "
                          f"{key}.<name>=<value>.")
    if key not in _KEYS and key not in verl_defaults():
        raise _unknown_key(key, "the command line")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an int of more than 4300 digits
        raise ConfigError(f"override {text[:80]!r}: the value is not valid YAML or too long a number "
                          f"({str(e)[:200]}).") from None
    if isinstance(value, int | float) and not isinstance(value, bool) and "_" in raw:
        value = raw.strip()  # YAML 1.1 reads 0.5_2 as 0.52; it is a "lower_upper" threshold
    return key, value


def _nest(flat: dict[str, Any]) -> Config:
    root = Config()
    for key, value in flat.items():
        node = root
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.section(p)
        dict.__setitem__(node, leaf, value)
    return root


def _allows_none(key: str) -> bool:
    types = _KEYS[key][0]
    return _NONE in (types if isinstance(types, tuple) else (types,))


def _verl_default_here(key: str, context: Any) -> Any:
    """verl's default of `key`, its interpolation (if any) resolved in this config (`context`, an OmegaConf
    tree of every value): rollout.prompt_length's default is data.max_prompt_length's value."""
    default = verl_defaults()[key]
    if not (isinstance(default, str) and "${" in default):
        return default
    try:
        OmegaConf.update(context, key, default, merge=False)
        value = OmegaConf.select(context, key, throw_on_missing=False)
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    except OmegaConfBaseException:
        return default  # refers to a key this config does not give: only the default as written matches


def _check_verl_values(given: dict[str, Any], context: Any, where: str, from_command_line: set[str]) -> dict[str, str]:
    """verl's keys that SCHEMA lacks, as given: each NOT_IMPLEMENTED one at verl's default (resolved in
    `context`, the whole config as given), else a ConfigError naming the key, the value and what to set
    instead. Returns {key: kind}."""
    kinds = {}
    for key, value in given.items():
        rule = verl_key_rule(key)
        if rule is None:
            raise ConfigError(f"verl key {key!r} has no rule in config.VERL_KEY_RULES (a new verl key?): refused "
                              f"rather than ignored.")
        if rule.kind == NOT_IMPLEMENTED:
            default = _verl_default_here(key, context)
            if value != default:
                raise ConfigError(f"{key}={value!r} (in {'the command line' if key in from_command_line else where}) changes what verl does in a way this program does "
                                  f"not implement: {rule.why}. Leave it at verl's default ({default!r}) or remove it.")
        kinds[key] = rule.kind
    return kinds


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- `key=value` overrides, each key and type checked.

    The file may be this program's own, or verl's (whole, or a hydra-style partial file composed over
    verl's defaults); overrides apply before OmegaConf resolves `${...}`, as in verl. verl's keys that
    SCHEMA lacks are checked against VERL_KEY_RULES (`verl_keys_without_effect` lists them)."""
    where = "the command line"
    tree = OmegaConf.create({})
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist (see configs/ for the shipped ones).")
        tree, where = _read_yaml(path), str(path)
    from_command_line = set()
    for text in overrides or []:
        key, value = parse_override(text)
        OmegaConf.update(tree, key, value, merge=False)
        from_command_line.add(key)
    try:
        resolved = OmegaConf.to_container(tree, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: an interpolation does not resolve: {e}") from None
    values = {k: default for k, (_, default) in _KEYS.items()}
    verl_given, unset, given = {}, {}, _flatten_user(resolved, where)
    for key, value in given.items():
        if key not in _KEYS:
            verl_given[key] = value
        elif key in verl_defaults() and verl_defaults()[key] in (_MISSING, None) and value == verl_defaults()[key] \
                and (value == _MISSING or not _allows_none(key)):
            unset[key] = value  # verl's "set it" / "unset" where this program has a default
        else:
            values[key] = _check_value(key, value)
    kinds = _check_verl_values(verl_given, OmegaConf.create(_nested({**values, **given})), where,
                               from_command_line)
    cfg = _nest(values)
    cfg._verl_keys = kinds
    cfg._verl_unset = {key: (value, values[key]) for key, value in unset.items()}
    return cfg


def verl_keys_without_effect(cfg: Config) -> list[str]:
    """The verl keys the config gave that SCHEMA lacks (each accepted by VERL_KEY_RULES: at any value, or
    at verl's default), in the file's order."""
    return list(getattr(cfg, "_verl_keys", {}))


def _collapsed(keys: list[str]) -> list[str]:
    """`keys` with every verl section whose leaves are all among them written once as `section.*`."""
    chosen, out = set(keys), []
    for key in keys:
        parts = key.split(".")
        for depth in range(1, len(parts)):
            section = ".".join(parts[:depth]) + "."
            if all(k in chosen for k in verl_defaults() if k.startswith(section)):
                key = section + "*"
                break
        if key not in out:
            out.append(key)
    return out


def describe_verl_keys(cfg: Config) -> str:
    """The start-up's lines about verl's keys: those given that have no effect here, and verl's unset values
    (`???`, null) that take this program's default. Empty for a config of this program's keys only."""
    lines, keys = [], verl_keys_without_effect(cfg)
    if keys:
        lines.append(f"verl keys with no effect here ({len(keys)}, accepted at these values; why: python config.py "
                     f"--keys): {', '.join(_collapsed(keys))}")
    unset = getattr(cfg, "_verl_unset", {})
    if unset:
        lines.append("verl values left unset, this program's default used: "
                     + ", ".join(f"{k}={v!r} -> {d!r}" for k, (v, d) in unset.items()))
    return "\n".join(lines)


def to_yaml(cfg: dict[str, Any]) -> str:
    """The resolved config as YAML, for the start-up print and the run directory (URLs redacted)."""
    return yaml.safe_dump(shown(cfg), sort_keys=False, default_flow_style=False)


def redact_url(url: str) -> str:
    """The url with its user:password and every query value replaced by ***: what may be printed or
    stored (errors, the start-up config, config.yaml, W&B)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<an unparsable url>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = re.sub(r"=[^&;]*", "=***", parts.query)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def shown(node: Any, key: str = "") -> Any:
    """The config as plain dicts, with every `*url` value's secrets redacted (redact_url): what may be
    printed, written to config.yaml or sent to an experiment tracker."""
    if isinstance(node, dict):
        return {k: shown(v, k) for k, v in node.items()}
    return redact_url(node) if key.endswith("url") and isinstance(node, str) else node


LOGGERS = ("console", "tensorboard", "wandb")


# Numeric keys and the values that can work: key -> (test, rule). A value outside is refused before
# anything loads, naming the key, the value, the rule and the schema's default (a valid value);
# `null`, where a key allows it, means "derive it" and is not tested.
def _at_least(low: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= low), f">= {low}"


def _between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> tuple[
        Callable[[Any], bool], str]:
    def test(v: Any) -> bool:
        return (low < v if low_open else low <= v) and (v < high if high_open else v <= high)

    return test, f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


_POSITIVE = ((lambda v: v > 0), "> 0")
_NON_NEGATIVE, _ONE_OR_MORE, _FRACTION = _at_least(0), _at_least(1), _between(0, 1)
_TOP_K = (_at_least(-1)[0], ">= -1 (-1: no top-k cut)")
_FREQ = (_at_least(-1)[0], ">= -1 (-1 or 0: never; k: every k steps and at the last)")
_ARR, _ROLLOUT = "actor_rollout_ref", "actor_rollout_ref.rollout"
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "data.max_prompt_length": _ONE_OR_MORE,
    "data.max_response_length": _ONE_OR_MORE,
    "data.max_val_samples": _ONE_OR_MORE,
    f"{_ARR}.nccl_timeout": (_POSITIVE[0], "> 0 (seconds a collective may wait for the slowest rank)"),
    f"{_ARR}.model.lora_rank": (_NON_NEGATIVE[0], ">= 0 (0: no LoRA, full fine-tuning)"),
    f"{_ARR}.model.lora_alpha": _POSITIVE,
    f"{_ARR}.actor.ppo_epochs": _ONE_OR_MORE,
    f"{_ARR}.actor.grad_clip": (_POSITIVE[0], "> 0 (the largest gradient norm; 1e9 for no clipping)"),
    # the ratio is clipped to [1 - low, 1 + high]: 1 - low must stay positive
    f"{_ARR}.actor.clip_ratio": _between(0, 1, high_open=True),
    f"{_ARR}.actor.clip_ratio_low": _between(0, 1, high_open=True),
    f"{_ARR}.actor.clip_ratio_high": _NON_NEGATIVE,
    f"{_ARR}.actor.clip_ratio_c": ((lambda v: v > 1), "> 1 (dual-clip caps the loss of A < 0 at -A x clip_ratio_c)"),
    f"{_ARR}.actor.kl_loss_coef": _NON_NEGATIVE,
    f"{_ARR}.actor.policy_loss.clip_cov_ratio": _between(0, 1, low_open=True),
    f"{_ARR}.actor.policy_loss.kl_cov_ratio": _between(0, 1, low_open=True),
    f"{_ARR}.actor.policy_loss.ppo_kl_coef": _NON_NEGATIVE,
    f"{_ARR}.actor.policy_loss.dro_beta": _POSITIVE,
    f"{_ARR}.actor.tau_pos": _POSITIVE,
    f"{_ARR}.actor.tau_neg": _POSITIVE,
    f"{_ROLLOUT}.top_k": _TOP_K,
    f"{_ROLLOUT}.top_p": _between(0, 1, low_open=True),
    f"{_ROLLOUT}.gpu_memory_utilization": _between(0, 1, low_open=True),
    f"{_ROLLOUT}.max_num_seqs": _ONE_OR_MORE,
    f"{_ROLLOUT}.max_num_batched_tokens": _ONE_OR_MORE,
    f"{_ROLLOUT}.cpu_kv_cache_space_gb": _ONE_OR_MORE,
    f"{_ROLLOUT}.val_kwargs.n": _ONE_OR_MORE,
    f"{_ROLLOUT}.val_kwargs.temperature": (_NON_NEGATIVE[0], ">= 0 (0: greedy)"),
    f"{_ROLLOUT}.val_kwargs.top_k": _TOP_K,
    f"{_ROLLOUT}.val_kwargs.top_p": _between(0, 1, low_open=True),
    "critic.ppo_epochs": _ONE_OR_MORE,
    "critic.grad_clip": (_POSITIVE[0], "> 0 (the largest gradient norm; 1e9 for no clipping)"),
    "critic.cliprange_value": _NON_NEGATIVE,
    "reward_model.overlong_buffer.penalty_factor": _NON_NEGATIVE,
    "reward_model.sandbox_fusion.max_concurrent": _ONE_OR_MORE,
    "reward_model.sandbox_fusion.memory_limit_mb": _ONE_OR_MORE,
    "reward_model.sandbox_fusion.max_retries": (_NON_NEGATIVE[0], ">= 0 (the attempts after the first)"),
    **{f"reward_model.{scorer}.{key}": rule for scorer in ("remote", "judge")
       for key, rule in (("timeout_s", (_POSITIVE[0], "> 0 seconds per attempt")), ("max_concurrent", _ONE_OR_MORE),
                         ("max_retries", (_NON_NEGATIVE[0], ">= 0 (the attempts after the first)")))},
    "reward_model.judge.max_tokens": _ONE_OR_MORE,
    "algorithm.gamma": _FRACTION,
    "algorithm.lam": _FRACTION,
    "algorithm.kl_ctrl.kl_coef": _NON_NEGATIVE,
    "algorithm.kl_ctrl.horizon": _POSITIVE,
    "algorithm.kl_ctrl.target_kl": _POSITIVE,
    "trainer.total_epochs": _NON_NEGATIVE,
    "trainer.total_training_steps": (_NON_NEGATIVE[0], ">= 0 (0: no training step, set-up only; null: "
                                     "trainer.total_epochs x the batches of an epoch)"),
    "trainer.test_freq": _FREQ,
    "trainer.save_freq": _FREQ,
    "trainer.critic_warmup": (_NON_NEGATIVE[0], ">= 0 (0: the actor trains from step 1)"),
    "trainer.max_actor_ckpt_to_keep": (_ONE_OR_MORE[0], ">= 1 (null keeps every checkpoint)"),
    "trainer.max_critic_ckpt_to_keep": (_ONE_OR_MORE[0], ">= 1 (null keeps every checkpoint)"),
    "trainer.max_consecutive_skipped_steps": _ONE_OR_MORE,
    "trainer.v1.colocate_async.num_warmup_batches": (_NON_NEGATIVE[0], ">= 0 (0: no batch ahead, the sync run)"),
    "trainer.v1.separate_async.num_warmup_batches": (lambda v: v in (0, 1), "0 (sequential) or 1 (one step off); "
                                                      "more batches ahead are not implemented here"),
    "trainer.v1.separate_async.parameter_sync_step": _ONE_OR_MORE,
    f"{_ROLLOUT}.nnodes": (_NON_NEGATIVE[0], ">= 0 (0: the engine collocated with the actor on every rank)"),
    f"{_ROLLOUT}.n_gpus_per_node": (_ONE_OR_MORE[0], ">= 1 (null: trainer.n_gpus_per_node)"),
    "trainer.v1.sampler.max_off_policy_threshold": (_ONE_OR_MORE[0], ">= 1 weight versions (1: on policy)"),
    f"{_ROLLOUT}.over_sample_rate": _between(0, 1, high_open=True),
    "distillation.distillation_loss.topk": _ONE_OR_MORE,
    "distillation.distillation_loss.distillation_loss_coef": _NON_NEGATIVE,
    "distillation.distillation_loss.loss_max_clamp": _POSITIVE,
    "distillation.distillation_loss.clip_ratio": _between(0, 1, high_open=True),
    "distillation.distillation_loss.clip_ratio_low": _between(0, 1, high_open=True),
    "distillation.distillation_loss.clip_ratio_high": _NON_NEGATIVE,
}
for _optim_section in (f"{_ARR}.actor.optim", "critic.optim"):
    _RANGES.update({
        f"{_optim_section}.lr": _NON_NEGATIVE,
        f"{_optim_section}.weight_decay": _NON_NEGATIVE,
        f"{_optim_section}.lr_warmup_steps_ratio": _FRACTION,
        f"{_optim_section}.min_lr_ratio": _FRACTION,
        f"{_optim_section}.total_training_steps": ((lambda v: v == -1 or v >= 1), "-1 (the run's length) or >= 1"),
    })


def _peek(cfg: dict[str, Any], key: str) -> Any:
    """The value of dotted `key`, looked at without counting as a read (see Config, unread_keys)."""
    node: Any = cfg
    for part in key.split("."):
        node = dict.__getitem__(node, part)
    return node


# Float keys where an infinite value has a meaning (no clipping); every other float must be finite.
_INFINITY_MEANS_OFF = {f"{_ARR}.actor.grad_clip", "critic.grad_clip"}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_ranges(cfg: Config) -> None:
    """Every float key finite (but _INFINITY_MEANS_OFF's), every numeric key of _RANGES within its range,
    optim.betas two numbers in [0, 1), the judge's score_range two numbers low < high."""
    for key in _KEYS:
        value = _peek(cfg, key)
        if isinstance(value, float) and not math.isfinite(value) and key not in _INFINITY_MEANS_OFF:
            raise ConfigError(f"{key}={value!r} must be a finite number; e.g. {key}={_KEYS[key][1]!r} (the default).")
    low_high = _peek(cfg, "reward_model.judge.score_range")
    if not (isinstance(low_high, list) and len(low_high) == 2 and all(map(_is_number, low_high))
            and low_high[0] < low_high[1]):
        raise ConfigError(f"reward_model.judge.score_range={low_high!r} must be two finite numbers low < high, the "
                          f"scores the judge's template asks for; e.g. reward_model.judge.score_range=[0,10].")
    for key, (test, rule) in _RANGES.items():
        value = _peek(cfg, key)
        if value is not None and not test(value):
            default = _KEYS[key][1]
            raise ConfigError(f"{key}={value!r} must be {rule}; e.g. {key}={'null' if default is None else repr(default)} "
                              f"(the default).")
    for section in (f"{_ARR}.actor.optim", "critic.optim"):
        betas = _peek(cfg, f"{section}.betas")
        if len(betas) != 2 or not all(isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1
                                      for b in betas):
            raise ConfigError(f"{section}.betas={betas!r} must be two numbers in [0, 1), Adam's decay rates of "
                              f"its moments; e.g. {section}.betas=[0.9,0.999] (the default).")



def _check_reward_model(cfg: Config) -> None:
    """reward_model.enable=true: a model to load, and nothing set that its score would silently skip."""
    rm, algorithm = cfg.reward_model, cfg.algorithm
    if rm.model.path is None:
        raise ConfigError("reward_model.enable=true needs reward_model.model.path: a sequence-classification "
                          "checkpoint with one label (e.g. a Qwen2ForSequenceClassification directory).")
    for key in ("micro_batch_size_per_gpu", "max_length"):
        if rm[key] is not None and rm[key] < 1:
            raise ConfigError(f"reward_model.{key}={rm[key]} must be >= 1, or null (the default).")
    if rm.overlong_buffer.enable:
        raise ConfigError("reward_model.overlong_buffer.enable=true with reward_model.enable=true: the reward "
                          "model's score is the training score as it is (verl's reward managers return it "
                          "unchanged), so no overlong penalty would be added. Set overlong_buffer.enable=false.")
    if algorithm.filter_groups.enable and algorithm.filter_groups.metric not in (
            "reward", "score", "seq_reward", "seq_final_reward"):
        raise ConfigError(f"algorithm.filter_groups.metric={algorithm.filter_groups.metric!r} with "
                          "reward_model.enable=true: the reward model gives a score and no extras; filter on "
                          "the score (metric=score).")


def check_supported(cfg: Config) -> None:
    """Refuse values that verl accepts but this program does not implement, and values that cannot
    work, each naming its key and what to set instead (so no accepted key is silently ignored)."""
    actor_rollout_ref, critic = cfg.actor_rollout_ref, cfg.critic
    implemented = {"actor_rollout_ref.actor.strategy": actor_rollout_ref.actor.strategy,
                   "actor_rollout_ref.rollout.name": actor_rollout_ref.rollout.name,
                   "reward_model.reward_manager": cfg.reward_model.reward_manager}
    for key, value in implemented.items():  # one implementation each (CHOICES lists it); say so if that changes
        if value not in CHOICES[key]:
            raise ConfigError(f"{key}={value!r} is not implemented; valid: {', '.join(CHOICES[key])}.")
    if cfg.reward_model.enable:
        _check_reward_model(cfg)
    if cfg.data.val_batch_size is not None:
        raise ConfigError(f"data.val_batch_size={cfg.data.val_batch_size}: validation hands the whole held-out "
                          "set to the engine at once (vLLM batches it itself); set data.val_batch_size=null, or "
                          "data.max_val_samples to validate on fewer prompts.")
    if critic.fsdp_config.fsdp_size not in (None, actor_rollout_ref.actor.fsdp_config.fsdp_size):
        raise ConfigError(
            f"critic.fsdp_config.fsdp_size={critic.fsdp_config.fsdp_size} differs from the actor's "
            f"actor_rollout_ref.actor.fsdp_config.fsdp_size={actor_rollout_ref.actor.fsdp_config.fsdp_size}: the critic is "
            f"sharded on the actor's FSDP mesh. Set them equal, or critic.fsdp_config.fsdp_size=null.")
    keep_actor, keep_critic = cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep
    if keep_critic is not None and keep_critic != keep_actor:
        raise ConfigError(
            f"trainer.max_critic_ckpt_to_keep={keep_critic} differs from trainer.max_actor_ckpt_to_keep="
            f"{keep_actor}: actor and critic are saved together, one directory per step. Set them equal "
            f"or leave max_critic_ckpt_to_keep null.")
    train_files = cfg.data.train_files
    if train_files is None or train_files == [] or train_files == "":
        raise ConfigError(f"data.train_files={'null' if train_files is None else repr(train_files)}: no training data. Give parquet/jsonl files in verl's "
                          f"row format, e.g. data.train_files=~/data/gsm8k/train.parquet (which `python "
                          f"prepare_data.py gsm8k --out ~/data/gsm8k` writes).")
    check_ranges(cfg)
    if actor_rollout_ref.rollout.temperature <= 0:
        raise ConfigError(
            f"actor_rollout_ref.rollout.temperature={actor_rollout_ref.rollout.temperature}: training samples must come from "
            f"the policy, and the log-probs divide the logits by it; use a value > 0 (1.0 samples the policy "
            f"as it is). Greedy decoding is for validation: rollout.val_kwargs.do_sample=false.")
    check_router_replay(cfg)
    check_rollout_correction(cfg)
    check_algorithm(cfg)
    check_multi_turn(cfg)
    check_timeouts(cfg)
    check_reward_source(cfg)
    check_distillation(cfg)
    check_colocate_async(cfg)
    unknown = [name for name in cfg.trainer.logger if name not in LOGGERS]
    if unknown:
        raise ConfigError(f"trainer.logger has unknown entries {unknown}; valid: {', '.join(LOGGERS)}.")


# --- algorithm.rollout_correction: threshold specs (verl's formats), checked before any model loads ---

_RC = "algorithm.rollout_correction"


def _bounds(text: str, what: str, example: str, reciprocal_lower: bool = False) -> tuple[float | None, float]:
    """"lower_upper" or one number (the upper bound; lower 1/upper with reciprocal_lower, else None) ->
    (lower, upper), both positive with lower <= upper. `what` and `example` go into the errors."""
    try:
        if "_" in text:
            lower_text, upper_text = text.split("_", 1)
            lower, upper = float(lower_text), float(upper_text)
        else:
            upper = float(text)
            lower = 1.0 / upper if reciprocal_lower and upper > 0 else None
    except ValueError:
        raise ConfigError(f"{what} is not a number or 'lower_upper' ({example}).") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ConfigError(f"{what}: bounds must be positive with lower <= upper ({example}).")
    return lower, upper


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """rollout_is_threshold -> (upper, lower): a number is TIS's upper bound (weights clamped to it,
    lower None); "lower_upper" is IcePop (weights outside [lower, upper] set to 0)."""
    lower, upper = _bounds(str(spec).strip(), f"{_RC}.rollout_is_threshold={spec!r}", "e.g. 2.0, or '0.5_5.0'")
    return upper, lower


def parse_rs_thresholds(options: str, spec: float | str | None) -> dict[str, tuple[float | None, float]]:
    """rollout_rs (a comma list, duplicates dropped) and rollout_rs_threshold (one per option, or one
    shared) -> {option: (lower, upper)}. k1 options bound the ratio: "lower_upper", or one number as the
    upper bound with lower = 1/upper; k2 / k3 options take an upper bound only (lower None)."""
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    unknown = [o for o in names if o not in ROLLOUT_RS_OPTIONS]
    if not names or unknown:
        raise ConfigError(f"{_RC}.rollout_rs={options!r}: unknown option(s) {unknown}; valid: "
                          f"{', '.join(ROLLOUT_RS_OPTIONS)} (comma-separated to combine).")
    if spec is None:
        raise ConfigError(f"{_RC}.rollout_rs={options!r} needs {_RC}.rollout_rs_threshold (e.g. '0.5_2.0' for "
                          f"*_k1, 0.01 for *_k2 / *_k3).")
    specs = [part.strip() for part in str(spec).split(",") if part.strip()]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ConfigError(f"{_RC}.rollout_rs_threshold={spec!r} gives {len(specs)} thresholds for {len(names)} "
                          f"rollout_rs options {names}: give one for all, or one per option.")
    out: dict[str, tuple[float | None, float]] = {}
    for name, text in zip(names, specs, strict=True):
        if not name.endswith("k1") and "_" in text:
            raise ConfigError(f"{_RC}.rollout_rs_threshold {text!r} for {name}: k2 / k3 options take one "
                              f"upper bound, not 'lower_upper'.")
        example = "e.g. '0.5_2.0' or 2.0" if name.endswith("k1") else "e.g. 0.01"
        out[name] = _bounds(text, f"{_RC}.rollout_rs_threshold {text!r} for {name}", example,
                            reciprocal_lower=name.endswith("k1"))
    return out


def sampling_truncates(rollout: Config) -> bool:
    """Whether the engine samples from a truncated distribution (top_k > 0 or top_p < 1)."""
    return rollout.top_k > 0 or rollout.top_p < 1.0


def check_vision_run(cfg: Config, model_type: str) -> None:
    """What a run on a vision-language model (actor_rollout_ref.model.path) supports: GRPO-style single-turn
    rollouts on the collocated engine, packed or padded, fixed or token-budget micro batches, a frozen or
    trained vision tower, a KL reference. Refused, naming the key: what no test has run on images yet."""
    arr, model = cfg.actor_rollout_ref, f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path!r}"
    sp, v1_mode = arr.actor.ulysses_sequence_parallel_size, cfg.trainer.v1.trainer_mode
    refused = {  # key: (its value, refused?, what to set instead)
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size": (
            sp, sp > 1, "set it to 1 (the image tokens are not split over ranks)"),
        "actor_rollout_ref.model.lora_rank": (
            arr.model.lora_rank, arr.model.lora_rank > 0,
            "set it to 0 (full fine-tuning; actor.freeze_vision_tower=true trains the language model alone)"),
        "algorithm.adv_estimator": (cfg.algorithm.adv_estimator, cfg.algorithm.adv_estimator == "gae",
                                    "use grpo, rloo or another estimator without a critic (a critic takes no images)"),
        "actor_rollout_ref.rollout.multi_turn.enable": (
            arr.rollout.multi_turn.enable, arr.rollout.multi_turn.enable,
            "set it to false (multi-turn rollouts with images, or tools returning images, are not supported)"),
        "trainer.v1.trainer_mode": (v1_mode, v1_mode != "sync", "use sync"),
        "distillation.enabled": (cfg.distillation.enabled, cfg.distillation.enabled, "set it to false"),
        "reward_model.enable": (cfg.reward_model.enable, cfg.reward_model.enable,
                                "score with a rule function or a remote reward instead"),
    }
    for key, (value, on, alternative) in refused.items():
        if on:
            raise ConfigError(f"{key}={value!r} is not supported with a vision-language model ({model}, "
                              f"{model_type}); {alternative}.")


def check_router_replay(cfg: Config) -> None:
    """verl's router replay keys for MoE models (docs/moe.md): R2 (routes recorded in the old-log-prob forward,
    replayed in the update's); R3 and the engine's routes are refused: the CPU engine cannot return them."""
    mode = cfg.actor_rollout_ref.actor.router_replay.mode
    if cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay or mode == "R3":
        key = ("actor_rollout_ref.rollout.enable_rollout_routing_replay=true" if mode != "R3"
               else "actor_rollout_ref.actor.router_replay.mode=R3")
        raise ConfigError(
            f"{key} is not supported: R3 replays the routes the rollout engine chose, and vLLM 0.32 returns routed "
            "experts only from its GPU model runner V2 (never on the CPU engine); this trainer does not read them "
            "from the engine. Use actor_rollout_ref.actor.router_replay.mode=R2 (routes recorded in the "
            "old-log-prob forward, replayed in the update) with enable_rollout_routing_replay=false.")
    if mode != "R2":
        return
    sp = cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size
    if sp > 1:
        raise ConfigError(f"actor_rollout_ref.actor.router_replay.mode=R2 with actor.ulysses_sequence_parallel_size="
                          f"{sp} is not supported: routes are mapped to rows in whole sequences, not Ulysses slices. "
                          "Set ulysses_sequence_parallel_size=1 or router_replay.mode=disabled.")
    if cfg.algorithm.rollout_correction.bypass_mode:
        raise ConfigError(f"actor_rollout_ref.actor.router_replay.mode=R2 with {_RC}.bypass_mode=true: R2 records "
                          "the routes in the old-log-prob forward, which bypass mode skips. Set bypass_mode=false, "
                          "or router_replay.mode=disabled.")


def check_rollout_correction(cfg: Config) -> None:
    """algorithm.rollout_correction's values, before any model loads."""
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is is not None:
        parse_is_threshold(rc.rollout_is_threshold)
    if rc.rollout_rs is not None:
        parse_rs_thresholds(rc.rollout_rs, rc.rollout_rs_threshold)
    if rc.bypass_mode and sampling_truncates(cfg.actor_rollout_ref.rollout):
        rollout = cfg.actor_rollout_ref.rollout
        raise ConfigError(
            f"{_RC}.bypass_mode=true with actor_rollout_ref.rollout.top_k={rollout.top_k} / top_p={rollout.top_p}: "
            f"bypass mode uses the engine's log-probs as the old log-probs of the PPO ratio, and those are of the "
            f"truncated distribution it sampled from, while the actor's are over the whole vocabulary, so the "
            f"ratio would be off by the kept probability mass on every token. Set {_RC}.bypass_mode=false (the "
            f"correction then compares like with like), or top_k=-1 and top_p=1.0.")


def check_algorithm(cfg: Config) -> None:
    """The algorithm keys that only work together (DAPO's, the policy losses'), checked before any model loads."""
    data, algorithm, reward_model = cfg.data, cfg.algorithm, cfg.reward_model
    overlong, filter_groups = reward_model.overlong_buffer, algorithm.filter_groups
    if overlong.enable:
        if reward_model.reward_manager != "dapo":
            raise ConfigError(
                "reward_model.overlong_buffer.enable=true is read by verl's DAPO reward manager only (the naive one "
                "ignores it); set reward_model.reward_manager=dapo, or overlong_buffer.enable=false.")
        if not 0 < overlong.len <= data.max_response_length:
            raise ConfigError(
                f"reward_model.overlong_buffer.len={overlong.len} must be in 1..data.max_response_length="
                f"{data.max_response_length}: the penalty grows over the last `len` tokens a response may have "
                f"(DAPO: 4096 of 20480).")
    if filter_groups.enable:
        if data.gen_batch_size is not None and data.gen_batch_size < 1:
            raise ConfigError(f"data.gen_batch_size={data.gen_batch_size} must be >= 1 prompts per generation "
                              "batch, or null for data.train_batch_size (DAPO generates 3x: 1536 for 512).")
        if filter_groups.metric == "seq_final_reward" and algorithm.use_kl_in_reward:
            raise ConfigError(
                "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: groups are "
                "kept or dropped before the KL penalty is known; use metric=seq_reward (or acc).")
    elif data.gen_batch_size not in (None, data.train_batch_size):
        raise ConfigError(
            f"data.gen_batch_size={data.gen_batch_size} is only used by dynamic sampling; set "
            "algorithm.filter_groups.enable=true, or data.gen_batch_size=null (each step generates for "
            f"data.train_batch_size={data.train_batch_size} prompts).")
    # a key of one policy loss that the chosen mode does not read would be ignored: refuse it, naming the
    # modes that read it
    policy_loss = cfg.actor_rollout_ref.actor.policy_loss
    mode = _ALGORITHMS.policy_losses[policy_loss.loss_mode]
    prefix = "actor_rollout_ref.actor.policy_loss."
    for name in dict.fromkeys(k for m in _ALGORITHMS.policy_losses.values() for k in m.keys):
        key = policy_loss_key(name)
        value, default = _peek(cfg, key), _KEYS[key][1]
        if name not in mode.keys and value != default:
            readers = [m.name for m in _ALGORITHMS.policy_losses.values() if name in m.keys]
            raise ConfigError(f"{key}={value!r} is read by loss_mode={' / '.join(readers)} only, not by "
                              f"{prefix}loss_mode={mode.name}, which would ignore it. Set loss_mode={readers[0]}, "
                              f"or leave {name} at its default ({default!r}).")
    check_gdpo(algorithm)
    if mode.name == "dro" and policy_loss.dro_beta is None:
        raise ConfigError(f"{prefix}loss_mode=dro needs {prefix}dro_beta, the weight of its quadratic penalty on the "
                          f"log-ratio (> 0; verl has no default either), e.g. {prefix}dro_beta=0.1.")
    check_estimator_inputs(cfg)
    lower, upper = _peek(policy_loss, "clip_cov_lb"), _peek(policy_loss, "clip_cov_ub")
    if not lower < upper:
        raise ConfigError(f"{prefix}clip_cov_lb={lower} must be below clip_cov_ub={upper}: clip_cov draws its "
                          f"tokens from the covariances between them (defaults 1.0, 5.0).")


def check_gdpo(algorithm: Config) -> None:
    """algorithm.gdpo_reward_keys / gdpo_reward_weights: with adv_estimator=gdpo only, the keys a list of
    names and the weights one number per key."""
    keys, weights = algorithm.gdpo_reward_keys, algorithm.gdpo_reward_weights
    if algorithm.adv_estimator != "gdpo":
        for name, value in (("gdpo_reward_keys", keys), ("gdpo_reward_weights", weights)):
            if value is not None:
                raise ConfigError(f"algorithm.{name}={value} is read by algorithm.adv_estimator=gdpo only, not by "
                                  f"{algorithm.adv_estimator}; set adv_estimator=gdpo, or {name}=null.")
        return
    if not keys or not all(isinstance(k, str) for k in keys):
        raise ConfigError(f"algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys, the names of the reward "
                          f"components your reward function returns in its dict (got {keys}), e.g. "
                          f"algorithm.gdpo_reward_keys=[acc,format] (as verl).")
    if weights is not None and (len(weights) != len(keys) or not all(
            isinstance(w, int | float) and not isinstance(w, bool) for w in weights)):
        raise ConfigError(f"algorithm.gdpo_reward_weights={weights} must be one number per gdpo_reward_keys={keys}, "
                          f"or null (1 each).")
    if algorithm.use_kl_in_reward:
        raise ConfigError("algorithm.adv_estimator=gdpo with algorithm.use_kl_in_reward=true: gdpo's advantages come "
                          "from the reward components alone (as verl's), so the KL penalty in the reward would be "
                          "dropped; use actor_rollout_ref.actor.use_kl_loss=true instead.")


def check_estimator_inputs(cfg: Config) -> None:
    """What the estimator needs beside rewards: a critic to warm up; the optimal token baseline's
    per-token sum of squared probabilities, which only the separate old-log-prob forward computes."""
    actor, algorithm, estimator = cfg.actor_rollout_ref.actor, cfg.algorithm, cfg.algorithm.adv_estimator
    if cfg.trainer.critic_warmup > 0 and not adv_estimator_traits(estimator).needs_critic:
        critics = [e.name for e in _ALGORITHMS.adv_estimators.values() if e.needs_critic]
        raise ConfigError(f"trainer.critic_warmup={cfg.trainer.critic_warmup} with algorithm.adv_estimator="
                          f"{estimator}, which has no critic to warm up; set trainer.critic_warmup=0, or "
                          f"adv_estimator={' / '.join(critics)}.")
    if estimator not in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        return
    if not actor.calculate_sum_pi_squared:
        raise ConfigError(f"algorithm.adv_estimator={estimator} reads sum_v pi(v)^2 per token from the "
                          "old-log-prob forward; set actor_rollout_ref.actor.calculate_sum_pi_squared=true (as verl).")
    rc = algorithm.rollout_correction
    if rc.bypass_mode:
        raise ConfigError(f"algorithm.adv_estimator={estimator} with {_RC}.bypass_mode=true: bypass mode "
                          f"runs no old-log-prob forward, so there is no sum_v pi(v)^2; set {_RC}.bypass_mode=false.")
    if rc.rollout_is is not None:
        raise ConfigError(f"algorithm.adv_estimator={estimator} with {_RC}.rollout_is={rc.rollout_is!r}: "
                          f"here the IS weights are computed after the advantages, so the baseline cannot be "
                          f"weighted by them as verl's is; set {_RC}.rollout_is=null.")


# agent.PARSERS implements each (tests/test_agent.py checks the two agree); said here so that config
# stays free of the tool machinery and a typo fails before anything loads.
TOOL_CALL_FORMATS = ("hermes", "demo")


def check_multi_turn(cfg: Config) -> None:
    """actor_rollout_ref.rollout.multi_turn (and the verl keys multi-turn examples set), before any model loads."""
    rollout, key = cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout.multi_turn"
    mt, nccl_timeout = rollout.multi_turn, cfg.actor_rollout_ref.nccl_timeout
    _ = cfg.data.return_raw_chat  # accepted either way; read, so a run does not report it unused
    if rollout.mode not in ("sync", "async"):
        raise ConfigError(f"actor_rollout_ref.rollout.mode={rollout.mode!r}; valid: sync, async (both mean the "
                          f"in-process engine here, multi-turn batched turn by turn).")
    if mt.format not in TOOL_CALL_FORMATS:
        raise ConfigError(f"{key}.format={mt.format!r} names no tool-call parser; valid: {', '.join(TOOL_CALL_FORMATS)}.")
    if mt.tool_response_truncate_side not in ("left", "right", "middle"):
        raise ConfigError(f"{key}.tool_response_truncate_side={mt.tool_response_truncate_side!r}; valid: left "
                          f"(cut the head), right (cut the tail), middle (keep both ends).")
    if not 0 < mt.tool_timeout_s <= nccl_timeout / 4:
        raise ConfigError(
            f"{key}.tool_timeout_s={mt.tool_timeout_s:g} must be > 0 and at most a quarter of "
            f"actor_rollout_ref.nccl_timeout={nccl_timeout} s: the ranks of a TP group wait in a collective while "
            f"one of them runs its tools, so a slow tool must become an error observation long before the "
            f"collective times out. Lower tool_timeout_s or raise nccl_timeout.")
    for name in ("max_parallel_calls", "max_tool_response_length", "max_assistant_turns", "max_user_turns"):
        if mt[name] is not None and mt[name] < 1:
            raise ConfigError(f"{key}.{name}={mt[name]} must be >= 1{' or null (no limit)' if 'turns' in name else ''}.")
    paths = {name: mt[name] for name in ("tool_config_path", "function_tool_path")}
    if mt.enable and not any(paths.values()) and mt.environment is None:
        raise ConfigError(f"{key}.enable=true needs tools: set {key}.tool_config_path (verl's tool YAML) and/or "
                          f"{key}.function_tool_path (a .py file of functions), or {key}.environment "
                          f"(module.Class of an agent.Environment).")
    if mt.environment is not None and "." not in mt.environment:
        raise ConfigError(f"{key}.environment={mt.environment!r} must be module.Class (e.g. agent.GuessNumberEnv).")
    for name, path in paths.items():
        if path is not None and not Path(path).expanduser().is_file():
            raise ConfigError(f"{key}.{name}={path!r}: no such file (relative paths are from {Path.cwd()}).")


def check_timeouts(cfg: Config) -> None:
    """trainer.hang_timeout_s and reward_model.timeout_s: >= 0, and the watchdog before the collectives."""
    hang, collective = cfg.trainer.hang_timeout_s, cfg.actor_rollout_ref.nccl_timeout
    if not 0 <= hang <= collective:
        raise ConfigError(
            f"trainer.hang_timeout_s={hang:g} must be in 0..actor_rollout_ref.nccl_timeout={collective}: the watchdog "
            f"must end a hang, with a report of who is behind, before the collective timeout ends it without one "
            f"(0 turns the watchdog off). Lower trainer.hang_timeout_s or raise actor_rollout_ref.nccl_timeout.")
    if cfg.reward_model.timeout_s < 0:
        raise ConfigError(f"reward_model.timeout_s={cfg.reward_model.timeout_s:g} must be >= 0 seconds per sample "
                          f"(0: no limit).")


_DISTILL = "distillation.distillation_loss"


_V1 = "trainer.v1"


def check_colocate_async(cfg: Config) -> None:
    """trainer.v1 (verl 0.9's V1 trainer keys) and rollout.over_sample_rate, before any model loads. colocate_async
    carries unfinished samples across weight updates, so a trained token may come from older weights than
    the update starts from: the loss must know (decoupled rollout correction or bypass mode)."""
    v1, rollout = cfg.trainer.v1, cfg.actor_rollout_ref.rollout
    if rollout.over_sample_rate > 0:
        raise ConfigError(
            f"actor_rollout_ref.rollout.over_sample_rate={rollout.over_sample_rate:g} is not implemented: verl "
            f"aborts the last requests of a step and trains without them (or on their truncation), a bias towards "
            f"short responses. {_V1}.trainer_mode=colocate_async cuts the same tail and carries the cut samples "
            f"to the next step instead; set over_sample_rate=0.")
    check_rollout_pool(cfg)
    if v1.trainer_mode == "sync":
        return  # verl: the sampler's keys are no-ops in sync (a run that sets them hears they went unread)
    if v1.trainer_mode == "separate_async":
        check_separate_async(cfg)
        return
    warmup = v1.colocate_async.num_warmup_batches
    threshold, strategy = v1.sampler.max_off_policy_threshold, v1.sampler.max_off_policy_strategy
    mode = f"{_V1}.trainer_mode=colocate_async"
    if rollout.multi_turn.enable:
        raise ConfigError(f"{mode} with actor_rollout_ref.rollout.multi_turn.enable=true is not supported yet: a "
                          f"cut trajectory would have to carry its environment (a tool's state) across steps. Use "
                          f"{_V1}.trainer_mode=sync for multi-turn rollouts.")
    if cfg.algorithm.filter_groups.enable:
        raise ConfigError(f"{mode} with algorithm.filter_groups.enable=true (DAPO's dynamic sampling) is not "
                          f"supported yet: its extra generation batches would need their own carried groups. Use "
                          f"{_V1}.trainer_mode=sync with dynamic sampling.")
    if adv_estimator_traits(cfg.algorithm.adv_estimator).baseline_rollout is not None:
        raise ConfigError(f"{mode} with algorithm.adv_estimator={cfg.algorithm.adv_estimator}: its baseline rollout "
                          f"(a greedy response per prompt) would come from other weights than a carried group's "
                          f"samples. Use grpo / rloo / another group estimator, or {_V1}.trainer_mode=sync.")
    if strategy == "wait" and warmup >= threshold:
        raise ConfigError(
            f"{_V1}.colocate_async.num_warmup_batches={warmup} with {_V1}.sampler.max_off_policy_threshold="
            f"{threshold} and max_off_policy_strategy=wait: with {warmup + 1} batches in flight and one trained per "
            f"step, groups reach the threshold faster than a step can train them, and waiting drops none. Use "
            f"num_warmup_batches <= {threshold - 1}, a larger threshold, or max_off_policy_strategy=drop.")
    rc = cfg.algorithm.rollout_correction
    if warmup > 0 and not (rc.bypass_mode or rc.rollout_is is not None):
        raise ConfigError(
            f"{mode} with num_warmup_batches={warmup}: carried samples hold tokens sampled by older weights than "
            f"the update starts from, and a PPO ratio against the current actor alone (the on-policy shortcut, or "
            f"an old-log-prob forward without weights) anchors the clip at a policy that never sampled them. Set "
            f"algorithm.rollout_correction.rollout_is=token (decoupled PPO: IS weights actor / engine, e.g. with "
            f"rollout_is_threshold=2.0) or algorithm.rollout_correction.bypass_mode=true (the engine's log-probs "
            f"are the old ones), or num_warmup_batches=0 (then nothing is ever cut: the sync run).")


def check_rollout_pool(cfg: Config) -> None:
    """verl's three keys of a separate rollout pool agree: hybrid_engine=false, rollout.nnodes > 0 and
    trainer_mode=separate_async come together (placement.py lays the pool out), or none of them."""
    arr, mode = cfg.actor_rollout_ref, cfg.trainer.v1.trainer_mode
    nnodes, per_node = arr.rollout.nnodes, arr.rollout.n_gpus_per_node
    separate = mode == "separate_async"
    # verl's default n_gpus_per_node is ${trainer.n_gpus_per_node}: that value says nothing of a pool
    if arr.hybrid_engine and not separate and (nnodes != 0 or per_node not in (None, cfg.trainer.n_gpus_per_node)):
        raise ConfigError(
            f"actor_rollout_ref.rollout.nnodes={nnodes} n_gpus_per_node={'null' if per_node is None else per_node} describe a rollout pool of its "
            f"own, but actor_rollout_ref.hybrid_engine=true collocates the engine with the actor on every rank. For "
            f"a separate pool set actor_rollout_ref.hybrid_engine=false {_V1}.trainer_mode=separate_async; otherwise "
            f"leave rollout.nnodes=0 and rollout.n_gpus_per_node=null.")
    if not separate and not arr.hybrid_engine:
        raise ConfigError(
            f"actor_rollout_ref.hybrid_engine=false (a rollout pool on ranks of its own) needs "
            f"{_V1}.trainer_mode=separate_async (it is {mode}), as in verl 0.9. Set both, with "
            f"actor_rollout_ref.rollout.nnodes >= 1, or hybrid_engine=true.")
    if separate and arr.hybrid_engine:
        raise ConfigError(
            f"{_V1}.trainer_mode=separate_async with actor_rollout_ref.hybrid_engine=true asks for verl's hybrid "
            f"replicas on the trainer ranks beside the standalone pool, which is not implemented: the pool here "
            f"generates alone. Set actor_rollout_ref.hybrid_engine=false, or trainer_mode=colocate_async.")
    if separate and nnodes < 1:
        raise ConfigError(
            f"{_V1}.trainer_mode=separate_async needs a rollout pool: actor_rollout_ref.rollout.nnodes={nnodes}. Set "
            f"rollout.nnodes >= 1 and rollout.n_gpus_per_node (null: trainer.n_gpus_per_node's "
            f"{cfg.trainer.n_gpus_per_node}).")


def check_separate_async(cfg: Config) -> None:
    """trainer.v1.trainer_mode=separate_async (placement.py): what the split loop implements, before any model
    loads. At num_warmup_batches=1 the trained batch was sampled by the weights one update old, so the loss
    must know (decoupled rollout correction or bypass mode, as colocate_async)."""
    v1, arr = cfg.trainer.v1, cfg.actor_rollout_ref
    sep = v1.separate_async
    mode = f"{_V1}.trainer_mode=separate_async"
    mini, tbs = arr.actor.ppo_mini_batch_size, cfg.data.train_batch_size
    if tbs != sep.parameter_sync_step * mini:
        raise ConfigError(
            f"{mode}: data.train_batch_size={tbs} must equal {_V1}.separate_async.parameter_sync_step="
            f"{sep.parameter_sync_step} x actor_rollout_ref.actor.ppo_mini_batch_size={mini} (verl's rule: the actor "
            f"updates once per mini batch, and the pool gets the weights after the last). Set "
            f"parameter_sync_step={tbs // mini if tbs % mini == 0 else 'train_batch_size / ppo_mini_batch_size'}.")
    warmup, threshold = sep.num_warmup_batches, v1.sampler.max_off_policy_threshold
    if v1.sampler.max_off_policy_strategy != "drop":
        raise ConfigError(f"{mode}: {_V1}.sampler.max_off_policy_strategy=wait has nothing to wait for: the pool "
                          f"generates whole batches, at most one ahead, so no group outlives the bound. Leave it at drop.")
    if warmup + 1 > threshold:
        raise ConfigError(
            f"{mode} with {_V1}.separate_async.num_warmup_batches={warmup}: each trained batch was sampled by the "
            f"weights {warmup} update(s) old, {warmup + 1} weight versions, over {_V1}.sampler.max_off_policy_threshold="
            f"{threshold}. Raise the threshold to {warmup + 1}, or set num_warmup_batches=0 (sequential).")
    rc = cfg.algorithm.rollout_correction
    if warmup == 1 and not (rc.bypass_mode or rc.rollout_is is not None):
        raise ConfigError(
            f"{mode} with {_V1}.separate_async.num_warmup_batches={warmup}: every trained batch was sampled by the "
            f"weights one update older than the update starts from, and a PPO ratio against the current actor "
            f"alone anchors the clip at a policy that never sampled it. Set "
            f"algorithm.rollout_correction.rollout_is=token (decoupled PPO: IS weights actor / engine, e.g. with "
            f"rollout_is_threshold=2.0) or algorithm.rollout_correction.bypass_mode=true (the engine's log-probs "
            f"are the old ones), or num_warmup_batches=0 (sequential).")


def check_distillation(cfg: Config) -> None:
    """distillation.enabled: a teacher to load, on the actor's mesh, and a loss that can train (verl's checks)."""
    distill = cfg.distillation
    if not distill.enabled:
        return
    teacher, loss = distill.teacher_models.teacher_model, distill.distillation_loss
    if teacher.model_path is None:
        raise ConfigError("distillation.enabled=true needs distillation.teacher_models.teacher_model.model_path: the "
                          "teacher, a causal LM with the actor's tokenizer (e.g. a larger model of the same family).")
    if distill.nnodes != 0:
        raise ConfigError(
            f"distillation.nnodes={distill.nnodes} (x n_gpus_per_node={distill.n_gpus_per_node}) asks for verl's "
            f"separate teacher pool; here the teacher is sharded on the actor's FSDP mesh and runs between the "
            f"rollout and the update, as the reference model does. Set distillation.nnodes=0 (the default); "
            f"distillation.teacher_models.teacher_model.fsdp_config.param_offload=true keeps its shards on the host.")
    if loss.loss_mode in ("k1", "kl") and not loss.use_policy_gradient:
        raise ConfigError(
            f"{_DISTILL}.loss_mode={loss.loss_mode} with use_policy_gradient=false: the gradient of k1 (log q - log p) "
            f"with respect to the student's weights does not depend on the teacher's log-probs, so it would not "
            f"distil. Set {_DISTILL}.use_policy_gradient=true (k1 as a per-token reward), or loss_mode=k3 (verl's "
            f"default) or forward_kl_topk.")
    if loss.loss_mode == "forward_kl_topk":
        if loss.topk is None:
            raise ConfigError(f"{_DISTILL}.loss_mode=forward_kl_topk needs {_DISTILL}.topk (verl's default: 32).")
        sp = cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size
        if sp > 1:
            raise ConfigError(
                f"{_DISTILL}.loss_mode=forward_kl_topk with actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}"
                f" is not implemented (the top-k log-probs are gathered from whole rows); use a KL estimator "
                f"(loss_mode=k3) with Ulysses, or ulysses_sequence_parallel_size=1.")


def check_reward_source(cfg: Config) -> None:
    """At most one of a custom reward function, a remote scorer and an LLM judge scores the samples."""
    chosen = {key: value for key, value in (("custom_reward_function.path", cfg.custom_reward_function.path),
                                            ("reward_model.remote.url", cfg.reward_model.remote.url),
                                            ("reward_model.judge.url", cfg.reward_model.judge.url))
              if value is not None}
    if len(chosen) > 1:
        raise ConfigError(f"{' and '.join(f'{k}={v!r}' for k, v in chosen.items())} are both set, but one scorer "
                          f"gives the sample's score; set the others to null.")
    for key, url in chosen.items():
        if key.endswith(".url") and not url.startswith(("http://", "https://")):
            raise ConfigError(f"{key}={url!r} must be an http:// or https:// URL.")


def flat_values(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every schema key's value, as {'a.b.c': value}, looked at without counting as reads."""
    return {key: _peek(cfg, key) for key in _KEYS}


def non_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """The resolved config's keys whose value differs from the schema's default, as {'a.b.c': value}:
    what the start-up prints (the whole config goes to <default_local_dir>/config.yaml)."""
    return {key: shown(value, key) for key, value in flat_values(cfg).items() if value != _KEYS[key][1]}


def verl_rules_markdown() -> str:
    """VERL_KEY_RULES as the table in docs/verl-semantics.md (tests/test_config.py keeps the two equal)."""
    table = verl_key_table()
    implemented = sum(kind == IMPLEMENTED for _, kind, _ in table)
    lines = [f"verl {VERL_VERSION}'s generated config has {len(table)} leaf keys: {implemented} are this program's "
             f"keys (`python config.py --keys`); each of the others is decided by the first rule below that "
             f"matches it. *no effect*: accepted at any value; *not implemented*: accepted at verl's default "
             f"only, any other value refused before anything loads.", "",
             "| verl keys | kind | keys | what verl does, what to use here |", "|---|---|---|---|"]
    for rule in VERL_KEY_RULES:
        n = sum(1 for key, _, _ in table if key not in _KEYS and verl_key_rule(key) is rule)
        lines.append(f"| `{rule.pattern}` | {rule.kind} | {n} | {rule.why} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Print the resolved config, or every valid key.")
    ap.add_argument("--config", help="YAML file: this program's (configs/) or verl's (whole, or hydra-style partial)")
    ap.add_argument("--keys", action="store_true", help="list every valid key with its type and default, then "
                    "verl's keys that this program does not implement, by rule")
    ap.add_argument("--markdown", action="store_true", help="with --keys: verl's rules as docs/verl-semantics.md's table")
    ap.add_argument("overrides", nargs="*", help="key=value overrides")
    args = ap.parse_args()
    if args.keys and args.markdown:
        print(verl_rules_markdown(), end="")
    elif args.keys:
        for key, (types, default) in _KEYS.items():
            print(f"{key:<66} {_type_name(types):<18} {default!r}")
        print(f"\nverl {VERL_VERSION}'s keys that this program does not implement, by the first rule that matches "
              f"(no effect: any value accepted; not implemented: verl's default only):")
        for key, kind, why in verl_key_table():
            if kind != IMPLEMENTED:
                print(f"{key:<66} {kind:<16} {verl_defaults()[key]!r}: {why}")
    else:
        try:
            cfg = load_config(args.config, args.overrides)
            print(to_yaml(cfg), end="")
            if describe_verl_keys(cfg):
                print(describe_verl_keys(cfg), file=sys.stderr)
        except ConfigError as e:
            raise SystemExit(f"config error: {e}") from None
