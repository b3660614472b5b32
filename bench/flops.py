"""The compute floor of a step: the FLOPs each phase must do, from a decoder's config and the token
counts, and the matmul rate the same threads reach at the same moment (what those FLOPs are held against).

The count (pure arithmetic, `forward_flops` / `generation_flops` / `step_flops`), for a decoder of
`layers` blocks, hidden size h, `heads` query heads of head_dim d (d_attn = heads * d, the query
width), kv_heads key/value heads, intermediate size i, vocabulary V:

  matmul parameters per block  N_block = h*d_attn (q) + 2*h*kv_heads*d (k, v) + d_attn*h (o)
                                         + m*h*i (the MLP: m = 3 gated (gate, up, down), 2 plain)
  one forward over a sequence of L tokens whose last K positions predict tokens (the LM head runs
  only there: models.compute_log_probs' logits_to_keep):
      2 * N_block * layers * L                 every block's matmuls, 2 FLOPs per multiply-add
    + 4 * d_attn * L^2 * layers                attention's two matmuls (Q K^T and P V) over the full
                                               L x L square, as PaLM's / Megatron's / verl's MFU count it
                                               and torch's FlopCounterMode counts sdpa; a causal kernel
                                               that skips the upper triangle does about half of it
    + 2 * h * V * K                            the LM head
  the embedding is a lookup (0 FLOPs); norms, rotary, activations and the softmax are elementwise
  (not counted: they are bandwidth, not matmuls). A packed row of several sequences counts each one
  alone (attention.py's packed_sdpa runs them so). Padding counts nothing: the FLOPs are the useful ones.

  a training pass (forward + backward) = 3 x the forward: the backward does each matmul twice (the
  input's gradient and the weight's; attention's four), so the update phase is 3 x epochs x forward.
  With frozen base weights (a LoRA adapter) the weights' gradients are not computed: 2 x the forward
  (the adapters' own matmuls are not counted). Activation checkpointing's recomputed forward is not
  counted (model FLOPs, not hardware FLOPs).

  generation of R tokens after a P-token prompt (a KV-cache engine, vLLM's prefill + decode):
      2 * N_block * layers * (P + R - 1)       the prompt, then every sampled token but the last is fed
    + 4 * d_attn * layers * (P^2 + sum_{t=1}^{R-1} (P + t))   the prefill's square, then each decode
                                               step's query against its P + t cached keys
    + 2 * h * V * R                            one LM head row per sampled token

A value model (critic) is the same body with a 1-wide head: V = 1.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from models import default_dtypes


@dataclass(frozen=True)
class DecoderShape:
    """The matmul shapes of a decoder-only transformer (Llama / Qwen2 / Mistral family)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    mlp_matrices: int = 3  # gated MLP (gate, up, down); 2 for fc1, fc2

    @property
    def attn_width(self) -> int:  # d_attn: the query width
        return self.heads * self.head_dim

    @property
    def block_params(self) -> int:
        """Matmul parameters of one decoder block (biases are elementwise: not counted)."""
        h, d, kv = self.hidden, self.head_dim, self.kv_heads
        return h * self.attn_width + 2 * h * kv * d + self.attn_width * h + self.mlp_matrices * h * self.intermediate

    @property
    def body_params(self) -> int:
        """Matmul parameters of every block: what a token's forward multiplies by (the LM head apart)."""
        return self.block_params * self.layers


GATED_MLP = {"llama", "qwen2", "qwen3", "mistral"}  # hidden_act on gate * up, then down


def decoder_shape(config: Any, head_width: int | None = None) -> DecoderShape:
    """DecoderShape of a transformers config (PretrainedConfig); head_width replaces the vocabulary as the
    output head's width (1 for a value model). Refuses what the count does not describe (mixtures of
    experts, sliding windows would need their own terms)."""
    model_type = getattr(config, "model_type", "?")
    if model_type not in GATED_MLP:
        raise ValueError(f"flops.decoder_shape: model_type {model_type!r} is not one of {sorted(GATED_MLP)} "
                         "(the gated-MLP decoders whose matmuls this count knows)")
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        raise ValueError(f"flops.decoder_shape: {model_type} with experts: the count has no MoE term")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return DecoderShape(layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
                        kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                        intermediate=config.intermediate_size,
                        vocab=config.vocab_size if head_width is None else head_width)


@dataclass(frozen=True)
class Flops:
    """A count split by where it goes: the blocks' matmuls, attention's two, the output head."""

    matmul: float
    attention: float
    head: float

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.head

    def __mul__(self, k: float) -> Flops:
        return Flops(self.matmul * k, self.attention * k, self.head * k)

    __rmul__ = __mul__

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.matmul + other.matmul, self.attention + other.attention, self.head + other.head)


def forward_flops(shape: DecoderShape, seq_lens: Sequence[int], head_tokens: int) -> Flops:
    """One forward over sequences of these lengths (each alone: no padding, no cross-sequence attention),
    with the output head on head_tokens positions in all (see the module docstring)."""
    tokens = sum(seq_lens)
    squares = sum(length * length for length in seq_lens)
    return Flops(matmul=2.0 * shape.body_params * tokens,
                 attention=4.0 * shape.attn_width * shape.layers * squares,
                 head=2.0 * shape.hidden * shape.vocab * head_tokens)


def generation_flops(shape: DecoderShape, prompt_lens: Sequence[int], response_lens: Sequence[int]) -> Flops:
    """Sampling response_lens[i] tokens after prompt_lens[i] with a KV cache (prefill, then one decode
    step per token but the first): see the module docstring."""
    fed = attention = 0.0
    for p, r in zip(prompt_lens, response_lens, strict=True):
        if r == 0:
            continue
        steps = r - 1  # decode steps: the prefill samples the first token
        fed += p + steps
        attention += p * p + steps * p + steps * (steps + 1) / 2  # sum_{t=1}^{steps} (p + t)
    return Flops(matmul=2.0 * shape.body_params * fed,
                 attention=4.0 * shape.attn_width * shape.layers * attention,
                 head=2.0 * shape.hidden * shape.vocab * sum(response_lens))


def step_flops(actor: DecoderShape, prompt_lens: Sequence[int], response_lens: Sequence[int], *,
               actor_epochs: int = 1, old_log_prob: bool = True, ref: bool = False,
               critic: DecoderShape | None = None, critic_epochs: int = 1,
               frozen_actor_weights: bool = False) -> dict[str, Flops]:
    """The FLOPs of each phase of one PPO / GRPO step over these samples, keyed by train_ppo's timer
    names: gen, old_log_prob and ref (one forward each; ref is the actor's shape), update_actor (3 x
    actor_epochs forwards; 2 x with frozen_actor_weights, a LoRA adapter's), values and update_critic
    (the critic's, when there is one). A phase that does not run is absent."""
    lens = [p + r for p, r in zip(prompt_lens, response_lens, strict=True)]
    forward = forward_flops(actor, lens, sum(response_lens))
    passes = (2 if frozen_actor_weights else 3) * actor_epochs
    phases = {"gen": generation_flops(actor, prompt_lens, response_lens), "update_actor": passes * forward}
    if old_log_prob:
        phases["old_log_prob"] = forward
    if ref:
        phases["ref"] = forward
    if critic is not None:
        values = forward_flops(critic, lens, sum(response_lens))  # the value head on the response positions
        phases["values"], phases["update_critic"] = values, 3 * critic_epochs * values
    return phases


# ---------------------------------------------------------------------------------------------
# The rate those FLOPs are held against


def _timed_rates(run: Callable[[], None], work: float, device: torch.device, seconds: float,
                 reps: int) -> tuple[list[float], float]:
    """FLOP/s of `reps` timed runs of `run` (which does `work` FLOPs), about seconds / reps each, after one
    warm-up (thread pool, kernel choice); and the process's CPU seconds per wall second per thread over
    them: near 1 on free cores, lower while other jobs hold them (then the phases, longer than the
    probe, are likely slowed more than it is)."""
    def timed_once() -> float:
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    timed_once()  # warm-up
    per_rep = max(1, round(seconds / reps / max(timed_once(), 1e-9)))  # runs per timed rep
    rates = []
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    for _ in range(reps):
        rates.append(per_rep * work / sum(timed_once() for _ in range(per_rep)))
    cpu_share = (time.process_time() - cpu_start) / (time.perf_counter() - wall_start) / torch.get_num_threads()
    return rates, cpu_share


def matmul_rate(device: torch.device, dtype: torch.dtype | None = None, size: int | None = None,
                seconds: float = 0.25, reps: int = 5) -> dict[str, float]:
    """FLOP/s of a square (size x size) matmul on these threads, now: `reps` timed runs of about
    seconds / reps each after one warm-up; the median (the reference) and the best. size defaults to
    1024 on the CPU (a 2-GFLOP product: large enough for the kernel's peak, short on a busy core) and
    8192 on an accelerator."""
    dtype = dtype or default_dtypes(device.type)[0]  # the dtype the trainer computes in there
    size = size or (1024 if device.type == "cpu" else 8192)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    work = 2.0 * size**3

    def product() -> None:
        torch.mm(a, b, out=out)

    rates, cpu_share = _timed_rates(product, work, device, seconds, reps)
    return {"median": statistics.median(rates), "best": max(rates), "size": size, "threads": torch.get_num_threads(),
            "cpu_share": cpu_share if device.type == "cpu" else None, "dtype": str(dtype).removeprefix("torch.")}


Linear = Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]  # weight (out, in) -> (x -> x @ weight.T)


def engine_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T as the CPU engine runs its unquantized linear layers (vLLM 0.32: oneDNN with
    the weight packed once, vllm.model_executor.layers.utils' CPU GEMM dispatch), or torch's linear
    where the engine would not use oneDNN (an accelerator, a CPU build without it). For probes of the
    engine's decode-step rate (decode_matmul_rate); weight is (out, in), as nn.Linear holds it."""
    from vllm import _custom_ops as ops

    if weight.device.type != "cpu" or not ops._supports_onednn:
        return lambda x: torch.nn.functional.linear(x, weight)
    handler = ops.create_onednn_mm(weight.t(), 32)
    return lambda x: ops.onednn_mm(handler, x, None)


def decode_matmul_rate(shape: DecoderShape, batch: int, device: torch.device, dtype: torch.dtype | None = None,
                       seconds: float = 0.25, linear: Linear | None = None) -> dict[str, float]:
    """FLOP/s of one decode step's matmuls at `batch` sequences: every block's fused q/k/v, o, fused
    gate/up and down projections and the LM head, as a KV-cache engine runs them (vLLM fuses q/k/v and
    gate/up), each block with weights of its own so that, as in the engine, every step reads them all
    from memory. `linear` builds each layer's product from its weight (default torch's linear; the bench
    passes engine_linear, the CPU engine's own oneDNN kernel on pre-packed weights, which is
    faster than torch's at a few rows). A decode step is a (batch x hidden) product per weight: at a
    small batch it reads far more bytes per FLOP than the square probe (matmul_rate), and the kernels
    reach a fraction of its rate. Holds one copy of the weights: for the bench's small models. Returns
    {"rate": FLOP/s (median of 5 timed runs), "batch", "weight_gb_per_s": the weights' bytes per second}."""
    dtype = dtype or default_dtypes(device.type)[0]
    linear = linear or (lambda weight: lambda x: torch.nn.functional.linear(x, weight))
    h, i, d_attn = shape.hidden, shape.intermediate, shape.attn_width
    qkv = d_attn + 2 * shape.kv_heads * shape.head_dim
    dims = [(h, qkv), (d_attn, h), (h, (shape.mlp_matrices - 1) * i), (i, h)] * shape.layers + [(h, shape.vocab)]
    products = [(k, linear(torch.randn(n, k, device=device, dtype=dtype))) for k, n in dims]
    inputs = {k: torch.randn(batch, k, device=device, dtype=dtype) for k in {h, d_attn, i}}
    params = shape.body_params + h * shape.vocab
    work, weight_bytes = 2.0 * batch * params, params * torch.finfo(dtype).bits // 8

    def one_step() -> None:
        for k, product in products:
            product(inputs[k])

    rate = statistics.median(_timed_rates(one_step, work, device, seconds, reps=5)[0])
    return {"rate": rate, "batch": batch, "weight_gb_per_s": rate / work * weight_bytes / 1e9}


# ---------------------------------------------------------------------------------------------
# Each phase against its floor, from a run's metrics (bench/step_flops.py adds flops/* to them)

FLOOR_PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor")


def floor_table(rows: Sequence[dict[str, float]]) -> dict:
    """From train_ppo metrics rows (each with timing_s/<phase> and flops/<phase>, per rank, reduced as
    means over ranks) the mean of each phase that ran: {phase: {gflop, seconds, gflop_per_s,
    vs_matmul}} per rank, with vs_matmul the achieved rate over flops/matmul_rate (the same threads'
    square-matmul rate, probed at the end of each step), and for gen also decode_matmul_gflop_per_s
    and vs_decode_matmul (against flops/decode_matmul_rate, when the run has it); and that rate's
    mean, "matmul_gflop_per_s", and the probe's CPU share (matmul_rate's cpu_share: below 1, other jobs held the cores)."""
    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in rows) / len(rows)

    rate, decode_rate = mean("flops/matmul_rate"), mean("flops/decode_matmul_rate")
    phases = {}
    for phase in FLOOR_PHASES:
        work, seconds = mean(f"flops/{phase}"), mean(f"timing_s/{phase}")
        if work > 0 and seconds > 0:
            phases[phase] = {"gflop": work / 1e9, "seconds": seconds, "gflop_per_s": work / seconds / 1e9,
                             "vs_matmul": work / seconds / rate if rate > 0 else None}
    if "gen" in phases and decode_rate > 0:  # generation against its own matmuls' rate at its decode batch
        phases["gen"]["decode_matmul_gflop_per_s"] = decode_rate / 1e9
        phases["gen"]["vs_decode_matmul"] = phases["gen"]["gflop_per_s"] * 1e9 / decode_rate
    return {"matmul_gflop_per_s": rate / 1e9, "matmul_best_gflop_per_s": mean("flops/matmul_rate_best") / 1e9,
            "matmul_threads": mean("flops/matmul_threads"), "matmul_cpu_share": mean("flops/matmul_cpu_share"),
            "phases": phases}


FLOOR_COLUMNS = [("run", "run", ""), ("phase", "phase", ""), ("gflop", "GFLOP/rank", ".2f"),
                 ("seconds", "s", ".2f"), ("gflop_per_s", "GFLOP/s", ".1f"),
                 ("matmul_gflop_per_s", "matmul GFLOP/s", ".1f"), ("vs_matmul", "/ matmul", ".2f"),
                 ("decode_matmul_gflop_per_s", "decode matmul GFLOP/s", ".1f"),
                 ("vs_decode_matmul", "/ decode matmul", ".2f"),
                 ("matmul_cpu_share", "probe cpu/wall", ".2f")]


def floor_rows(run: str, floor: dict) -> list[dict]:
    """floor_table's phases as table rows (FLOOR_COLUMNS)."""
    return [{"run": run, "phase": phase, **r, "matmul_gflop_per_s": floor["matmul_gflop_per_s"],
             "matmul_cpu_share": floor.get("matmul_cpu_share")} for phase, r in floor["phases"].items()]
