"""`make gpu-check` (benchmarks/gpu_check.py) on the CPU: the script end to end, and its logic.

The end-to-end run is the script's `--device cpu --small` mode in a
subprocess (tiny shapes, the Triton kernels in the interpreter): every
section must run, every correctness check pass, and the report carry the
fields the GPU run fills. The unit tests pin the pieces whose mistakes would
make a GPU report wrong without failing it: the busy-time union, the
tie-aware greedy rule, the workload, version checks, JUnit parsing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the script's sections live there, not in the package

from gpu_check_parts import attention_bw, cuda_tests, environment, greedy_check, roofline, step_profile  # noqa: E402
from gpu_check_parts import report as report_part  # noqa: E402
from gpu_check_parts.checkpoint import QWEN3_0_6B  # noqa: E402
from gpu_check_parts.plan import make_plan  # noqa: E402
from gpu_check_parts.throughput import nano_vllm_workload  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(out),
                           "--device", "cpu", "--small"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)  # a hang guard: the run takes 2 minutes on one free core
    assert proc.returncode == 0, f"gpu_check --device cpu --small failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out, json.loads((out / "report.json").read_text())


def test_small_cpu_run_fills_every_section(report):
    out, r = report
    plan = make_plan("cpu", small=True)
    assert {n: v["status"] for n, v in r["sections"].items()} == {n: "ok" for n in
        ("cuda_tests", "throughput", "cudagraphs", "attention_bw", "moe", "quant_fp8", "step_profile", "memory")}, \
        "a section did not run"
    assert r["checks"] and all(c["ok"] for c in r["checks"]), f"a correctness check failed: {r['checks']}"
    t = r["sections"]["cuda_tests"]
    assert t["tests"] > 0 and t["passed"] == t["tests"] and (out / t["log"]).exists(), \
        "the pytest subset ran nothing, or its JUnit counts were misread"

    cg = r["sections"]["cudagraphs"]
    assert [row["mode"] for row in cg["rows"]] == ["eager", "FULL", "PIECEWISE", "FULL_AND_PIECEWISE"] and all(
        row["status"] == "ok" and len(row["profile"]) == len(plan.profile_batches) for row in cg["rows"]), \
        "every graph mode must start, profile each batch size and run the workload"
    assert cg["full_identical"] and cg["rows"][1]["capture_sizes"] > 0, \
        "FULL graphs (padded inputs, the eager kernels) must give the eager tokens"

    tp = r["sections"]["throughput"]
    assert tp["engine"]["output_tokens"] == tp["workload"]["output_tokens"] > 0, \
        "the engine must produce exactly the workload's max_tokens per request"
    assert [h["batch_size"] for h in tp["hf_static"]] == list(plan.hf_batch_sizes)
    assert all(h["tok_per_s"] > 0 and h["requests"] == plan.num_requests for h in tp["hf_static"]), \
        "the small plan's HF static batches must cover the whole workload"
    assert tp["hf_continuous"]["status"] in ("ok", "not available in this transformers")
    assert len(tp["greedy_check"]["requests"]) == plan.greedy_requests
    assert tp["engine_over_best_hf_static"] == pytest.approx(
        tp["engine"]["tok_per_s"] / max(h["tok_per_s"] for h in tp["hf_static"])), "the throughput ratio is miscomputed"

    a = r["sections"]["attention_bw"]
    assert [(row["batch"], row["context"]) for row in a["rows"]] == [
        (b, c) for b in plan.attn_batches for c in plan.attn_contexts], "attention shapes missing"
    assert all(row["varlen"]["bytes_per_s"] > 0 and row["decode_vs_varlen_max_diff"] < 1e-2 for row in a["rows"]), \
        "the decode and varlen launches must agree on the same decode batch"

    mo = r["sections"]["moe"]
    assert [row["batch"] for row in mo["rows"]] == list(plan.moe_batches) and mo["ok"], \
        "the fused-MoE section must check the Triton kernel against the reference at every batch of the plan"
    assert all(row["max_abs_err"] <= row["tolerance"] and row["reference_over_triton"] == pytest.approx(
        row["reference_us"] / row["triton_us"]) for row in mo["rows"]), "the MoE speed ratio is miscomputed"
    assert mo["reference_over_triton_at_goal"] == mo["rows"][plan.moe_batches.index(plan.moe_goal_batch)][
        "reference_over_triton"], "the MoE goal must be judged at the goal batch"

    q = r["sections"]["quant_fp8"]
    assert [(tuple(row["shape"]), row["batch"]) for row in q["rows"]] == [
        (s, b) for s in plan.fp8_shapes for b in plan.fp8_batches] and q["ok"] and q["scaled_mm"], \
        "the FP8 section must check torch._scaled_mm (available on a CPU) at every shape and batch of the plan"
    assert "## FP8 W8A8 linears" in (out / "report.md").read_text(), "the FP8 table is missing from report.md"

    p = r["sections"]["step_profile"]
    assert [q["batch"] for q in p["rows"]] == list(plan.profile_batches)
    assert all(q["device_busy_ms_per_step"] > 0 and q["running_during_profile"] == q["batch"] for q in p["rows"]), \
        "the profile saw no busy time, or requests finished before the profiled steps"
    assert any("_prepare_inputs" in line for line in p["rows"][0]["host_profile"]) and "Host profile of batch 1" in (
        out / "report.md").read_text(), "batch 1's host profile (where the wall time beyond busy goes) is missing"

    m = r["sections"]["memory"]
    kvh, d = 2, 16  # the small checkpoint: 2 layers, 2 KV heads of 16, bf16
    per_block = 2 * 2 * plan.block_size * kvh * d * 2
    assert (m["bytes_per_block"], m["num_gpu_blocks"]) == (per_block, plan.kv_cache_memory_bytes // per_block), \
        "the KV block count must be the byte budget divided by 2 x layers x block x kv_heads x head_dim x 2 bytes"

    rf = tp["engine"]["roofline"]
    reqs = nano_vllm_workload(plan.num_requests, plan.prompt_len, plan.output_len, plan.max_token_id)
    # Every prompt token is computed once, and every output token but the last is fed back once.
    assert sum(ph["tokens"] for ph in rf["phases"].values()) == sum(len(p) + m - 1 for p, m in reqs), \
        "the schedule recorder missed or double-counted steps of the timed run"
    assert rf["phases"]["prefill"]["tokens"] >= sum(len(p) for p, _ in reqs) and rf["phases"]["decode"]["steps"] > 0
    assert 0 < rf["floor_s"] <= rf["wall_s"] and rf["engine_over_floor"] >= 1, "a floor above the engine's own time"
    for name in ("prefill", "decode"):
        w = rf["windows"][name]
        assert w["steps"] == plan.roofline_profile_steps and set(w["phases"]) == {name}, \
            f"the {name} profiler window must hold {plan.roofline_profile_steps} steps of its phase only: {w}"
        assert w["busy_ms_per_step"] > 0 and w["top_kernels"], f"the {name} window profiled nothing: {w}"
        # On a CPU the linears may run in the engine's own C++ kernel, which the profiler does
        # not see as an operator: no GEMM time then, and no rate (never a made-up one).
        assert (w["gemm_fraction_of_peak"] is None) == (w["gemm_us_per_step"] == 0) and (
            w["gemm_fraction_of_peak"] is None or w["gemm_fraction_of_peak"] > 0), w
    assert "### Roofline of the throughput run" in (out / "report.md").read_text()
    assert all(row["engine_vs_decode_max_diff"] < 1e-2 for row in a["rows"]), \
        "the launch the engine makes for a decode batch (split-KV when small) must agree with the decode kernel"

    assert [g["name"] for g in r["goals"]] == [g[0] for g in report_part.GOALS]
    assert all(g["met"] is None for g in r["goals"]), "speed goals must not be judged on a CPU run"
    md = (out / "report.md").read_text()
    for heading in ("## Verdict", "## Goals", "## CUDA tests", "## Throughput", "## Decode attention bandwidth",
                    "## Fused MoE", "## Decode step profile", "## KV cache sizing"):
        assert heading in md, f"report.md lacks {heading!r}"


def test_nano_vllm_workload_is_the_published_one():
    reqs = nano_vllm_workload(256, (100, 1024), (100, 1024), 10000)
    # nano-vllm's README reports 133,966 output tokens for its 256-sequence benchmark.
    assert sum(m for _, m in reqs) == 133966, "the workload differs from nano-vllm's bench.py draw (seed 0)"
    assert all(100 <= len(p) <= 1024 and 100 <= m <= 1024 and max(p) <= 10000 for p, m in reqs)


def test_union_length_counts_overlaps_once():
    assert step_profile.union_length([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20, \
        "overlapping kernel or operator intervals counted twice: device-busy time too high"
    assert step_profile.union_length([(3, 4), (0, 1)]) == 2
    assert step_profile.union_length([]) == 0


def test_tie_aware_rule_accepts_hf_bf16_choices_and_rejects_clear_losers():
    # Two near-tied logits 1.8 eps apart; a bf16 error of eps on each flips the order.
    eps = 0.01
    ref = torch.tensor([[1.0, 1.0 - 1.8 * eps, 0.0]])
    low = ref + torch.tensor([[-eps, eps, 0.0]])
    chosen = int(low.argmax())
    gaps = greedy_check.tie_aware_gaps(ref, [chosen])
    noise = (low - ref).abs().max().item()
    assert chosen == 1 and greedy_check.passes(gaps, noise), \
        "HF bf16's own argmax must pass: the bound is twice its error, not once"
    assert not greedy_check.passes(greedy_check.tie_aware_gaps(ref, [2]), noise), \
        "a token a whole logit behind the maximum must fail"
    assert greedy_check.common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2


def test_versions_and_peaks():
    assert environment.parse_version("2.11.0+cu128") == (2, 11, 0)
    assert environment.parse_version("3.6.0rc1") == (3, 6, 0)
    found = {"python": "3.12.1", "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0"}
    assert environment.check_versions(found) == [], "the GPU machine's versions must be accepted"
    assert environment.check_versions({**found, "transformers": "4.57.1"}) == [
        "transformers 4.57.1 is older than the minimum 5.0"]
    assert environment.check_versions({**found, "torch": "2.10.0"}) == [], "2.10 >= 2.4: compare numbers, not text"
    assert attention_bw.published_peak("NVIDIA H100 80GB HBM3") == 3.35e12
    assert attention_bw.published_peak("NVIDIA H100 PCIe") == 2.0e12, "PCIe must not match the SXM entry first"
    assert attention_bw.published_peak("NVIDIA H200") == 4.8e12
    assert attention_bw.published_peak("Some Other GPU") is None


def test_cuda_test_selection_and_junit_parsing(tmp_path):
    files = cuda_tests.cuda_test_files()
    for f in ("tests/test_kernels_paged_attention.py", "tests/test_ch5_models.py", "tests/test_ch5_triton_engine.py"):
        assert f in files, f"{f} runs on the GPU when there is one; the CUDA subset must include it"
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite tests="4" failures="1" errors="1" skipped="1">'
                   '<testcase classname="tests.a" name="t1"/><testcase classname="tests.a" name="t2">'
                   '<failure message="AssertionError: wrong slot&#10;more"/></testcase>'
                   '<testcase classname="tests.b" name="t3"><error message="boom"/></testcase>'
                   '<testcase classname="tests.b" name="t4"><skipped/></testcase></testsuite></testsuites>')
    got = cuda_tests.parse_junit(xml)
    assert (got["tests"], got["passed"], got["failures"], got["errors"], got["skipped"]) == (4, 1, 1, 1, 1)
    assert got["failed"] == [{"test": "tests.a::t2", "kind": "failure", "message": "AssertionError: wrong slot"},
                             {"test": "tests.b::t3", "kind": "error", "message": "boom"}]
    log = ("....F\nGPU-CHECK FAILED tests/test_x.py::test_y[a (b)] (call)\n    def test_y():\n"
           "E       AssertionError: logits differ from HF by 3.1e-04\nE       assert False\n\n..")
    assert cuda_tests.failures_in_log(log) == [{"test": "tests/test_x.py::test_y[a (b)]", "kind": "call",
                                               "message": "AssertionError: logits differ from HF by 3.1e-04"}], \
        "a failure written to the log (the record of a run interrupted before its XML) was misread"


def test_cpu_without_small_is_refused(capsys):
    import gpu_check

    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--out", "x", "--device", "cpu"])
    assert "--device cpu needs --small" in capsys.readouterr().err


def test_budgeted_plan_keeps_the_full_shapes_and_runs_the_tests_last():
    plan = make_plan("cuda", small=False, budget_s=330)
    full = make_plan("cuda", small=False)
    assert (plan.num_requests, plan.prompt_len, plan.output_len) == (full.num_requests, full.prompt_len,
                                                                     full.output_len), \
        "a budgeted run must measure the same workload as the full plan"
    assert plan.hf_batch_sizes == (128,) and plan.hf_budget_s == 0.0 and plan.hf_continuous_budget_s == 0.0, \
        "a budgeted run measures one HF static batch (the 5x goal's baseline) and skips HF continuous batching"
    assert plan.deadline_s < 330, "a budgeted run stops starting sections before its budget"


def test_child_processes_import_the_source_tree(monkeypatch):
    """The engine core is a spawned process: without the finder in its interpreter too,
    `import mini_vllm` fails there on a machine where the package is not installed."""
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    environment._children_use_source_tree()
    probe = ("import sys; import mini_vllm; "
             "print(any(type(f).__name__ == '_SourceTreeFinder' for f in sys.meta_path), mini_vllm.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    found, path = out.stdout.split()
    assert found == "True", "a child interpreter started without the source-tree finder"
    assert Path(path).parent == REPO / "05_mini_vllm", f"the child imported mini_vllm from {path}, not the checkout"


def test_runtime_modules_are_checked_and_carried_wheels_only_installed_when_needed(tmp_path, monkeypatch):
    """A GPU image without pyzmq failed every engine section with ModuleNotFoundError;
    the check now names what is missing up front, and installs carried wheels
    (`make gpu-wheels`) only when something is missing."""
    assert environment.missing_modules(("json", "no_such_module_for_gpu_check")) == ["no_such_module_for_gpu_check"], \
        "missing_modules must list exactly the modules that cannot be imported"
    assert environment.missing_modules() == [], \
        f"this environment lacks the engine's runtime modules {environment.missing_modules()}"
    (tmp_path / "x-0.1-py3-none-any.whl").write_bytes(b"not a wheel")  # pip would fail on it if it were used
    path_before = list(sys.path)
    assert environment.install_wheels(tmp_path) == [], "nothing is missing here, so no wheel may be installed"
    assert environment.install_wheels(tmp_path / "absent") == []
    assert sys.path == path_before, "install_wheels changed sys.path although it installed nothing"


def test_roofline_costs_a_step_as_counted_by_hand():
    m = roofline.ModelCost.from_config(QWEN3_0_6B, dtype_bytes=2)
    assert m.kv_bytes_per_token == 112 * 1024, "K and V x 28 layers x 8 KV heads x 128 x 2 bytes is 112 KiB"
    # per layer: q 1024x2048, k and v 1024x1024 each, o 2048x1024, gate/up/down 1024x3072 each
    linear = 28 * (2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072)
    assert m.linear_params == linear == 440_401_920
    assert m.weight_bytes == 2 * (linear + 151_936 * 1024), "weights read a step: every linear and the LM head"
    # a decode at 100 cached tokens beside a 50-token prefill chunk from scratch; both sample
    step = roofline.StepRecord(t=0.0, seqs=[(100, 1), (0, 50)], sampled=2, prompt_tokens=50)
    c = roofline.step_cost(m, step)
    assert c["kv_read"] == (101 + 50) * 114_688 and c["kv_write"] == 51 * 114_688
    assert c["logits"] == 2 * 2 * 4 * 151_936, "fp32 logits written and read once per sampled row"
    # keys seen: the decode 101; the chunk 1 + 2 + ... + 50 = 1275
    assert c["flops"] == 2 * linear * 51 + 2 * 151_936 * 1024 * 2 + 4 * 28 * 16 * 128 * (101 + 1275)
    # bytes dominate: the floor is bytes / bandwidth unless the FLOP peak is tiny
    assert roofline.floor_s(c, 1e12, 1e15) == pytest.approx(c["bytes"] / 1e12)
    assert roofline.floor_s(c, 1e12, 1e9) == pytest.approx(c["flops"] / 1e9)


def test_roofline_account_splits_phases_and_times_steps_until_the_next():
    m = roofline.ModelCost.from_config(QWEN3_0_6B, dtype_bytes=2)
    steps = [roofline.StepRecord(10.0, [(0, 64)], 1, 64), roofline.StepRecord(11.0, [(64, 1)], 1, 0),
             roofline.StepRecord(11.5, [(65, 1)], 1, 0)]
    r = roofline.account(m, steps, end_t=12.5, copy_bw=1e12, peak_flops=1e15)
    assert r["phases"]["prefill"]["steps"] == 1 and r["phases"]["prefill"]["wall_s"] == pytest.approx(1.0)
    assert r["phases"]["decode"]["steps"] == 2 and r["phases"]["decode"]["wall_s"] == pytest.approx(1.5), \
        "a step lasts from its schedule to the next one's (the last: to the end of the run)"
    assert r["floor_s"] == pytest.approx(sum(roofline.floor_s(roofline.step_cost(m, s), 1e12, 1e15) for s in steps))
    assert r["totals"]["weights"] == 3 * m.weight_bytes


def test_model_free_schedule_computes_every_token_once():
    reqs = nano_vllm_workload(12, (5, 40), (3, 20), 500, seed=3)
    steps = roofline.model_free_schedule(reqs, num_blocks=200, block_size=16, max_num_seqs=8,
                                         max_num_batched_tokens=64, max_model_len=128)
    assert sum(n for s in steps for _, n in s.seqs) == sum(len(p) + m - 1 for p, m in reqs), \
        "every prompt token is computed once and every output token but the last fed back once"
    assert sum(s.sampled for s in steps) == sum(m for _, m in reqs), "one sampled row per output token"
    assert all(len(s.seqs) <= 8 and sum(n for _, n in s.seqs) <= 64 for s in steps), "the step budgets were ignored"
    assert sum(s.prompt_tokens for s in steps) == sum(len(p) for p, _ in reqs)
