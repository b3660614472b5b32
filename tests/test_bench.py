"""The benchmark scripts under bench/ at their smallest size, so they cannot rot: each smoke run
launches the real thing (torchrun, the vLLM CPU engine, train_ppo.py) on the 0.3M-parameter tiny
model and checks that its JSON has the fields the suite reports, as positive finite numbers. The
growth summary, the plot and the target table are checked on made-up numbers, without any launch.
These are not benchmarks: the numbers of a run this small measure overhead."""

import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import ROOT, torchrun

sys.path.insert(0, str(ROOT / "bench"))
import bench_memory  # noqa: E402
import bench_packing  # noqa: E402
import bench_rollout  # noqa: E402
import bench_split  # noqa: E402
import bench_step  # noqa: E402
import bench_sync  # noqa: E402
import bench_ulysses  # noqa: E402
import run_all  # noqa: E402


def run_script(module: ModuleType, args: list[str]) -> None:
    """A bench script's launcher in this process, as run_all.py runs it (`module.run(module.parse_args(args))`):
    the workers it starts are its own processes, and the launcher's imports (~7 s of CPU each) are paid
    once, by this module."""
    module.run(module.parse_args(args))


def assert_positive(obj: dict, *keys: str) -> None:
    for key in keys:
        value = obj
        for part in key.split("."):
            value = value[part]
        assert isinstance(value, int | float) and math.isfinite(value) and value > 0, (key, value)


def smoke_args(tiny_assets: dict, out: Path) -> list[str]:
    return ["--assets", str(tiny_assets["tiny-qwen2"].parent), "--out", str(out)]


@pytest.mark.slow
def test_bench_packing_smoke(tiny_assets, tmp_path):
    out = tmp_path / "packing.json"
    run_script(bench_packing, ["--models", "tiny", "--samples", "6", "--max-prompt-length", "16",
                                    "--max-response-length", "32", "--micro-batch", "2", "--repeats", "1",
                                    *smoke_args(tiny_assets, out)])
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"padded", "packed", "packed_dynamic"}
    for row in rows.values():
        assert_positive(row, "log_prob_s", "log_prob_peak_gb", "update_s", "update_peak_gb", "tokens_processed")
        assert row["max_abs_diff_vs_padded"] < 1e-4  # the variants compute the same log-probs
    assert rows["padded"]["padding_fraction"] > 0 == rows["packed"]["padding_fraction"]
    assert rows["packed"]["tokens_processed"] < rows["padded"]["tokens_processed"]
    assert rows["packed_dynamic"]["micro_batches"] <= rows["packed"]["micro_batches"]
    # activations follow the tokens a micro batch runs: the token-budget ones stay within the budget
    assert rows["packed_dynamic"]["max_tokens_per_micro"] <= rows["packed_dynamic"]["token_budget"]
    assert 0 < rows["packed_dynamic"]["act_vs_budget"] <= 1
    assert rows["packed"]["act_peak_gb"] < rows["padded"]["act_peak_gb"]


@pytest.mark.slow
def test_bench_ulysses_smoke(tiny_assets, tmp_path):
    out = tmp_path / "ulysses.json"
    run_script(bench_ulysses, ["--model", "tiny", "--samples", "4", "--max-prompt-length", "16",
                                    "--max-response-length", "32", "--repeats", "1", *smoke_args(tiny_assets, out)])
    sp1, sp2 = json.loads(out.read_text())["rows"]
    assert (sp1["variant"], sp2["variant"]) == ("sp1", "sp2")
    for row in (sp1, sp2):
        assert_positive(row, "log_prob_s", "update_s", "update_peak_gb", "tokens_per_rank")
    assert_positive(sp2, "update_all_to_all_s", "update_gather_s")
    assert sp1["update_all_to_all_s"] == 0  # no sp group: plain sdpa
    assert sp2["max_abs_diff_vs_sp1"] < 1e-5  # sp=2 computes sp=1's log-probs
    assert sp2["update_vs_sp1"] == pytest.approx(sp2["update_s"] / sp1["update_s"])
    assert 0 < sp2["update_all_to_all_share"] < 1


@pytest.mark.slow
def test_bench_rollout_smoke(tiny_assets, tmp_path):
    out = tmp_path / "rollout.json"
    run_script(bench_rollout, ["--models", str(tiny_assets["tiny-qwen2"]), "--prompts", "4", "--rollout-n", "2",
                                    "--max-tokens", "16", "--reps", "2", *smoke_args(tiny_assets, out)])
    report = json.loads(out.read_text())
    assert report["benchmark"] == "rollout" and report["machine"]["device"] == "cpu"
    [result] = report["results"]
    assert result["model"] == "tiny-qwen2" and result["prompts"] == 4 and result["n"] == 2
    for phase in ("standalone", "hf_generate", "resident", "collocated"):
        assert_positive(result[phase], "tokens_per_s", "tokens", "seconds", "mean_len")
        assert result[phase]["max_len"] <= 16
    assert isinstance(result["contended"], bool) and result["threads"] >= 1
    assert_positive(result, "params_m", "collocated_vs_standalone", "collocated_vs_resident", "vllm_vs_hf",
                    "collocated.update_s", "collocated.sync_s")
    # same seeds, a 1e-7 learning rate: the collocated engine samples (nearly) what the standalone one did
    assert abs(result["collocated"]["tokens"] - result["standalone"]["tokens"]) <= 0.1 * result["standalone"]["tokens"]


@pytest.mark.slow
def test_bench_sync_smoke(tiny_assets, tmp_path):
    out = tmp_path / "sync.json"
    run_script(bench_sync, ["--models", "tiny", "--layouts", "2x2", "--reps", "1",
                                 *smoke_args(tiny_assets, out)])
    report = json.loads(out.read_text())
    [result] = report["results"]
    assert (result["layout"], result["world"], result["tp"]) == ("2x2", 2, 2)
    assert_positive(result, "bytes_gb", "copy_floor_s", "copy_gbps", "per_tensor_copy_s", "gather_s",
                    "gather_recv_gbps", "engine_load_s", "sync_s", "sync_vs_floor", "bf16_gather_then_cast_s",
                    "bf16_cast_then_gather_s", "gather_floor_s", "sync_vs_transport_floor")
    assert math.isfinite(result["extra_peak_gb"]) and len(result["per_rank"]) == 2
    # the transport floor adds the all-gather to the copy: a larger floor, a smaller ratio
    floor = result["copy_floor_s"] + result["gather_floor_s"]
    assert result["sync_vs_transport_floor"] == pytest.approx(result["sync_s"] / floor)
    assert result["sync_vs_transport_floor"] < result["sync_vs_floor"]
    # 0.3M float32 parameters (the untied embedding and LM head included)
    assert 0.001 < result["bytes_gb"] < 0.002
    # results.md renders the same numbers as Markdown
    md = run_all.markdown({"sync": report}, [], report["machine"], 60.0, ["--only", "sync"]).splitlines()
    assert "Reproduce: `python bench/run_all.py --only sync`" in md
    row, *lora_rows = [line for line in md if line.startswith("| 2x2 |")]
    assert f"| {result['sync_s']:.3f} |" in row and md[md.index(row) - 2].startswith("| WxTP | model |")
    # LoRA cases: after the first sync, the merged target modules only (q_proj,v_proj brings k_proj: fewer bytes)
    all_linear, qv = result["lora"]
    assert (all_linear["targets"], qv["targets"]) == ("all-linear", "q_proj,v_proj") and len(lora_rows) == 2
    assert 0 < qv["lora_bytes_gb"] < all_linear["lora_bytes_gb"] <= result["bytes_gb"]
    assert qv["lora_sync_s"] > 0 and qv["lora_vs_full"] == pytest.approx(qv["lora_sync_s"] / result["sync_s"])


@pytest.mark.slow
def test_bench_memory_smoke(tiny_assets, tmp_path):
    out = tmp_path / "memory.json"
    run_script(bench_memory, ["--models", "tiny", "--prompts", "2", "--rollout-n", "2", "--max-tokens", "8",
                                   "--micro-batch", "2", "--steps", "1", *smoke_args(tiny_assets, out)])
    report = json.loads(out.read_text())
    [result] = report["results"]
    assert result["offload_is_noop"] is True  # a CPU run, and the report says so
    assert len(result["per_rank"]) == 2
    for rank in result["per_rank"]:
        assert_positive(rank, "load.peak_gb", "load.end_gb")
        assert set(rank["variants"]) == {"no_offload", "param_and_optimizer_offload"}
        for phases in rank["variants"].values():
            assert set(phases) == set(("sync", "gen", "old_log_prob", "ref", "update"))
            for phase in phases.values():
                assert_positive(phase, "peak_gb", "end_gb")


@pytest.mark.slow
def test_bench_step_smoke(tiny_assets, tmp_path):
    out = tmp_path / "step.json"
    run_script(bench_step, ["--sizes", str(tiny_assets["tiny-qwen2"]), "--n-values", "2",
                                 "--response-lengths", "8", "--prompts", "2", "--steps", "2",
                                 *smoke_args(tiny_assets, out)])
    report = json.loads(out.read_text())
    base = report["base"]
    assert (base["n"], base["max_response_length"], base["samples_per_step"], base["steps_measured"]) == (2, 8, 4, 1)
    assert_positive(base, "step_s", "params_m", "tokens_per_s_per_rank", "gen_tokens_per_s_per_rank",
                    "max_memory_gb", "response_length_mean", *(f"phases_s.{p}" for p in
                    ("sync_weights", "gen", "ref", "values", "update_critic", "update_actor")))
    # one mini batch of one epoch: the old log-probs come from the update's forward, no phase of their own
    assert base["on_policy_shortcut"] == 1 and base["phases_s"]["old_log_prob"] == 0
    assert base["response_length_mean"] <= 8
    assert report["points"] == [base]  # one point: no sweep, no plot
    assert report["png"] is None
    # each phase against its floor: the FLOPs step_flops.py counted, over the phase's seconds, against the
    # matmul probe of the same threads
    floor = base["floor"]
    assert_positive(floor, "matmul_gflop_per_s", "matmul_best_gflop_per_s", "matmul_threads")
    assert floor["matmul_gflop_per_s"] <= floor["matmul_best_gflop_per_s"] and 0 < floor["matmul_cpu_share"] <= 1.1
    assert set(floor["phases"]) == {"gen", "ref", "values", "update_critic", "update_actor"}  # no old_log_prob
    for phase, row in floor["phases"].items():
        assert_positive(row, "gflop", "seconds", "gflop_per_s", "vs_matmul")
        assert row["seconds"] == pytest.approx(base["phases_s"][phase])
        assert row["gflop_per_s"] == pytest.approx(row["gflop"] / row["seconds"])
        assert row["vs_matmul"] == pytest.approx(row["gflop_per_s"] / floor["matmul_gflop_per_s"])
    # generation also against the model's own decode-step matmuls at its decode batch (a skinny product)
    gen = floor["phases"]["gen"]
    assert_positive(gen, "decode_matmul_gflop_per_s", "vs_decode_matmul")
    assert gen["vs_decode_matmul"] == pytest.approx(gen["gflop_per_s"] / gen["decode_matmul_gflop_per_s"])
    lp = floor["phases"]
    assert lp["update_actor"]["gflop"] == pytest.approx(3 * lp["ref"]["gflop"])  # forward + backward, one epoch
    assert lp["update_critic"]["gflop"] == pytest.approx(3 * lp["values"]["gflop"])
    # the fixed cost: one prompt x one sample per rank, the same model and response budget
    fixed = report["fixed"]
    assert (fixed["n"], fixed["samples_per_rank"], fixed["max_response_length"]) == (1, 1, 8)
    assert_positive(fixed, "step_s", "phases_s.update_actor", "floor.phases.update_actor.gflop")
    assert fixed["floor"]["phases"]["update_actor"]["gflop"] < lp["update_actor"]["gflop"]
    (_, steps, _), (_, floors, _) = bench_step.tables(report)
    assert [row["name"] for row in steps] == [base["name"], fixed["name"]]
    assert [row["run"] for row in floors].count(base["name"]) == len(floor["phases"])


def fake_point(name: str, step_s: float, **fields) -> dict:
    point = {"name": name, "model": "5m", "params_m": 5.0, "n": 4, "max_response_length": 64,
             "samples_per_step": 32, "response_length_mean": 50.0, "generated_tokens_per_step": 1600.0,
             "step_s": step_s, "other_s": 0.1, "phases_s": {p: step_s / 10 for p in bench_step.PHASES}}
    return point | fields


@pytest.mark.slow
def test_bench_split_smoke(tiny_assets, tmp_path):
    """bench_split.py: a 1 + 1 split run sequential and one step off (train_ppo.py, two launches)."""
    out = tmp_path / "split.json"
    bench_split.main(["--steps", "3", "--repeats", "1", "--response-length", "12", "--batch", "4",
                      *smoke_args(tiny_assets, out)])
    report = json.loads(out.read_text())
    assert [len(runs) for runs in report["runs"].values()] == [1, 1]
    for mode in ("sequential", "one_step_off"):
        assert_positive(report["median"][mode], "step", "wait_rollout", "gen", "train", "sync_weights")
    assert report["speedup"] == pytest.approx(report["median"]["sequential"]["step"] /
                                              report["median"]["one_step_off"]["step"])


def test_growth_exponent_and_plot(tmp_path):
    linear = [fake_point("a", 1.0, samples_per_step=16), fake_point("b", 4.0, samples_per_step=64)]
    assert bench_step.exponent(linear, "samples_per_step") == pytest.approx(1.0)
    sublinear = [fake_point("a", 1.0, samples_per_step=16), fake_point("b", 2.0, samples_per_step=64)]
    assert bench_step.exponent(sublinear, "samples_per_step") == pytest.approx(0.5)
    assert bench_step.exponent(linear[:1], "samples_per_step") is None
    png = bench_step.plot({"n": linear, "size": [fake_point("s", 1.0), fake_point("m", 3.0, params_m=15.0)]},
                          tmp_path / "growth.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def floor(**vs_matmul: float) -> dict:
    """A made-up flops.floor_table: each phase's ratio to the matmul probe."""
    return {"matmul_gflop_per_s": 100.0, "phases": {p: {"vs_matmul": v} for p, v in vs_matmul.items()}}


def test_targets_table():
    reports = {
        "rollout": {"results": [{"model": "30m", "collocated_vs_standalone": 0.85, "contended": False},
                                {"model": "5m", "collocated_vs_standalone": 0.5, "contended": True},
                                {"model": "100m", "collocated_vs_standalone": 0.97},
                                {"model": "15m", "collocated_vs_standalone": 0.95,
                                 "collocated_vs_standalone_cycles": [0.95, 0.88, 1.02]}]},
        "sync": {"results": [{"model": "30m", "layout": "2x2", "sync_vs_floor": 7.5}]},
        "step": {"growth": {"n": {"x": "samples_per_step", "exponent": 0.8},
                            "size": {"x": "params_m", "exponent": 1.3}, "response_length": None}},
        "peer_trl": {"results": [
            {"size": "25m", "model": "llama-25m", "step_ratio": 0.45, "step_ratio_reps": [0.4, 0.5],
             "gen_tok_s_ratio": 2.1, "gen_tok_s_ratio_reps": [1.9, 2.3], "rss_excess_gb": 1.5, "kv_cache_gb": 1.07,
             "ours": {"floor": floor(update_actor=0.55, gen=0.45, old_log_prob=0.5)},
             "floor_reps": [floor(update_actor=0.5, gen=0.35), floor(update_actor=0.6, gen=0.55)]},
            {"size": "1m", "model": "llama-1m", "step_ratio": 0.9, "step_ratio_reps": [0.85, 0.95],
             "gen_tok_s_ratio": 1.2, "rss_excess_gb": 0.5, "kv_cache_gb": 1.07}]},
    }
    reports["step"] |= {"base": {"name": "5m_n4_len64", "floor": floor(update_actor=0.4, gen=0.2)},
                        "fixed": {"name": "5m_fixed", "step_s": 1.5}}
    rows = {(r["target"], r["where"]): r for r in run_all.targets(reports)}
    assert rows[("collocated / standalone rollout >= 0.9", "30m")]["met"] is False
    assert rows[("collocated / standalone rollout >= 0.9", "100m")]["met"] is True
    # measured while other jobs held the cores: reported, but no verdict
    assert rows[("collocated / standalone rollout >= 0.9", "5m CONTENDED, rerun")]["met"] is None
    # cycles on both sides of the limit: the median passes, but the spread is larger than the margin
    assert rows[("collocated / standalone rollout >= 0.9", "15m (cycles 0.88-1.02: within noise)")]["met"] is None
    assert rows[("sync <= 2 x copy floor", "30m 2x2")]["met"] is False
    assert rows[("step time growth exponent <= 1", "n sweep, vs samples_per_step")]["met"] is True
    assert rows[("step time growth (reported)", "size sweep, vs params_m")]["met"] is None
    assert rows[("s/step ours / TRL <= 0.5", "llama-25m")]["met"] is True  # 0.5 itself passes
    assert rows[("generated tok/s per rank ours / TRL >= 2.0", "llama-25m (reps 1.90-2.30: within noise)")]["met"] is None
    assert rows[("s/step ours / TRL <= 0.8", "llama-1m")]["met"] is False
    assert ("generated tok/s per rank ours / TRL >= 2.0", "llama-1m") not in rows  # no such target on 1m
    assert rows[("peak RSS/rank over TRL <= KV cache (GB)", "llama-25m")]["met"] is False
    assert rows[("peak RSS/rank over TRL <= KV cache (GB)", "llama-1m")]["met"] is True
    # each phase against the matmul probe: the limits on the 25m work, per rep; the rest reported
    assert rows[("update_actor FLOP/s / matmul rate >= 0.7", "llama-25m ours")]["met"] is False
    gen = rows[("gen FLOP/s / matmul rate >= 0.4", "llama-25m ours (reps 0.35-0.55: within noise)")]
    assert (gen["value"], gen["met"]) == (0.45, None)
    assert rows[("old_log_prob FLOP/s / matmul rate (reported)", "llama-25m ours")]["limit"] is None
    assert not any(where.startswith("llama-1m ours") for _, where in rows)  # no floor measured there
    assert rows[("update_actor FLOP/s / matmul rate (reported)", "5m_n4_len64")]["value"] == 0.4
    assert rows[("fixed cost: 1 prompt x 1 sample s/step (reported)", "5m_fixed")]["value"] == 1.5
    assert run_all.targets({}) == []


def test_peer_floor_table():
    """peer_trl's side of ours carries each phase against its floor (step_flops.py's metrics), per rep and
    over all reps; TRL's has none; the table and run_all's targets read it."""
    import peer_trl

    def side(update_s: float, floor: bool) -> dict:
        metrics = {"timing_s/update_actor": update_s, "flops/update_actor": 3e11, "timing_s/gen": 4.0,
                   "flops/gen": 6e10, "flops/matmul_rate": 1e11, "flops/matmul_rate_best": 1.2e11,
                   "flops/matmul_threads": 1.0}
        run = {"step_s": [10.0, 12.0], "gen_s": [4.0, 4.0], "phases_s": {"gen": 4.0}, "mean_len": [80.0, 90.0],
               "peak_rss_gb": 3.0, "wall_s": 60.0}
        return run | ({"floor_metrics": [metrics, metrics]} if floor else {})

    result = peer_trl.compare("25m", 23.7, [side(5.0, True), side(3.0, True)], [side(6.0, False)] * 2)
    assert result["trl"]["floor"] is None
    update = result["ours"]["floor"]["phases"]["update_actor"]
    assert update["seconds"] == pytest.approx(4.0) and update["vs_matmul"] == pytest.approx(3e11 / 4.0 / 1e11)
    assert [rep["phases"]["update_actor"]["vs_matmul"] for rep in result["floor_reps"]] == pytest.approx([0.6, 1.0])
    assert result["ours"]["floor"]["phases"]["gen"]["gflop_per_s"] == pytest.approx(15.0)
    report = {"settings": {"prompts": 16, "n": 4, "world": 2, "steps": 3, "reps": 2}, "results": [result]}
    *_, (title, rows, columns) = peer_trl.tables(report)
    assert [(r["run"], r["phase"]) for r in rows] == [("llama-25m ours", "gen"), ("llama-25m ours", "update_actor")]
    targets = {r["target"]: r for r in run_all.floor_targets(result)}
    assert targets["update_actor FLOP/s / matmul rate >= 0.7"]["met"] is None  # reps 0.6 and 1.0 straddle it
    assert targets["gen FLOP/s / matmul rate >= 0.4"]["met"] is False  # 0.15 in both reps


def test_rehearsal_targets():
    """memory_rehearsal's phases in run_all's target table: planned / measured within 1 +- 0.15."""
    reports = {"rehearsal": {"cases": [{"case": "7b:8", "phases": {"sync": {"ratio": 1.15}, "update": {"ratio": 0.84}}}]}}
    rows = {(r["target"], r["where"]): r for r in run_all.targets(reports)}
    target = "memory plan / rehearsal within 1 +- 0.15"
    assert rows[(target, "7b:8 sync")]["met"] is True and rows[(target, "7b:8 update")]["met"] is False
    assert len(rows) == 2


def test_long_sequence_targets():
    """bench_packing's and bench_ulysses's rows in run_all's target table, on made-up numbers."""
    reports = {
        "packing": {"rows": [{"model": "30m", "variant": "padded", "update_vs_padded": 1.0},
                             {"model": "30m", "variant": "packed_dynamic", "update_vs_padded": 0.46,
                              "act_vs_budget": 0.7},
                             {"model": "5m", "variant": "packed_dynamic", "update_vs_padded": 0.8,
                              "act_vs_budget": 1.2}]},
        "ulysses": {"rows": [{"model": "30m", "variant": "sp1", "update_vs_sp1": None},
                             {"model": "30m", "variant": "sp2", "update_vs_sp1": 1.4, "update_all_to_all_share": 0.2}]},
    }
    rows = {(r["target"], r["where"]): r for r in run_all.targets(reports)}
    assert len(rows) == 6
    assert rows[("packed + dynamic / padded update time <= 0.6", "30m")]["met"] is True
    assert rows[("packed + dynamic / padded update time <= 0.6", "5m")]["met"] is False
    assert rows[("packed + dynamic activations / token budget <= 1", "30m")]["met"] is True
    assert rows[("packed + dynamic activations / token budget <= 1", "5m")]["met"] is False
    sp = rows[("sp=2 / sp=1 update time (reported)", "30m")]
    assert (sp["value"], sp["limit"], sp["met"]) == (1.4, None, None)
    assert rows[("all-to-all share of the sp=2 update (reported)", "30m")]["value"] == 0.2


@pytest.mark.slow
def test_device_check_smoke(tiny_assets, tmp_path):
    """bench/device_check.py (the GPU machine's first check, no vLLM) runs its checks on 2 CPU ranks."""
    # the dry run of `make gpu-check`: the real-vocabulary checks and the rehearsal at a small vocabulary
    torchrun(2, ROOT / "bench" / "device_check.py", "--model", str(tiny_assets["tiny-qwen2"]), "--batch", "4",
             "--prompt-len", "16", "--response-len", "16", "--micro-batch", "2", "--out", str(tmp_path),
             "--vocab-size", "512", "--vocab-layers", "1", "--rehearsal", "--case 0.5b:2 --layers 1 --prompt-len 8 "
             "--response-len 8 --samples 2 --micro-batch 1 --vocab-size 512", "--vl-shape", "tiny", timeout=400)
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["all_ranks_ok"] and report["world"] == 2 and report["ok"]
    rows = {r["check"]: r for r in report["rows"]}
    for what in ("log-probs", "entropy"):  # fp32 on the CPU: the two layouts agree to rounding
        assert rows[f"packed = padded {what} (0.5b x1 layers, vocab 512)"]["ok"] is True
    assert rows["gradient accumulation: 1 = 4 micro batches (grad norm)"]["ok"] is True
    # the VLM entry at tiny size, float32: the trainer's layouts and HF per row agree; without pixels HF is off
    vl = {name: r for name, r in rows.items() if "(Qwen2.5-VL tiny, vocab 128)" in name}
    assert len(vl) == 4 and all(r["ok"] is True for r in vl.values()), vl
    rehearsed = [r for name, r in rows.items() if name.startswith("rehearsal 0.5b:2 ")]
    assert len(rehearsed) == 3 and all(r["ok"] is None for r in rehearsed)  # reported; gated on CUDA only
    assert report["rehearsal"]["cases"][0]["measure"] == "live storages"
    checks = set(report["checks_rank0"])
    assert {"update_finite_and_moved", "gather_equals_full_tensor", "offload_round_trip_exact"} <= checks
    # the offload plan: every combination on FSDP and HSDP, walked with the trainer's functions; on the
    # CPU the device checks are skipped, and the report says so
    import offload
    combos = [label for label, _ in offload.flag_combinations()]
    assert [(r["layout"], r["flags"]) for r in report["plan"]] == [(m, c) for m in ("fsdp", "hsdp") for c in combos]
    assert all(r["finite_and_moved"] and len(r["losses"]) == 4 for r in report["plan"])
    assert checks - {"update_finite_and_moved", "gather_equals_full_tensor", "offload_round_trip_exact"} == {
        f"plan[{m}: {c}] {check}" for m in ("fsdp", "hsdp") for c in combos
        for check in ("finite_and_moved",)}  # + placement_ok, freed_ok, estimate_ok on CUDA
    assert any("CPU" in part for part in report["skipped"]) and any("vLLM" in part for part in report["skipped"])
    for name in ("load", "log_prob", "update", "gather", "offload"):
        assert math.isfinite(report["phases"][name]["seconds"]) and report["phases"][name]["peak_gb"] > 0
    assert all(math.isfinite(loss) for loss in report["losses"]) and len(report["losses"]) == 2


@pytest.mark.slow
def test_bench_tail_smoke(tiny_assets, tmp_path):
    """bench/bench_tail.py at its smallest: sync steps against colocate_async's cut, its JSON's fields."""
    out = tmp_path / "tail.json"
    torchrun(1, ROOT / "bench" / "bench_tail.py", "--model", str(tiny_assets["tiny-qwen2"]), "--groups", "2",
             "--rollout-n", "2", "--max-tokens", "16", "--steps", "2", "--out", str(out), timeout=400)
    result = json.loads(out.read_text())
    for mode in ("sync", "cut"):
        assert_positive(result, f"{mode}.gen_s_per_trained_sample", f"{mode}.mean_trained_length")
    assert_positive(result, "ratio_cut_over_sync")
