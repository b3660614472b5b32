
import pytest
from conftest import ROOT

from config import ConfigError, flat_keys, load_config, parse_override

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


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


def test_choices_equal_what_ppo_core_implements():
    """config.py names the choices (and stays free of torch); ppo_core.py implements exactly those."""
    import subprocess
    import sys

    import config
    import ppo_core

    assert tuple(ppo_core.ADV_ESTIMATORS) == config.ADV_ESTIMATORS
    assert tuple(ppo_core.KL_ESTIMATORS) == config.KL_ESTIMATORS
    assert set(config.GROUP_ESTIMATORS) | set(config.CRITIC_ESTIMATORS) <= set(config.ADV_ESTIMATORS)
    assert ppo_core.LOSS_AGG_MODES is config.LOSS_AGG_MODES
    for mode in config.LOSS_AGG_MODES:  # each accepted mode aggregates without error
        ppo_core.agg_loss(ppo_core.torch.ones(2, 3), ppo_core.torch.ones(2, 3), mode)
    code = "import sys, config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=config.Path(config.__file__).parent).returncode == 0


def test_verl_defaults():
    cfg = load_config()
    assert cfg.data.filter_overlong_prompts is False and cfg.data.truncation == "error"
    assert cfg.critic.loss_agg_mode is None and cfg.critic.shuffle is None  # null: the actor's
    assert cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "constant"


@pytest.mark.parametrize("override,fragment", [
    ("actor_rollout_ref.hybrid_engine=false", "hybrid_engine=false"),
    ("data.val_batch_size=8", "data.val_batch_size=8"),
    ("critic.fsdp_config.fsdp_size=2", "critic.fsdp_config.fsdp_size=2"),
    ("trainer.max_critic_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=2"),
    ("actor_rollout_ref.rollout.temperature=0", "temperature=0.0"),
    ("trainer.logger=[console,wandbb]", "['wandbb']"),
    ("reward_model.enable=true", "reward_model.enable=true"),
])
def test_unsupported_values_are_refused_with_the_key(override, fragment):
    from config import check_supported

    with pytest.raises(ConfigError, match=None) as err:
        check_supported(load_config(None, [override]))
    assert fragment in str(err.value)


def test_config_records_the_keys_a_program_reads():
    from config import non_defaults, to_yaml, unread_keys

    cfg = load_config(None, ["data.seed=3"])
    to_yaml(cfg), non_defaults(cfg), dict(cfg)  # looking at the whole config is not reading it
    assert len(unread_keys(cfg)) == len(flat_keys())
    cfg.data.seed, cfg.actor_rollout_ref.actor.optim["lr"]
    assert set(flat_keys()) - set(unread_keys(cfg)) == {"data.seed", "actor_rollout_ref.actor.optim.lr"}
