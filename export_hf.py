"""Export a checkpoint's actor (or critic) to a Hugging Face model directory.

    python export_hf.py outputs/run/global_step_200 --out exported/step200
    python export_hf.py outputs/run --out exported/latest          # the latest complete checkpoint

The result (config.json, tokenizer, model.safetensors) loads with
`AutoModelForCausalLM.from_pretrained(out)` and with `vllm.LLM(model=out)`. One process, no GPU, no
process group: DCP reads the shards written by any number of ranks into one full state dict, with
tensors loaded weights_only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from checkpoint import STATE_FILE, complete_checkpoints


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory whose latest complete checkpoint is taken."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    found = complete_checkpoints(path)
    if not found:
        raise SystemExit(f"export_hf: {path} is neither a complete checkpoint (no {STATE_FILE}) nor a run "
                         f"directory holding one (global_step_N/).")
    return found[-1]


def export(checkpoint: str | Path, out: str | Path, which: str = "actor", dtype: str = "float32") -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    ckpt = resolve_checkpoint(checkpoint)
    hf_dir = ckpt / "hf"
    config = AutoConfig.from_pretrained(hf_dir)
    if which == "critic":
        config.num_labels = 1
        auto_cls = AutoModelForTokenClassification
    else:
        auto_cls = AutoModelForCausalLM
    # Built for real on the CPU (not on the meta device): non-persistent buffers such as the rotary
    # inv_freq are in no checkpoint and must come from the constructor.
    model = auto_cls.from_config(config, dtype=torch.float32)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt / which), no_dist=True)
    model.load_state_dict(state["model"])
    out = Path(out)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="global_step_N directory, or a run directory (latest checkpoint)")
    ap.add_argument("--out", required=True, help="output HF model directory")
    ap.add_argument("--which", choices=["actor", "critic"], default="actor")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = ap.parse_args(argv)
    out = export(args.checkpoint, args.out, args.which, args.dtype)
    print(f"exported {resolve_checkpoint(args.checkpoint)} ({args.which}) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
