"""Write configs/verl/ppo_trainer-<version>.json: every leaf key of verl's generated PPO config with its
default as verl writes it (interpolations such as `${oc.select:...}` kept unresolved), from verl's wheel.

Run once per verl version, by hand (nothing downloads at test or run time):

    .venv/bin/pip download verl==0.9.1 --no-deps -d /tmp/verlwheel
    python tests/make_verl_keys.py /tmp/verlwheel/verl-0.9.1-py3-none-any.whl

config.py reads the file: verl's keys that this program does not implement are accepted at these
defaults only (config.VERL_KEY_RULES), and a hydra-style partial file is composed over them.
tests/test_config.py checks that the rules classify every key in it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import zipfile
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
GENERATED = "verl/trainer/config/_generated_ppo_trainer.yaml"


def leaves(tree: dict, prefix: str = "") -> dict:
    """{'a.b.c': value} for every leaf; an empty mapping is a leaf (verl's free-form kwargs)."""
    out = {}
    for name, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", type=Path, help="verl-<version>-py3-none-any.whl")
    args = ap.parse_args()
    version = re.match(r"verl-([^-]+)-", args.wheel.name)
    if version is None:
        sys.exit(f"{args.wheel.name} is not named like a verl wheel (verl-<version>-...whl)")
    with zipfile.ZipFile(args.wheel) as wheel:
        text = wheel.read(GENERATED).decode()
    tree = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    out = ROOT / "configs" / "verl" / f"ppo_trainer-{version.group(1)}.json"
    out.write_text(json.dumps({"verl": version.group(1), "source": GENERATED, "defaults": leaves(tree)},
                              indent=1) + "\n")
    print(f"{out}: {len(leaves(tree))} leaf keys")


if __name__ == "__main__":
    main()
