"""The report of `make gpu-check`: `report.json` (everything) and `report.md` (the summary).

No vLLM counterpart file. The JSON holds every number each section returned;
the markdown shows the verdicts, the goals of issue 24 and the main tables.
"""
from __future__ import annotations

import json
from pathlib import Path

# (name, goal text, threshold) of the issue's goals; judged only on CUDA (`met` is null elsewhere).
GOALS = [("engine_over_hf_static", "engine tok/s >= 5x HF generate's best static batch", 5.0),
         ("decode_attention_fraction_of_peak", "decode attention >= 60% of peak bandwidth at batch 64 x 2,048", 0.6),
         ("batch1_step_wall_over_busy", "batch-1 decode step wall time <= 1.3x its device-busy time (engine default)",
          1.3)]


def goals(sections: dict, device: str) -> list[dict]:
    def get(section, *keys):
        v = sections.get(section, {})
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    values = {"engine_over_hf_static": get("throughput", "engine_over_best_hf_static"),
              # the launch the engine's Triton backend makes for a pure-decode step
              "decode_attention_fraction_of_peak": get("attention_bw", "at_goal_shape", "decode", "fraction_of_peak"),
              "batch1_step_wall_over_busy": get("step_profile", "batch1_wall_over_busy")}
    out = []
    for name, text, bound in GOALS:
        v = values[name]
        met = None if v is None or device != "cuda" else (
            v <= bound if name == "batch1_step_wall_over_busy" else v >= bound)
        out.append({"name": name, "goal": text, "value": v, "met": met, "measured_on_cuda": device == "cuda"})
    return out


def write(out_dir: Path, report: dict) -> None:
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out_dir / "report.md").write_text(markdown(report))


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
        g = tp["greedy_check"]
        lines += ["", "Greedy check (first requests): " + "; ".join(
            f"{q['exact_prefix']}/{q['exact_of']} leading tokens equal to HF, max fp32 gap {q['max_gap']:.3g} "
            f"vs 2 x HF bf16 noise {2 * q['hf_bf16_noise']:.3g} ({'ok' if q['ok'] else 'FAIL'})"
            for q in g["requests"])]
    a = s.get("attention_bw", {})
    if "rows" in a:
        lines += ["", "## Decode attention bandwidth", "", f"Published peak {_num(a['published_peak_bytes_per_s'])} B/s,"
                  f" measured copy {_num(a['copy_bytes_per_s'])} B/s.", "",
                  "| batch | context | varlen us | varlen B/s | of peak | decode us | decode B/s |", "|---|---|---|---|---|---|---|"]
        for row in a["rows"]:
            v, d = row["varlen"], row["decode"]
            lines.append(f"| {row['batch']} | {row['context']} | {v['us']:.1f} | {v['bytes_per_s']:.3g} | "
                         f"{_num(v['fraction_of_peak'], '{:.0%}')} | {d['us']:.1f} | {d['bytes_per_s']:.3g} |")
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
