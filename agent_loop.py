"""Multi-turn rollouts: the policy and an environment (tools, a game, a simulated user) take turns.

Batched turn by turn, in-process (verl's `rollout.mode=async` is accepted and means the same here):
each turn is one engine call over the dp group's trajectories still running, each prompt being the
trajectory's ids so far (token in, token out: sampled ids are never decoded and re-encoded for
training; only the environment's replies are tokenized, as the chat template renders them after the
assistant's end of turn). Every rank of a rollout TP group holds every trajectory of the group and
makes the same engine calls; trajectory j's environment lives on TP rank j % tp alone, and its
replies reach the other ranks through one all-gather per turn, so a tool runs once and a slow or
failing tool cannot put the ranks out of step (agent.ToolEnvironment turns errors into text).

    sample = functools.partial(rollout.sample_turns, llm, sampling)     # or any sampler: (prompts, seeds, max_tokens)
    batch, stats = generate_multi_turn(sample, rows, prompt_indices, sampling, limits, step=step, make_env=...,
                                       renderer=..., decode=..., tp_group=group)

Returns a rollout.RolloutBatch whose response_mask is 1 on the tokens the policy sampled only (the
environment's are attended, not trained) and whose rollout_log_probs are 0 on them, plus per-sample
counts (MultiTurnStats) and each trajectory's turns, for the reward and the logs.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import rollout

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from agent import Environment, ObservationRenderer, StepResult

# The sampler of one turn: (prompts, their seeds, each prompt's max_tokens) -> one rollout.Turn per prompt.
# The engine's is functools.partial(rollout.sample_turns, llm, sampling); every rank of a TP group must get
# the same turns for the same call.
Sampler = Callable[[list[list[int]], list[int], list[int]], list[rollout.Turn]]


@dataclass(frozen=True)
class TurnLimits:
    """How many turns a trajectory may take (actor_rollout_ref.rollout.multi_turn); None: no limit."""

    max_assistant_turns: int | None = None
    max_user_turns: int | None = None


@dataclass
class Trajectory:
    """One sample as it grows: the prompt, then assistant and environment tokens in turn."""

    row: Any  # the dataset row (data.Prompt)
    prompt_index: int
    sample: int
    response: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 on tokens the policy sampled
    log_probs: list[float] = field(default_factory=list)  # the engine's, 0 on environment tokens
    assistant_turns: int = 0
    user_turns: int = 0
    calls: int = 0
    failed_calls: int = 0
    tool_reward: float = 0.0  # the environment's step rewards, summed
    final_rewards: dict[str, float] = field(default_factory=dict)  # its rewards at the end (calc_reward by tool)
    tool_seconds: float = 0.0
    turns: list[dict[str, Any]] = field(default_factory=list)  # role, text, tokens, trained
    done: bool = False

    def add(self, ids: list[int], sampled: bool, log_probs: list[float] | None = None) -> None:
        self.response += ids
        self.loss_mask += [int(sampled)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)


@dataclass
class MultiTurnStats:
    """Per sample: (B*n,) tensors of the turns as verl counts them (user + assistant + 1), the tool
    calls and the failed ones; what the reward function gets in extra_info (num_turns,
    rollout_reward_scores: the final rewards by name, tool_rewards: the step rewards); the turns."""

    num_turns: torch.Tensor
    tool_calls: torch.Tensor
    tool_failures: torch.Tensor
    reward_info: list[dict[str, Any]]
    turns: list[list[dict[str, Any]]]
    tool_seconds: float  # this rank's time in its environments

    def rows(self, index: slice) -> MultiTurnStats:
        return MultiTurnStats(self.num_turns[index], self.tool_calls[index], self.tool_failures[index],
                              self.reward_info[index], self.turns[index], self.tool_seconds)


def _check_lockstep(trajs: list[Trajectory], group: dist.ProcessGroup | None) -> None:
    """Every rank of the TP group must hold the same trajectories (the same engine calls made them):
    compare a digest of their ids and masks, and fail loudly on every rank rather than train on a split."""
    if group is None or dist.get_world_size(group) == 1:
        return
    digest = hashlib.blake2b(repr([(t.response, t.loss_mask) for t in trajs]).encode(), digest_size=16).hexdigest()
    every_rank: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(every_rank, digest, group=group)
    if len(set(every_rank)) > 1:
        raise RuntimeError(f"the ranks of rollout TP group {dist.get_process_group_ranks(group)} hold different "
                           f"trajectories (digests {every_rank}): an environment answered differently on some rank.")


def _gather_results(mine: dict[int, Any], group: dist.ProcessGroup | None) -> dict[int, Any]:
    """Every rank's {trajectory: result} of the TP group, merged (each trajectory has one owner)."""
    if group is None or dist.get_world_size(group) == 1:
        return mine
    every_rank: list[dict[int, Any]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(every_rank, mine, group=group)
    return {j: result for part in every_rank for j, result in part.items()}


def generate_multi_turn(sample: Sampler, rows: Sequence[Any], prompt_indices: Sequence[int],
                        sampling: rollout.Sampling, limits: TurnLimits, *, step: int,
                        make_env: Callable[[Any], Environment], renderer: ObservationRenderer,
                        decode: Callable[[list[int]], str],
                        tp_group: dist.ProcessGroup | None = None) -> tuple[rollout.RolloutBatch, MultiTurnStats]:
    """sampling.n trajectories per row of this rollout dp group, prompt-major, turn by turn until each
    ends: a turn with no call (or a reply the environment ends on), the token budget (sampling.max_tokens),
    a turn cut by it, a turn limit, or an environment reply that does not fit what is left. Each turn is one
    call of `sample` over the trajectories still running, seeded from sampling.seed. make_env(row) builds a
    reset environment; it runs on this rank for the trajectories it owns. Collective over tp_group."""
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    trajs = [Trajectory(row, index, s) for row, index in zip(rows, prompt_indices, strict=True)
             for s in range(sampling.n)]
    envs = {j: make_env(t.row) for j, t in enumerate(trajs) if j % tp_size == tp_rank}
    budget = sampling.max_tokens
    for turn in itertools.count():
        active = [j for j, t in enumerate(trajs) if not t.done]
        if not active:
            break
        results = sample([list(trajs[j].row.token_ids) + trajs[j].response for j in active],
                         [rollout.sample_seed(sampling.seed, step, trajs[j].prompt_index, trajs[j].sample, turn)
                          for j in active],
                         [budget - len(trajs[j].response) for j in active])
        replying = []
        for j, result in zip(active, results, strict=True):
            t = trajs[j]
            t.add(result.token_ids, True, result.log_probs)
            t.assistant_turns += 1
            t.turns.append({"role": "assistant", "text": decode(result.token_ids), "tokens": len(result.token_ids),
                            "trained": True})
            turn_limit = limits.max_assistant_turns is not None and t.assistant_turns >= limits.max_assistant_turns
            # no reply may follow: checked before the environment runs, so no call runs for a reply dropped
            reply_limit = limits.max_user_turns is not None and t.user_turns >= limits.max_user_turns
            t.done = result.finish_reason != "stop" or len(t.response) >= budget or turn_limit or reply_limit
            if not t.done:
                replying.append(j)
        # the environments answer on their owner ranks; every rank of the group gets every answer
        owned = [j for j in replying if j in envs]
        start = time.perf_counter()  # this rank's environments step concurrently: a slow tool holds up only itself
        steps = step_all([envs[j] for j in owned], [trajs[j].turns[-1]["text"] for j in owned])
        seconds = time.perf_counter() - start
        for j in owned:
            trajs[j].tool_seconds += seconds / len(owned)
            _log_errors(envs[j])
        answers = _gather_results({j: _as_plain(result) for j, result in zip(owned, steps, strict=True)}, tp_group)
        for j in replying:
            _take_answer(trajs[j], answers[j], renderer, budget)
    _check_lockstep(trajs, tp_group)
    closing = _gather_results({j: _close(env) for j, env in envs.items()}, tp_group)
    for j, t in enumerate(trajs):
        t.final_rewards = closing[j]
    batch = rollout.pad_rollout([list(t.row.token_ids) for t in trajs], [t.response for t in trajs],
                                [t.log_probs for t in trajs], [t.prompt_index for t in trajs], budget,
                                sampling.pad_token_id, sampling.max_prompt_length,
                                loss_masks=[t.loss_mask for t in trajs])
    stats = MultiTurnStats(
        num_turns=torch.tensor([t.user_turns + t.assistant_turns + 1 for t in trajs], dtype=torch.float32),
        tool_calls=torch.tensor([t.calls for t in trajs], dtype=torch.float32),
        tool_failures=torch.tensor([t.failed_calls for t in trajs], dtype=torch.float32),
        reward_info=[{"num_turns": t.user_turns + t.assistant_turns + 1, "rollout_reward_scores": t.final_rewards,
                      "tool_rewards": t.tool_reward} for t in trajs],
        turns=[t.turns for t in trajs], tool_seconds=sum(t.tool_seconds for t in trajs))
    return batch, stats


def step_all(envs: Sequence[Environment], texts: Sequence[str]) -> list[StepResult]:
    """agent.step_all (concurrently), each environment guarded by _Guarded."""
    import agent

    return agent.step_all([_Guarded(env) for env in envs], texts)


@dataclass
class _Guarded:
    """An environment whose step never raises: a custom one that does (agent.ToolEnvironment never does)
    ends its trajectory, rather than this rank, which would leave the TP group waiting in a collective."""

    env: Any

    def step(self, text: str) -> StepResult:
        import agent

        try:
            return self.env.step(text)
        except Exception as e:
            logger.warning("environment %s raised in step, ending its trajectory: %s: %s", type(self.env).__name__,
                           type(e).__name__, e)
            return agent.StepResult(None)


def _close(env: Environment) -> dict[str, float]:
    try:
        rewards = env.close()
    except Exception as e:
        logger.warning("environment %s raised in close: %s: %s", type(env).__name__, type(e).__name__, e)
        return {}
    _log_errors(env)
    return rewards


def _log_errors(env: Environment) -> None:
    """What went wrong inside a tool environment's tools (agent.ToolEnvironment.errors), into the rank's log."""
    errors = getattr(env, "errors", None)
    if errors:
        for error in errors:
            logger.warning("tool error: %s", error)
        errors.clear()


def _as_plain(result: StepResult) -> dict[str, Any]:
    """A StepResult as plain data, for the all-gather."""
    return {"messages": result.messages, "calls": result.num_calls, "failed": result.num_failed_calls,
            "reward": float(result.reward)}


def _take_answer(t: Trajectory, answer: dict[str, Any], renderer: ObservationRenderer, budget: int) -> None:
    """Append the environment's reply to a trajectory, or end it (no reply, a limit, no room)."""
    t.calls += answer["calls"]
    t.failed_calls += answer["failed"]
    t.tool_reward += answer["reward"]
    if not answer["messages"]:  # no parsable call, or the environment is done
        t.done = True
        return
    ids = renderer(answer["messages"])
    if len(t.response) + len(ids) >= budget:  # the reply does not fit, with room for an answer to it (verl)
        t.done = True
        return
    t.add(ids, False)
    t.user_turns += 1
    t.turns.append({"role": answer["messages"][-1].get("role", "tool"),
                    "text": "\n".join(str(m.get("content", "")) for m in answer["messages"]),
                    "tokens": len(ids), "trained": False})
