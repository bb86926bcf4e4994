"""The report of `make gpu-check`: `report.json` (everything) and `report.md` (the summary).

No vLLM counterpart file. The JSON holds every number each section returned;
the markdown shows the verdicts, the goals of issue 24 and the main tables.
"""
from __future__ import annotations

import json
from pathlib import Path

from gpu_check_parts import quant_fp8

# (name, goal text, threshold, "min" or "max") of the issues' goals; judged only on CUDA (`met` is null
# elsewhere). The goals are written for an H100; an H200 has more bandwidth, so its figures are easier.
GOALS = [("engine_tok_per_s", "nano-vllm's workload >= 15,000 output tok/s", 15000.0, "min"),
         ("engine_over_hf_static", "engine tok/s >= 5x HF generate's best static batch", 5.0, "min"),
         ("batch1_step_wall_ms", "batch-1 decode step <= 1.0 ms wall (engine default)", 1.0, "max"),
         ("decode_attention_batch1_us", "decode attention <= 10 us a layer at batch 1 x 2,048", 10.0, "max"),
         ("decode_attention_fraction_of_copy", "decode attention >= 80% of copy bandwidth at batch 64 x 2,048",
          0.8, "min"),
         ("prefill_gemm_fraction_of_peak", "largest prefill steps' GEMMs >= 50% of dense bf16 peak", 0.5, "min"),
         ("worst_wall_over_busy", "decode step wall <= 1.15x device-busy at batch 1, 8 and 64 (engine default)",
          1.15, "max"),
         ("moe_triton_over_reference", "fused-MoE Triton kernel >= 5x the reference loop at batch 256", 5.0, "min")]


def goals(sections: dict, device: str) -> list[dict]:
    def get(section, *keys):
        v = sections.get(section, {})
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else (v[k] if isinstance(v, list) and isinstance(k, int)
                                                      and k < len(v) else None)
        return v

    rows = {(r["batch"], r["context"]): r for r in get("attention_bw", "rows") or []}
    profile = {r["batch"]: r for r in get("step_profile", "rows") or []}
    ratios = [profile[b]["wall_over_busy"] for b in (1, 8, 64) if b in profile and profile[b]["wall_over_busy"]]
    values = {"engine_tok_per_s": get("throughput", "engine", "tok_per_s"),
              "engine_over_hf_static": get("throughput", "engine_over_best_hf_static"),
              "batch1_step_wall_ms": profile[1]["wall_ms_per_step"] if 1 in profile else None,
              # the launch the engine's Triton backend makes for a pure-decode step
              "decode_attention_batch1_us": rows[(1, 2048)]["engine"]["us"] if (1, 2048) in rows else None,
              "decode_attention_fraction_of_copy": get("attention_bw", "at_goal_shape", "engine", "fraction_of_copy"),
              "prefill_gemm_fraction_of_peak": get("throughput", "engine", "roofline", "windows", "prefill",
                                                   "gemm_fraction_of_peak"),
              "worst_wall_over_busy": max(ratios) if ratios else None,
              "moe_triton_over_reference": get("moe", "reference_over_triton_at_goal")}
    out = []
    for name, text, bound, kind in GOALS:
        v = values[name]
        met = None if v is None or device != "cuda" else (v >= bound if kind == "min" else v <= bound)
        out.append({"name": name, "goal": text, "value": v, "met": met, "measured_on_cuda": device == "cuda"})
    return out


def write(out_dir: Path, report: dict) -> None:
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out_dir / "report.md").write_text(markdown(report))


def roofline_lines(rf: dict | None) -> list[str]:
    """The throughput run against its floor: per phase, then each profiler window."""
    if not rf:
        return []
    t = rf["totals"]
    lines = ["", "### Roofline of the throughput run", "",
             f"{rf['steps']} steps moved {t['bytes'] / 1e12:.3g} TB (weights {t['weights'] / 1e12:.3g}, KV read "
             f"{t['kv_read'] / 1e12:.3g}, KV written {t['kv_write'] / 1e12:.3g}, logits {t['logits'] / 1e12:.3g}) "
             f"and computed {t['flops'] / 1e15:.3g} PFLOP; copy bandwidth {rf['copy_bytes_per_s']:.3g} B/s, peak "
             f"{rf['peak_flops']:.3g} FLOP/s ({rf['peak_source']}). Floor {rf['floor_s']:.2f} s: engine time / floor "
             f"= **{_num(rf['engine_over_floor'], '{:.2f}')}**.", "",
             "| phase | steps | tokens | wall s | floor s | wall / floor |", "|---|---|---|---|---|---|"]
    lines += [f"| {p} | {v['steps']} | {v['tokens']} | {v['wall_s']:.2f} | {v['floor_s']:.2f} | "
              f"{_num(v['wall_over_floor'], '{:.2f}')} |" for p, v in rf["phases"].items()]
    lines += ["", "| window | steps (phases) | batch | wall ms/step | busy ms/step | host ms/step | floor ms/step | "
              "busy / floor | GEMM of peak |", "|---|---|---|---|---|---|---|---|---|"]
    for name, w in rf["windows"].items():
        lines.append(f"| {name} | {w['steps']} {w['phases']} | {w['batch']} | {w['wall_ms_per_step']:.2f} | "
                     f"{w['busy_ms_per_step']:.2f} | {w['host_ms_per_step']:.2f} | {w['floor_ms_per_step']:.3f} | "
                     f"{_num(w['busy_over_floor'], '{:.2f}')} | {_num(w['gemm_fraction_of_peak'], '{:.0%}')} |")
    for name, w in rf["windows"].items():
        lines += ["", f"Top kernels, {name} window (us per step, calls per step):", ""]
        lines += [f"- {k['us_per_step']:.0f} us, {k['calls_per_step']:.0f}x `{k['name']}`" for k in w["top_kernels"]]
    return lines


def moe_lines(mo: dict) -> list[str]:
    if "rows" not in mo:
        return []
    sh = mo["shape"]
    lines = ["", "## Fused MoE", "", f"{sh['experts']} experts top-{sh['top_k']}, hidden {sh['hidden']}, expert "
             f"intermediate {sh['intermediate']}, {mo['dtype']}; each output checked against the reference first.", "",
             "| batch | tokens per busy expert | reference us | Triton us | reference / Triton | max abs err | ok |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['tokens_per_busy_expert']:.1f} | {r['reference_us']:.0f} | {r['triton_us']:.0f} | "
              f"{r['reference_over_triton']:.2f} | {r['max_abs_err']:.3g} | {'yes' if r['ok'] else '**NO**'} |"
              for r in mo["rows"]]
    return lines


def _num(v, fmt="{:.3g}") -> str:
    return "n/a" if v is None else fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def markdown(r: dict) -> str:
    m, s = r["meta"], r["sections"]
    lines = [f"# mini-vLLM GPU check: {m['device_info'].get('name')} ({m['device']}{', --small' if m['small'] else ''})",
             "", f"Started {m['started']}, {m['seconds']:.0f} s. Versions: "
             + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + "."
             + (f" Host CPU: {c['model_name']} ({m['device_info']['cpu_count']} cores; {', '.join(c['isa'])})."
                if (c := m["device_info"].get("host_cpu")) else "")
             + (f" Carried wheels installed: {', '.join(m['wheels_installed'])}." if m.get("wheels_installed") else ""),
             ""]
    if m["device"] != "cuda":
        lines += ["**CPU smoke run: the numbers below show that the script works, not how fast anything is.**", ""]
    lines += ["## Verdict", "", "| check | ok |", "|---|---|"]
    lines += [f"| {c['name']} | {'yes' if c['ok'] else '**NO**'} |" for c in r["checks"]]
    lines += ["", "## Goals", "", "| goal | value | met |", "|---|---|---|"]
    lines += [f"| {g['goal']} | {_num(g['value'])} | {_num(g['met'])} |" for g in r["goals"]]
    lines += ["", "## Sections", "", "| section | status | seconds |", "|---|---|---|"]
    lines += [f"| {n} | {v.get('status')} | {_num(v.get('seconds'), '{:.1f}')} |" for n, v in s.items()]
    t = s.get("cuda_tests", {})
    if "tests" in t:
        lines += ["", "## CUDA tests", "", f"{t['passed']} passed, {t['failures']} failed, {t['errors']} errors, "
                  f"{t['skipped']} skipped in {t['seconds']:.0f} s (log: `{t['log']}`)."]
        lines += [f"- {f['test']}: {f['message']}" for f in t["failed"]]
    tp = s.get("throughput", {})
    if "engine" in tp:
        lines += ["", "## Throughput", "", "| run | requests | output tokens | seconds | tok/s |", "|---|---|---|---|---|"]
        e = tp["engine"]
        lines.append(f"| mini-vLLM engine | {tp['workload']['requests']} | {e['output_tokens']} | "
                     f"{e['seconds']:.1f} | {e['tok_per_s']:.0f} |")
        for h in tp.get("hf_static", []):
            lines.append(f"| HF generate, static batch {h['batch_size']} | {h.get('requests')} | "
                         f"{_num(h.get('output_tokens'))} | {_num(h.get('seconds'), '{:.1f}')} | "
                         f"{_num(h.get('tok_per_s'), '{:.0f}')} ({h['status']}) |")
        c = tp["hf_continuous"]
        lines.append(f"| HF continuous batching | {_num(c.get('requests'))} | {_num(c.get('output_tokens'))} | "
                     f"{_num(c.get('seconds'), '{:.1f}')} | {_num(c.get('tok_per_s'), '{:.0f}')} ({c['status']}) |")
        lines += roofline_lines(e.get("roofline"))
        g = tp["greedy_check"]
        lines += ["", "Greedy check (first requests): " + "; ".join(
            f"{q['exact_prefix']}/{q['exact_of']} leading tokens equal to HF, max fp32 gap {q['max_gap']:.3g} "
            f"vs 2 x HF bf16 noise {2 * q['hf_bf16_noise']:.3g} ({'ok' if q['ok'] else 'FAIL'})"
            for q in g["requests"])]
    a = s.get("attention_bw", {})
    if "rows" in a:
        lines += ["", "## Decode attention bandwidth", "", f"Published peak {_num(a['published_peak_bytes_per_s'])} B/s,"
                  f" measured copy {_num(a['copy_bytes_per_s'])} B/s.", "",
                  "| batch | context | varlen us | decode us | segments | engine us | engine B/s | of copy | of peak |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in a["rows"]:
            v, d, e = row["varlen"], row["decode"], row["engine"]
            lines.append(f"| {row['batch']} | {row['context']} | {v['us']:.1f} | {d['us']:.1f} | {row['segments']} | "
                         f"{e['us']:.1f} | {e['bytes_per_s']:.3g} | {e['fraction_of_copy']:.0%} | "
                         f"{_num(e['fraction_of_peak'], '{:.0%}')} |")
    lines += moe_lines(s.get("moe", {}))
    lines += quant_fp8.lines(s.get("quant_fp8", {}))
    cg = s.get("cudagraphs", {})
    if "rows" in cg:
        lines += ["", "## Eager vs CUDA graphs", "", "| mode | start-up s | capture s | batch | wall ms/step | "
                  "busy ms/step | wall / busy | requests identical to eager |", "|---|---|---|---|---|---|---|---|"]
        for r in cg["rows"]:
            if "profile" not in r:
                lines.append(f"| {r['mode']} | {r['status']} | | | | | | |")
                continue
            for i, q in enumerate(r["profile"]):
                same = r.get("requests_identical_to_eager", "(oracle)") if i == 0 else ""
                lines.append(f"| {r['mode'] if i == 0 else ''} | {_num(r['startup_s'], '{:.1f}') if i == 0 else ''} | "
                             f"{_num(r['capture_s'], '{:.1f}') if i == 0 else ''} | {q['batch']} | "
                             f"{q['wall_ms_per_step']:.2f} | {q['device_busy_ms_per_step']:.2f} | "
                             f"{_num(q['wall_over_busy'], '{:.2f}')} | {same} |")
        lines += [f"- {r['mode']}: first divergences (request, token index) {r['first_divergences']}"
                  for r in cg["rows"] if r.get("first_divergences")]
    p = s.get("step_profile", {})
    if "rows" in p:
        lines += ["", f"## Decode step profile (busy: {p['busy_source']})", "",
                  "| batch | wall ms/step | busy ms/step | host ms/step | wall / busy |", "|---|---|---|---|---|"]
        lines += [f"| {q['batch']} | {q['wall_ms_per_step']:.2f} | {q['device_busy_ms_per_step']:.2f} | "
                  f"{q['host_ms_per_step']:.2f} | {_num(q['wall_over_busy'], '{:.2f}')} |" for q in p["rows"]]
        lines += [f"\nHost profile of batch {q['batch']}'s decode steps (a timer per phase):\n\n```\n"
                  + "\n".join(q["host_profile"]) + "\n```" for q in p["rows"] if q.get("host_profile")]
    mem = s.get("memory", {})
    if "num_gpu_blocks" in mem:
        lines += ["", "## KV cache sizing", "", f"Rule: {mem['budget_rule']}. {mem['num_gpu_blocks']} blocks x "
                  f"{mem['bytes_per_block']} B = {mem['kv_cache_bytes'] / 2**30:.2f} GiB ({mem['kv_tokens']} tokens); "
                  f"weights {mem['weights_bytes'] / 2**30:.2f} GiB of {mem['total_bytes'] / 2**30:.1f} GiB. "
                  f"Free after the heaviest step: {_num(mem['free_bytes_after_heavy_step'])} B; peak used fraction "
                  f"{_num(mem['peak_used_fraction'])}; within budget: {mem['within_utilization']}."]
    errors = [(n, v["error"]) for n, v in s.items() if v.get("error")]
    if errors:
        lines += ["", "## Errors", ""] + [f"### {n}\n\n```\n{e}\n```" for n, e in errors]
    return "\n".join(lines) + "\n"
