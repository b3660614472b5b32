"""The planner's arithmetic and every validation error, with no process group."""

import itertools
import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT

from config import ConfigError, load_config
from mesh_utils import ForwardSpec, UpdateSpec, plan_device_map, validate

SEED_1 = ROOT / "configs" / "gsm8k_grpo_1node_6gpu.yaml"
SEED_2 = ROOT / "configs" / "gsm8k_grpo_2node_6gpu.yaml"


def plan(path=SEED_1, *overrides, world=None):
    data = ["data.train_files=train.parquet"] if path is None else []  # the built-in defaults have no data
    return validate(load_config(path, [*data, *overrides]), world)


def test_seed_six_gpu_numbers():
    dims, p = plan()
    dm = plan_device_map(dims)
    assert dm.rollout_tp_groups == [[0, 1], [2, 3], [4, 5]]
    assert dm.fsdp_groups == [[0, 1, 2, 3, 4, 5]]
    assert (p.prompts_per_rollout_group, p.samples_per_rollout_group, p.total_samples) == (20, 240, 720)
    assert p.actor_update.mini_batch_size == 120 and p.samples_per_rank == 120


@pytest.mark.parametrize("fsdp_size, groups", [
    (2, [[0, 1], [2, 3], [4, 5]]),
    (3, [[0, 1, 2], [3, 4, 5]]),
    (6, [[0, 1, 2, 3, 4, 5]]),
])
def test_fsdp_size_groups(fsdp_size, groups):
    dims, _ = plan(SEED_1, f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size}")
    assert plan_device_map(dims).fsdp_groups == groups
    assert dims.ddp == 6 // fsdp_size


def test_ulysses_divides_the_per_rank_batch():
    dims, p = plan(SEED_1, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")
    assert (dims.train_dp, dims.sp) == (3, 2)
    assert plan_device_map(dims).sp_groups == [[0, 1], [2, 3], [4, 5]]
    assert plan_device_map(dims).train_dp_groups == [[0, 2, 4], [1, 3, 5]]
    assert p.actor_update.mini_batch_size == 720 // 3
    assert plan_device_map(plan()[0]).train_dp_groups == [[0, 1, 2, 3, 4, 5]]


def test_ulysses_token_budgets_are_per_gpu_times_sp():
    """verl's meaning: an sp group's micro batch holds budget x sp tokens, 1/sp of them per gpu; so the
    budget need only hold 1/sp of the longest sample."""
    _, p = plan(SEED_1, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=768")
    assert p.actor_update.max_token_len == p.old_log_prob.max_token_len == p.ref_log_prob.max_token_len == 1536


def test_two_nodes_keep_tp_pairs_on_one_node():
    dims, p = plan(SEED_2)
    dm = plan_device_map(dims)
    assert dims.world_size == 12 and dims.rollout_dp == 6
    for group in dm.rollout_tp_groups:
        assert len({dm.node_of_rank[r] for r in group}) == 1
    assert dm.node_of_rank == [0] * 6 + [1] * 6
    assert p.total_samples == 720 and p.actor_update.mini_batch_size == 60


def simulate(tbs, n, mini, world, tp, sp):
    """The batch flow done by hand with explicit lists, to check the closed-form plan against."""
    prompts = list(range(tbs))
    groups = world // tp
    per_group = [prompts[g * tbs // groups:(g + 1) * tbs // groups] for g in range(groups)]
    samples = [(p, k) for chunk in per_group for p in chunk for k in range(n)]
    train_ranks = world // sp
    shares = [samples[r * len(samples) // train_ranks:(r + 1) * len(samples) // train_ranks]
              for r in range(train_ranks)]
    # a mini batch is `mini` prompts' samples, spread evenly over the training ranks
    mini_samples = mini * n
    return len(per_group[0]), len(per_group[0]) * n, len(samples), len(shares[0]), mini_samples // train_ranks


@pytest.mark.parametrize("world, tp, sp, n", [
    (w, tp, sp, n) for w, tp, sp, n in itertools.product([1, 2, 4, 6, 8], [1, 2, 4], [1, 2], [1, 4, 12])
    if w % tp == 0 and w % sp == 0 and 24 % (w // tp) == 0 and (12 * n) % (w // sp) == 0
])
def test_plan_matches_simulation(world, tp, sp, n):
    tbs, mini = 24, 12
    _, p = plan(None, f"data.train_batch_size={tbs}", f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
                f"actor_rollout_ref.rollout.n={n}", f"trainer.n_gpus_per_node={world}",
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
                f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}",
                f"critic.ulysses_sequence_parallel_size={sp}",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3")
    got = (p.prompts_per_rollout_group, p.samples_per_rollout_group, p.total_samples, p.samples_per_rank,
           p.actor_update.mini_batch_size)
    assert got == simulate(tbs, n, mini, world, tp, sp)
    assert p.critic_update.mini_batch_size == p.actor_update.mini_batch_size  # the default estimator, gae


# Each of the seed's pitfalls (and verl's), as the error a user gets; each names the key and numbers.
PITFALLS = [
    (SEED_1, ["data.train_batch_size=61"], ["data.train_batch_size=61", "3 rollout dp groups", "Nearest valid: 60"]),
    (SEED_1, ["actor_rollout_ref.rollout.tensor_model_parallel_size=8"],
     ["tensor_model_parallel_size=8", "0 rollout dp groups", "Valid values: 1, 2, 3, 6"]),
    (SEED_1, ["actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
     ["tensor_model_parallel_size=4", "n_gpus_per_node=6", "Valid values: 1, 2, 3, 6"]),
    (SEED_2, ["actor_rollout_ref.rollout.tensor_model_parallel_size=4"], ["span two nodes"]),
    (SEED_1, ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"],
     ["ulysses_sequence_parallel_size=4", "world size 6", "Valid values: 1, 2, 3, 6"]),
    (SEED_1, ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=121"],
     ["log_prob_micro_batch_size_per_gpu=121", "120 samples"]),
    (SEED_1, ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0"], ["between 1 and"]),
    (SEED_1, ["actor_rollout_ref.actor.fsdp_config.fsdp_size=4"], ["fsdp_size=4", "Valid values: -1, 1, 2, 3, 6"]),
    (SEED_1, ["actor_rollout_ref.actor.ppo_mini_batch_size=7"], ["ppo_mini_batch_size=7", "train_batch_size=60"]),
    (SEED_1, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7"],
     ["ppo_micro_batch_size_per_gpu=7", "per-rank mini batch 120"]),
    (SEED_1, ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=63", "actor_rollout_ref.actor.ppo_mini_batch_size=63"],
     ["63 samples cannot be split evenly over 6 ranks"]),
    # 3 rollout groups of TP 2 and 3 training ranks of ulysses sp 2: 9 samples split over 3 training
    # ranks, but a group's 3 samples do not split over its 2 TP ranks (found failing at step 1)
    (SEED_1, ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
              "data.train_batch_size=3", "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3"],
     ["9 samples cannot be split evenly over 6 ranks", "ulysses sp 2"]),
    (SEED_1, ["actor_rollout_ref.rollout.n=1"], ["rollout.n=1 must be >= 2"]),
    (SEED_1, ["reward_model.enable=true"], ["reward_model.enable"]),
    (SEED_1, ["algorithm.adv_estimator=gae", "critic.ulysses_sequence_parallel_size=2"],
     ["critic.ulysses_sequence_parallel_size=2"]),
    (SEED_1, ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2"],
     ["actor_rollout_ref.ref.ulysses_sequence_parallel_size=2", "actor's"]),
    (SEED_1, ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=false"],
     ["actor_rollout_ref.model.use_remove_padding=false", "ulysses_sequence_parallel_size=2"]),
    (SEED_1, ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "algorithm.adv_estimator=gae",
              "critic.ulysses_sequence_parallel_size=2", "critic.model.use_remove_padding=false"],
     ["critic.model.use_remove_padding=false"]),
    (SEED_1, ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.actor.use_dynamic_bsz=true",
              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=700"],
     ["ppo_max_token_len_per_gpu=700 x ulysses sp 2", "at least 768"]),
    # token budgets (use_dynamic_bsz) must hold one whole sample: 512 + 1024 tokens in the seed config
    (SEED_1, ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000"],
     ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000", "= 1536 tokens", "at least 1536"]),
    (SEED_1, ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=99"],
     ["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=99", "at least 1536"]),
    (SEED_1, ["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1535"],
     ["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1535", "at least 1536"]),
    (SEED_1, ["algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=64"],
     ["critic.ppo_max_token_len_per_gpu=64", "at least 1536"]),
]


def test_token_budgets_follow_verl_defaults():
    """Off by default; on, each forward's budget defaults to the actor's (the critic's own: 32768)."""
    _, p = plan(SEED_1, "algorithm.adv_estimator=gae")
    assert (p.actor_update.max_token_len, p.old_log_prob.max_token_len, p.values.max_token_len) == (None, None, None)
    _, p = plan(SEED_1, "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=4096")
    assert (p.actor_update.max_token_len, p.old_log_prob.max_token_len, p.ref_log_prob.max_token_len,
            p.critic_update.max_token_len, p.values.max_token_len) == (16384, 16384, 4096, 32768, 32768)
    _, p = plan(SEED_1, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false")
    assert (p.actor_update.max_token_len, p.old_log_prob.max_token_len, p.ref_log_prob.max_token_len) == (
        16384, None, 16384)
    _, p = plan(SEED_1, "algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=true",
                "critic.forward_max_token_len_per_gpu=2000")
    assert (p.actor_update.max_token_len, p.critic_update.max_token_len, p.values.max_token_len) == (
        None, 32768, 2000)


# verl's rules, written out: a null key of a role means the actor's value (the ref's and the values'
# micro batch: the rollout's log-prob one). The seed config: 120 samples per rank, actor micro 8,
# log-prob micro 8, use_kl_loss (a reference model), use_remove_padding.
SEED_ACTOR = UpdateSpec(epochs=1, mini_batch_size=120, micro_batch_size=8, max_token_len=None, shuffle=False,
                        loss_agg_mode="token-mean", use_remove_padding=True, grad_clip=1.0)


def test_seed_roles():
    _, p = plan(SEED_1)
    assert p.old_log_prob == p.ref_log_prob == ForwardSpec(micro_batch_size=8, max_token_len=None,
                                                           use_remove_padding=True)
    assert p.actor_update == SEED_ACTOR
    assert p.values is None and p.critic_update is None  # GRPO: no critic


def test_critic_nulls_take_the_actors_values():
    _, p = plan(SEED_1, "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.ppo_epochs=2",
                "actor_rollout_ref.actor.shuffle=true", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                "critic.grad_clip=0.5", "critic.model.use_remove_padding=false")
    # mini batch: the actor's 60 prompts x 12 / 6 ranks; micro null: the whole mini batch
    assert p.critic_update == UpdateSpec(epochs=2, mini_batch_size=120, micro_batch_size=120, max_token_len=None,
                                         shuffle=True, loss_agg_mode="seq-mean-token-mean", use_remove_padding=False,
                                         grad_clip=0.5)
    assert p.values == ForwardSpec(micro_batch_size=8, max_token_len=None, use_remove_padding=False)
    assert p.actor_update.epochs == 2 and p.actor_update.shuffle


def test_critic_and_ref_keys_of_their_own():
    _, p = plan(SEED_1, "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.ppo_epochs=2",
                "actor_rollout_ref.actor.shuffle=true", "critic.ppo_epochs=3", "critic.shuffle=false",
                "critic.loss_agg_mode=seq-mean-token-sum", "critic.ppo_mini_batch_size=30",
                "critic.ppo_micro_batch_size_per_gpu=20", "critic.forward_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2")
    assert p.critic_update == UpdateSpec(epochs=3, mini_batch_size=60, micro_batch_size=20, max_token_len=None,
                                         shuffle=False, loss_agg_mode="seq-mean-token-sum", use_remove_padding=True,
                                         grad_clip=1.0)
    assert p.values == ForwardSpec(4, None, True)
    assert p.ref_log_prob == ForwardSpec(2, None, True) and p.old_log_prob == ForwardSpec(8, None, True)


@pytest.mark.parametrize("kl_loss, kl_in_reward, has_ref", [(True, False, True), (False, True, True),
                                                            (False, False, False)])
def test_a_reference_model_only_for_a_kl_term(kl_loss, kl_in_reward, has_ref):
    _, p = plan(SEED_1, f"actor_rollout_ref.actor.use_kl_loss={kl_loss}", f"algorithm.use_kl_in_reward={kl_in_reward}")
    assert (p.ref_log_prob is not None) == has_ref


def test_dynamic_bsz_nulls_follow_the_actor():
    _, p = plan(SEED_1, "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4000",
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false", "critic.ppo_max_token_len_per_gpu=5000")
    assert p.old_log_prob == ForwardSpec(8, 4000, True)  # rollout's budget null: the actor's
    assert p.ref_log_prob == ForwardSpec(8, None, True)  # its own switch, off
    assert p.critic_update.max_token_len == 5000 and p.values == ForwardSpec(8, 5000, True)  # critic's switch null


@pytest.mark.parametrize("path, overrides, fragments", PITFALLS, ids=lambda x: None)
def test_pitfalls_are_clear_errors(path, overrides, fragments):
    with pytest.raises(ConfigError) as err:
        plan(path, *overrides)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_launch_must_match_config():
    with pytest.raises(ConfigError, match=r"torchrun launched 4 processes but .* 1 x 6 = 6"):
        plan(SEED_1, world=4)


def planner(*args):
    return subprocess.run([sys.executable, "mesh_utils.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_planner_cli_prints_the_seed_numbers():
    out = planner("--config", str(SEED_1))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for fragment in ["TP groups [[0,1], [2,3], [4,5]]", "3 rollout dp groups x 20 prompts",
                     "240 samples per group, 720 in all", "= 120 per rank"]:
        assert fragment in text, fragment
    # per role: micro 8 -> 15 forward micro steps for each log-prob forward; the actor's 1 epoch of mini
    # batches of 120 in micro batches of 8 (15 accumulation steps), no token budget, no shuffle
    assert re.search(r"old log-probs +8 +15 +- +yes", text) and re.search(r"ref log-probs +8 +15 +- +yes", text)
    assert re.search(r"actor +1 +120 +8 +15 +- +no +token-mean +1.0 +yes", text), text
    roles = text.split("Per role")[1].split("Memory plan")[0]
    assert not re.search(r"^ +values ", roles, re.M) and not re.search(r"^ +critic ", roles, re.M)  # GRPO: no critic


def test_planner_cli_json_is_the_layout_and_batch_plan():
    out = planner("--config", str(SEED_1), "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert set(plan) == {"dims", "device_map", "batch"}  # the memory plan is memory_plan.py's
    assert plan["device_map"]["rollout_tp_groups"] == [[0, 1], [2, 3], [4, 5]]


def test_planner_cli_refuses_a_bad_config():
    out = planner("--config", str(SEED_1), "actor_rollout_ref.rollout.tensor_model_parallel_size=4")
    assert out.returncode == 1
    assert "tensor_model_parallel_size=4" in out.stderr and out.stdout == ""


@pytest.mark.parametrize("override, fragment", [
    ("actor_rollout_ref.nccl_timeout=0", "actor_rollout_ref.nccl_timeout=0 must be > 0"),
    ("data.train_files=null", "data.train_files=null: no training data"),
    ("trainer.total_training_steps=-5", "trainer.total_training_steps=-5 must be >= 0"),
    ("actor_rollout_ref.actor.optim.lr=-1", "actor_rollout_ref.actor.optim.lr=-1.0 must be >= 0"),
    ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n=0 must be >= 1"),
])
def test_planner_refuses_what_the_trainer_refuses(override, fragment):
    out = planner("--config", str(ROOT / "configs" / "tiny_cpu.yaml"), override)
    assert out.returncode == 1 and fragment in out.stderr, out.stderr


def test_every_rollout_group_needs_a_validation_prompt():
    """Each rollout dp group generates its own share of the validation set; a group with none crashed
    at the first validation while the other waited in a collective (max_val_samples=1, 2 groups)."""
    from mesh_utils import ParallelDims, check_validation_share

    dims = ParallelDims(world_size=4, nnodes=1, n_gpus_per_node=4, fsdp=4, infer_tp=2, sp=1)  # 2 rollout groups
    check_validation_share(2, dims, None)
    with pytest.raises(ConfigError, match=r"1 validation prompt\(s\) \(data.max_val_samples=1\) .* 2 rollout dp "
                                          r"groups; use at least 2 \(data.max_val_samples >= 2\)"):
        check_validation_share(1, dims, 1)


# --- a separate rollout pool (actor_rollout_ref.hybrid_engine=false, trainer.v1.trainer_mode=separate_async) ---

SPLIT = ["actor_rollout_ref.hybrid_engine=false", "trainer.v1.trainer_mode=separate_async",
         "actor_rollout_ref.rollout.nnodes=1", "trainer.v1.separate_async.parameter_sync_step=1",
         "trainer.v1.separate_async.num_warmup_batches=0", "trainer.val_before_train=false", "trainer.test_freq=-1",
         "trainer.save_freq=-1"]


def test_seed_split_trainer_node_and_rollout_node():
    """The seed's job with a second node of rollout: the trainers keep the seed's numbers (6 ranks, 120 samples
    each), the pool's TP pairs sit on node 1, and the trainers' idle engines pair up on their own ranks."""
    dims, p = plan(SEED_1, *SPLIT)
    assert (dims.world_size, dims.rollout_ranks, dims.launched, dims.rollout_dp) == (6, 6, 12, 3)
    assert p.samples_per_rank == 120 and p.prompts_per_rollout_group == 20
    dm = plan_device_map(dims)
    assert dm.fsdp_groups == [[0, 1, 2, 3, 4, 5]]
    assert dm.rollout_tp_groups == [[6, 7], [8, 9], [10, 11]]
    assert dm.idle_engine_groups == [[0, 1], [2, 3], [4, 5]]
    assert dm.node_of_rank == [0] * 6 + [1] * 6
    hsdp, _ = plan(SEED_1, *SPLIT, "actor_rollout_ref.actor.fsdp_config.fsdp_size=3")
    assert plan_device_map(hsdp).fsdp_groups == [[0, 1, 2], [3, 4, 5]]  # over the trainers only


def test_split_launch_counts_both_pools():
    dims, _ = plan(SEED_1, *SPLIT, "actor_rollout_ref.rollout.n_gpus_per_node=2", world=8)
    assert dims.launched == 8 and dims.rollout_dp == 1
    with pytest.raises(ConfigError, match=re.escape("torchrun launched 6 processes but the trainers (trainer.nnodes x "
                                                    "trainer.n_gpus_per_node = 1 x 6) and the rollout pool")):
        plan(SEED_1, *SPLIT, world=6)


@pytest.mark.parametrize("overrides, fragments", [
    # a pool that is not a multiple of the TP size / a TP group across the pool's nodes
    (["actor_rollout_ref.rollout.n_gpus_per_node=3"],
     ["tensor_model_parallel_size=2 must divide actor_rollout_ref.rollout.n_gpus_per_node=3", "Valid values: 1, 3"]),
    (["actor_rollout_ref.rollout.nnodes=2", "actor_rollout_ref.rollout.n_gpus_per_node=1",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
     ["would span two of its nodes", "rollout.n_gpus_per_node=1"]),
    # vLLM's consecutive TP groups over the whole job: none may hold a trainer and a rollout rank
    (["trainer.n_gpus_per_node=3", "actor_rollout_ref.rollout.n_gpus_per_node=2", "data.train_batch_size=6",
      "actor_rollout_ref.actor.ppo_mini_batch_size=6"],
     ["must divide the 3 trainer ranks", "trainer and rollout ranks at once"]),
    # a batch that does not divide over the pool's engines, or over the trainers
    (["actor_rollout_ref.rollout.n_gpus_per_node=16"],
     ["data.train_batch_size=60 must be a positive multiple of the 8 rollout dp groups (rollout pool 16"]),
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n_gpus_per_node=2", "actor_rollout_ref.rollout.n=1",
      "algorithm.adv_estimator=gae", "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6"],
     ["6 samples cannot be split evenly over 4 ranks"]),
], ids=["pool-not-tp-multiple", "tp-across-pool-nodes", "tp-across-roles", "batch-over-engines", "batch-over-trainers"])
def test_split_pitfalls_are_clear_errors(overrides, fragments):
    with pytest.raises(ConfigError) as err:
        plan(SEED_1, *SPLIT, *overrides)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_planner_cli_prints_the_roles():
    out = planner("--config", str(SEED_1), *SPLIT, "actor_rollout_ref.rollout.n_gpus_per_node=2")
    assert "rollout pool 1 node(s) x 2 = ranks 6..7" in out.stdout and "     6     1  rollout" in out.stdout
    assert "hands them to the 6 trainer ranks" in out.stdout
