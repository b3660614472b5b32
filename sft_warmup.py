"""A short supervised pass that turns a random tiny model into a weak solver of the demo task.

Real RL runs start from an SFT model; the demo does the same at toy scale, so that RL has something
to sharpen: after this pass the model answers some questions right and the score has room to rise.

    python sft_warmup.py --model assets/tiny-qwen2 --data assets/data/train.parquet \
        --out assets/tiny-qwen2-sft --steps 150

Single process, plain PyTorch, a few seconds to a minute on a CPU. Loss on the answer tokens only.

With --tools (verl's tool YAML) the examples are tool trajectories, built token in / token out as
the multi-turn rollout sees them: the prompt's ids as data.load_prompts renders them, the assistant's
call (`calc(37*48)`, from the row's extra_info.expression) and its end of turn, the tool's answer as
agent.ObservationRenderer renders it (masked out of the loss), then `#### 1776` and its end of turn.
A fraction (--tool-fraction) of the rows are tool trajectories, the others direct `#### answer`
replies; --val then runs the multi-turn loop with HF on the warmed model (greedy and sampled) and
prints how often it calls the tool and how often it is right:

    python sft_warmup.py --model assets/tiny-qwen2 --data assets/data/tools_train.parquet \
        --out assets/tiny-qwen2-tools-sft --tools configs/tools/calculator.yaml --format demo \
        --val assets/data/tools_val.parquet
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from data import load_rows

Example = tuple[list[int], list[int]]  # token ids, and 1 where the loss is taken


def encode_example(tokenizer: PreTrainedTokenizerBase, row: dict) -> tuple[list[int], int]:
    """Token ids of prompt + `#### answer` + EOS, and where the answer starts."""
    prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    answer = f"#### {row['reward_model']['ground_truth']}"
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p_ids + a_ids, len(p_ids)


def make_batch(examples: list[tuple[list[int], int]] | list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded inputs; labels are the ids from `start` on (an int), or where the mask (a list) is 1."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)  # -100: ignored by the HF loss
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, trained) in enumerate(examples):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        if isinstance(trained, int):
            labels[i, trained:len(ids)] = torch.tensor(ids[trained:])
        else:
            labels[i, :len(ids)] = torch.where(torch.tensor(trained, dtype=torch.bool), torch.tensor(ids), -100)
        attention[i, :len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}


# -----------------------------------------------------------------------------
# Tool trajectories (--tools), token in / token out


class ToolTask:
    """The pieces the multi-turn rollout uses, built the same way here: the tools of a verl tool YAML,
    an agent.ToolEnvironment with the call parser, the ObservationRenderer and the assistant's end-of-turn id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tool_config: str, parser: str) -> None:
        import agent

        self.tokenizer, self.parser = tokenizer, parser
        self.tools = agent.load_tools(tool_config)
        self.schemas = agent.tool_schemas(self.tools)
        self.renderer = agent.ObservationRenderer(tokenizer, self.schemas)
        # the id the chat template closes an assistant turn with (what the model samples to end it)
        self.end_of_turn = self.renderer.prefix_ids[-1]
        self.stop_ids = set(agent.end_of_turn_ids(tokenizer))

    def env(self, row: Any) -> Any:
        import agent

        env = agent.ToolEnvironment(self.tools, self.parser)
        env.reset(row)
        return env

    def prompts(self, files: str, key: str) -> list[Any]:
        """data.Prompt rows, rendered as the trainer renders them (the tool schemas given to the template)."""
        import inspect

        import data

        kwargs = {"tools": self.schemas} if "tools" in inspect.signature(data.load_prompts).parameters else {}
        prompts, _ = data.load_prompts(files, self.tokenizer, key=key, prompt_key="prompt", max_prompt_length=1 << 20,
                                       filter_overlong=False, truncation="error", **kwargs)
        return prompts

    def assistant_ids(self, text: str) -> list[int]:
        """The ids of an assistant turn as the model samples them: the text's tokens, then the end of turn.
        Checked: the ids decode to the text and encode back to themselves (a tokenizer that merges
        differently in context would train on ids the model never samples)."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.tokenizer.decode(ids) != text or [self.tokenizer(self.tokenizer.decode([i]), add_special_tokens=False)
                                                  ["input_ids"] for i in ids] != [[i] for i in ids]:
            raise ValueError(f"the tokenizer does not encode {text!r} one sampled token at a time ({ids}); the SFT "
                             f"ids would differ from what the rollout samples.")
        return ids + [self.end_of_turn]

    def trajectory(self, prompt: Any, use_tool: bool) -> Example:
        """prompt ids (0), the call + end of turn (1), the observation ids (0), `#### answer` + end of turn (1);
        or prompt (0) and `#### answer` + end of turn (1) when not use_tool."""
        ids, trained = list(prompt.token_ids), [0] * len(prompt.token_ids)
        if use_tool:
            call = f"calc({prompt.extra_info['expression']})"
            env = self.env(prompt)
            result = env.step(call)
            env.close()
            if result.messages is None or result.num_failed_calls:
                raise ValueError(f"the tool call {call!r} for {prompt.text!r} failed: {result.messages}")
            answer = result.messages[0]["content"]
            if answer != str(prompt.ground_truth):
                raise ValueError(f"the tool answered {answer!r} to {call!r}, the ground truth is {prompt.ground_truth!r}")
            for part, is_trained in ((self.assistant_ids(call), 1), (self.renderer(result.messages), 0)):
                ids += part
                trained += [is_trained] * len(part)
        final = self.assistant_ids(f"#### {prompt.ground_truth}")
        return ids + final, trained + [1] * len(final)


def hf_sampler(model: Any, temperature: float, stop_ids: set[int], pad_id: int) -> Callable[..., list[Any]]:
    """The multi-turn loop's sampler (agent_loop.Sampler) with HF forwards, token by token over the batch:
    each prompt's own seeded generator, until a stop id (kept) or its max_tokens."""
    import rollout

    @torch.no_grad()
    def sample(prompts: list[list[int]], seeds: list[int], max_tokens: list[int]) -> list[rollout.Turn]:
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        turns = [rollout.Turn([], [], "length") for _ in prompts]
        active = [i for i, limit in enumerate(max_tokens) if limit > 0]
        while active:
            seqs = [list(prompts[i]) + turns[i].token_ids for i in active]
            width = max(map(len, seqs))
            ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in seqs])  # (b, width) left-padded
            mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()  # (b, V)
            log_probs = torch.log_softmax(logits / (temperature or 1.0), -1)  # (b, V)
            still = []
            for row, i in enumerate(active):
                if temperature == 0:
                    token = int(logits[row].argmax())
                else:
                    token = int(torch.multinomial(log_probs[row].exp(), 1, generator=generators[i]))
                turns[i].token_ids.append(token)
                turns[i].log_probs.append(float(log_probs[row, token]))
                if token in stop_ids:
                    turns[i].finish_reason = "stop"
                elif len(turns[i].token_ids) < max_tokens[i]:
                    still.append(i)
            active = still
        return turns

    return sample


def simulate_tool_loop(model: Any, task: ToolTask, prompts: list[Any], *, temperature: float, max_response_length: int,
                       max_assistant_turns: int | None, max_user_turns: int | None, seed: int = 0) -> dict[str, float]:
    """The multi-turn rollout's loop (agent_loop.generate_multi_turn) driven by HF forwards (hf_sampler) instead
    of the engine: the same turns, ending rules and environment. Returns the rates RL starts from."""
    import rollout
    from agent_loop import TurnLimits, generate_multi_turn
    from rewards import default_compute_score

    pad = task.tokenizer.pad_token_id
    sampling = rollout.Sampling(n=1, temperature=temperature, max_tokens=max_response_length,
                                stop_token_ids=tuple(task.stop_ids), pad_token_id=pad, seed=seed)
    batch, stats = generate_multi_turn(
        hf_sampler(model, temperature, task.stop_ids, pad), prompts, list(range(len(prompts))), sampling,
        TurnLimits(max_assistant_turns, max_user_turns), step=0, make_env=task.env, renderer=task.renderer,
        decode=lambda ids: task.tokenizer.decode(ids, skip_special_tokens=True))
    n = len(prompts)
    texts = task.tokenizer.batch_decode([r[m.bool()] for r, m in zip(
        batch.responses, batch.attention_mask[:, -batch.responses.shape[1]:], strict=True)], skip_special_tokens=True)
    scores = [float(default_compute_score(p.data_source, text, p.ground_truth)) for p, text in zip(prompts, texts,
                                                                                                 strict=True)]
    calls, failed = stats.tool_calls.tolist(), stats.tool_failures.tolist()
    right = [bool(c) and not f and any(t["role"] == "assistant" and t["text"] == f"calc({p.extra_info['expression']})"
                                       for t in turns)
             for p, turns, c, f in zip(prompts, stats.turns, calls, failed, strict=True)]
    num_called = sum(c > 0 for c in calls)
    return {
        "score": sum(scores) / n,
        "call_frequency": sum(calls) / n,  # calls per sample (tools/call_frequency)
        "called": num_called / n,  # samples with a call
        "right_call": sum(right) / max(num_called, 1),  # of those: the call was the question, exactly
        "copied": sum(s for s, r in zip(scores, right, strict=True) if r) / max(sum(right), 1),
        "score_without_tool": sum(s for s, c in zip(scores, calls, strict=True) if not c) / max(n - num_called, 1),
        "num_turns": stats.num_turns.mean().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory to start from")
    ap.add_argument("--data", required=True, help="parquet/jsonl in verl's row format (prompt, reward_model)")
    ap.add_argument("--out", required=True, help="where to save the warmed model (skipped if it exists)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="retrain even if --out exists")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default torch's; 1 is faster on a busy machine)")
    ap.add_argument("--tools", metavar="TOOL_YAML", help="train on tool trajectories with these tools (verl's YAML)")
    ap.add_argument("--format", default="demo", help="with --tools: the tool-call format (multi_turn.format)")
    ap.add_argument("--tool-fraction", type=float, default=0.3,
                    help="with --tools: the fraction of rows trained as tool trajectories, the rest as direct answers")
    ap.add_argument("--val", help="with --tools: rows to run the multi-turn loop on after training, greedy and sampled")
    ap.add_argument("--max-response-length", type=int, default=32, help="with --val: the trajectory's token budget")
    ap.add_argument("--max-assistant-turns", type=int, default=3)
    ap.add_argument("--max-user-turns", type=int, default=2)
    args = ap.parse_args()

    out = Path(args.out)
    if (out / "config.json").is_file() and not args.force:
        print(f"sft_warmup: {out} exists, skipping (use --force to retrain)")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    task = None
    if args.tools:
        task = ToolTask(tokenizer, args.tools, args.format)
        pick = random.Random(args.seed + 1)
        uses = [(p, pick.random() < args.tool_fraction) for p in task.prompts(args.data, "--data")]
        examples = [task.trajectory(p, use_tool) for p, use_tool in uses]
        print(f"sft_warmup: {len(examples)} examples, {sum(u for _, u in uses)} of them tool trajectories", flush=True)
    else:
        examples = [encode_example(tokenizer, row) for row in load_rows(args.data, "--data")]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = make_batch(rng.sample(examples, min(args.batch_size, len(examples))), tokenizer.pad_token_id)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == args.steps:
            print(f"sft step {step}/{args.steps} | loss {loss.item():.4f} | {time.perf_counter() - start:.1f}s",
                  flush=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"sft_warmup: saved {out}")
    if task is not None and args.val:
        model.eval()
        prompts = task.prompts(args.val, "--val")
        for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            stats = simulate_tool_loop(model, task, prompts, temperature=temperature,
                                       max_response_length=args.max_response_length,
                                       max_assistant_turns=args.max_assistant_turns, max_user_turns=args.max_user_turns,
                                       seed=args.seed)
            print(f"sft_warmup: tool loop on {args.val}, {name}: {json.dumps({k: round(v, 3) for k, v in stats.items()})}",
                  flush=True)


if __name__ == "__main__":
    main()
