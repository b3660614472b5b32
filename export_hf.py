"""Export a checkpoint's actor (or critic) to a Hugging Face model directory.

    python export_hf.py outputs/run/global_step_200 --out exported/step200
    python export_hf.py outputs/run --out exported/latest          # the latest complete checkpoint
    python export_hf.py outputs/lora_run --out exported/adapter --adapter-only   # LoRA: peft's format

The result (config.json, tokenizer, model.safetensors) loads with
`AutoModelForCausalLM.from_pretrained(out)` and with `vllm.LLM(model=out)`. One process, no GPU, no
process group: DCP reads the shards written by any number of ranks into one full state dict, with
tensors loaded weights_only.

A checkpoint is code: DCP's own index (`<model>/.metadata`) is a pickle, which runs whatever it holds
when read. Export only checkpoints you or someone you trust wrote (as with resuming).

A LoRA run's checkpoint holds the adapter only; its hf/adapter_config.json names the base model,
which is read again. The default export is the merged model (W + scale * B @ A, a plain HF model);
--adapter-only writes the adapter in peft's format (adapter_config.json, adapter_model.safetensors),
for `PeftModel.from_pretrained(base, out)` or vLLM's `LLM(base, enable_lora=True)` with a LoRARequest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from checkpoint import STATE_FILE, check_files, complete_checkpoints


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory whose latest complete checkpoint is taken; its files
    checked against the sizes and CRCs recorded at save."""
    path = Path(path)
    found = [path] if (path / STATE_FILE).is_file() else complete_checkpoints(path)
    if not found:
        raise SystemExit(f"export_hf: {path} is neither a complete checkpoint (no {STATE_FILE}) nor a run "
                         f"directory holding one (global_step_N/).")
    problems = check_files(found[-1], deep=True)
    if problems:
        raise SystemExit(f"export_hf: checkpoint {found[-1]} is damaged, not exporting it: {'; '.join(problems)}.")
    unrecorded = "files" not in json.loads((found[-1] / STATE_FILE).read_text())
    print(f"export_hf: reading {found[-1]}{' (no file record: its files are unchecked)' if unrecorded else ''}; its "
          f"DCP index (.metadata) is a pickle, run when read: export only checkpoints you trust", file=sys.stderr)
    return found[-1]


def export(checkpoint: str | Path, out: str | Path, which: str = "actor", dtype: str = "float32",
           adapter_only: bool = False) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    ckpt = resolve_checkpoint(checkpoint)
    hf_dir = ckpt / "hf"
    if which == "actor" and (hf_dir / "adapter_config.json").is_file():
        return _export_lora(ckpt, Path(out), dtype, adapter_only)
    if adapter_only:
        raise SystemExit(f"export_hf: --adapter-only needs a LoRA run's checkpoint; {ckpt} holds a full "
                         f"{which} (no hf/adapter_config.json).")
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


def _export_lora(ckpt: Path, out: Path, dtype: str, adapter_only: bool) -> Path:
    """The base model (from adapter_config.json's base_model_name_or_path) with the checkpoint's adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lora_config = LoraConfig.from_pretrained(ckpt / "hf")
    base_path = lora_config.base_model_name_or_path
    try:
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    except OSError as e:
        raise SystemExit(f"export_hf: cannot load the base model {base_path!r} named in {ckpt / 'hf'}/"
                         f"adapter_config.json ({e}); the adapter needs it.") from None
    model = get_peft_model(base, lora_config)
    state = {"model": {k: v for k, v in model.state_dict().items() if ".lora_" in k}}  # what the run saved
    dcp.load(state, checkpoint_id=str(ckpt / "actor"), no_dist=True)  # fails if a tensor is missing
    model.load_state_dict(state["model"], strict=False)  # the adapter's tensors; the base ones are loaded
    if adapter_only:
        model.save_pretrained(out)  # adapter_config.json + adapter_model.safetensors, peft's names
    else:
        model.merge_and_unload().to(getattr(torch, dtype)).save_pretrained(out)
    AutoTokenizer.from_pretrained(ckpt / "hf").save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="A checkpoint is code: DCP's index "
                                 "(<model>/.metadata) is a pickle, run when read. Export only checkpoints you trust.")
    ap.add_argument("checkpoint", help="global_step_N directory, or a run directory (latest checkpoint)")
    ap.add_argument("--out", required=True, help="output HF model directory")
    ap.add_argument("--which", choices=["actor", "critic"], default="actor")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--adapter-only", action="store_true",
                    help="LoRA runs: write the adapter in peft's format instead of the merged model")
    args = ap.parse_args(argv)
    out = export(args.checkpoint, args.out, args.which, args.dtype, args.adapter_only)
    print(f"exported {resolve_checkpoint(args.checkpoint)} ({args.which}) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
