"""bench/flops.py: the per-phase FLOP count against a hand count and against torch's FlopCounterMode on
real tiny models (eager attention: FlopCounterMode does not count the CPU's fused sdpa kernel), and
the matmul-rate probe."""

import math
import sys

import pytest
import torch
from conftest import ROOT
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(ROOT / "bench"))
import flops  # noqa: E402

TINY = LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                   intermediate_size=16, vocab_size=10)


def test_hand_count():
    shape = flops.decoder_shape(TINY)
    # per block: q 8x8, k and v 8x(1x4) each, o 8x8, gate/up/down 3 x 8x16
    assert shape.block_params == 64 + 32 + 32 + 64 + 384 == 576 and shape.body_params == 1152
    fwd = flops.forward_flops(shape, [3, 5], head_tokens=4)
    assert fwd.matmul == 2 * 1152 * 8
    assert fwd.attention == 4 * 8 * 2 * (3 * 3 + 5 * 5)  # d_attn 8, 2 layers, each sequence's square
    assert fwd.head == 2 * 8 * 10 * 4 and fwd.total == fwd.matmul + fwd.attention + fwd.head
    # a 2-token prompt, 3 sampled tokens: the prefill (2 tokens, a 2x2 square), then 2 decode steps
    # against 3 and 4 cached keys; the LM head once per sampled token
    gen = flops.generation_flops(shape, [2], [3])
    assert (gen.matmul, gen.attention, gen.head) == (2 * 1152 * 4, 4 * 8 * 2 * (4 + 3 + 4), 2 * 8 * 10 * 3)
    assert flops.generation_flops(shape, [2, 4], [0, 1]).matmul == 2 * 1152 * 4  # nothing sampled: nothing fed
    phases = flops.step_flops(shape, [2, 4], [3, 1], actor_epochs=2, ref=True)
    assert set(phases) == {"gen", "update_actor", "old_log_prob", "ref"}
    one = flops.forward_flops(shape, [5, 5], head_tokens=4)
    assert phases["old_log_prob"] == phases["ref"] == one and phases["update_actor"].total == 6 * one.total
    lora = flops.step_flops(shape, [2, 4], [3, 1], frozen_actor_weights=True)
    assert lora["update_actor"].total == 2 * one.total  # input gradients only
    critic = flops.decoder_shape(TINY, head_width=1)
    with_critic = flops.step_flops(shape, [2], [3], old_log_prob=False, critic=critic, critic_epochs=1)
    assert "old_log_prob" not in with_critic and with_critic["values"].head == 2 * 8 * 1 * 3
    assert with_critic["update_critic"].total == 3 * with_critic["values"].total


def test_refuses_what_it_does_not_count():
    config = LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=16)
    config.model_type = "gpt2"
    with pytest.raises(ValueError, match="gpt2"):
        flops.decoder_shape(config)


@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-llama-tied"])
def test_against_flop_counter(tiny_assets, model):
    """The count is exactly what FlopCounterMode sees: a forward with the LM head on the last positions,
    forward + backward (3x), and KV-cache generation (prefill + decode steps)."""
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny_assets[model], attn_implementation="eager")
    shape = flops.decoder_shape(lm.config)
    ids = torch.randint(3, 100, (2, 9))
    with FlopCounterMode(display=False) as counter:
        lm(input_ids=ids, logits_to_keep=4)
    assert counter.get_total_flops() == flops.forward_flops(shape, [9, 9], head_tokens=8).total
    with FlopCounterMode(display=False) as counter:
        lm(input_ids=ids, logits_to_keep=4).logits.sum().backward()
    assert counter.get_total_flops() == 3 * flops.forward_flops(shape, [9, 9], head_tokens=8).total
    prompt = torch.randint(3, 100, (1, 7))
    with FlopCounterMode(display=False) as counter:
        out = lm.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                          min_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out.shape[1] == 13
    assert counter.get_total_flops() == flops.generation_flops(shape, [7], [6]).total


def test_matmul_rate():
    rate = flops.matmul_rate(torch.device("cpu"), size=128, seconds=0.02, reps=3)
    assert math.isfinite(rate["median"]) and 0 < rate["median"] <= rate["best"]
    assert (rate["size"], rate["dtype"], rate["threads"]) == (128, "float32", torch.get_num_threads())
    assert 0 < rate["cpu_share"] <= 1.1  # CPU seconds per wall second per thread (other threads add a little)


def test_decode_matmul_rate():
    """The decode-step probe times every weight of the shape once per step: its bytes over its time."""
    shape = flops.decoder_shape(TINY)
    probe = flops.decode_matmul_rate(shape, 4, torch.device("cpu"), seconds=0.02)
    assert probe["batch"] == 4 and math.isfinite(probe["rate"]) and probe["rate"] > 0
    work = 2 * 4 * (shape.body_params + shape.hidden * shape.vocab)
    weight_bytes = 4 * (shape.body_params + shape.hidden * shape.vocab)
    assert probe["weight_gb_per_s"] == pytest.approx(probe["rate"] / work * weight_bytes / 1e9)


def test_decode_matmul_rate_with_the_engines_kernel():
    """flops.engine_linear computes what torch's linear does (the probe times the engine's kernel)."""
    weight, x = torch.randn(48, 32), torch.randn(5, 32)
    assert torch.allclose(flops.engine_linear(weight)(x), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    probe = flops.decode_matmul_rate(flops.decoder_shape(TINY), 2, torch.device("cpu"), seconds=0.02,
                                     linear=flops.engine_linear)
    assert probe["rate"] > 0
