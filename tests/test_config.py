
import re

import pytest
from conftest import ROOT

from config import ConfigError, algorithm_traits, check_supported, flat_keys, load_config, parse_override

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DATA = "data.train_files=train.parquet"  # a run needs training data; the checks below look at the config alone


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.trainer.n_gpus_per_node >= 1
    assert isinstance(cfg.actor_rollout_ref.model.path, str)


def test_shipped_configs_include_the_seed_jobs():
    names = {p.name for p in CONFIGS}
    assert {"gsm8k_grpo_1node_6gpu.yaml", "gsm8k_grpo_2node_6gpu.yaml"} <= names


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  train_batch_size: 60\nactor_rollout_ref:\n  rollout:\n    n: 12\n")
    cfg = load_config(f, ["actor_rollout_ref.rollout.n=4", "trainer.logger=[console,tensorboard]",
                          "data.val_files=null", "actor_rollout_ref.actor.optim.lr=3e-6"])
    assert cfg.data.train_batch_size == 60
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert cfg.data.val_files is None
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-6)
    # untouched keys keep their defaults, reachable both ways
    assert cfg["algorithm"]["gamma"] == cfg.algorithm.gamma == 1.0


def test_int_is_accepted_for_float_but_bool_is_not_int():
    cfg = load_config(None, ["actor_rollout_ref.actor.grad_clip=1"])
    assert isinstance(cfg.actor_rollout_ref.actor.grad_clip, float)
    with pytest.raises(ConfigError, match=r"'data.train_batch_size' expects int, got True"):
        load_config(None, ["data.train_batch_size=true"])


@pytest.mark.parametrize("override, pattern", [
    ("data.train_batch_siz=60", r"unknown config key 'data.train_batch_siz'.*Did you mean 'data.train_batch_size'"),
    ("data.train_batch_size=sixty", r"'data.train_batch_size' expects int, got 'sixty'"),
    ("algorithm.adv_estimator=ppo", r"'algorithm.adv_estimator' is 'ppo'; valid values: gae, grpo"),
    ("trainer.nnodes", r"not of the form key=value"),
    ("data=3", r"unknown config key 'data'|section"),
])
def test_bad_overrides_name_the_key(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_misspelled_key_in_yaml_is_an_error(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("actor_rollout_ref:\n  rollout:\n    tensor_parallel_size: 2\n")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.tensor_parallel_size.*" + str(f)):
        load_config(f)


def test_wrong_type_in_yaml_and_missing_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  logger: console\n")
    with pytest.raises(ConfigError, match=r"'trainer.logger' expects list"):
        load_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_parse_override_values():
    assert parse_override("trainer.test_freq=5") == ("trainer.test_freq", 5)
    assert parse_override("+trainer.seed=7") == ("trainer.seed", 7)
    assert parse_override("data.train_files=a=b.parquet") == ("data.train_files", "a=b.parquet")


def test_every_key_has_a_default_of_its_type():
    for key, (types, default) in flat_keys().items():
        types = types if isinstance(types, tuple) else (types,)
        assert isinstance(default, types), key


def test_the_source_reading_equals_ppo_core_registries():
    """config.algorithm_traits reads ppo_core.py's registrations from its text; importing it must agree."""
    import config
    import ppo_core

    traits = config.algorithm_traits()
    assert {name: (e.name, e.needs_critic, e.compares_group, e.baseline_rollout)
            for name, e in ppo_core.ADV_ESTIMATORS.items()} == {
        name: (t.name, t.needs_critic, t.compares_group, t.baseline_rollout) for name, t in traits.adv_estimators.items()}
    assert list(traits.adv_estimators) == list(ppo_core.ADV_ESTIMATORS)  # the order the errors list them in
    assert {name: (p.name, p.keys) for name, p in ppo_core.POLICY_LOSSES.items()} == {
        name: (t.name, t.keys) for name, t in traits.policy_losses.items()}
    assert list(traits.policy_losses) == list(ppo_core.POLICY_LOSSES)
    assert traits.kl_estimators == tuple(ppo_core.KL_ESTIMATORS)
    assert traits.loss_agg_modes == ppo_core.LOSS_AGG_MODES
    assert traits.distillation_losses == ppo_core.DISTILLATION_LOSS_MODES


def test_the_planner_checks_without_torch():
    """config and the planner's validation never import torch (the launch scripts' gate)."""
    import subprocess
    import sys

    code = ("import sys, config, mesh_utils; mesh_utils.validate(config.load_config('configs/tiny_cpu.yaml', "
            "['algorithm.adv_estimator=gae'])); sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_the_source_reader_on_a_small_source(tmp_path):
    """The reader takes each trait from the decorator, else from the register function's default, and
    refuses what it cannot read."""
    import config

    source = tmp_path / "core.py"
    source.write_text('''
def register_adv_estimator(name, *, needs_critic=False, compares_group=False, baseline_rollout=None): ...
def register_policy_loss(name, *, keys=()): ...
@register_adv_estimator("mine", compares_group=True)
@other_decorator()
def mine(): ...
@register_adv_estimator("critic_one", needs_critic=True, baseline_rollout="greedy")
def critic_one(): ...
@register_policy_loss("loss", keys=("a", "b"))
def loss(): ...
KL_ESTIMATORS: dict = {"k1": f, "k3": g}
LOSS_AGG_MODES = ("token-mean",)
DISTILLATION_LOSS_MODES = ("k3",)
''')
    traits = config.algorithm_traits(source)
    assert traits.adv_estimators == {"mine": config.EstimatorTraits("mine", False, True, None),
                                     "critic_one": config.EstimatorTraits("critic_one", True, False, "greedy")}
    assert traits.policy_losses == {"loss": config.PolicyLossTraits("loss", ("a", "b"))}
    assert (traits.kl_estimators, traits.loss_agg_modes, traits.distillation_losses) == (
        ("k1", "k3"), ("token-mean",), ("k3",))
    not_literal = tmp_path / "not_literal.py"  # (algorithm_traits caches by path)
    not_literal.write_text(source.read_text().replace("compares_group=True", "compares_group=FLAG"))
    with pytest.raises(RuntimeError, match=r"not_literal.py:4: .* literal arguments here, got 'FLAG'"):
        config.algorithm_traits(not_literal)
    twice = tmp_path / "twice.py"
    twice.write_text(source.read_text().replace('"critic_one"', '"mine"'))
    with pytest.raises(RuntimeError, match=r"twice.py:7: .* must name one new string"):
        config.algorithm_traits(twice)


def test_verl_defaults():
    cfg = load_config()
    assert cfg.data.filter_overlong_prompts is False and cfg.data.truncation == "error"
    assert cfg.critic.loss_agg_mode is None and cfg.critic.shuffle is None  # null: the actor's
    assert cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "constant"


@pytest.mark.parametrize("override,fragment", [
    ("actor_rollout_ref.hybrid_engine=false", "hybrid_engine=false (a rollout pool on ranks of its own) needs "
                                              "trainer.v1.trainer_mode=separate_async"),
    ("data.val_batch_size=8", "data.val_batch_size=8"),
    ("critic.fsdp_config.fsdp_size=2", "critic.fsdp_config.fsdp_size=2"),
    ("trainer.max_critic_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=2"),
    ("actor_rollout_ref.rollout.temperature=0", "temperature=0.0"),
    ("trainer.logger=[console,wandbb]", "['wandbb']"),
    ("reward_model.enable=true", "reward_model.enable=true needs reward_model.model.path"),
    ("reward_model.overlong_buffer.enable=true", "reward_model.reward_manager=dapo"),
    ("data.gen_batch_size=96", "algorithm.filter_groups.enable=true"),
])
def test_unsupported_values_are_refused_with_the_key(override, fragment):
    from config import check_supported

    with pytest.raises(ConfigError, match=None) as err:
        check_supported(load_config(None, [DATA, override]))
    assert fragment in str(err.value)


def test_config_records_the_keys_a_program_reads():
    from config import non_defaults, to_yaml, unread_keys

    cfg = load_config(None, ["data.seed=3"])
    to_yaml(cfg), non_defaults(cfg), dict(cfg)  # looking at the whole config is not reading it
    assert len(unread_keys(cfg)) == len(flat_keys())
    cfg.data.seed, cfg.actor_rollout_ref.actor.optim["lr"]
    assert set(flat_keys()) - set(unread_keys(cfg)) == {"data.seed", "actor_rollout_ref.actor.optim.lr"}


TEACHER = ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=teacher"]


@pytest.mark.parametrize("overrides,fragment", [
    (["reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true"], "overlong_buffer.len=0"),
    (["reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true", "data.max_response_length=8",
      "reward_model.overlong_buffer.len=9"], "data.max_response_length=8"),
    (["algorithm.filter_groups.enable=true", "data.gen_batch_size=0"], "data.gen_batch_size=0"),
    # a learned reward model's score is the training score as it is: nothing of the rule's is added
    (["reward_model.enable=true", "reward_model.model.path=rm", "reward_model.reward_manager=dapo",
      "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4"], "no overlong penalty"),
    (["reward_model.enable=true", "reward_model.model.path=rm", "algorithm.filter_groups.enable=true",
      "algorithm.filter_groups.metric=acc"], "filter on the score"),
    (["reward_model.enable=true", "reward_model.model.path=rm", "reward_model.micro_batch_size_per_gpu=0"],
     "reward_model.micro_batch_size_per_gpu=0 must be >= 1"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward",
      "algorithm.use_kl_in_reward=true"], "metric=seq_reward"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0"],
     "clip_cov_ratio=0.0"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov", "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=2"],
     "kl_cov_ratio=2.0"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "actor_rollout_ref.actor.policy_loss.clip_cov_lb=6"],
     "clip_cov_lb=6.0"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=ppo"], ", ".join(algorithm_traits().policy_losses)),
    # a key of another mode would be ignored
    (["actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.001"],
     "clip_cov_ratio=0.001 is read by loss_mode=clip_cov only, not by actor_rollout_ref.actor.policy_loss.loss_mode="
     "vanilla"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=1"],
     "ppo_kl_coef=1.0 is read by loss_mode=kl_cov only"),
    # sapo's temperatures sit under actor, as in verl, and are refused for another mode too
    (["actor_rollout_ref.actor.tau_neg=2"], "actor_rollout_ref.actor.tau_neg=2.0 is read by loss_mode=sapo only"),
    (["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"], "dro_beta=0.1 is read by loss_mode=dro only"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=dro"], "loss_mode=dro needs actor_rollout_ref.actor.policy_loss."
     "dro_beta"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=dro", "actor_rollout_ref.actor.policy_loss.dro_beta=0"],
     "dro_beta=0.0 must be > 0"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_pos=0"], "tau_pos=0.0"),
    (["actor_rollout_ref.actor.loss_agg_mode=token-max"], "token-mean, token-sum, seq-mean-token-sum"),
    # on-policy distillation: a teacher, on the actor's mesh, and a loss whose gradient sees the teacher
    (["distillation.enabled=true"], "needs distillation.teacher_models.teacher_model.model_path"),
    ([*TEACHER, "distillation.nnodes=1", "distillation.n_gpus_per_node=4"],
     "distillation.nnodes=1 (x n_gpus_per_node=4) asks for verl's separate teacher pool"),
    ([*TEACHER, "distillation.distillation_loss.loss_mode=k1"], "use_policy_gradient=true (k1 as a per-token reward)"),
    ([*TEACHER, "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=null"],
     "forward_kl_topk needs distillation.distillation_loss.topk"),
    ([*TEACHER, "distillation.distillation_loss.loss_mode=forward_kl_topk",
      "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], "ulysses_sequence_parallel_size=2 is not implemented"),
    ([*TEACHER, "distillation.distillation_loss.loss_mode=k4"], "forward_kl_topk, kl, k1, abs, mse, k2, low_var_kl, k3"),
    ([*TEACHER, "distillation.distillation_loss.policy_loss_mode=gspo"], "valid values: vanilla"),
    ([*TEACHER, "distillation.distillation_loss.topk=0"], "distillation.distillation_loss.topk=0 must be >= 1"),
])
def test_algorithm_keys_that_only_work_together(overrides, fragment):
    from config import check_supported

    with pytest.raises(ConfigError) as err:
        check_supported(load_config(None, [DATA, *overrides]))
    assert fragment in str(err.value)


def test_gen_batch_size_must_split_like_train_batch_size():
    from mesh_utils import validate

    base = [DATA, "algorithm.filter_groups.enable=true", "trainer.n_gpus_per_node=6", "data.train_batch_size=60",
            "actor_rollout_ref.actor.ppo_mini_batch_size=60", "actor_rollout_ref.rollout.n=12"]
    validate(load_config(None, [*base, "data.gen_batch_size=180"]))  # DAPO's 3x, on the seed's layout
    with pytest.raises(ConfigError, match="data.gen_batch_size=31 .* Nearest valid: 30"):
        validate(load_config(None, [*base, "data.gen_batch_size=31"]))


# Values no run can use, each refused before anything loads with the key, the value and a valid value
# (the schema's default); before these checks some trained an epoch, others ended in a torch traceback.
@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.nccl_timeout=0", "actor_rollout_ref.nccl_timeout=0 must be > 0 (seconds a collective may "
     "wait for the slowest rank); e.g. actor_rollout_ref.nccl_timeout=1800 (the default)."),
    ("data.train_files=null", "data.train_files=null: no training data."),
    ("data.train_files=[]", "data.train_files=[]: no training data."),
    ("trainer.total_training_steps=-1", "trainer.total_training_steps=-1 must be >= 0 (0: no training step, "
     "set-up only; null: trainer.total_epochs x the batches of an epoch); e.g. trainer.total_training_steps=null"),
    ("actor_rollout_ref.actor.optim.lr=-1", "actor_rollout_ref.actor.optim.lr=-1.0 must be >= 0; e.g. "
     "actor_rollout_ref.actor.optim.lr=1e-06 (the default)."),
    ("critic.optim.lr=-1e-5", "critic.optim.lr=-1e-05 must be >= 0; e.g. critic.optim.lr=1e-05 (the default)."),
    ("critic.optim.weight_decay=-0.1", "critic.optim.weight_decay=-0.1 must be >= 0; e.g. "
     "critic.optim.weight_decay=0.01"),
    ("actor_rollout_ref.actor.optim.betas=[0.9,1.0]", "actor_rollout_ref.actor.optim.betas=[0.9, 1.0] must be two "
     "numbers in [0, 1), Adam's decay rates of its moments; e.g. actor_rollout_ref.actor.optim.betas=[0.9,0.999]"),
    ("critic.optim.betas=[0.9]", "critic.optim.betas=[0.9] must be two numbers in [0, 1)"),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=1.5", "lr_warmup_steps_ratio=1.5 must be in [0, 1]"),
    ("critic.optim.total_training_steps=0", "critic.optim.total_training_steps=0 must be -1 (the run's length) or "
     ">= 1; e.g. critic.optim.total_training_steps=-1"),
    ("actor_rollout_ref.actor.ppo_epochs=0", "actor_rollout_ref.actor.ppo_epochs=0 must be >= 1; e.g. "
     "actor_rollout_ref.actor.ppo_epochs=1"),
    ("critic.ppo_epochs=0", "critic.ppo_epochs=0 must be >= 1; e.g. critic.ppo_epochs=null (the default)."),
    ("actor_rollout_ref.actor.clip_ratio=-0.2", "actor_rollout_ref.actor.clip_ratio=-0.2 must be in [0, 1); e.g. "
     "actor_rollout_ref.actor.clip_ratio=0.2"),
    ("actor_rollout_ref.actor.clip_ratio_low=1", "clip_ratio_low=1.0 must be in [0, 1)"),
    ("actor_rollout_ref.actor.clip_ratio_c=1", "clip_ratio_c=1.0 must be > 1"),
    ("actor_rollout_ref.actor.grad_clip=0", "actor_rollout_ref.actor.grad_clip=0.0 must be > 0"),
    ("actor_rollout_ref.rollout.temperature=-1", "actor_rollout_ref.rollout.temperature=-1.0: training samples"),
    ("actor_rollout_ref.rollout.val_kwargs.temperature=-1", "val_kwargs.temperature=-1.0 must be >= 0 (0: greedy)"),
    ("actor_rollout_ref.rollout.top_p=0", "actor_rollout_ref.rollout.top_p=0.0 must be in (0, 1]"),
    ("actor_rollout_ref.rollout.top_k=-2", "actor_rollout_ref.rollout.top_k=-2 must be >= -1"),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=1.5", "gpu_memory_utilization=1.5 must be in (0, 1]"),
    ("actor_rollout_ref.rollout.val_kwargs.n=0", "actor_rollout_ref.rollout.val_kwargs.n=0 must be >= 1"),
    ("data.max_response_length=0", "data.max_response_length=0 must be >= 1; e.g. data.max_response_length=512"),
    ("data.max_prompt_length=-3", "data.max_prompt_length=-3 must be >= 1"),
    ("algorithm.gamma=1.5", "algorithm.gamma=1.5 must be in [0, 1]"),
    ("algorithm.kl_ctrl.kl_coef=-0.001", "algorithm.kl_ctrl.kl_coef=-0.001 must be >= 0"),
    ("critic.cliprange_value=-0.5", "critic.cliprange_value=-0.5 must be >= 0"),
    ("trainer.save_freq=-2", "trainer.save_freq=-2 must be >= -1 (-1 or 0: never; k: every k steps and at the "
     "last); e.g. trainer.save_freq=-1"),
    ("trainer.max_consecutive_skipped_steps=0", "trainer.max_consecutive_skipped_steps=0 must be >= 1"),
    ("reward_model.sandbox_fusion.max_concurrent=0", "reward_model.sandbox_fusion.max_concurrent=0 must be >= 1"),
    ("trainer.max_actor_ckpt_to_keep=0", "trainer.max_actor_ckpt_to_keep=0 must be >= 1 (null keeps every "
     "checkpoint)"),
])
def test_values_that_cannot_work_are_refused(override, message):
    with pytest.raises(ConfigError) as err:
        check_supported(load_config(None, [DATA, override]))
    assert message in str(err.value)


OTB = ["algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"]


@pytest.mark.parametrize("overrides, message", [
    (["trainer.critic_warmup=2", "algorithm.adv_estimator=grpo"], "trainer.critic_warmup=2 with algorithm.adv_estimator=grpo, which has no critic "
     "to warm up; set trainer.critic_warmup=0, or adv_estimator=gae."),
    (["trainer.critic_warmup=-1", "algorithm.adv_estimator=gae"], "trainer.critic_warmup=-1 must be >= 0"),
    (OTB[:1], "set actor_rollout_ref.actor.calculate_sum_pi_squared=true (as verl)"),
    ([*OTB, "algorithm.rollout_correction.bypass_mode=true"], "there is no sum_v pi(v)^2; set "
     "algorithm.rollout_correction.bypass_mode=false"),
    ([*OTB, "algorithm.rollout_correction.rollout_is=token"], "set algorithm.rollout_correction.rollout_is=null"),
    (["algorithm.adv_estimator=tir_optimal_token_baseline"], "algorithm.adv_estimator=tir_optimal_token_baseline reads "
     "sum_v pi(v)^2"),
    (["algorithm.adv_estimator=gdpo"], "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,format]", "algorithm.gdpo_reward_weights=[1]"],
     "gdpo_reward_weights=[1] must be one number per gdpo_reward_keys=['acc', 'format']"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc]", "algorithm.use_kl_in_reward=true"],
     "the KL penalty in the reward would be dropped"),
    (["algorithm.adv_estimator=grpo", "algorithm.gdpo_reward_keys=[acc]"],
     "algorithm.gdpo_reward_keys=['acc'] is read by algorithm.adv_estimator=gdpo only"),
])
def test_estimator_inputs_that_are_missing_are_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_supported(load_config(None, [DATA, *overrides]))
    assert message in str(err.value)
    check_supported(load_config(None, [DATA, "trainer.critic_warmup=2", "algorithm.adv_estimator=gae"]))
    check_supported(load_config(None, [DATA, *OTB]))


@pytest.mark.parametrize("override", [
    "trainer.total_training_steps=0",  # verl: 0 steps (set-up, then exit); null: total_epochs x batches per epoch
    "trainer.total_epochs=0", "trainer.save_freq=0", "trainer.test_freq=-1", "actor_rollout_ref.actor.optim.lr=0",
    "actor_rollout_ref.actor.clip_ratio_high=10", "actor_rollout_ref.rollout.top_k=0", "algorithm.lam=0",
    "actor_rollout_ref.rollout.val_kwargs.temperature=0",
])
def test_edge_values_that_work_are_accepted(override):
    check_supported(load_config(None, [DATA, override]))


PLACEHOLDER_VALUES = {"reward_server": "http://127.0.0.1:1", "tests": "tests", "root": "outputs/short_runs",
                      "code_val": "assets/data/val.parquet", "untrained": "m", "teacher": "t", "student": "s",
                      "reward_model": "assets/tiny-rm", "moe": "assets/tiny-qwen2-moe"}


def test_every_short_run_config_is_valid():
    """tests/short_runs.py's cases share a few launches, where one bad config fails every test that uses
    the launch; check each here, in the fast loop, as the trainer would before any model loads (at its
    launch's world size)."""
    from short_runs import CASES, LAUNCHES, launch_of

    from config import check_supported
    from mesh_utils import validate

    for name, (path, overrides) in CASES.items():
        cfg = load_config(path, ["data.train_files=assets/data/train.parquet",
                                 *(re.sub(r"\{(\w+)\}", lambda m: PLACEHOLDER_VALUES[m[1]], o) for o in overrides)])
        try:
            check_supported(cfg)
            validate(cfg, LAUNCHES[launch_of(name)][0])
        except ConfigError as e:
            raise AssertionError(f"short run {name}: {e}") from None


V1 = "trainer.v1"
ASYNC = [DATA, f"{V1}.trainer_mode=colocate_async", f"{V1}.sampler.max_off_policy_strategy=wait",
         f"{V1}.sampler.max_off_policy_threshold=2", "algorithm.rollout_correction.rollout_is=token"]


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.over_sample_rate=0.1"], "over_sample_rate=0.1 is not implemented"),
    (["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.environment=agent.GuessNumberEnv"],
     "multi_turn.enable=true is not supported yet"),
    (["algorithm.filter_groups.enable=true"], "dynamic sampling) is not supported yet"),
    (["algorithm.adv_estimator=remax"], "baseline rollout"),
    ([f"{V1}.colocate_async.num_warmup_batches=2"], "num_warmup_batches <= 1"),
    ([f"{V1}.sampler.max_off_policy_threshold=0"], "max_off_policy_threshold=0 must be >= 1"),
    # tokens of older weights without a correction: the clip would be anchored at a policy that never sampled
    (["algorithm.rollout_correction.rollout_is=null"], "rollout_is=token"),
    ([f"{V1}.trainer_mode=fully_async"], "valid values: sync, colocate_async, separate_async"),
    ([f"{V1}.sampler.max_off_policy_strategy=keep"], "valid values: drop, wait"),
])
def test_colocate_async_refusals(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_supported(load_config(None, [*ASYNC, *overrides]))


def test_colocate_async_accepts_the_corrected_and_the_degenerate_settings():
    check_supported(load_config(None, ASYNC))
    check_supported(load_config(None, [*ASYNC, "algorithm.rollout_correction.rollout_is=null",
                                       "algorithm.rollout_correction.bypass_mode=true"]))
    # no batch ahead: nothing is ever cut, no token is stale, so nothing needs correcting
    check_supported(load_config(None, [*ASYNC, "algorithm.rollout_correction.rollout_is=null",
                                       f"{V1}.colocate_async.num_warmup_batches=0"]))
    # drop never lets a group pass the threshold, whatever the warm-up
    check_supported(load_config(None, [*ASYNC, f"{V1}.sampler.max_off_policy_strategy=drop",
                                       f"{V1}.colocate_async.num_warmup_batches=3"]))


SPLIT = [DATA, "actor_rollout_ref.hybrid_engine=false", f"{V1}.trainer_mode=separate_async",
         "actor_rollout_ref.rollout.nnodes=1", f"{V1}.separate_async.parameter_sync_step=1",
         "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "algorithm.adv_estimator=grpo",
         "actor_rollout_ref.rollout.n=2", "algorithm.rollout_correction.rollout_is=token",
         "trainer.val_before_train=false"]


@pytest.mark.parametrize("overrides, message", [
    # the three keys of a separate pool come together (verl 0.9)
    (["actor_rollout_ref.hybrid_engine=true"], "separate_async with actor_rollout_ref.hybrid_engine=true"),
    (["actor_rollout_ref.rollout.nnodes=0"], "needs a rollout pool: actor_rollout_ref.rollout.nnodes=0"),
    ([f"{V1}.trainer_mode=sync", "actor_rollout_ref.hybrid_engine=true"],
     "actor_rollout_ref.rollout.nnodes=1 n_gpus_per_node=null describe a rollout pool"),
    ([f"{V1}.trainer_mode=sync"], "hybrid_engine=false (a rollout pool on ranks of its own) needs"),
    # verl's rule: train_batch_size = parameter_sync_step x ppo_mini_batch_size
    ([f"{V1}.separate_async.parameter_sync_step=4"], "data.train_batch_size=4 must equal trainer.v1.separate_async."
                                                       "parameter_sync_step=4 x actor_rollout_ref.actor.ppo_mini_batch_size=4"),
    ([f"{V1}.separate_async.num_warmup_batches=2"], "0 (sequential) or 1 (one step off)"),
    ([f"{V1}.sampler.max_off_policy_threshold=1"], "Raise the threshold to 2"),
    ([f"{V1}.sampler.max_off_policy_strategy=wait"], "Leave it at drop"),
    # one step off without a correction: the clip anchored at a policy that never sampled the batch
    (["algorithm.rollout_correction.rollout_is=null"], "num_warmup_batches=0 (sequential)"),
])
def test_separate_async_refusals(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_supported(load_config(None, [*SPLIT, *overrides]))


def test_separate_async_accepts_sequential_and_corrected_one_step_off():
    check_supported(load_config(None, [*SPLIT, "trainer.save_freq=2", "trainer.val_before_train=true",
                                       "trainer.test_freq=2"]))  # checkpoints hold the pool's state; it validates
    check_supported(load_config(None, [*SPLIT, "algorithm.rollout_correction.rollout_is=null",
                                       "algorithm.rollout_correction.bypass_mode=true"]))
    check_supported(load_config(None, [*SPLIT, "algorithm.rollout_correction.rollout_is=null",
                                       f"{V1}.separate_async.num_warmup_batches=0"]))
    # token-budget micro batches: agreed over the trainers (the train dp group), tests/test_train_ppo_split.py
    check_supported(load_config(None, [*SPLIT, "actor_rollout_ref.actor.use_dynamic_bsz=true"]))
    # DAPO's dynamic sampling: the pool's generation batches until the step's prompts have groups that differ
    check_supported(load_config(None, [*SPLIT, "algorithm.filter_groups.enable=true"]))
    # a learned reward model: on the pool's ranks, scoring before the hand-off
    check_supported(load_config(None, [*SPLIT, "reward_model.enable=true", "reward_model.model.path=rm"]))
    # multi-turn rollouts (their environments and tools on the pool) and ReMax's greedy baseline, generated there
    check_supported(load_config(None, [*SPLIT, "actor_rollout_ref.rollout.multi_turn.enable=true",
                                       "actor_rollout_ref.rollout.multi_turn.environment=m.E",
                                       "algorithm.adv_estimator=remax"]))
    # LoRA: trainer 0 sends the merged weights, then the modules the adapter changes
    check_supported(load_config(None, [*SPLIT, "actor_rollout_ref.model.lora_rank=8"]))


# --- verl's own files: whole, hydra-style partial, and the three kinds of key --------------------------

def _verl_generated(tmp_path):
    """verl 0.9.1's generated config, written back as YAML from the repo's copy of its keys and defaults
    (interpolations as verl wrote them)."""
    import yaml

    from config import _nested, verl_defaults

    path = tmp_path / "_generated_ppo_trainer.yaml"
    path.write_text(yaml.safe_dump(_nested(verl_defaults()), sort_keys=False))
    return path


def test_the_key_table_covers_every_verl_key_with_one_rule_each():
    """Every leaf of verl 0.9.1's generated config is a key of SCHEMA or decided by a rule (no catch-all),
    and every rule decides some key: a key of a new verl version cannot fall through the cracks."""
    import json

    from config import IMPLEMENTED, VERL_DEFAULTS_FILE, VERL_KEY_RULES, verl_key_rule, verl_key_table

    fixture = json.loads(VERL_DEFAULTS_FILE.read_text())
    assert fixture["verl"] == "0.9.1" and len(fixture["defaults"]) == 898
    table = verl_key_table()
    assert [key for key, _, _ in table] == list(fixture["defaults"])
    assert [key for key, kind, _ in table if kind is None] == []
    assert sum(kind == IMPLEMENTED for _, kind, _ in table) == 194
    used = {verl_key_rule(key).pattern for key, kind, _ in table if kind != IMPLEMENTED}
    assert [rule.pattern for rule in VERL_KEY_RULES if rule.pattern not in used] == []


def test_the_docs_table_is_the_generated_one():
    from config import verl_rules_markdown

    assert verl_rules_markdown() in (ROOT / "docs" / "verl-semantics.md").read_text()


def test_verls_generated_config_loads_and_plans(tmp_path):
    """The whole generated file with only the data and model paths given: it loads, passes every check,
    plans, and the start-up lists the keys with no effect here; one unsupported value is refused by key."""
    from config import NO_EFFECT, describe_verl_keys, verl_key_rule, verl_keys_without_effect
    from mesh_utils import validate

    path = _verl_generated(tmp_path)
    paths = [DATA, "actor_rollout_ref.model.path=assets/tiny-qwen2"]
    cfg = load_config(path, paths)
    check_supported(cfg)
    dims, plan = validate(cfg, None)
    assert dims.world_size == 8 and cfg.trainer.total_epochs == 30  # verl's values, not this program's
    assert cfg.actor_rollout_ref.rollout.name == "vllm"  # verl's ??? : this program's default, said at start-up
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"  # an interpolation, resolved
    assert len(verl_keys_without_effect(cfg)) == 898 - 194
    text = describe_verl_keys(cfg)
    assert "verl keys with no effect here (704" in text and "actor_rollout_ref.rollout.name='???' -> 'vllm'" in text
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.rollout.name' is 'sglang'; valid values: vllm"):
        check_supported(load_config(path, [*paths, "actor_rollout_ref.rollout.name=sglang"]))
    # not implemented: refused off verl's default, with the key, the value and what to set
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.use_liger=True \(in the command line\).*"
                                          r"Liger.*set it false"):
        load_config(path, [*paths, "actor_rollout_ref.model.use_liger=true"])
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.prompt_length=100 .*data.max_prompt_length.*"
                                          r"verl's default \(512\)"):
        load_config(path, [*paths, "actor_rollout_ref.rollout.prompt_length=100"])
    # an interpolated default is compared with its value in this config
    load_config(path, [*paths, "data.max_prompt_length=100", "actor_rollout_ref.rollout.prompt_length=100"])
    # no effect here: any value; the example scripts' lines
    for line in ("actor_rollout_ref.model.use_shm=True", "actor_rollout_ref.rollout.load_format=safetensors",
                 "actor_rollout_ref.rollout.layered_summon=True"):
        load_config(path, [*paths, line])
        assert verl_key_rule(line.split("=")[0]).kind == NO_EFFECT
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.actor.profiler.enabel'.*Did you mean "
                                          r"'actor_rollout_ref.actor.profiler.enable'"):
        load_config(path, [*paths, "actor_rollout_ref.actor.profiler.enabel=true"])


PARTIAL = """\
hydra:
  searchpath:
    - file://verl/trainer/config
defaults:
  - ppo_trainer
  - _self_
data:
  train_files: train.parquet
  max_prompt_length: 1024
  max_response_length: ${data.max_prompt_length}
  train_batch_size: 64
actor_rollout_ref:
  model:
    path: assets/tiny-qwen2
  actor:
    ppo_mini_batch_size: ${oc.select:data.train_batch_size,256}
    ppo_epochs: 2
  rollout:
    name: vllm
    n: 4
critic:
  ppo_micro_batch_size_per_gpu: 4
trainer:
  experiment_name: partial
"""


def test_a_hydra_partial_file_resolves_as_verl_does(tmp_path):
    """A partial file with hydra's header, composed over verl's defaults: its own interpolations, and verl's
    defaults that interpolate its values, resolve to what verl's definitions say (written out by hand
    here), and the command line moves them before they resolve, as in verl."""
    path = tmp_path / "ppo_trainer_split.yaml"
    path.write_text(PARTIAL)
    cfg = load_config(path)
    check_supported(cfg)
    arr = cfg.actor_rollout_ref
    assert cfg.data.max_response_length == 1024  # ${data.max_prompt_length}
    assert arr.actor.ppo_mini_batch_size == 64  # ${oc.select:data.train_batch_size,256}
    # verl's critic defaults: ${oc.select:actor_rollout_ref.actor.ppo_epochs,1} and friends
    assert (cfg.critic.ppo_epochs, cfg.critic.ppo_mini_batch_size) == (2, 64)
    assert cfg.critic.forward_micro_batch_size_per_gpu == 4  # ${oc.select:.ppo_micro_batch_size_per_gpu,null}
    assert cfg.critic.forward_max_token_len_per_gpu == 32768  # ${.ppo_max_token_len_per_gpu}
    assert arr.rollout.log_prob_max_token_len_per_gpu == 16384  # the actor's ppo_max_token_len_per_gpu
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/partial"
    assert cfg.actor_rollout_ref.nccl_timeout == 600 and cfg.trainer.total_epochs == 30  # verl's defaults
    moved = load_config(path, ["data.max_prompt_length=256", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                               "trainer.experiment_name=moved"])
    assert moved.data.max_response_length == 256 and moved.critic.ppo_epochs == 2
    assert moved.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 4096
    assert moved.trainer.default_local_dir == "checkpoints/verl_examples/moved"
    # the same values as OmegaConf's own merge of verl's defaults and the file's body
    from omegaconf import OmegaConf

    body = OmegaConf.load(path)
    for name in ("hydra", "defaults"):
        body.pop(name)
    reference = OmegaConf.merge(OmegaConf.load(_verl_generated(tmp_path)), body)
    for key in ("data.max_response_length", "critic.ppo_mini_batch_size", "critic.forward_micro_batch_size_per_gpu",
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "trainer.default_local_dir"):
        value = cfg
        for part in key.split("."):
            value = value[part]
        assert value == OmegaConf.select(reference, key), key


def test_a_partial_file_that_names_other_verl_groups_is_refused(tmp_path):
    path = tmp_path / "megatron.yaml"
    path.write_text(PARTIAL.replace("  - ppo_trainer\n", "  - ppo_megatron_trainer\n"))
    with pytest.raises(ConfigError, match=r"names \['ppo_megatron_trainer'\]; only verl's ppo_trainer"):
        load_config(path)
    broken = tmp_path / "broken.yaml"
    broken.write_text(PARTIAL.replace("${data.max_prompt_length}", "${data.max_prompt_lenght}"))
    with pytest.raises(ConfigError, match=r"interpolation does not resolve.*max_prompt_lenght"):
        load_config(broken)


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.optim.lr=inf", "must be a finite number"),
    ("actor_rollout_ref.actor.optim.weight_decay=.inf", "must be a finite number"),
    ("algorithm.kl_ctrl.kl_coef=inf", "must be a finite number"),
    ("reward_model.timeout_s=inf", "must be a finite number"),
    ("actor_rollout_ref.actor.entropy_coeff=nan", "must be a finite number"),
    ("reward_model.judge.score_range=[10,0]", "two finite numbers low < high"),
    ("data.train_batch_size=" + "9" * 5000, "too long a number"),
    ("data={a: 1}", "'data' is a section; give its keys one by one"),
])
def test_non_finite_and_malformed_values_are_refused_before_anything_loads(override, message):
    """The audit's G2/G3: inf and nan where they mean nothing, a 5000-digit number, a section as a value."""
    with pytest.raises(ConfigError, match=message):
        check_supported(load_config("configs/tiny_cpu.yaml", [override]))


def test_inf_where_it_means_no_limit_is_accepted():
    check_supported(load_config("configs/tiny_cpu.yaml", ["actor_rollout_ref.actor.grad_clip=inf"]))


def test_a_key_verl_dropped_is_refused_with_what_does_its_job_here(tmp_path):
    with pytest.raises(ConfigError, match=r"interaction_config_path' in the command line is not a key of verl "
                                          r"0.9.1.*multi_turn.environment=module.Class"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.interaction_config_path=interaction.yaml"])
