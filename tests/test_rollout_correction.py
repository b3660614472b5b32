"""rollout_correction.py against references computed another way: plain loops over the vocabulary
for the top-k / top-p cut (ppo_core.truncation_mask, and vLLM's own implementation of it), per-element
loops for the weights and the rejection, hand values for the metrics, the whole batch against its
shares on 2 gloo ranks, and the log-probs of compute_log_probs' truncated output against a plain HF
forward."""

import math

import pytest
import torch
from conftest import run_gloo

import config
import ppo_core as pc
import rollout_correction as rc
from config import Config, ConfigError, load_config, parse_is_threshold, parse_rs_thresholds

INF = float("inf")


def rand(*shape, seed=0, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def lengths_to_mask(lengths, T):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()  # (B, T)


def rc_cfg(**values) -> Config:
    cfg = load_config(None, [f"algorithm.rollout_correction.{k}={v}" for k, v in values.items()])
    return cfg.algorithm.rollout_correction


def spec(**values) -> rc.Correction:
    return rc.Correction.from_config(rc_cfg(**values))


# --- the top-k / top-p cut ------------------------------------------------------------------------


def kept_ref(row: list[float], top_k: int, top_p: float) -> set[int]:
    """vLLM's rule, one token at a time in float64: top-k keeps logits >= the k-th largest; top-p keeps
    a token when the (top-k-renormalised) mass of the tokens strictly above it is below p, or it is the
    largest."""
    vocab = len(row)
    kept = set(range(vocab))
    if 0 < top_k < vocab:
        kth = sorted(row, reverse=True)[top_k - 1]
        kept = {t for t in kept if row[t] >= kth}
    if top_p < 1.0:
        z = sum(math.exp(row[t]) for t in kept)
        best = max(kept, key=lambda t: row[t])
        kept = {t for t in kept if t == best or sum(math.exp(row[u]) for u in kept if row[u] > row[t]) / z < top_p}
    return kept


CUTS = [(-1, 1.0), (0, 1.0), (5, 1.0), (1, 1.0), (-1, 0.9), (-1, 0.3), (-1, 0.01), (8, 0.7), (3, 0.95), (40, 0.5)]


@pytest.mark.parametrize("top_k,top_p", CUTS)
def test_truncation_mask_and_log_probs_equal_a_loop_over_the_vocabulary(top_k, top_p):
    logits = rand(30, 40, seed=1, scale=2.0)  # (N, V)
    labels = torch.randint(0, 40, (30,), generator=torch.Generator().manual_seed(2))
    mask = pc.truncation_mask(logits, top_k, top_p)
    got = pc.truncated_log_probs(logits, labels, top_k, top_p, chunk_size=7)  # chunks cut rows unevenly
    for i, row in enumerate(logits.tolist()):
        kept = kept_ref(row, top_k, top_p)
        assert {t for t in range(40) if mask[i, t]} == kept
        label = labels[i].item()
        want = row[label] - math.log(sum(math.exp(row[t]) for t in kept)) if label in kept else -INF
        assert got[i].item() == pytest.approx(want, abs=1e-12)


def test_no_cut_is_the_full_vocabulary_log_prob():
    logits = rand(4, 6, 50, seed=3).float()
    labels = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(3))  # not the global RNG
    labels[0], labels[1] = logits[0].argmax(-1), logits[1].argmin(-1)  # tokens inside and outside every cut
    full = pc.logprobs_from_logits(logits, labels)
    assert torch.allclose(pc.truncated_log_probs(logits, labels, -1, 1.0), full, atol=1e-6)
    cut = pc.truncated_log_probs(logits, labels, 10, 0.8)
    kept = cut.isfinite()  # labels outside the set get -inf
    assert 0 < kept.sum() < kept.numel() and (cut[kept] > full[kept]).all()  # renormalised: higher


def test_truncation_mask_equals_vllms_sampler():
    """The same cut as the engine's own code (vLLM 0.32's CPU path), in float32 as the engine runs it."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = rand(64, 300, seed=4, scale=3.0).float()
    for top_k, top_p in CUTS:
        k = torch.full((64,), top_k if 0 < top_k < 300 else 300, dtype=torch.long) if top_k > 0 else None
        p = torch.full((64,), top_p, dtype=torch.float32) if top_p < 1.0 else None
        engine = apply_top_k_top_p(logits.clone(), k, p)  # -inf outside the kept set
        assert torch.equal(pc.truncation_mask(logits, top_k, top_p), engine.isfinite()), (top_k, top_p)
        processed = engine.log_softmax(-1)  # what logprobs_mode="processed_logprobs" returns
        labels = engine.argmax(-1)
        assert torch.allclose(pc.truncated_log_probs(logits, labels, top_k, top_p),
                              processed.gather(-1, labels[:, None])[:, 0], atol=1e-6)


def test_compute_log_probs_truncation_equals_a_plain_forward(tiny_assets):
    """models.compute_log_probs' truncated output, padded and packed, against the HF model's logits cut by
    the reference loop; the log-probs are unchanged by asking for it."""
    from transformers import AutoModelForCausalLM

    import models

    model = AutoModelForCausalLM.from_pretrained(tiny_assets["tiny-qwen2"], torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (3, 11), generator=g)
    attention = torch.ones_like(ids)
    attention[0, :3] = 0  # a left-padded prompt
    attention[2, -2:] = 0  # a response that ended early
    batch = {"input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
             "responses": ids[:, -5:]}
    temperature, top_k, top_p = 0.7, 20, 0.8
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=batch["position_ids"]).logits
        logits = logits[:, -6:-1].double() / temperature  # (3, 5, V) the positions predicting the response
        full = models.compute_log_probs(model, batch, temperature, 2).log_probs
        for packed in (False, True):
            forward = models.compute_log_probs(model, batch, temperature, 2, use_remove_padding=packed,
                                               truncation=(top_k, top_p))
            again, cut = forward.log_probs, forward.truncated
            valid = attention[:, -5:].bool()
            assert torch.allclose(again[valid], full[valid], atol=1e-5)
            for i in range(3):
                for t in range(5):
                    if not valid[i, t]:
                        continue
                    row, label = logits[i, t].tolist(), ids[i, 6 + t].item()
                    kept = kept_ref(row, top_k, top_p)
                    want = row[label] - math.log(sum(math.exp(row[u]) for u in kept)) if label in kept else -INF
                    assert cut[i, t].item() == pytest.approx(want, abs=1e-4), (packed, i, t)


# --- importance weights ---------------------------------------------------------------------------


def weights_ref(log_ratio, mask, level, upper, lower):
    out = torch.zeros_like(log_ratio)
    for i in range(log_ratio.shape[0]):
        seq = sum(log_ratio[i, t].item() for t in range(log_ratio.shape[1]) if mask[i, t])
        for t in range(log_ratio.shape[1]):
            if not mask[i, t]:
                continue
            w = math.exp(max(-20, min(20, log_ratio[i, t].item() if level == "token" else seq)))
            out[i, t] = min(w, upper) if lower is None else (w if lower <= w <= upper else 0.0)
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold,upper,lower", [(2.0, 2.0, None), ("0.5_1.5", 1.5, 0.5)])
def test_is_weights_equal_a_loop(level, threshold, upper, lower):
    log_ratio, mask = rand(6, 5, seed=5, scale=0.4), lengths_to_mask([5, 3, 1, 0, 4, 5], 5)
    log_ratio[0, 0] = 30.0  # past the safety bound
    weights, metrics = rc.is_weights(log_ratio, mask, level, *parse_is_threshold(threshold))
    want = weights_ref(log_ratio, mask, level, upper, lower)
    assert torch.allclose(weights, want, atol=1e-12)
    valid = [want[i, t].item() for i in range(6) for t in range(5) if mask[i, t]]
    assert metrics["rollout_is_mean"] == pytest.approx(sum(valid) / len(valid))
    seq_means = [sum(want[i, t].item() for t in range(5) if mask[i, t]) / max(1, mask[i].sum().item())
                 for i in range(6)]
    assert metrics["rollout_is_seq_mean"] == pytest.approx(sum(seq_means) / 6)
    assert metrics["rollout_is_seq_max_deviation"] == pytest.approx(max(abs(m - 1) for m in seq_means))
    mean = sum(valid) / len(valid)
    ess = 1 / (sum((w / (mean + 1e-8)) ** 2 for w in valid) / len(valid))
    assert metrics["rollout_is_eff_sample_size"] == pytest.approx(ess)
    assert metrics["rollout_is_std"] == pytest.approx(math.sqrt(max(0, sum(w * w for w in valid) / len(valid)
                                                                    - mean ** 2)), abs=1e-9)
    if level == "token":
        assert metrics["rollout_is_max"] == pytest.approx(max(valid))
        raw = [math.exp(min(20, log_ratio[i, t].item())) for i in range(6) for t in range(5) if mask[i, t]]
        assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(sum(r > upper for r in raw) / len(raw))
        assert metrics["rollout_is_ratio_fraction_low"] == pytest.approx(
            sum(r < (lower or 1 / upper) for r in raw) / len(raw))
    else:  # sequence: the max is of the unclamped-to-threshold product (safety bound 20 only)
        assert metrics["rollout_is_max"] == pytest.approx(math.exp(20.0))
    assert ("rollout_is_oob_ratio" in metrics) == (lower is not None)


def test_is_weights_batch_normalize_makes_the_mean_one():
    log_ratio, mask = rand(5, 4, seed=6, scale=0.3), lengths_to_mask([4, 2, 3, 1, 4], 4)
    for level in ("token", "sequence"):
        weights, metrics = rc.is_weights(log_ratio, mask, level, 5.0, batch_normalize=True)
        raw, _ = rc.is_weights(log_ratio, mask, level, 5.0)
        if level == "token":
            assert pc.masked_mean(weights, mask).item() == pytest.approx(1.0)
        else:
            assert pc.masked_mean(weights, mask, axis=-1).mean().item() == pytest.approx(1.0)
        assert torch.allclose(weights * metrics["rollout_is_batch_norm_factor"], raw)


def test_identical_policies_give_weights_one_and_zero_divergence():
    lp, mask = -rand(4, 6, seed=7).abs(), lengths_to_mask([6, 2, 5, 3], 6)
    weights, kept, metrics = rc.rollout_correction(lp, lp.clone(), mask, spec(rollout_is="sequence",
                                                                              rollout_rs="token_k1",
                                                                              rollout_rs_threshold="0.9_1.1"))
    assert torch.equal(weights, mask.double()) and torch.equal(kept, mask)
    for name, value in {"kl": 0, "k3_kl": 0, "chi2_token": 0, "chi2_seq": 0, "log_ppl_diff": 0, "ppl_ratio": 1,
                        "rollout_is_mean": 1, "rollout_rs_masked_fraction": 0}.items():
        assert metrics[f"rollout_corr/{name}"] == pytest.approx(value, abs=1e-12), name
    ppl = sum(math.exp(-sum(lp[i, :n].tolist()) / n) for i, n in enumerate([6, 2, 5, 3])) / 4
    assert metrics["rollout_corr/training_ppl"] == pytest.approx(ppl)
    assert metrics["rollout_corr/rollout_ppl"] == pytest.approx(ppl)


def test_offpolicy_metrics_by_hand():
    """One sequence of two tokens: actor log-probs (-1, -2), engine's (-1.5, -1)."""
    actor, engine, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2)
    m = rc.offpolicy_metrics(actor, engine, mask)
    log_r = [0.5, -1.0]
    assert m["kl"] == pytest.approx(-(0.5 - 1.0) / 2)
    assert m["k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in log_r) / 2, rel=1e-6)
    assert m["training_ppl"] == pytest.approx(math.exp(1.5)) and m["rollout_ppl"] == pytest.approx(math.exp(1.25))
    assert m["log_ppl_diff"] == pytest.approx(-1.25 + 1.5)
    assert m["chi2_token"] == pytest.approx(sum(math.exp(2 * x) for x in log_r) / 2 - 1, rel=1e-6)
    assert m["chi2_seq"] == pytest.approx(math.exp(2 * -0.5) - 1, rel=1e-6)


# --- rejection ------------------------------------------------------------------------------------


def rejection_ref(log_ratio, mask, option, lower, upper):
    """Per element: the option's value (token, or its sequence's) and the bound test."""
    B, T = log_ratio.shape
    keep = torch.ones(B, T, dtype=torch.bool)
    est = {"k1": lambda x: -x, "k2": lambda x: 0.5 * x * x, "k3": lambda x: math.exp(x) - 1 - x}[option[-2:]]
    for i in range(B):
        values = [est(max(-20, min(20, log_ratio[i, t].item()))) for t in range(T)]
        valid = [values[t] for t in range(T) if mask[i, t]]
        for t in range(T):
            if option.startswith("token"):
                v = values[t]
            elif option.startswith("seq_sum"):
                v = sum(valid)
            elif option.startswith("seq_mean"):
                v = sum(valid) / len(valid) if valid else 0.0
            else:
                v = max(valid) if valid else 0.0
            keep[i, t] = (math.log(lower) <= v <= math.log(upper)) if lower is not None else v <= upper
    return mask * keep.long()


@pytest.mark.parametrize("option,threshold,lower,upper", [
    ("token_k1", "0.8_1.25", 0.8, 1.25), ("token_k1", 1.25, 0.8, 1.25), ("token_k2", 0.02, None, 0.02),
    ("token_k3", 0.02, None, 0.02), ("seq_sum_k1", "0.5_2.0", 0.5, 2.0), ("seq_sum_k2", 0.05, None, 0.05),
    ("seq_sum_k3", 0.05, None, 0.05), ("seq_mean_k1", "0.9_1.1", 0.9, 1.1), ("seq_mean_k2", 0.01, None, 0.01),
    ("seq_mean_k3", 0.01, None, 0.01), ("seq_max_k2", 0.03, None, 0.03), ("seq_max_k3", 0.03, None, 0.03)])
def test_rejection_mask_equals_a_loop(option, threshold, lower, upper):
    log_ratio, mask = rand(8, 6, seed=8, scale=0.25), lengths_to_mask([6, 4, 1, 0, 6, 2, 5, 3], 6)
    kept, metrics = rc.rejection_mask(log_ratio, mask, parse_rs_thresholds(option, threshold))
    want = rejection_ref(log_ratio, mask, option, None if option[-2:] != "k1" else lower, upper)
    assert torch.equal(kept, want)
    rejected = ((mask == 1) & (want == 0)).sum().item()
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(rejected / mask.sum().item())
    assert metrics[f"rollout_rs_{option}_masked_fraction"] == pytest.approx(rejected / mask.sum().item())
    rows_hit = sum(bool(((mask[i] == 1) & (want[i] == 0)).any()) for i in range(8))
    assert metrics["rollout_rs_seq_masked_fraction"] == pytest.approx(rows_hit / 8)  # over all rows, as verl
    assert metrics[f"rollout_rs_{option}_seq_masked_fraction"] == pytest.approx(rows_hit / 7)  # non-empty rows


def test_rejection_options_combine_by_and():
    log_ratio, mask = rand(8, 6, seed=9, scale=0.25), lengths_to_mask([6, 4, 1, 2, 6, 2, 5, 3], 6)
    both, _ = rc.rejection_mask(log_ratio, mask, parse_rs_thresholds("token_k2,seq_mean_k1,token_k2", "0.02,0.9_1.1"))
    a, _ = rc.rejection_mask(log_ratio, mask, parse_rs_thresholds("token_k2", 0.02))
    b, _ = rc.rejection_mask(log_ratio, mask, parse_rs_thresholds("seq_mean_k1", "0.9_1.1"))
    assert torch.equal(both, a * b) and 0 < both.sum() < mask.sum()


# --- the losses -----------------------------------------------------------------------------------


def test_policy_loss_weights_multiply_each_token():
    old, new, adv = rand(3, 4, seed=10) * 0.1 - 1, rand(3, 4, seed=11) * 0.1 - 1, rand(3, 4, seed=12)
    mask, weights = lengths_to_mask([4, 2, 3], 4), rand(3, 4, seed=13).abs()
    loss, *_ = pc.compute_policy_loss(old, new, adv, mask, 0.2, 0.28, 3.0, "token-mean", rollout_is_weights=weights)
    total = 0.0
    for i in range(3):
        for t in range(4):
            if mask[i, t]:
                r, a = math.exp(new[i, t] - old[i, t]), adv[i, t].item()
                ppo = max(-a * r, -a * min(max(r, 0.8), 1.28))
                total += weights[i, t].item() * (min(ppo, -a * 3.0) if a < 0 else ppo)
    assert loss.item() == pytest.approx(total / mask.sum().item())


def test_reinforce_loss_equals_a_loop_and_its_gradient_is_the_weighted_score():
    """Bypass mode's loss_type=reinforce trains with the gpg loss: -A log pi_theta x w, no clipping."""
    engine, adv, mask = rand(2, 3, seed=14) - 1, rand(2, 3, seed=15), lengths_to_mask([3, 2], 3)
    log_prob = (rand(2, 3, seed=16) - 1).requires_grad_()
    weights = rand(2, 3, seed=17).abs()
    loss, metrics = pc.policy_loss("gpg", engine, log_prob, adv, mask, "seq-mean-token-sum", rollout_is_weights=weights)
    ppo_kl = metrics["actor/ppo_kl"]
    want = sum(-adv[i, t].item() * log_prob[i, t].item() * weights[i, t].item()
               for i in range(2) for t in range(3) if mask[i, t]) / 2
    assert loss.item() == pytest.approx(want)
    loss.backward()
    assert torch.allclose(log_prob.grad, -adv * weights * mask / 2)
    assert ppo_kl.item() == pytest.approx((engine - log_prob).detach()[mask.bool()].mean().item())


# --- the whole batch over ranks -------------------------------------------------------------------


def _shares_worker(rank: int, init_file: str, actor, engine, mask, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    cfg = spec(rollout_is="token", rollout_is_batch_normalize="true", rollout_rs="seq_mean_k3",
               rollout_rs_threshold=0.025)
    rows = slice(rank * 4, rank * 4 + 4)
    weights, kept, metrics = rc.correct_batch(actor[rows], engine[rows], mask[rows], cfg, dist.group.WORLD)
    torch.save({"weights": weights, "kept": kept, "metrics": metrics}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_correct_batch_on_two_ranks_equals_the_whole_batch(tmp_path):
    actor, engine = rand(8, 5, seed=18) * 0.2 - 1, rand(8, 5, seed=19) * 0.2 - 1
    mask = lengths_to_mask([5, 3, 2, 5, 1, 4, 5, 2], 5)
    run_gloo(_shares_worker, 2, str(tmp_path / "init"), actor, engine, mask, str(tmp_path / "out"))
    cfg = spec(rollout_is="token", rollout_is_batch_normalize="true", rollout_rs="seq_mean_k3",
               rollout_rs_threshold=0.025)
    weights, kept, metrics = rc.rollout_correction(actor, engine, mask, cfg)
    shares = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    assert torch.allclose(torch.cat([s["weights"] for s in shares]), weights)
    assert torch.equal(torch.cat([s["kept"] for s in shares]), kept)
    assert 0 < kept.sum() < mask.sum()
    for share in shares:
        assert share["metrics"] == pytest.approx(metrics)


def test_metric_names_are_verls():
    """The names verl 0.9.1 logs for token IS + one RS option (its rollout_corr_helper)."""
    log_ratio = rand(4, 3, seed=20, scale=0.1)
    mask = torch.ones(4, 3)
    _, _, metrics = rc.rollout_correction(log_ratio - 1, -torch.ones(4, 3), mask,
                                          spec(rollout_is="token", rollout_rs="token_k1",
                                               rollout_rs_threshold="0.5_2.0"))
    verl = ["rollout_is_mean", "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low", "rollout_is_max",
            "rollout_is_min", "rollout_is_std", "rollout_is_eff_sample_size", "rollout_is_seq_mean",
            "rollout_is_seq_std", "rollout_is_seq_max", "rollout_is_seq_min", "rollout_is_seq_max_deviation",
            "rollout_is_seq_fraction_high", "rollout_is_seq_fraction_low", "training_ppl", "training_log_ppl", "kl",
            "k3_kl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max",
            "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq", "rollout_rs_masked_fraction",
            "rollout_rs_seq_masked_fraction"]
    verl += [f"rollout_rs_token_k1_{s}" for s in (
        "mean", "max", "min", "fraction_high", "fraction_low", "std", "seq_mean", "seq_std", "seq_max", "seq_min",
        "seq_max_deviation", "seq_fraction_high", "seq_fraction_low", "masked_fraction", "seq_masked_fraction")]
    assert sorted(metrics) == sorted(f"rollout_corr/{n}" for n in verl)


# --- config ---------------------------------------------------------------------------------------


def test_threshold_specs_and_their_errors():
    assert config.parse_is_threshold(2.0) == (2.0, None)
    assert config.parse_is_threshold("0.5_5.0") == (5.0, 0.5)
    assert config.parse_rs_thresholds("token_k1,seq_sum_k3", "2.0,0.1") == {"token_k1": (0.5, 2.0),
                                                                             "seq_sum_k3": (None, 0.1)}
    for bad in ("2_1", "-1", "x", "0_2"):
        with pytest.raises(ConfigError, match="rollout_is_threshold"):
            config.parse_is_threshold(bad)
    with pytest.raises(ConfigError, match="valid: token_k1"):
        config.parse_rs_thresholds("token_k9", 0.1)
    with pytest.raises(ConfigError, match="needs algorithm.rollout_correction.rollout_rs_threshold"):
        config.parse_rs_thresholds("token_k2", None)
    with pytest.raises(ConfigError, match="one upper bound"):
        config.parse_rs_thresholds("token_k2", "0.1_0.2")
    with pytest.raises(ConfigError, match="3 thresholds for 2"):
        config.parse_rs_thresholds("token_k2,token_k3", "1,2,3")
    # YAML 1.1 and Python's float() read 0.5_2 as 0.52; it is a lower_upper threshold
    assert rc_cfg(rollout_is_threshold="0.5_2").rollout_is_threshold == "0.5_2"


def test_bypass_mode_with_a_truncated_sampler_is_refused():
    cfg = load_config(None, ["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.top_p=0.9"])
    with pytest.raises(ConfigError, match="bypass_mode=false"):
        config.check_rollout_correction(cfg)
    config.check_rollout_correction(load_config(None, ["algorithm.rollout_correction.bypass_mode=true"]))
