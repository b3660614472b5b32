"""Collocated vLLM rollout on the rollout tensor-parallel submesh: build, sync, generate, sleep, stop.

Every rank holds one `vllm.LLM` (distributed_executor_backend="external_launcher"). The ranks
of one row of rollout_mesh ('dp', 'infer_tp') form one vLLM tensor-parallel engine; they must
call `generate` with the same prompts and parameters, and they get the same samples back.

    llm = build_rollout_engine(model_path, rollout_mesh, max_model_len=1024,
                               gpu_memory_utilization=0.5, dtype="bfloat16", enforce_eager=False)
    sync_weights(llm, iter_full_params(actor))          # every step: wake -> reload -> wake the KV cache
    check = StaleWeightsCheck(STALE_TOLERANCE["bfloat16"])
    check.check(engine_fingerprint(llm, probe), actor_probe_log_probs)   # did the update land?
    my_prompts = shard_for_dp(prompts, dp_rank, dp_size)
    sampling = Sampling(n=12, temperature=1.0, max_tokens=256, stop_token_ids=(eos,), pad_token_id=pad, seed=0)
    batch = generate(llm, my_prompts, sampling, step=step, prompt_indices=...)
    my_share = split_for_training(batch, infer_tp_rank, infer_tp_size)
    shutdown(llm)                                       # instead of dist.destroy_process_group()

vLLM is imported inside the functions that need it (it takes seconds), so importing this module is cheap.
Every access to vLLM's engine internals goes through `_vllm_internals` and the stepping calls beside it
(`_add_request`, `_step`, `_abort`: stream_generate's), except two: wake_up asks
`llm.llm_engine.is_sleeping()`, and the sync's log filters name vLLM's loggers. `_restore_cpu_moe_layout`,
beside it, works around a vLLM bug with the MoE layers' kernels (docs/moe.md). The rest uses vLLM's
public API.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:  # vLLM takes seconds to import: each function that needs it imports it
    from vllm import LLM

logger = logging.getLogger(__name__)

TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


# ---------------------------------------------------------------------------------------------
# The one place that touches vLLM internals (vLLM 0.32, V1 engine, in-process)


@dataclass
class _Internals:
    worker: object  # vllm.v1.worker.{gpu,cpu}_worker.Worker: has reload_weights()
    engine_core: object  # vllm.v1.engine.core_client.InprocClient: has shutdown()
    packed_modules: dict[str, list[str]]  # the model's fused layers: {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


class _DropKnownNoise(logging.Filter):
    """vLLM logs these at start-up or on every weight sync; all are expected here and would bury the
    step lines: the rotary embedding's cache is derived from the config, never loaded; the prefix
    cache is reset on purpose after each sync; with skip_tokenizer_init (token ids in and out) there
    is no chat template to warm up and no EOS id, which generate() passes as a stop token instead;
    stream_generate hands the engine token ids, which need no renderer;
    the CPU worker's threads are bound by VLLM_CPU_OMP_THREADS_BIND, not torch.set_num_threads."""

    MESSAGES = ("RotaryEmbedding: Failed to load weights", "MRotaryEmbedding: Failed to load weights",
                "Successfully reset prefix cache",
                "Chat template warmup failed", "Using None for EOS token id because tokenizer is not initialized",
                "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.",
                "Passing raw prompts to InputProcessor is deprecated and will be removed in the future. You should "
                "instead pass the outputs of Renderer.render_cmpl() or Renderer.render_chat().")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.MESSAGES


def _quiet_sync_logs() -> None:
    for name in ("vllm.model_executor.model_loader.reload.layerwise", "vllm.v1.core.block_pool",
                 "vllm.renderers.base", "vllm.v1.worker.cpu_worker", "vllm.v1.engine.input_processor"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) for f in log.filters):
            log.addFilter(_DropKnownNoise())


def _vllm_internals(llm: LLM) -> _Internals:
    engine = llm.llm_engine
    worker = engine.model_executor.driver_worker.worker
    packed = getattr(worker.model_runner.get_model(), "packed_modules_mapping", {})
    return _Internals(worker=worker, engine_core=engine.engine_core,
                      packed_modules={k: list(v) for k, v in packed.items()})


def _reset_encoder_cache(llm: LLM) -> None:
    """A vision-language engine's: reload_weights clears the worker's cached image embeddings but not the
    scheduler's record of them, so the next prompt with an image seen before fails ("Encoder cache miss")."""
    if llm.llm_engine.model_config.is_multimodal_model:
        llm.llm_engine.reset_encoder_cache()


def _vocab_size(llm: LLM) -> int:
    return llm.llm_engine.model_config.get_vocab_size()


def _add_request(llm: LLM, prompt_token_ids: list[int], params: object) -> str:
    """One request into the in-process engine, numbered from the LLM's own counter (as LLM.generate numbers
    its requests, so the two can be mixed); its id."""
    request_id = str(next(llm.request_counter))
    llm.llm_engine.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params)
    return request_id


def _step(llm: LLM) -> list:
    """One engine step: every running request advances by one token (prefills first); the outputs of the
    requests that produced tokens (DELTA: only the new ones)."""
    return llm.llm_engine.step()


def _abort(llm: LLM, request_ids: list[str]) -> None:
    """Remove requests from the engine; in process, an aborted request produces no output."""
    llm.llm_engine.abort_request(request_ids)
    left = llm.llm_engine.get_num_unfinished_requests()
    if left:
        raise RuntimeError(f"the rollout engine still holds {left} requests after aborting {len(request_ids)}")


def _restore_cpu_moe_layout(llm: LLM, reloaded: set[str]) -> int:
    """Re-run the CPU experts' weight packing on the MoE layers a sync reloaded (module names in
    `reloaded`, e.g. "model.layers.0.mlp.experts"); returns how many layers it repacked.

    vLLM 0.32's reload_weights runs each reloaded layer's process_weights_after_loading, but the
    unquantized MoE method packs its experts for the kernel (`moe_kernel.fused_experts`'s own
    process_weights_after_loading: the CPU kernel's prepack) only the first time, when it builds the
    kernel (UnquantizedFusedMoEMethod._setup_kernel). After a sync the experts hold the raw tensors
    while the CPU kernel reads them as prepacked: log-probs off by 0.1 to 0.9 (docs/moe.md, the
    reproduction). tests/test_moe.py shows the bug is still there; drop this once it is fixed."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not reloaded:
        return 0
    model = _vllm_internals(llm).worker.model_runner.get_model()
    repacked: dict[str, str] = {}  # sent module -> the engine's layer under it that holds the experts
    for name, layer in model.named_modules():
        experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        sent = next((m for m in reloaded if name == m or name.startswith(m + ".")), None)
        if experts is None or sent is None:
            continue
        experts.process_weights_after_loading(layer)
        repacked[sent] = name
    if set(repacked) != reloaded:
        raise RuntimeError(f"the sync sent experts of {sorted(reloaded - set(repacked))}, which hold no MoE layer "
                           f"of the engine's model with a kernel to repack ({sorted(repacked.values())} do)")
    return len(repacked)


def _expert_layers(named_tensors: Iterable[tuple[str, torch.Tensor]], seen: set[str]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the tensors through, adding to `seen` the module of every routed expert's tensor:
    "model.layers.0.mlp.experts" for "model.layers.0.mlp.experts.3.up_proj.weight"."""
    for name, tensor in named_tensors:
        if ".experts." in name:
            seen.add(name.split(".experts.")[0] + ".experts")
        yield name, tensor


class _DropPartialReloadNoise(logging.Filter):
    """A sync that sends only some layers (LoRA's) leaves the others as they are, on purpose; vLLM warns
    about each untouched layer, every sync."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.endswith(": Failed to load weights")
                    or message.startswith("Following weights were not loaded from checkpoint"))


# ---------------------------------------------------------------------------------------------
# Building the engine


def check_rollout_mesh(rollout_mesh: DeviceMesh) -> None:
    """vLLM splits the default process group into TP groups of consecutive ranks
    [g*tp, ..., g*tp + tp - 1]; rollout_mesh's rows must be exactly those groups."""
    if rollout_mesh.mesh_dim_names != ("dp", "infer_tp"):
        raise ValueError(f"rollout_mesh must have dims ('dp', 'infer_tp'), got {rollout_mesh.mesh_dim_names}")
    dp, tp = rollout_mesh.size(0), rollout_mesh.size(1)
    world = dist.get_world_size()
    if dp * tp != world:
        raise ValueError(
            f"rollout_mesh ({dp} x {tp}) must cover all {world} ranks: vLLM's external launcher splits the "
            f"whole default process group into TP groups. Set {TP_KEY} to a divisor of {world}."
        )
    expected = torch.arange(world).reshape(dp, tp)
    if not torch.equal(rollout_mesh.mesh.cpu(), expected):
        raise ValueError(
            f"rollout_mesh rows {rollout_mesh.mesh.tolist()} are not the TP groups vLLM will form "
            f"({expected.tolist()}: consecutive global ranks). Build the mesh as "
            f"world_mesh._unflatten(0, ({dp}, {tp}), ('dp', 'infer_tp')) over ranks in order."
        )


def build_rollout_engine(
    model_path: str,
    rollout_mesh: DeviceMesh,
    *,
    max_model_len: int,
    gpu_memory_utilization: float,
    dtype: str,
    enforce_eager: bool,
    cpu_kv_cache_gib: int = 1,
    seed: int | None = None,
    images_per_prompt: int = 0,
    **engine_kwargs: object,
) -> LLM:
    """One vLLM engine per rank, TP over the rows of rollout_mesh, with random ("dummy") weights
    that the first `sync_weights` replaces. seed: the engine's (None: its dp rank in rollout_mesh).
    Extra keyword arguments go to `vllm.LLM`.

    images_per_prompt > 0: a vision-language model's engine, taking up to that many images per prompt
    (generate's engine_prompts). Its multimodal processor needs the tokenizer, and pixels are normalised by
    the HF processor on the host: the device-side normalisation's buffers are not checkpoint tensors, so a
    sync would leave them as the dummy load made them."""
    from vllm import LLM
    from vllm.platforms import current_platform

    check_rollout_mesh(rollout_mesh)
    _quiet_sync_logs()
    # Keep the engine in this process (no engine-core subprocess), so all TP ranks step in lockstep.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    shm_ident = None
    if current_platform.is_cpu():
        # The CPU backend sizes its KV cache from this (GiB), not from gpu_memory_utilization.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
        if rollout_mesh.size(1) > 1:
            shm_ident = cpu_shm_ident()
            clear_stale_cpu_shm()
        # A prompt split over scheduler steps (chunked prefill) has its first sample discarded and its
        # seeded generator rewound, which CPU generators cannot do ("CPU Generator does not use offset"):
        # long multi-turn prompts hit it. Unsplit, a prompt that does not fit a step waits for the next.
        engine_kwargs.setdefault("enable_chunked_prefill", False)
    if images_per_prompt:
        engine_kwargs.update(limit_mm_per_prompt={"image": images_per_prompt, "video": 0},
                             mm_device_do_normalize=False, mm_processor_cache_gb=0)
    # vLLM collects and freezes the garbage collector's heap once the engine is up (freeze_gc_heap) and
    # calls gc.collect() six times on the way there (loading, profiling, that freeze), each walking every
    # object the imports made (~640k after torch, transformers and vLLM: ~0.4 s of CPU each). Collected
    # and frozen here first, as vLLM would a moment later, those calls walk only what start-up adds.
    gc.collect()
    gc.freeze()
    with _named_cpu_shm(shm_ident):
        return LLM(
            model=model_path,
            tensor_parallel_size=rollout_mesh.size(1),
            distributed_executor_backend="external_launcher",
            load_format="dummy",  # weights come from the actor, not from disk
            skip_tokenizer_init=not images_per_prompt,  # token ids in, token ids out (a VLM's images need it)
            # TP ranks of one group share a seed so they sample alike; groups differ. Requests carry
            # their own seeds (see sample_seed), so this only matters for unseeded requests.
            seed=rollout_mesh.get_local_rank("dp") if seed is None else seed,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_sleep_mode=current_platform.is_sleep_mode_available(),
            # Logprobs of the distribution actually sampled from (after temperature), so they are
            # comparable with the actor's log-probs of logits / temperature.
            logprobs_mode="processed_logprobs",
            **engine_kwargs,
        )


SHM_DIR = "/dev/shm"
_IDENT = re.compile(r"^(\d+)x(\d+)(?:n\d+)?-")  # cpu_shm_ident's prefix of a segment's name: port, a local pid
_TP_ENGINES_BUILT = [0]  # TP>1 engines this process has built (rollout.release lets a launch build another)


def cpu_shm_ident() -> str:
    """A name for this job's vLLM CPU tensor-parallel shared-memory segments, the same on every rank of a node and
    different for every job on it: the rendezvous port and the pid of the node's first rank ("29500x4242"; the
    second engine a process builds after rollout.release: "29500x4242n1").
    vLLM would name them after its init method, which under torchrun ("env://") is the same for every job, so
    two TP>1 jobs on one node would collide (`create shm in SHMManager failed. errno: 17`)."""
    me = (socket.gethostname(), int(os.environ.get("LOCAL_RANK", "0")), os.getpid())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    first = min((local_rank, pid) for host, local_rank, pid in everyone if host == me[0])[1]
    built, _TP_ENGINES_BUILT[0] = _TP_ENGINES_BUILT[0], _TP_ENGINES_BUILT[0] + 1  # every rank builds alike
    return f"{os.environ.get('MASTER_PORT', '0')}x{first}" + (f"n{built}" if built else "")


@contextlib.contextmanager
def _named_cpu_shm(ident: str | None) -> Iterator[None]:
    """While the engine starts, vLLM's external launcher hands its workers an init method that ends in `ident`
    (the CPU worker names its segments after it, VLLM_DIST_IDENT). The process group exists already, so the
    init method is used for nothing else."""
    if ident is None:
        yield
        return
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    original = ExecutorWithExternalLauncher._distributed_args

    def distributed_args(self: ExecutorWithExternalLauncher) -> tuple[str, int, int]:
        _, rank, local_rank = original(self)
        return f"env://{ident}", rank, local_rank

    ExecutorWithExternalLauncher._distributed_args = distributed_args
    try:
        yield
    finally:
        ExecutorWithExternalLauncher._distributed_args = original


def _mapped_by(path: str) -> list[int]:
    """Pids of the live processes that have `path` mapped (from /proc/<pid>/maps)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as maps:
                if any(line.rstrip("\n").endswith(path) for line in maps):
                    pids.append(int(entry))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def clear_stale_cpu_shm(shm_dir: str = SHM_DIR) -> list[str]:
    """vLLM's CPU backend keeps the shared memory of its TP all-reduce in segments that a killed job leaves
    behind. Before the engine starts, local rank 0 of each node removes (and returns) the segments of jobs that
    are gone: named by cpu_shm_ident after a pid that no longer lives, or named the way vLLM names them itself
    (one name for every job), and in both cases mapped by no process. A live job's segments are never touched:
    its pid lives from before it creates them."""
    removed = []
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and os.path.isdir(shm_dir):
        for name in sorted(os.listdir(shm_dir)):
            if "cpushm" not in name:
                continue
            ident = _IDENT.match(name)
            if ident and os.path.exists(f"/proc/{ident.group(2)}"):
                continue
            path = os.path.join(shm_dir, name)
            if not _mapped_by(path):
                os.unlink(path)
                removed.append(path)
    if removed:
        logger.warning("removed %d stale vLLM CPU shared-memory segments left by a killed job: %s",
                       len(removed), ", ".join(removed))
    return removed


# ---------------------------------------------------------------------------------------------
# Weight sync and checks that it landed


def packed_modules(llm: LLM) -> dict[str, list[str]]:
    """The engine's fused layers and the checkpoint modules each is loaded from, e.g. {"qkv_proj":
    ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}: a sync that updates one
    part of such a layer must send all of its parts (lora.sync_modules)."""
    return _vllm_internals(llm).packed_modules


def sync_weights(llm: LLM, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> float:
    """Actor -> engine, the whole sequence: wake the engine's weights, stream the (HF name, full
    tensor) pairs in, drop the prefix cache, then wake the KV cache, so the accelerator holds the
    weights twice at most (the wake-ups do nothing where vLLM cannot sleep). Returns seconds taken.

    `reload_weights` consumes the iterator lazily (vLLM buffers at most one layer's tensors),
    so passing models.iter_full_params(actor) never builds a second full model copy.
    Plain `model.load_weights` fails on the CPU backend, which repacks weights at start-up.

    partial: the tensors cover only some layers (a LoRA sync); the engine keeps the others as they are.
    Each layer it reloads must get all of its tensors (vLLM rebuilds a layer once its parts arrive).
    A MoE model's tensors must have checkpoint names (moe.engine_names); the CPU engine's reloaded
    experts are packed again afterwards (_restore_cpu_moe_layout).
    """
    start = time.perf_counter()
    wake_up(llm, ["weights"])
    loggers = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")]
    quiet = _DropPartialReloadNoise()
    for log in loggers if partial else []:
        log.addFilter(quiet)
    reloaded_experts: set[str] = set()
    try:
        _vllm_internals(llm).worker.reload_weights(weights_iterator=_expert_layers(named_tensors, reloaded_experts))
    finally:
        for log in loggers:
            log.removeFilter(quiet)
    _restore_cpu_moe_layout(llm, reloaded_experts)
    _reset_encoder_cache(llm)  # images embedded by the old vision tower
    # Cached prompt KV blocks were computed with the old weights. vLLM keeps the blocks of requests still in
    # the engine: a stream that left one there would sample on from KV of the old weights.
    held = llm.llm_engine.get_num_unfinished_requests()
    if held:
        raise RuntimeError(f"{held} requests are still in the rollout engine at a weight sync: their KV is of the "
                           f"old weights (every stream must finish or abort its requests before the next sync)")
    llm.reset_prefix_cache()
    wake_up(llm, ["kv_cache"])
    return time.perf_counter() - start


def engine_fingerprint(llm: LLM, probe_token_ids: Sequence[int], max_tokens: int = 4) -> torch.Tensor:
    """Greedy token ids and their logprobs on a fixed probe prompt, (2, max_tokens), float64.
    Any real weight change moves the logprobs, so comparing two fingerprints shows whether a
    sync reached the engine."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": list(probe_token_ids)}], params, use_tqdm=False)[0].outputs[0]
    log_probs = [entry[tok].logprob for tok, entry in zip(output.token_ids, output.logprobs, strict=True)]
    return torch.tensor([list(output.token_ids), log_probs], dtype=torch.float64)


# How far the actor's log-probs on the probe may move while an engine of this dtype, synced with
# it, still returns bit-identical probe log-probs: float32 shows any real change; bf16 logits hide
# changes below ~1/64 of a logit.
STALE_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2}


class StaleWeightsCheck:
    """Tells "the update did not reach the engine" from "the update changed nothing".

    After each sync, feed it the engine's fingerprint (engine_fingerprint) and the actor's own
    log-probs of a fixed probe sequence. While the engine's fingerprint stays bit-identical, the
    actor must not move: if the actor's probe log-probs have moved by more than `tolerance` since
    the engine's fingerprint last changed, the engine is serving stale weights. A step whose
    gradient was zero (every GRPO group uniform, weight decay 0) moves neither, and passes.
    """

    def __init__(self, tolerance: float) -> None:
        self.tolerance = tolerance
        self.engine: torch.Tensor | None = None  # fingerprint when the engine last changed
        self.actor: torch.Tensor | None = None  # the actor's probe log-probs at that moment

    def check(self, engine: torch.Tensor, actor: torch.Tensor) -> None:
        """Raise RuntimeError when the engine kept its weights although the actor moved."""
        if self.engine is None or not torch.equal(engine, self.engine):
            self.engine, self.actor = engine.clone(), actor.clone()
            return
        moved = (actor - self.actor).abs().max().item()
        if moved > self.tolerance:
            raise RuntimeError(
                f"The rollout engine's outputs on the probe prompt are bit-identical to an earlier sync, but "
                f"the actor's own log-probs on the probe have moved by {moved:.2e} since then (more than "
                f"{self.tolerance:g}): weight updates are not reaching vLLM. Fingerprint: {engine.tolist()}"
            )


def logprob_diff(
    rollout_log_probs: torch.Tensor, actor_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """|vLLM logprob - actor logprob| over response tokens; near zero when the sync is right and both
    are of the same distribution: the same temperature and, as vLLM's are of its top-k / top-p cut,
    actor log-probs under that cut (ppo_core.truncated_log_probs)."""
    diff = (rollout_log_probs - actor_log_probs).abs()[response_mask.bool()]  # (num_tokens,)
    if diff.numel() == 0:  # no token to compare (a rank whose samples are all of older weights)
        return {"logprob_diff_mean": 0.0, "logprob_diff_max": 0.0}
    return {"logprob_diff_mean": diff.mean().item(), "logprob_diff_max": diff.max().item()}


# ---------------------------------------------------------------------------------------------
# Generation


@dataclass
class RolloutBatch:
    """B prompts x n samples, in prompt-major order (prompt i's samples are rows i*n .. i*n+n-1)."""

    prompts: torch.Tensor  # (B*n, P) left-padded with pad_token_id
    responses: torch.Tensor  # (B*n, R) right-padded with pad_token_id, R = max_tokens
    response_mask: torch.Tensor  # (B*n, R) the loss mask: 1 on tokens the policy sampled, EOS included
    input_ids: torch.Tensor  # (B*n, P+R) prompts then responses
    attention_mask: torch.Tensor  # (B*n, P+R) 1 on every real token (a response's own and any it was given)
    position_ids: torch.Tensor  # (B*n, P+R)
    rollout_log_probs: torch.Tensor  # (B*n, R) vLLM's logprob of each sampled token, 0 where masked
    prompt_index: torch.Tensor  # (B*n,) global index of the prompt each sample came from

    def __len__(self) -> int:
        return self.prompts.shape[0]

    def rows(self, index: slice) -> RolloutBatch:
        return RolloutBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


def sample_seed(base_seed: int, step: int, prompt_index: int, sample_index: int, turn: int = 0,
                segment: int = 0) -> int:
    """A per-request seed that depends only on what is sampled, never on the parallel layout. Turns
    after the first (multi-turn rollouts) key on the turn too, and a cut sample's later segments
    (stream_generate) on the segment; the first keeps the single-turn key."""
    key = (f"{base_seed}/{step}/{prompt_index}/{sample_index}" + (f"/{turn}" if turn else "")
           + (f"/s{segment}" if segment else ""))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1  # 63 bits


# Seeds: a step's generation batch k (dynamic sampling draws several) samples with seed + k x this, and
# validation with seed + VALIDATION_SEED_OFFSET, so that no two of them share a request's seed (sample_seed)
GEN_BATCH_SEED_STRIDE = 1_000_003
VALIDATION_SEED_OFFSET = 7919


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How a rollout samples (actor_rollout_ref.rollout, or its val_kwargs for validation), single-turn
    (generate) and multi-turn (agent_loop.generate_multi_turn) alike."""

    n: int  # responses per prompt
    temperature: float  # 0: greedy
    max_tokens: int  # the response's budget (a multi-turn trajectory's: sampled and environment tokens together)
    stop_token_ids: tuple[int, ...]  # what ends a response (the EOS id) or an assistant turn (agent.end_of_turn_ids)
    pad_token_id: int
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    seed: int = 0  # with the step, the prompt and the sample, fixes each request's seed (sample_seed)
    # never sampled: a VLM's image/video pad tokens (the trainer masks its logits alike: vision.ban_tokens)
    banned_token_ids: tuple[int, ...] = ()
    max_prompt_length: int | None = None  # prompts are left-padded to this (None: the longest given)

    def for_batch(self, gen_batch: int) -> Sampling:
        """Generation batch `gen_batch` of a step: fresh seeds for every batch after the first."""
        return replace(self, seed=self.seed + GEN_BATCH_SEED_STRIDE * gen_batch)

    def greedy(self) -> Sampling:
        """One greedy response per prompt (ReMax's baseline)."""
        return replace(self, n=1, temperature=0.0)


@dataclass
class Turn:
    """One request's sampled tokens, the engine's log-prob of each, and why it stopped."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop": a stop token (kept, last) ended it; "length": max_tokens did


def sample_turns(llm: LLM, sampling: Sampling, prompt_token_ids: Sequence[Sequence[int]], seeds: Sequence[int],
                 max_tokens: int | Sequence[int], engine_prompts: Sequence[dict] | None = None) -> list[Turn]:
    """One engine call: a response per prompt (each with its own seed, and max_tokens if a list), under
    sampling's temperature, top-p, top-k and stop ids. All TP ranks of a group must make the same call;
    they get the same turns back. functools.partial(sample_turns, llm, sampling) is the multi-turn loop's
    sampler (agent_loop.generate_multi_turn). engine_prompts: what vLLM gets instead of the ids, one per
    prompt (a VLM's: vision.engine_prompt, the ids with each image's pads collapsed, and the images)."""
    from vllm import SamplingParams

    limits = [max_tokens] * len(seeds) if isinstance(max_tokens, int) else list(max_tokens)
    requests = ([{"prompt_token_ids": list(prompt)} for prompt in prompt_token_ids] if engine_prompts is None
                else list(engine_prompts))
    if len(requests) != len(seeds):
        raise ValueError(f"{len(requests)} engine prompts for {len(seeds)} seeds")
    allowed = None
    if sampling.banned_token_ids:
        banned = set(sampling.banned_token_ids)
        allowed = [t for t in range(_vocab_size(llm)) if t not in banned]
    # With skip_tokenizer_init vLLM knows no EOS id: without stop_token_ids, nothing stops early.
    params = [SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                             max_tokens=limit, stop_token_ids=list(sampling.stop_token_ids), logprobs=0,
                             allowed_token_ids=allowed, seed=seed)
              for seed, limit in zip(seeds, limits, strict=True)]
    outputs = llm.generate(requests, params, use_tqdm=False)
    turns = []
    for out in outputs:
        sampled = out.outputs[0]
        log_probs = [entry[tok].logprob for tok, entry in zip(sampled.token_ids, sampled.logprobs, strict=True)]
        turns.append(Turn(list(sampled.token_ids), log_probs, "stop" if sampled.finish_reason == "stop" else "length"))
    return turns


def generate(llm: LLM, prompt_token_ids: list[list[int]], sampling: Sampling, *, step: int = 0,
             prompt_indices: Sequence[int] | None = None, engine_prompts: Sequence[dict] | None = None
             ) -> RolloutBatch:
    """Sample sampling.n responses per prompt of this dp group. All TP ranks of the group must call this
    with the same arguments.

    prompt_indices are the prompts' global indices in the step's batch (default 0..B-1); with
    sampling.seed and `step` they fix each request's seed, so samples do not depend on the dp/tp layout.
    Prompts are left-padded to sampling.max_prompt_length (None: the longest here).
    engine_prompts: what vLLM gets for each prompt instead of its ids (sample_turns); the batch keeps the ids.
    """
    n = sampling.n
    prompt_indices = list(range(len(prompt_token_ids))) if prompt_indices is None else list(prompt_indices)
    if len(prompt_indices) != len(prompt_token_ids):
        raise ValueError(f"{len(prompt_indices)} prompt_indices for {len(prompt_token_ids)} prompts")
    sample_prompts = [list(p) for p in prompt_token_ids for _ in range(n)]
    sample_indices = [i for i in prompt_indices for _ in range(n)]
    seeds = [sample_seed(sampling.seed, step, index, sample) for index in prompt_indices for sample in range(n)]
    sample_requests = None if engine_prompts is None else [r for r in engine_prompts for _ in range(n)]
    turns = sample_turns(llm, sampling, sample_prompts, seeds, sampling.max_tokens, sample_requests)
    return pad_rollout(sample_prompts, [t.token_ids for t in turns], [t.log_probs for t in turns], sample_indices,
                       sampling.max_tokens, sampling.pad_token_id, sampling.max_prompt_length)


@dataclass
class Trajectory:
    """One sample of a stream (stream_generate): its tokens so far, the engine's log-prob of each and the
    weight version that sampled each. Plain host data, so an unfinished one is carried to the next step
    and saved in checkpoints (vars / Trajectory(**saved))."""

    prompt_index: int  # the prompt's global index (data.PromptSampler)
    sample_index: int  # which of its n samples
    dispatch_step: int  # the step it was dispatched in: with the indices it fixes the seeds (sample_seed)
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)  # the engine's, as sampled
    versions: list[int] = field(default_factory=list)  # per token: the weight version that sampled it
    segments: int = 0  # engine requests made for it so far; the next one's seed keys on it
    finish_reason: str | None = None  # "stop" | "length"; None while unfinished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamStats:
    """What a stream_generate call cost: engine steps, requests running at each (the occupancy), the
    partial responses prefilled again (a carried sample's tokens, under the new weights), aborts."""

    engine_steps: int = 0
    running: list[int] = field(default_factory=list)  # requests in the engine at each step
    reprefilled_tokens: int = 0
    aborted: int = 0


def _check_same_decision(cut: bool, tp_group: dist.ProcessGroup | None, engine_step: int) -> None:
    """Every rank of the TP group must cut at the same engine step: a rank that stepped on alone would wait
    in the engine's all-reduce forever. Compare the decision (a collective per engine step, TP > 1 only) and
    raise on every rank at the first step they differ."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(tp_group)) else "cpu"
    votes = torch.tensor([int(cut)], device=device)
    dist.all_reduce(votes, group=tp_group)
    if votes.item() not in (0, dist.get_world_size(tp_group)):
        raise RuntimeError(f"the ranks of rollout TP group {dist.get_process_group_ranks(tp_group)} disagree on "
                           f"cutting the stream at engine step {engine_step} ({votes.item()} of them would): the stop "
                           f"rule must read the engine's outputs only.")


def stream_generate(llm: LLM, sampling: Sampling, trajectories: Sequence[Trajectory], *, version: int,
                    stop: Callable[[Sequence[Trajectory]], bool] | None = None,
                    tp_group: dist.ProcessGroup | None = None) -> StreamStats:
    """Advance the unfinished trajectories on the engine, step by step, mirroring each step's new tokens
    and log-probs into them (tagged with weight `version`), until all finish or `stop(trajectories)` says
    to cut (asked first before any request is made, then after every engine step); then the rest are aborted and stay unfinished, to be resubmitted by a later call as prompt +
    tokens so far, with the remaining budget (sampling.max_tokens - len(tokens)) and the seed of their
    next segment. stop sees only what the engine returned, so every rank of a TP group, which gets the same
    outputs, cuts at the same engine step. Without a cut, one call on fresh trajectories gives exactly
    `generate`'s samples: the same requests in the same order with the same seeds. tp_group: the rollout TP
    group, whose ranks compare each decision (_check_same_decision)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    stats, live = StreamStats(), {}
    if stop is not None and stop(trajectories):  # enough already (complete groups carried over): no engine work
        return stats
    for traj in trajectories:
        if traj.finished:
            continue
        seed = sample_seed(sampling.seed, traj.dispatch_step, traj.prompt_index, traj.sample_index,
                           segment=traj.segments)
        params = SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                max_tokens=sampling.max_tokens - len(traj.tokens),
                                stop_token_ids=list(sampling.stop_token_ids), logprobs=0, seed=seed,
                                output_kind=RequestOutputKind.DELTA)
        live[_add_request(llm, traj.prompt + traj.tokens, params)] = traj
        traj.segments += 1
        stats.reprefilled_tokens += len(traj.tokens)
    while live:
        stats.running.append(len(live))
        outputs = _step(llm)
        stats.engine_steps += 1
        for out in outputs:
            traj, sampled = live[out.request_id], out.outputs[0]
            traj.tokens += sampled.token_ids
            traj.log_probs += [entry[tok].logprob for tok, entry in zip(sampled.token_ids, sampled.logprobs,
                                                                        strict=True)]
            traj.versions += [version] * len(sampled.token_ids)
            if out.finished:
                traj.finish_reason = "stop" if sampled.finish_reason == "stop" else "length"
                del live[out.request_id]
        cut = bool(live) and stop is not None and stop(trajectories)
        _check_same_decision(cut, tp_group, stats.engine_steps)
        if cut:
            _abort(llm, list(live))
            stats.aborted = len(live)
            break
    return stats


def trajectories_batch(trajs: Sequence[Trajectory], sampling: Sampling) -> tuple[RolloutBatch, torch.Tensor]:
    """Finished trajectories -> the padded batch training consumes (pad_rollout), and the weight version of
    each response token, (N, R) long, -1 on padding."""
    if not all(t.finished for t in trajs):
        raise ValueError("trajectories_batch takes finished trajectories only")
    batch = pad_rollout([t.prompt for t in trajs], [t.tokens for t in trajs], [t.log_probs for t in trajs],
                        [t.prompt_index for t in trajs], sampling.max_tokens, sampling.pad_token_id,
                        sampling.max_prompt_length)
    versions = torch.full((len(trajs), sampling.max_tokens), -1, dtype=torch.long)  # (N, R)
    for row, traj in enumerate(trajs):
        versions[row, :len(traj.versions)] = torch.tensor(traj.versions, dtype=torch.long)
    return batch, versions


def pad_rollout(
    prompts: list[list[int]],
    responses: list[list[int]],
    log_probs: list[list[float]],
    prompt_indices: list[int],
    max_tokens: int,
    pad_token_id: int,
    max_prompt_length: int | None = None,
    loss_masks: list[list[int]] | None = None,
) -> RolloutBatch:
    """Pack ragged prompts/responses into the padded tensors that training consumes. loss_masks, per
    response token, say which tokens the policy sampled (default: all of them); the attention mask
    covers every token either way."""
    longest = max(len(p) for p in prompts)
    prompt_len = longest if max_prompt_length is None else max_prompt_length
    if longest > prompt_len:
        raise ValueError(f"a prompt has {longest} tokens, more than data.max_prompt_length={prompt_len}")
    num = len(prompts)
    prompt_ids = torch.full((num, prompt_len), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((num, prompt_len), dtype=torch.long)
    response_ids = torch.full((num, max_tokens), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((num, max_tokens), dtype=torch.long)
    response_log_probs = torch.zeros((num, max_tokens), dtype=torch.float32)
    response_attention = torch.zeros((num, max_tokens), dtype=torch.long)
    for row, (prompt, response, lp) in enumerate(zip(prompts, responses, log_probs, strict=True)):
        if len(prompt) > 0:
            prompt_ids[row, -len(prompt):] = torch.tensor(prompt)
            prompt_mask[row, -len(prompt):] = 1
        response_ids[row, :len(response)] = torch.tensor(response, dtype=torch.long)
        response_attention[row, :len(response)] = 1
        if loss_masks is None:
            response_mask[row, :len(response)] = 1
        else:
            if len(loss_masks[row]) != len(response):
                raise ValueError(f"sample {row}: a loss mask of {len(loss_masks[row])} tokens for a response of "
                                 f"{len(response)}")
            response_mask[row, :len(response)] = torch.tensor(loss_masks[row], dtype=torch.long)
        response_log_probs[row, :len(response)] = torch.tensor(lp, dtype=torch.float32)
    # Positions count real prompt tokens from 0 and continue through the response (as verl does).
    prompt_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (N, P)
    response_positions = prompt_positions[:, -1:] + torch.arange(1, max_tokens + 1)  # (N, R)
    return RolloutBatch(
        prompts=prompt_ids,
        responses=response_ids,
        response_mask=response_mask,
        input_ids=torch.cat([prompt_ids, response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, response_attention], dim=1),
        position_ids=torch.cat([prompt_positions, response_positions], dim=1),
        rollout_log_probs=response_log_probs,
        prompt_index=torch.tensor(prompt_indices, dtype=torch.long),
    )


# ---------------------------------------------------------------------------------------------
# Groups in flight (trainer.v1.trainer_mode=colocate_async): the stop rule, the selection, the bound.
# A group is one prompt's n trajectories from one dispatch; pure functions of the trajectories, so every
# rank of a TP group, holding the same ones, decides alike.


def groups_of(trajs: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """The trajectories by group (dispatch step, prompt index), in the order their groups first appear."""
    groups: dict[tuple[int, int], list[Trajectory]] = {}
    for traj in trajs:
        groups.setdefault((traj.dispatch_step, traj.prompt_index), []).append(traj)
    return list(groups.values())


def span(step: int, dispatch_step: int) -> int:
    """verl V1's measure of a group's age at training step `step`: the weight versions from its dispatch
    to that step, step - dispatch_step + 1 (1: sampled and trained in one step, on policy)."""
    return step - dispatch_step + 1


def should_cut(trajs: Sequence[Trajectory], *, step: int, quota: int, threshold: int, strategy: str) -> bool:
    """Stop generating at `step` once `quota` groups are complete, and (strategy wait) no unfinished group
    has reached `threshold`: it could not be trained at a later step within the bound, so it must finish now."""
    groups = groups_of(trajs)
    if len({g[0].prompt_index for g in groups if all(t.finished for t in g)}) < quota:  # one group per prompt
        return False
    return strategy != "wait" or all(span(step, g[0].dispatch_step) < threshold
                                     for g in groups if not all(t.finished for t in g))


def select_groups(trajs: Sequence[Trajectory], quota: int) -> tuple[list[Trajectory], list[Trajectory]]:
    """(the `quota` oldest complete groups, prompt-major, each group's samples in order; the rest, in their
    order). Oldest: the earliest dispatch step, then the order of dispatch. A prompt drawn again (the next
    epoch) while its earlier group is in flight waits a step: a batch holds one group per prompt, as the
    advantages group samples by prompt."""
    groups = groups_of(trajs)
    complete = sorted((i for i, g in enumerate(groups) if all(t.finished for t in g)),
                      key=lambda i: groups[i][0].dispatch_step)  # a stable sort: dispatch order within a step
    chosen: list[int] = []
    for i in complete:
        if len(chosen) < quota and all(groups[j][0].prompt_index != groups[i][0].prompt_index for j in chosen):
            chosen.append(i)
    selected = [t for i in chosen for t in groups[i]]
    return selected, [t for i, g in enumerate(groups) if i not in chosen for t in g]


def drop_stale(trajs: Sequence[Trajectory], next_step: int, threshold: int) -> tuple[list[Trajectory], int]:
    """Strategy drop: (the trajectories whose group can still be trained at `next_step` within the bound,
    the number of groups dropped)."""
    groups = groups_of(trajs)
    kept = [g for g in groups if span(next_step, g[0].dispatch_step) <= threshold]
    return [t for g in kept for t in g], len(groups) - len(kept)


def deal_groups(per_group: Sequence[Sequence[Trajectory]], dp_size: int) -> list[list[Trajectory]]:
    """Carried samples saved by rollout dp groups of another number, dealt anew to `dp_size` groups: whole
    groups (a prompt's n samples stay together, for its advantages), oldest first (dispatch step, then the
    saved groups' order), in turn, so that the counts differ by one at most. The seeds key on what is sampled
    (sample_seed), not on which engine samples it, so a sample goes on the same wherever it lands."""
    groups = sorted((g for trajs in per_group for g in groups_of(trajs)), key=lambda g: g[0].dispatch_step)
    return [[t for g in groups[dp::dp_size] for t in g] for dp in range(dp_size)]


# ---------------------------------------------------------------------------------------------
# Splitting the batch: prompts over dp groups, samples over all ranks for training


def shard_for_dp(items: Sequence, dp_rank: int, dp_size: int) -> list:
    """The contiguous share of the step's prompts that rollout dp group `dp_rank` generates for."""
    if len(items) % dp_size:
        raise ValueError(
            f"{len(items)} prompts (data.train_batch_size) cannot be split evenly over {dp_size} rollout "
            f"dp groups (world size / {TP_KEY}); use a multiple of {dp_size}."
        )
    per_group = len(items) // dp_size
    return list(items[dp_rank * per_group:(dp_rank + 1) * per_group])


def training_rows(num_samples: int, infer_tp_rank: int, infer_tp_size: int) -> slice:
    """Training is data parallel over all ranks: TP rank r of a group keeps slice r of the group's
    B*n samples (prompt-major, so a prompt's samples stay together when B divides by the TP size)."""
    if num_samples % infer_tp_size:
        raise ValueError(
            f"{num_samples} samples of a rollout group cannot be split evenly over its {infer_tp_size} "
            f"ranks; make (prompts per dp group x actor_rollout_ref.rollout.n) a multiple of {TP_KEY}."
        )
    per_rank = num_samples // infer_tp_size
    return slice(infer_tp_rank * per_rank, (infer_tp_rank + 1) * per_rank)


def split_for_training(batch: RolloutBatch, infer_tp_rank: int, infer_tp_size: int) -> RolloutBatch:
    """This TP rank's rows of the group's batch (training_rows)."""
    return batch.rows(training_rows(len(batch), infer_tp_rank, infer_tp_size))


# ---------------------------------------------------------------------------------------------
# Memory phases and shutdown


def sleep_level(partial_sync: bool) -> int:
    """vLLM's sleep level for an engine whose next sync_weights sends every weight (2: the weights are
    discarded, not copied to host memory and back only to be overwritten; vLLM 0.32 keeps the model's
    buffers, its runtime and CUDA-graph pools at either level) or only some layers (1: a LoRA sync
    leaves the other layers as they were, so they must survive the sleep)."""
    return 1 if partial_sync else 2


def sleep(llm: LLM, level: int = 1) -> bool:
    """Free the accelerator memory the engine holds before training. Level 1 keeps the weights in
    host memory; level 2 discards them, right only when the next wake-up is followed by a
    sync_weights of every weight (sleep_level). Returns False, doing nothing, where the platform has
    no sleep mode (CPU)."""
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        _log_once(f"vLLM sleep mode is not available on {current_platform.device_name}; the rollout "
                  "engine keeps its memory during training.")
        return False
    llm.sleep(level=level)
    return True


def wake_up(llm: LLM, tags: list[str] | None = None) -> bool:
    """Re-allocate engine memory (sync_weights wakes ["weights"], then ["kv_cache"], to keep the
    peak low). Returns False, doing nothing, without sleep mode (CPU)."""
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        _log_once(f"vLLM sleep mode is not available on {current_platform.device_name}; nothing to wake.")
        return False
    if not llm.llm_engine.is_sleeping():  # rollout.free_cache_engine=false: it never slept
        return False
    llm.wake_up(tags=tags)
    return True


def release(llm: LLM) -> None:
    """Drop vLLM's tensor-parallel groups and keep torch.distributed's default group: once the caller has
    dropped its references to llm, this process can build an engine of another TP size (collective: every rank
    calls it). The in-process engine's shutdown, which vLLM also runs when the engine is collected, would end the
    default group (shutdown's note): it is detached, and the engine's memory goes with its last reference."""
    from vllm.distributed.parallel_state import destroy_model_parallel

    _vllm_internals(llm).engine_core._finalizer.detach()
    destroy_model_parallel()
    gc.unfreeze()  # build_rollout_engine froze the heap: the dropped engine's objects must be collectable


def shutdown(llm: LLM) -> None:
    """Stop the engine, then the default process group. Call this instead of
    dist.destroy_process_group(): vLLM's shutdown destroys its own groups and the default one,
    and if it runs later (at interpreter exit) after the caller destroyed the default group, it
    fails with 'Invalid process group specified'."""
    _vllm_internals(llm).engine_core.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
