"""attention.py's packed_sdpa against references computed another way: a packed row's logits and
gradients equal those of each sequence run alone (Llama, Qwen2 with GQA, Mistral; odd lengths and a
one-token sequence), padded batches, sliding-window layers and KV-cache generation equal "sdpa"'s,
and no (N, N) mask is built for a packed row."""

import pytest
import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.masking_utils import create_causal_mask

import attention

LENGTHS = (7, 1, 13, 4, 30)  # a packed row of 55 tokens, one sequence a single token
COMMON = dict(vocab_size=96, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
              max_position_embeddings=256)
ARCHS = {
    "llama": (LlamaForCausalLM, LlamaConfig(num_key_value_heads=4, **COMMON)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(num_key_value_heads=2, **COMMON)),
    "mistral": (MistralForCausalLM, MistralConfig(num_key_value_heads=1, sliding_window=None, **COMMON)),
}


def _model(arch: str, implementation: str, **overrides) -> torch.nn.Module:
    cls, config = ARCHS[arch]
    config = config.__class__(**(config.to_dict() | overrides))
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation=implementation, dtype=torch.float32).eval()


def _packed_row(lengths: tuple[int, ...], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, vocab, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    return ids, torch.cat([torch.arange(n) for n in lengths])[None]


@pytest.mark.parametrize("path", ["per_sequence", "buckets"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_packed_row_equals_each_sequence_alone(arch, path, monkeypatch):
    """Logits of the packed row = each sequence's own forward; the gradient of a loss over the row =
    the sum of the per-sequence losses' gradients; by both of packed_sdpa's paths."""
    monkeypatch.setattr(attention, "PER_SEQUENCE_MAX", len(LENGTHS) if path == "per_sequence" else 0)
    model = _model(arch, attention.register_packed_attention())
    ids, positions = _packed_row(LENGTHS, model.config.vocab_size)
    weights = torch.randn(ids.shape[1], model.config.vocab_size, generator=torch.Generator().manual_seed(2))

    packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    (packed * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    alone = []
    for start, end in zip(starts[:-1], starts[1:], strict=True):
        logits = model(input_ids=ids[:, start:end], use_cache=False).logits[0]
        (logits * weights[start:end]).sum().backward()
        alone.append(logits.detach())
    torch.testing.assert_close(packed.detach(), torch.cat(alone), rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        scale = param.grad.abs().max()
        torch.testing.assert_close(packed_grads[name] / scale, param.grad / scale, rtol=1e-4, atol=1e-5, msg=name)


def test_no_mask_is_built_for_a_packed_row():
    """sdpa builds the row's (1, 1, N, N) block-diagonal mask; packed_sdpa builds none, and the
    sequence bounds are where the positions restart."""
    ids, positions = _packed_row(LENGTHS, 96)
    embeds = torch.empty(1, ids.shape[1], 0)
    masks = {}
    for implementation in ("sdpa", attention.register_packed_attention()):
        config = _model("qwen2", implementation).config
        masks[implementation] = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None,
                                                   past_key_values=None, position_ids=positions)
    assert masks["sdpa"].shape == (1, 1, 55, 55)
    assert masks[attention.ATTENTION_NAME] is None
    assert attention.sequence_bounds(positions[0]) == [0, 7, 8, 21, 25, 55]


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_padded_batches_sliding_windows_and_generation_equal_sdpa(arch):
    """Where a row is not packed the attention is transformers' sdpa: a left- and right-padded
    batch, a sliding window shorter than the sequences (Mistral), and greedy KV-cache generation."""
    overrides = {"sliding_window": 5} if arch == "mistral" else {}
    models = {name: _model(arch, name, **overrides) for name in ("sdpa", attention.register_packed_attention())}
    ids = torch.randint(3, 96, (3, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, -3:] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = {name: m(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
           for name, m in models.items()}
    torch.testing.assert_close(out["sdpa"], out[attention.ATTENTION_NAME], rtol=0, atol=0)
    if arch == "mistral":  # one unpadded row, longer than the window: the window's mask, not a per-sequence run
        one = {name: m(input_ids=ids[1:2], use_cache=False).logits for name, m in models.items()}
        torch.testing.assert_close(one["sdpa"], one[attention.ATTENTION_NAME], rtol=0, atol=0)
    settings = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    generated = {name: m.generate(input_ids=ids[1:], attention_mask=mask[1:], generation_config=settings)
                 for name, m in models.items()}
    assert torch.equal(generated["sdpa"], generated[attention.ATTENTION_NAME])


def test_a_packed_row_without_position_ids_is_refused():
    """An architecture whose attention is not handed position_ids cannot be split by sequence: an
    error naming the alternative, not one causal attention over the whole row."""
    q = torch.randn(1, 2, 9, 32)
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        attention.packed_sdpa_attention(torch.nn.Module(), q, q, q, None)


def test_buckets_cover_every_position_once_and_at_most_double_the_tokens():
    """plan_row on long-tailed lengths: each position's output is read from exactly one real slot of
    its own sequence, and a bucket's padded tokens are at most twice its real ones."""
    lengths = [1, 2, 3, 5, 8, 9, 17, 100, 33, 64, 65, 7, 1, 250]
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    plan = attention.plan_row(bounds, torch.device("cpu"))
    gathered = torch.cat([gather for gather, _, _ in plan.buckets])
    assert torch.equal(gathered[plan.take], torch.arange(bounds[-1]))  # every position reads itself back
    assert len(set(plan.take.tolist())) == bounds[-1]
    for gather, n, width in plan.buckets:
        rows = gather.view(n, width)
        real = int((rows[:, 1:] != rows[:, :-1]).sum()) + n  # a pad repeats its row's last position
        assert n * width <= 2 * real, (n, width, real)
    assert len(plan.buckets) <= 9  # about log2 of the longest over the shortest, not one per sequence
