"""On-policy distillation's model side: the teacher's check against the actor's tokenizer
(models.check_teacher), and compute_log_probs' top-k log-probs of a teacher and the student's log-probs at
given ids, in the packed and padded layouts of a real FSDP2 model, against a plain transformers forward of
each sequence alone, position by position."""

import json
import shutil

import pytest
import torch
from conftest import one_rank_process_group
from transformers import AutoModelForCausalLM, AutoTokenizer

import models
from config import ConfigError

PROMPT, RESPONSE, K = 6, 5, 3


def _teacher_dir(tmp_path, tiny_assets, name, tokenizer_from=None, **config_changes):
    """A teacher directory: tiny-qwen2's config (with changes) and a tokenizer (tiny-qwen2's, or another)."""
    out = tmp_path / name
    shutil.copytree(tiny_assets["tiny-qwen2"], out)
    if tokenizer_from is not None:
        for f in tokenizer_from.iterdir():
            if "token" in f.name:
                shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, **config_changes)))
    return out


def test_check_teacher_allows_a_padded_vocabulary_and_refuses_another_tokenizer(tiny_assets, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["tiny-qwen2"])
    assert len(tokenizer) == 100  # the student's 128 embedding rows are padded past its 100 tokens
    assert models.check_teacher(str(tiny_assets["tiny-qwen2"]), tokenizer, 128, False) == 100
    padded = _teacher_dir(tmp_path, tiny_assets, "padded", vocab_size=160)
    assert models.check_teacher(str(padded), tokenizer, 128, False) == 100
    fewer = _teacher_dir(tmp_path, tiny_assets, "fewer", vocab_size=112)
    with pytest.raises(ConfigError, match=r"vocab_size=112 embedding rows, fewer than the actor's 128"):
        models.check_teacher(str(fewer), tokenizer, 128, False)
    other = _teacher_dir(tmp_path, tiny_assets, "other", tokenizer_from=tiny_assets["tiny-qwen2"].parent
                         / "tiny-chatml-tokenizer")
    with pytest.raises(ConfigError, match=r"different tokenizer: 104 tokens against the actor's 100"):
        models.check_teacher(str(other), tokenizer, 128, False)


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """3 sequences: prompts of 3, 6, 6 real tokens (left-padded), responses of 5, 2, 4 (right-padded)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, PROMPT + RESPONSE), generator=g)
    prompt_lens, response_lens = torch.tensor([3, 6, 6]), torch.tensor([5, 2, 4])
    mask = torch.cat([torch.arange(PROMPT)[None] >= PROMPT - prompt_lens[:, None],
                      torch.arange(RESPONSE)[None] < response_lens[:, None]], dim=1).long()
    ids = ids * mask  # pad id 0
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, PROMPT:]}


def test_topk_and_gathered_log_probs_equal_a_plain_forward(tiny_assets):
    path = str(tiny_assets["tiny-qwen2"])
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = _batch(100)
    ids = torch.randint(0, 128, (3, RESPONSE, K), generator=torch.Generator().manual_seed(1))  # student's targets
    # the reference: each sequence alone, position by position
    want_values, want_ids, want_gathered = (torch.zeros(3, RESPONSE, K), torch.zeros(3, RESPONSE, K, dtype=torch.long),
                                            torch.zeros(3, RESPONSE, K))
    with torch.no_grad():
        for b in range(3):
            valid = batch["input_ids"][b][batch["attention_mask"][b].bool()]
            prompt_len = int(batch["attention_mask"][b, :PROMPT].sum())
            log_p = torch.log_softmax(plain(valid[None]).logits[0], -1)  # (L, 128)
            for j in range(int(batch["attention_mask"][b, PROMPT:].sum())):
                row = log_p[prompt_len + j - 1]  # predicts response token j
                top = sorted(range(100), key=lambda v: -row[v].item())[:K]  # only the tokenizer's 100 ids
                want_ids[b, j] = torch.tensor(top)
                want_values[b, j] = row[top]
                want_gathered[b, j] = row[ids[b, j]]
    with one_rank_process_group():
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        model = models.load_causal_lm(path, mesh, device=torch.device("cpu"), param_dtype=torch.float32,
                                      reduce_dtype=torch.float32).eval()
        with torch.no_grad():
            for packed in (True, False):
                forward = models.compute_log_probs(model, batch, 1.0, 2, use_remove_padding=packed, topk=(K, 100))
                values, top_ids = forward.topk_values, forward.topk_ids
                gathered = models.compute_log_probs(model, batch, 1.0, 2, use_remove_padding=packed, topk_ids=ids).gathered
                real = batch["attention_mask"][:, PROMPT:].bool()  # (3, R)
                assert torch.equal(top_ids[real], want_ids[real]), packed
                torch.testing.assert_close(values[real], want_values[real], atol=1e-5, rtol=0)
                torch.testing.assert_close(gathered[real], want_gathered[real], atol=1e-5, rtol=0)
                if packed:  # 0 past each response's end (padded: the model's output up to the micro batch's longest)
                    assert (values[~real] == 0).all() and (gathered[~real] == 0).all()
