#!/bin/bash
# The learning tests and both demos under other CPU kernels than this machine's own (make learning-caps).
#
# ATen, MKL and oneDNN choose their kernels by instruction set, so the same seeds give other floats, and
# a few steps later other samples, on another CPU. CI runs on whatever machine it gets (so far a Xeon
# without AMX, a Xeon with AMX and an AMD EPYC), so a learning test must hold on all of them. Capping the
# kernels here stands in for the other machines:
#   native   the machine's own kernels
#   avx2     ATEN_CPU_CAPABILITY=avx2 (ATen's vectorised kernels at AVX2)
#   default  ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
# (a cap is not a real machine: the numbers it gives stand for "other floats", not for any one CPU)
# For each cap: the learning tests (each logs its effect, standard error and margin to noise.jsonl,
# tests/noise.py), then `make demo`'s, `make demo-tools`' and `make demo-vl`'s steps on their own assets.
# Writes outputs/kernel_caps/<cap>/{pytest.log,noise.jsonl,demo/,demo_tools/,demo_vl/} and prints one table
# at the end.
#   bash tests/kernel_caps.sh                 # all three caps (~55 minutes on 2 cores)
#   CAPS="avx2" bash tests/kernel_caps.sh     # one of them
#   DEMOS=0 bash tests/kernel_caps.sh         # the tests only
#   TESTS="tests/test_lora.py" DEMOS=0 bash tests/kernel_caps.sh   # other tests (pytest's arguments)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/kernel_caps}
CAPS=${CAPS:-native avx2 default}
DEMOS=${DEMOS:-1}
DEFAULT_TESTS=(
  "tests/test_train_ppo.py::test_score_improves"
  "tests/test_lora.py::test_lora_grpo_learns_and_exports"
  "tests/test_reward_model.py::test_the_learned_reward_model_ranks_the_policys_answers"
  "tests/test_reward_model.py::test_grpo_raises_the_reward_models_score"
  "tests/test_train_ppo_distillation.py::test_a_student_distilled_from_the_demo_model_moves_toward_it"
  "tests/test_tools_demo.py::test_grpo_teaches_the_tiny_model_to_use_the_calculator"
)
if [ -n "${TESTS:-}" ]; then read -r -a TESTS <<< "$TESTS"; else TESTS=("${DEFAULT_TESTS[@]}"); fi

cap_env() {
  case $1 in
    native) echo "";;
    avx2) echo "ATEN_CPU_CAPABILITY=avx2";;
    # and no torch.compile (vLLM's sampler uses it): inductor's C++ code does not build when ATen's
    # capability is capped to default ('at::vec' has not been declared); the tests run eagerly anyway
    default) echo "ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 TORCHDYNAMO_DISABLE=1";;
    *) echo "unknown cap $1 (native, avx2, default)" >&2; exit 2;;
  esac
}

for cap in $CAPS; do
  vars=$(cap_env "$cap") || exit 2
  dir=$OUT/$cap
  rm -rf "$dir" && mkdir -p "$dir"
  echo "== $cap: ${vars:-the native kernels}"
  # shellcheck disable=SC2086
  env $vars NOISE_LOG="$PWD/$dir/noise.jsonl" "$PY" -m pytest -q -p no:cacheprovider --basetemp="$dir/pytest" \
    "${TESTS[@]}" > "$dir/pytest.log" 2>&1
  tail -1 "$dir/pytest.log"
  [ "$DEMOS" = 1 ] || continue
  assets=$dir/assets
  # shellcheck disable=SC2086
  {
    env $vars "$PY" make_assets.py --out "$assets" &&
    env $vars "$PY" sft_warmup.py --model "$assets/tiny-qwen2" --data "$assets/data/train.parquet" \
      --out "$assets/tiny-qwen2-sft" --steps 75 &&
    env $vars "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 train_ppo.py --config configs/tiny_cpu.yaml \
      "actor_rollout_ref.model.path=$assets/tiny-qwen2-sft" "data.train_files=$assets/data/train.parquet" \
      "data.val_files=$assets/data/val.parquet" "trainer.default_local_dir=$dir/demo" &&
    env $vars "$PY" sft_warmup.py --model "$assets/tiny-qwen2" --data "$assets/data/tools_train.parquet" \
      --out "$assets/tiny-qwen2-tools-sft" --tools configs/tools/calculator.yaml --format demo \
      --val "$assets/data/tools_val.parquet" --steps 200 --threads 1 &&
    env $vars "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 train_ppo.py \
      --config configs/tiny_cpu_tools.yaml "actor_rollout_ref.model.path=$assets/tiny-qwen2-tools-sft" \
      "data.train_files=$assets/data/tools_train.parquet" "data.val_files=$assets/data/tools_val.parquet" \
      "trainer.default_local_dir=$dir/demo_tools" &&
    env $vars "$PY" bench/bench_vl.py --assets "$assets" --steps 50 --out "$dir/demo_vl"
  } > "$dir/demos.log" 2>&1 || echo "   the demos failed: $dir/demos.log"
done

# shellcheck disable=SC2086
"$PY" - "$OUT" $CAPS <<'EOF'
import json, sys
from pathlib import Path
out, caps = Path(sys.argv[1]), sys.argv[2:]
print("\n| cap | test | what | effect | s.e. | floor | margin (s.e.) |\n|---|---|---|---:|---:|---:|---:|")
for cap in caps:
    log = out / cap / "noise.jsonl"
    for r in (json.loads(line) for line in (log.read_text().splitlines() if log.is_file() else [])):
        print(f"| {cap} | {r['test'].split('::')[-1]} | {r['what']} | {r['effect']:.4f} | {r['se']:.4f} | "
              f"{r['floor']:g} | {r['margin']:.1f} |")
print("\n| cap | demo val/score (step 0 -> last) | demo-tools val/score | demo-tools tools/call_frequency "
      "| demo-vl val/score | demo-vl training trend (s.e.) |\n|---|---|---|---|---|---|")
for cap in caps:
    cells = []
    for name, key in (("demo", "val/score"), ("demo_tools", "val/score"), ("demo_tools", "tools/call_frequency")):
        path = out / cap / name / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        values = [r[key] for r in rows if key in r]
        cells.append(f"{values[0]:.3f} -> {values[-1]:.3f}" if values else "-")
    vl = out / cap / "demo_vl" / "result.json"  # bench/bench_vl.py's summary of its run
    run = json.loads(vl.read_text())["run"] if vl.is_file() else None
    cells += ([f"{run['val_score_before']:.3f} -> {run['val_score_after']:.3f}",
               f"{run['score_rise']:+.3f} ({run['margin_se']:.1f} s.e.)"] if run else ["-", "-"])
    print(f"| {cap} | " + " | ".join(cells) + " |")
EOF
