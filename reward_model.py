"""A learned reward model (reward_model.enable): what it reads, and its score per sample.

The model is a sequence-classification checkpoint with one label (models.load_reward_model), sharded
with FSDP2 on the actor's FSDP mesh and, with reward_model.model.fsdp_config.param_offload, kept on the
host outside its own forward (models.load_frozen_model). Its score is its output at the sequence's last
real token (models.compute_sequence_scores). It reads the rollout's token ids as they are when its
tokenizer and chat template are the actor's; otherwise each sample's chat (the prompt's messages plus
the response, decoded, as the assistant's turn) is rendered again with the reward model's own template
and tokenizer, as verl's reward worker does (`_switch_chat_template`).

    rm = RewardModel.build(cfg, fsdp_mesh, device, actor_tokenizer, micro_batch_size)
    scores = rm.score(rows, prompts)   # (B,) from rows' input_ids, attention_mask, position_ids, responses
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from config import ConfigError
from data import Prompt


def same_tokenization(a: Any, b: Any) -> bool:
    """Whether ids made by tokenizer `a` with its chat template mean the same text to `b`: the same
    vocabulary, special tokens and chat template."""
    return (a.get_vocab() == b.get_vocab() and a.chat_template == b.chat_template
            and a.all_special_tokens == b.all_special_tokens)


def rerender(rows: dict[str, torch.Tensor], prompts: list[Prompt], source: Any, target: Any,
             max_length: int) -> dict[str, torch.Tensor]:
    """The samples of `rows` as the reward model's tokenizer (`target`) writes them: each prompt's chat with
    the response (its real tokens decoded by `source`, the EOS text removed) as the assistant's turn,
    through target's chat template, tokenized without added specials, cut to max_length on the right and
    right-padded. Returns input_ids, attention_mask, position_ids (B, T)."""
    width = rows["responses"].shape[1]
    response_tokens = rows["attention_mask"][:, -width:].bool()  # (B, R)
    pad = target.pad_token_id if target.pad_token_id is not None else (target.eos_token_id or 0)
    sequences = []
    for i, prompt_index in enumerate(rows["prompt_index"].tolist()):
        response = source.decode(rows["responses"][i][response_tokens[i]].tolist())
        if source.eos_token:
            response = response.replace(source.eos_token, "")
        chat = [*prompts[prompt_index].messages, {"role": "assistant", "content": response}]
        text = target.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
        sequences.append(target(text, add_special_tokens=False)["input_ids"][:max_length])
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), pad, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, ids in enumerate(sequences):
        input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, :len(ids)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def check_inputs(path: str, tokenizer: Any, model_config: Any, rerenders: bool, length: int | None) -> None:
    """At load, not at the first step: a reward model that re-renders needs a chat template, and its inputs
    (length tokens at most; None: cut to its context) must fit its context."""
    if rerenders and not tokenizer.chat_template:
        raise ConfigError(
            f"reward_model.model.path={path}: its tokenizer differs from the rollout's, so each sample is "
            f"re-rendered through its chat template, and it has none. Give a reward model whose tokenizer has a "
            f"chat_template, or one with the actor's tokenizer (it then reads the rollout's ids).")
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit is not None and length is not None and length > limit:
        key = "reward_model.max_length" if rerenders else "data.max_prompt_length + data.max_response_length"
        raise ConfigError(f"{key} = {length} tokens exceeds the reward model's max_position_embeddings={limit} "
                          f"(reward_model.model.path={path}); lower it to at most {limit}.")


@dataclass
class RewardModel:
    """The sharded model and how it reads a batch (reward_model.*)."""

    module: nn.Module
    device: torch.device
    micro_batch_size: int  # reward_model.micro_batch_size_per_gpu, resolved
    use_remove_padding: bool  # reward_model.model.use_remove_padding
    input_tokenizer: Any  # the tokenizer of the rollout's ids (reward_model.model.input_tokenizer or the actor's)
    tokenizer: Any | None  # the reward model's own, when it re-renders; None: it reads the rollout's ids
    max_length: int  # re-rendered inputs are cut to this (reward_model.max_length; null: its max_position_embeddings)

    @classmethod
    def build(cls, cfg: Any, fsdp_mesh: Any, device: torch.device, actor_tokenizer: Any,
              micro_batch_size: int, **sharding: Any) -> RewardModel:
        """Load reward_model.model.path on fsdp_mesh (sharding: models.ShardingOptions such as dtypes), and
        decide once whether its inputs are re-rendered."""
        from transformers import AutoTokenizer

        from models import load_frozen_model, load_reward_model

        rm_cfg = cfg.reward_model
        model_cfg = rm_cfg.model
        trust = model_cfg.trust_remote_code
        source = (AutoTokenizer.from_pretrained(model_cfg.input_tokenizer, trust_remote_code=trust)
                  if model_cfg.input_tokenizer else actor_tokenizer)
        target = AutoTokenizer.from_pretrained(model_cfg.path, trust_remote_code=trust)
        module = load_frozen_model(load_reward_model, model_cfg.path, fsdp_mesh,
                                   param_offload=model_cfg.fsdp_config.param_offload, device=device,
                                   trust_remote_code=trust, **sharding)
        rerenders = not same_tokenization(source, target)
        rollout_length = cfg.data.max_prompt_length + cfg.data.max_response_length
        check_inputs(model_cfg.path, target, module.config, rerenders, rm_cfg.max_length if rerenders else rollout_length)
        # null: all the reward model can read. Not P + R: its template may spell the same chat in more tokens,
        # and a cut there would drop the response's end, where the score is read
        max_length = rm_cfg.max_length or getattr(module.config, "max_position_embeddings", None) or rollout_length
        return cls(module, device, rm_cfg.micro_batch_size_per_gpu or micro_batch_size,
                   model_cfg.use_remove_padding, source, target if rerenders else None, max_length)

    def inputs(self, rows: dict[str, torch.Tensor], prompts: list[Prompt]) -> dict[str, torch.Tensor]:
        """What the reward model reads of `rows` (input_ids, attention_mask, position_ids (B, T))."""
        if self.tokenizer is None:
            return {key: rows[key] for key in ("input_ids", "attention_mask", "position_ids")}
        return rerender(rows, prompts, self.input_tokenizer, self.tokenizer, self.max_length)

    def score(self, rows: dict[str, torch.Tensor], prompts: list[Prompt]) -> torch.Tensor:
        """The score of each sample of `rows` (B,) float32 on the host. Collective over the FSDP mesh: every
        rank calls it with as many rows. A score that is not finite is a RewardError naming the rows."""
        from models import compute_sequence_scores
        from rewards import RewardError

        inputs = {key: value.to(self.device) for key, value in self.inputs(rows, prompts).items()}
        scores = compute_sequence_scores(self.module, inputs, self.micro_batch_size,
                                         use_remove_padding=self.use_remove_padding).cpu()  # (B,)
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:  # after the collective forward: the caller raises it on every rank together
            raise RewardError(f"the reward model (reward_model.model.path) scored {len(bad)} sample(s) of this rank "
                              f"{scores[bad[0]].item()} (rows {bad[:8]}), not a finite number: its weights or its "
                              f"inputs are broken (reward_model.model.fsdp_config, the dtype, max_length)")
        return scores
