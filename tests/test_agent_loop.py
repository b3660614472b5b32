"""The multi-turn loop (agent_loop.generate_multi_turn) on CPU with a scripted sampler and a scripted
environment, no engine: what each turn is sampled from (prompt, seed, token budget), what is trained on,
and every way a trajectory ends, against trajectories written out by hand."""

from types import SimpleNamespace

import pytest

import rollout
from agent import StepResult
from agent_loop import TurnLimits, generate_multi_turn

END = 99  # the end-of-turn id the scripted sampler stops on
REPLY = [7, 8]  # the rendered environment reply
PROMPTS = [[1, 2, 3], [4, 5]]


class ScriptedSampler:
    """Answers every prompt with `turn`, cut to its max_tokens, log-prob -0.1 per token: "stop" when it ends
    with the end of turn, else "length" (as the engine's); records each call."""

    def __init__(self, turn: list[int]) -> None:
        self.turn, self.calls = turn, []

    def __call__(self, prompts: list[list[int]], seeds: list[int], max_tokens: list[int]) -> list[rollout.Turn]:
        self.calls.append((prompts, seeds, max_tokens))
        cut = [self.turn[:limit] for limit in max_tokens]
        return [rollout.Turn(ids, [-0.1] * len(ids), "stop" if ids[-1:] == [END] else "length") for ids in cut]


class Replies:
    """Replies to the first `replies` assistant turns, then ends the trajectory; counts its steps."""

    steps = 0

    def __init__(self, replies: int) -> None:
        self.replies = replies

    def reset(self, row: object) -> None:
        self.turns = 0

    def step(self, text: str) -> StepResult:
        Replies.steps += 1
        self.turns += 1
        if self.turns > self.replies:
            return StepResult(None)
        return StepResult([{"role": "user", "content": "again"}], num_calls=1)

    def close(self) -> dict[str, float]:
        return {"turns": float(self.turns)}


def run_loop(turn: list[int], max_tokens: int, limits: TurnLimits, replies: int = 5):
    sampler = ScriptedSampler(turn)
    Replies.steps = 0
    sampling = rollout.Sampling(n=2, temperature=1.0, max_tokens=max_tokens, stop_token_ids=(END,), pad_token_id=0,
                                seed=5, max_prompt_length=4)
    rows = [SimpleNamespace(token_ids=p) for p in PROMPTS]

    def make_env(row: object) -> Replies:
        env = Replies(replies)
        env.reset(row)
        return env

    batch, stats = generate_multi_turn(sampler, rows, [10, 11], sampling, limits, step=3, make_env=make_env,
                                       renderer=lambda messages: list(REPLY), decode=lambda ids: str(ids))
    return sampler, batch, stats


def responses(batch: rollout.RolloutBatch) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(batch.responses, batch.attention_mask[:, -batch.responses.shape[1]:],
                                                           strict=True)]


def test_turns_are_sampled_from_the_trajectory_so_far_with_per_turn_seeds():
    sampler, batch, stats = run_loop([5, 6, END], max_tokens=12, limits=TurnLimits(), replies=1)
    # turn 0 from the prompts, turn 1 from prompt + turn + reply; 2 samples per prompt, prompt-major
    first, second = sampler.calls
    assert first[0] == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
    assert second[0] == [p + [5, 6, END] + REPLY for p in first[0]]
    assert first[2] == [12] * 4 and second[2] == [12 - 5] * 4  # what is left of the trajectory's budget
    # turn 0 seeds as a single-turn rollout does (its key has no turn), turn 1 adds the turn to the key
    assert first[1] == [rollout.sample_seed(5, 3, index, s) for index in (10, 11) for s in range(2)]
    assert second[1] == [rollout.sample_seed(5, 3, index, s, 1) for index in (10, 11) for s in range(2)]
    whole = [5, 6, END, *REPLY, 5, 6, END]
    assert responses(batch) == [whole] * 4
    assert batch.response_mask[0, :len(whole)].tolist() == [1, 1, 1, 0, 0, 1, 1, 1]  # the reply is not trained
    assert batch.rollout_log_probs[0, :len(whole)].tolist() == pytest.approx([-0.1] * 3 + [0.0] * 2 + [-0.1] * 3)
    assert batch.prompt_index.tolist() == [10, 10, 11, 11] and batch.prompts.shape == (4, 4)
    assert stats.num_turns.tolist() == [4.0] * 4  # 2 assistant + 1 user + 1, as verl counts
    assert stats.tool_calls.tolist() == [1.0] * 4
    assert [info["rollout_reward_scores"] for info in stats.reward_info] == [{"turns": 2.0}] * 4
    assert [t["role"] for t in stats.turns[0]] == ["assistant", "user", "assistant"]


@pytest.mark.parametrize("max_tokens, limits, want, env_steps", [
    # the budget cuts the second turn: 3 + 2 + 2 = 7 tokens, the turn ends by length
    (7, TurnLimits(), [5, 6, END, *REPLY, 5, 6], 4),
    # the reply would fill the budget (3 + 2 >= 5): no reply, no further turn
    (5, TurnLimits(), [5, 6, END], 4),
    # one assistant turn: the environment never runs
    (12, TurnLimits(max_assistant_turns=1), [5, 6, END], 0),
    # no reply may follow the first: the environment never runs
    (12, TurnLimits(max_user_turns=0), [5, 6, END], 0),
    # two replies, then the assistant turn limit
    (20, TurnLimits(max_assistant_turns=3), [5, 6, END, *REPLY, 5, 6, END, *REPLY, 5, 6, END], 8),
])
def test_every_way_a_trajectory_ends(max_tokens, limits, want, env_steps):
    _, batch, _ = run_loop([5, 6, END], max_tokens, limits)
    assert responses(batch) == [want] * 4
    assert Replies.steps == env_steps


def test_a_turn_without_the_end_of_turn_id_ends_the_trajectory():
    sampler, batch, _ = run_loop([5, 6], max_tokens=12, limits=TurnLimits())
    assert responses(batch) == [[5, 6]] * 4 and len(sampler.calls) == 1 and Replies.steps == 0
