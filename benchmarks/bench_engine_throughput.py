"""Engine output throughput on the tiny target (CPU), side by side with real vLLM and
against Hugging Face `generate`.

Workload: 256 requests, prompts cut from the standard library with 16-512
tokens, 16-256 output tokens each with ignore_eos, fixed seed, fp32.

Against vLLM (when `make vllm` has been run): both engines get equal settings
(block size 32, since vLLM's CPU attention needs a multiple of 32; 1 GiB of KV
cache each, enough that neither preempts; max_num_seqs 128; a 2,048-token step
budget; prefix caching off, since every run repeats the same prompts) and the same cores: this process is pinned to the cores vLLM's OpenMP
threads are bound to. vLLM runs in its default configuration (compiled, its
engine core in a separate process) through `vllm_runner.py --session`, so its
start-up is paid once and its runs interleave with the engine's, each after a
rest of SETTLE_S seconds (vLLM's processes keep working a while after a run). Before timing,
the first 64 requests run through both with logprobs and must agree token for
token (up to vLLM's own near-ties, see vllm_diff.py); every timed run then also
counts how many of the 256 requests came out identical. Reported per thread
count: the median [min-max] over `--runs` runs of each engine, the spread
(max / min), each run's time in the order they ran, and mini-vLLM / vLLM output
tok/s from the medians.

Baselines at the first thread count (`--skip-baselines` leaves them out): HF
static batches of size 1, 8 and 32 (left padded; a batch runs until its longest
request is done, as static batching does; greedy tokens compared with the
engine first), and the engine with max_num_seqs=1 (no batching). The run also
prints how much *work* each static batch size does per unit of useful work
(padded tokens through the linear layers, query-key pairs in prefill, keys read
per decoded token): at equal speed per unit of work, these ratios bound what
continuous batching alone can gain over static batching. Goal against HF: >= 3x.

Execution modes (`--modes`, comma-separated; each timed in the same interleaved
runs): `process` (the default: the engine core in its own process), `inproc`
(MINI_VLLM_ENABLE_V1_MULTIPROCESSING=0: one process, one step per `step()`),
`process-async` / `inproc-async` (asynchronous scheduling on top), and `process-O1` /
`process-O3` (the model compiled by `torch.compile` / traced and split at attention, as
`-O1` / `-O3` do; compile time is paid before timing).

Workloads (`--model`): `tiny` (the above: the 5M-parameter tiny target in fp32) and
`qwen3-0.6b`, the size a learner runs on a laptop: a Qwen3-0.6B-shaped checkpoint with
random weights in bf16 (`engine_workloads.qwen3_06b_checkpoint`, written once), 16
requests of 16-128 prompt and 16-64 output tokens, max_model_len 2048, detokenize off
(the tokenizer is the tiny one's). Its check before timing compares tokens and the
chosen token's logprob with bf16 tolerances (`vllm_diff.BF16_TIE_MARGIN`,
`BF16_LOGPROB_TOL`) and prints the largest logprob difference it saw. No HF baselines
for it. The first line printed is the machine (`machine.py`): every ratio holds for
that CPU only.

After the timed runs at each thread count, the workload runs once more in process with
every step recorded and is set against this machine's read floor (`cpu_floor.py`: weights
and KV bytes over the measured read bandwidth), printed as the fraction of the floor
reached, whole run and decode steps by batch size (`--no-floor` leaves it out). `--record`
appends each thread count's ratio to the machine matrix (`machine_matrix.py`: the JSON file
and the README's table).

Run: .venv/bin/python benchmarks/bench_engine_throughput.py [--model tiny|qwen3-0.6b]
     [--threads 1,2] [--runs 3] [--num-requests N] [--hf-batch-sizes 1,8,32]
     [--skip-baselines] [--no-vllm] [--no-floor] [--record] [--modes process,inproc,process-async,inproc-async]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import cpu_floor
import machine_matrix
from engine_workloads import qwen3_06b_checkpoint, sample_requests
from machine import machine_line
from mini_vllm import LLM, SamplingParams
from mini_vllm.course.tiny_models import load_tiny_model, model_path
from vllm_diff import BF16_LOGPROB_TOL, BF16_TIE_MARGIN, LOGPROB_TOL, TIE_MARGIN, compare_phase
from vllm_side import MISSING, VllmSession, pin, request, run_mini, vllm_job, vllm_python

GOAL = 3.0
# Equal settings for both engines (see the docstring).
# Prefix caching off: each engine runs the same 256 prompts several times, and a run must
# compute them rather than find the previous run's blocks in the cache.
SETTINGS = dict(block_size=32, kv_cache_memory_bytes=1 << 30, max_num_seqs=128, max_num_batched_tokens=2048,
                enable_prefix_caching=False)
CHECKED = 64  # requests compared with logprobs (near-tie rule) before timing
WORKLOAD_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}  # the machine matrix's workload names


class Workload:
    """One model and its requests: what both engines run, with equal settings."""

    def __init__(self, name, path, dtype, settings, num_requests, in_range, out_range, margin, tol, top_k,
                 detokenize):
        self.name, self.path, self.dtype, self.settings = name, path, dtype, settings
        self.num_requests, self.in_range, self.out_range = num_requests, in_range, out_range
        self.margin, self.tol, self.top_k, self.detokenize = margin, tol, top_k, detokenize


WORKLOADS = {
    "tiny": Workload("tiny", lambda: model_path("tiny-py-target"), "float32", SETTINGS, 256, (16, 512),
                     (16, 256), TIE_MARGIN, LOGPROB_TOL, 0, True),
    "qwen3-0.6b": Workload("qwen3-0.6b", qwen3_06b_checkpoint, "bfloat16", dict(SETTINGS, max_model_len=2048), 16,
                           (16, 128), (16, 64), BF16_TIE_MARGIN, BF16_LOGPROB_TOL, 1, False),
}
# Seconds of rest before each timed run. vLLM's worker process keeps working after a
# run returns (and after start-up): on the 2-core machine it used 1.0 s of CPU in the
# 5 s after a 2-thread run, then 0.1 s per 10 s. Without the rest that work lands in
# the course engine's run, which always follows vLLM's. The same rest precedes both.
SETTLE_S = 5.0


def engine_run(reqs, llm=None, detokenize: bool = True, **kw) -> tuple[float, list[list[int]]]:
    llm = llm or LLM(str(model_path("tiny-py-target")), dtype="float32", **dict(SETTINGS, **kw))
    sps = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, detokenize=detokenize) for _, m in reqs]
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    t = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


def phase(name: str, reqs, logprobs: int | None = None, detokenize: bool = True) -> dict:
    return {"name": name, "requests": [request(p, max_tokens=m, temperature=0.0, ignore_eos=True,
                                               logprobs=logprobs, detokenize=detokenize) for p, m in reqs]}


def max_logprob_diff(want: dict, got: dict) -> float:
    """The largest difference between the two engines' logprobs of the chosen token, over
    the positions where both chose the same one (what the bf16 tolerance is set from)."""
    worst = 0.0
    for w, g in zip(want["results"], got["results"]):
        wc, gc = w["outputs"][0], g["outputs"][0]
        for i, (a, b) in enumerate(zip(wc["token_ids"], gc["token_ids"])):
            if a != b or not wc.get("logprobs") or not gc.get("logprobs"):
                break
            lw = next((lp for t, lp, _ in wc["logprobs"][i] if t == a), None)
            lg = next((lp for t, lp, _ in gc["logprobs"][i] if t == b), None)
            if lw is not None and lg is not None:
                worst = max(worst, abs(lw - lg))
    return worst


def summary(times: list[float], useful: int) -> str:
    med = statistics.median(times)
    return (f"{med:6.1f} s [{min(times):.1f}-{max(times):.1f}]  {useful / med:7.1f} tok/s  "
            f"spread {max(times) / min(times):.2f}x  runs in order: {', '.join(f'{t:.1f}' for t in times)}")


MODES = {"process": dict(multiprocess_mode=True), "inproc": dict(multiprocess_mode=False),
         "process-async": dict(multiprocess_mode=True, async_scheduling=True),
         "inproc-async": dict(multiprocess_mode=False, async_scheduling=True),
         # the model compiled (vLLM's -O1 and -O3; on a CPU the default is eager, mode NONE)
         "process-O1": dict(multiprocess_mode=True, compilation_config=1),
         "process-O3": dict(multiprocess_mode=True, compilation_config=3)}


def side_by_side(reqs, threads: int, runs: int, llms: dict, wl: Workload) -> float:
    """Interleaved timed runs of vLLM and of the engine in each mode (`llms`: mode -> LLM) on
    `threads` pinned cores; returns the ratio of medians (mini-vLLM / vLLM output tok/s) of
    the first mode. Exits without timing if the tokens differ."""
    useful = sum(m for _, m in reqs)
    model = str(wl.path())
    with VllmSession(vllm_job(model, [], dtype=wl.dtype, threads=threads, **wl.settings)) as vs:
        print(f"  vLLM {vs.info['vllm_version']} up in {vs.info['load_s']:.0f} s (compile included)")
        check = phase("check", reqs[:CHECKED], logprobs=2, detokenize=wl.detokenize)
        want = vs.run(check)
        got = run_mini(model, [check], dtype=wl.dtype, **wl.settings)["phases"][0]  # a fresh engine: also warms up
        compared, total, problems = compare_phase(want, got, top_k=wl.top_k, fields=(), margin=wl.margin, tol=wl.tol)
        if problems:
            raise SystemExit("tokens differ from vLLM, not timing:\n" + "\n".join(problems[:5]))
        print(f"  greedy tokens of {len(check['requests'])} requests equal vLLM's ({compared}/{total} positions "
              f"compared, the rest after vLLM near-ties under {wl.margin}); largest logprob difference of a "
              f"chosen token {max_logprob_diff(want, got):.2e} (tolerance {wl.tol}): timing")
        t_v, t_m, same = [], {m: [] for m in llms}, {m: [] for m in llms}
        for r in range(runs):
            time.sleep(SETTLE_S)
            res = vs.run(phase(f"run{r}", reqs, detokenize=wl.detokenize))
            t_v.append(res["wall_s"])
            for mode, llm in llms.items():
                time.sleep(SETTLE_S)
                t, toks = engine_run(reqs, llm, detokenize=wl.detokenize)
                t_m[mode].append(t)
                same[mode].append(sum(o["outputs"][0]["token_ids"] == g for o, g in zip(res["results"], toks)))
    print(f"  vLLM                     {summary(t_v, useful)}")
    for mode in llms:
        print(f"  mini-vLLM {mode:<14} {summary(t_m[mode], useful)}  identical requests per run: "
              f"{same[mode]} of {len(reqs)}  / vLLM: {statistics.median(t_v) / statistics.median(t_m[mode]):.2f}x")
    ratio = statistics.median(t_v) / statistics.median(t_m[next(iter(llms))])
    print(f"  mini-vLLM ({next(iter(llms))}) / vLLM output tok/s (medians): {ratio:.2f}x")
    return ratio


@torch.inference_mode()
def hf_run(hf, reqs, batch_size: int) -> float:
    t = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i:i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), 1, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):  # left padding, as HF decoder-only generation needs
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        n = max(m for _, m in chunk)
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    top_k=None, top_p=None, temperature=None, pad_token_id=1)
    return time.perf_counter() - t


@torch.inference_mode()
def check_greedy(hf, reqs, engine_tokens, k: int = 6) -> None:
    for (p, m), got in list(zip(reqs, engine_tokens))[:k]:
        ids = torch.tensor([p])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, min_new_tokens=m,
                           do_sample=False, top_k=None, top_p=None, temperature=None,
                           pad_token_id=1)[0, len(p):].tolist()
        if want != got:
            raise SystemExit(f"greedy tokens differ from HF for a {len(p)}-token prompt: not timing")


def padding_work(reqs, batch_size: int) -> tuple[float, float, float]:
    """(linear tokens, prefill query-key pairs, decode key reads) that static
    batches of `batch_size` process, each divided by the useful amount."""
    lin = pre = dec = 0
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i:i + batch_size]
        width, n = max(len(p) for p, _ in chunk), max(m for _, m in chunk)
        lin += len(chunk) * (width + n)
        pre += len(chunk) * width * width
        dec += len(chunk) * (n * width + n * (n - 1) // 2)
    useful_lin = sum(len(p) + m for p, m in reqs)
    useful_pre = sum(len(p) ** 2 for p, _ in reqs)
    useful_dec = sum(m * len(p) + m * (m - 1) // 2 for p, m in reqs)
    return lin / useful_lin, pre / useful_pre, dec / useful_dec


def baselines(reqs, t_eng: float, engine_tokens, hf_batch_sizes: list[int]) -> None:
    useful = sum(m for _, m in reqs)
    hf = load_tiny_model("tiny-py-target", dtype=torch.float32)
    check_greedy(hf, reqs, engine_tokens)
    print("greedy tokens of the first requests match HF generate")
    rows = [("mini-vLLM engine (max_num_seqs=128)", t_eng)]
    t_one, _ = engine_run(reqs, max_num_seqs=1)
    rows.append(("mini-vLLM engine (max_num_seqs=1)", t_one))
    best = None
    for bs in hf_batch_sizes:
        t = hf_run(hf, reqs, bs)
        rows.append((f"HF generate, static batch {bs}", t))
        best = t if best is None else min(best, t)
    for name, t in rows:
        print(f"{name:<40} {t:8.1f} s  {useful / t:8.1f} output tok/s")
    if best is not None:
        ratio = best / t_eng
        print(f"engine / best HF static batch: {ratio:.2f}x (goal >= {GOAL}x)  "
              f"{'MET' if ratio >= GOAL else 'NOT MET'}")
    print(f"engine / engine with max_num_seqs=1: {t_one / t_eng:.2f}x")


def floor_run(reqs, llms: dict, wl: Workload, threads: int) -> None:
    """The workload once more, in process with its steps recorded, against this machine's
    read floor (cpu_floor.py): an in-process mode's engine if one is timed, else a new one."""
    llm = next((each for m, each in llms.items() if not MODES[m]["multiprocess_mode"]), None)
    own = llm is None
    if own:
        llm = LLM(str(wl.path()), dtype=wl.dtype, **wl.settings, multiprocess_mode=False)
        engine_run(reqs[:16], llm, detokenize=wl.detokenize)  # warm-up
    acc = cpu_floor.measure(llm, reqs, wl.path(), wl.dtype, threads, detokenize=wl.detokenize)
    print("\n".join(cpu_floor.report_lines(acc)))
    if own:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(WORKLOADS), default="tiny")
    ap.add_argument("--num-requests", type=int, default=None, help="default: the workload's (256 / 16)")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts, e.g. 1,2")
    ap.add_argument("--runs", type=int, default=3, help="interleaved timed runs per engine and thread count")
    ap.add_argument("--hf-batch-sizes", default="1,8,32")
    ap.add_argument("--skip-baselines", action="store_true", help="no HF / max_num_seqs=1 rows")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--modes", default="process", help=f"comma-separated, of {list(MODES)}")
    ap.add_argument("--no-floor", action="store_true", help="no read-floor run (cpu_floor.py) per thread count")
    ap.add_argument("--record", action="store_true",
                    help="append each thread count's ratio to the machine matrix (machine_matrix.py) and the README")
    args = ap.parse_args()
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; choose from {list(MODES)}")
    threads = [int(x) for x in args.threads.split(",")]
    hf_sizes = [int(x) for x in args.hf_batch_sizes.split(",") if x]
    wl = WORKLOADS[args.model]
    if wl.name != "tiny":
        hf_sizes = []  # HF baselines are the tiny workload's
    reqs = sample_requests(args.num_requests or wl.num_requests, wl.in_range, wl.out_range, seed=0)
    useful = sum(m for _, m in reqs)
    machine = machine_line(threads)
    print(machine)
    print(f"{wl.name} ({wl.dtype}): {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
          f"{useful} output tokens; both engines: {wl.settings}")
    for bs in hf_sizes:
        lin, pre, dec = padding_work(reqs, bs)
        print(f"static batch {bs:>2} does {lin:.2f}x the useful linear-layer tokens, {pre:.2f}x the prefill "
              f"query-key pairs, {dec:.2f}x the decode key reads")
    use_vllm = not args.no_vllm and vllm_python() is not None
    if not use_vllm and not args.no_vllm:
        print(f"(no side-by-side run: {MISSING})")
    ratios = {}
    for i, n in enumerate(threads):
        pin(n)
        print(f"\n== {n} thread(s), pinned to cores {sorted(__import__('os').sched_getaffinity(0))}")
        llms = {m: LLM(str(wl.path()), dtype=wl.dtype, **wl.settings, **MODES[m]) for m in modes}
        for llm in llms.values():
            engine_run(reqs[:16], llm, detokenize=wl.detokenize)  # warm-up
        llm = llms[modes[0]]
        if use_vllm:
            ratios[n] = side_by_side(reqs, n, args.runs, llms, wl)
        else:  # every mode, interleaved runs, as side_by_side times them
            times = {m: [] for m in modes}
            for _ in range(args.runs):
                for mode, each in llms.items():
                    time.sleep(SETTLE_S)
                    times[mode].append(engine_run(reqs, each, detokenize=wl.detokenize)[0])
            for mode in modes:
                print(f"  mini-vLLM {mode:<14} {summary(times[mode], useful)}")
        if not args.no_floor:
            floor_run(reqs, llms, wl, n)
        if i == 0 and not args.skip_baselines and wl.name == "tiny":
            t_eng, toks = engine_run(reqs, llm)
            baselines(reqs, t_eng, toks, hf_sizes)
        for llm in llms.values():
            llm.shutdown()
    if ratios:
        print("\nmini-vLLM / vLLM output tok/s: " + ", ".join(f"{r:.2f}x at {n} thread(s)" for n, r in ratios.items()))
    if ratios and args.record:
        machine_matrix.record([{"date": time.strftime("%Y-%m-%d"), "machine": machine,
                                "workload": f"{wl.name} {WORKLOAD_DTYPES[wl.dtype]}", "threads": n,
                                "ratio": round(r, 3), "runs": args.runs,
                                "source": f"bench_engine_throughput.py --modes {modes[0]}"} for n, r in ratios.items()])
        print(f"recorded in {machine_matrix.MATRIX.name} and the README's machine matrix")


if __name__ == "__main__":
    main()
