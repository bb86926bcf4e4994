"""`make gpu-check`: the engine on a CUDA machine, checked and measured in one run.

vLLM counterparts: `benchmarks/benchmark_throughput.py`,
`benchmarks/kernels/benchmark_paged_attention.py`, `benchmark_latency.py
--profile` and `collect_env.py`, in one script with one report.

Uses the Python, PyTorch, Triton and transformers already installed (minimum
versions in `gpu_check_parts/environment.py`, checked first) and imports
`mini_vllm` from this checkout without installing it. Sections, in order
(each one's failure is recorded and the next one still runs):

  cuda_tests    every test file that runs on the GPU when there is one, plus the
                engine parity and invariance tests on CUDA with the triton backend
  throughput    a random Qwen3-0.6B-shaped bf16 checkpoint on nano-vllm's workload:
                engine vs HF generate (static batches, continuous batching), greedy check;
                the roofline of the engine's own schedule (bytes, FLOPs, floor per step,
                engine time / floor by phase, a profiler window per phase)
  attention_bw  decode attention bytes/s against the device's peak
  quant_fp8     FP8 W8A8 linears (fp8_per_channel, torch._scaled_mm) against bf16 F.linear on
                Qwen3-0.6B's shapes, each product checked against the dequantized reference
  moe           the fused-MoE Triton kernel against the reference loop over experts,
                Qwen3-30B-A3B's experts in bf16 at batch 1, 64 and 256, checked first
  cudagraphs    eager vs FULL vs PIECEWISE vs FULL_AND_PIECEWISE: start-up, decode step
                wall vs busy time, tokens against the eager engine's
  step_profile  torch.profiler: device-busy vs wall time per decode step, batch 1/8/64/256
  memory        gpu_memory_utilization sizing: blocks chosen, memory left at the peak

Writes `report.json` and `report.md` (plus the pytest log) into --out. Exit
status 0 when every section ran and every correctness check passed (speed
goals are reported, not enforced); 1 otherwise; 2 when the environment is unfit.

Run: python benchmarks/gpu_check.py --out gpu-report           (CUDA; sized for about 13 minutes on an H100)
     python benchmarks/gpu_check.py --out /tmp/r --device cpu --small   (seconds: the script's own test)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from gpu_check_parts import environment

SECTIONS = ("cuda_tests", "throughput", "cudagraphs", "attention_bw", "moe", "quant_fp8", "step_profile", "memory")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for report.json, report.md and logs")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes: seconds on a CPU (the script's own test)")
    ap.add_argument("--only", action="append", choices=SECTIONS, help="run only this section (repeatable)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="fit the full plan into this many seconds (a short device lease): one HF batch per size, "
                         "the pytest subset last with the time left; the report is rewritten after every section")
    ap.add_argument("--wheels", type=Path, default=Path(__file__).resolve().parents[1] / ".whl",
                    help="wheels of the engine's runtime modules (pyzmq, msgspec, xgrammar, pydantic) for a "
                         "machine that cannot download: `make gpu-wheels` fills it; installed into a temporary "
                         "folder only when a module is missing")
    args = ap.parse_args(argv)
    if args.device == "cpu" and not args.small:
        ap.error("--device cpu needs --small: the full plan (a 0.6B model, 256 long requests) takes hours on a CPU")
    return args


def _section(name: str, fn, report: dict, start: float, deadline_s: float) -> None:
    if time.monotonic() - start > deadline_s:
        report["sections"][name] = {"status": "skipped: past the deadline", "seconds": 0.0}
        return
    t = time.monotonic()
    print(f"== {name}", flush=True)
    try:
        result = fn()
        result["status"] = "ok"
    except Exception:  # recorded in the report; the next section still runs
        result = {"status": "error", "error": traceback.format_exc(limit=8)}
        print(result["error"], file=sys.stderr, flush=True)
    result["seconds"] = time.monotonic() - t
    report["sections"][name] = result


def checks(sections: dict) -> list[dict]:
    """Correctness verdicts (the exit status); speed goals are separate."""
    s = sections
    out = [{"name": f"section {n} ran", "ok": v["status"] == "ok"} for n, v in s.items()
           if not v["status"].startswith("skipped: not selected")]
    if s.get("cuda_tests", {}).get("status") == "ok":
        out.append({"name": "CUDA tests passed", "ok": s["cuda_tests"]["ok"]})
    tp = s.get("throughput", {})
    if tp.get("status") == "ok":
        out.append({"name": "greedy tokens agree with HF (tie-aware, first requests)", "ok": tp["greedy_check"]["ok"]})
        out.append({"name": "every request got exactly max_tokens",
                    "ok": not tp["engine"]["requests_with_wrong_length"]})
    cg = s.get("cudagraphs", {})
    if cg.get("status") == "ok":
        out.append({"name": "every CUDA graph mode started and ran",
                    "ok": all(r.get("status") == "ok" for r in cg["rows"])})
        out.append({"name": "FULL CUDA graphs: greedy tokens identical to enforce_eager", "ok": cg["full_identical"]})
    if s.get("moe", {}).get("status") == "ok":
        out.append({"name": "fused-MoE Triton kernel equals the reference loop", "ok": s["moe"]["ok"]})
    if s.get("quant_fp8", {}).get("status") == "ok":
        out.append({"name": "FP8 W8A8 linears equal the dequantized reference", "ok": s["quant_fp8"]["ok"]})
    mem = s.get("memory", {})
    if mem.get("status") == "ok":
        out.append({"name": "KV cache sizing stayed within its budget", "ok": bool(mem["within_utilization"])})
    return out


def _write(out: Path, report: dict, start: float, device: str) -> None:
    from gpu_check_parts import report as rep

    report["meta"]["seconds"] = time.monotonic() - start
    report["checks"] = checks(report["sections"])
    report["goals"] = rep.goals(report["sections"], device)
    rep.write(out, report)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined: before any mini_vllm import
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The engine core in this process: the sections read its scheduler and executor directly.
    os.environ.setdefault("MINI_VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    environment.use_source_tree()
    installed = environment.install_wheels(args.wheels)
    missing = environment.missing_modules()
    if missing:
        print(f"gpu-check: the engine imports {', '.join(missing)}, which this Python lacks; on a machine that "
              f"cannot download, run `make gpu-wheels` where pip works and carry {args.wheels} along",
              file=sys.stderr)
        return 2
    versions = environment.installed_versions()
    too_old = environment.check_versions(versions)
    if too_old:
        print("gpu-check: " + "; ".join(too_old), file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: --device cuda but torch.cuda.is_available() is False "
              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})", file=sys.stderr)
        return 2
    from gpu_check_parts import (attention_bw, checkpoint, cuda_tests, cudagraphs, memory, moe, quant_fp8,
                                 step_profile, throughput)
    from gpu_check_parts.plan import free_device_memory, make_plan

    plan = make_plan(args.device, args.small, args.budget_s)
    order = SECTIONS[1:] + SECTIONS[:1] if args.budget_s is not None else SECTIONS
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    info = environment.device_info(args.device)
    report = {"meta": {"device": args.device, "small": args.small, "versions": versions, "device_info": info,
                       "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "mini_vllm_from": str(environment.REPO), "plan": plan.__dict__,
                       "wheels_installed": installed},
              "sections": {}}
    with tempfile.TemporaryDirectory(prefix="gpu_check_model_") as tmp:
        model_dir = Path(tmp)
        report["meta"]["checkpoint"] = checkpoint.write_checkpoint(model_dir, args.small, args.device)
        vocab = report["meta"]["checkpoint"]["vocab_size"]
        free_device_memory(args.device)
        def tests_timeout() -> float:  # in a budgeted run, the tests get what the other sections left
            if args.budget_s is None:
                return plan.tests_timeout_s
            return max(30.0, min(plan.tests_timeout_s, args.budget_s - 20.0 - (time.monotonic() - start)))

        runs = {"cuda_tests": lambda: cuda_tests.run(args.out, args.device, args.small, tests_timeout(),
                                                     engine_first=args.budget_s is not None),
                "throughput": lambda: throughput.run(str(model_dir), plan, info["name"]),
                "cudagraphs": lambda: cudagraphs.run(str(model_dir), plan, vocab),
                "attention_bw": lambda: attention_bw.run(plan, info["name"]),
                "moe": lambda: moe.run(plan),
                "quant_fp8": lambda: quant_fp8.run(plan),
                "step_profile": lambda: step_profile.run(str(model_dir), plan, vocab),
                "memory": lambda: memory.run(str(model_dir), plan, vocab)}
        for name in order:
            if args.only and name not in args.only:
                report["sections"][name] = {"status": "skipped: not selected", "seconds": 0.0}
                continue
            _section(name, runs[name], report, start, plan.deadline_s)
            free_device_memory(args.device)
            _write(args.out, report, start, args.device)  # a run cut short still leaves its report
    _write(args.out, report, start, args.device)
    ok = all(c["ok"] for c in report["checks"])
    print(f"gpu-check: {'all checks passed' if ok else 'FAILED'}; report in {args.out}/report.md", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
