"""The course's side of the conversation with real vLLM: find `.venv-vllm`, write a job,
run `vllm_runner.py` in that venv's Python, read the result back. Used by the side-by-side
benchmarks and by `tests/test_vs_vllm.py`; nothing here imports vLLM.

Equal settings, the rule of every comparison: the same checkpoint, dtype, token budget,
maximum batch size, KV-cache bytes and cores. vLLM's CPU attention needs a block size that
is a multiple of 32, so a comparison that wants identical block boundaries (prefix caching)
runs the course's engine at 32 too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")
RESULT_MARK = "@@mini-vllm-result "  # marks vllm_runner.py --session result lines on stdout
MISSING = "real vLLM is not installed: run `make vllm` (creates .venv-vllm, about 2 minutes)"


def vllm_python() -> Path | None:
    """`.venv-vllm`'s interpreter if `make vllm` completed, else None."""
    venv = Path(os.environ.get("MINI_VLLM_VLLM_VENV", ROOT / ".venv-vllm"))
    py = venv / "bin" / "python"
    return py if py.is_file() and (venv / ".installed").is_file() else None


# The cores this process could use when it started: `pin` narrows the process's own
# affinity, and a later `pin` to more cores must still find them.
_CORES = sorted(os.sched_getaffinity(0))


def cpu_list(threads: int) -> str:
    """The first `threads` cores this process may use, as vLLM's bind syntax ("0,1")."""
    cores = _CORES[:threads]
    if len(cores) < threads:
        raise ValueError(f"threads must be <= the {len(cores)} cores this process may use, got {threads}")
    return ",".join(str(c) for c in cores)


def pin(threads: int) -> None:
    """Pins this process to the cores `cpu_list(threads)` names and sets torch's thread
    count, so the course's engine runs on exactly the cores vLLM's threads are bound to."""
    import torch
    os.sched_setaffinity(0, [int(c) for c in cpu_list(threads).split(",")])
    torch.set_num_threads(threads)


def request(prompt_token_ids, arrive_at_step: int = 0, **sampling) -> dict:
    return {"prompt_token_ids": list(prompt_token_ids), "sampling": sampling,
            "arrive_at_step": arrive_at_step}


def vllm_job(model, phases: list[dict], *, dtype: str = "float32", threads: int = 1,
             **engine_args) -> dict:
    """One job for vllm_runner.py: a vLLM instance on `model` running `phases` in order."""
    return {"model": str(model), "dtype": dtype, "cpus": cpu_list(threads),
            "engine_args": engine_args, "phases": phases}


def run_vllm_jobs(jobs: list[dict], *, in_process: bool = False, timeout: float = 1800) -> list[dict]:
    """Runs the jobs one after another in one `.venv-vllm` subprocess; returns their results.

    `in_process=True` runs vLLM's engine core in the driver's process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): tokens are the same and start-up is several times
    faster, which is what tests want. Benchmarks keep vLLM's default (a separate engine-core
    process with its OpenMP threads bound to the job's cores), the configuration users run.
    Raises RuntimeError with vLLM's last lines of output if the subprocess fails."""
    py = vllm_python()
    if py is None:
        raise RuntimeError(MISSING)
    threads = len(jobs[0]["cpus"].split(","))
    with tempfile.TemporaryDirectory() as tmp:
        job_path, res_path = Path(tmp, "job.json"), Path(tmp, "result.json")
        job_path.write_text(json.dumps({"jobs": jobs}))
        env = _env(threads, in_process)
        proc = subprocess.run([str(py), str(RUNNER), str(job_path), str(res_path)], env=env,
                              cwd=tmp, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not res_path.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{tail}")
        return json.loads(res_path.read_text())["jobs"]


def _env(threads: int, in_process: bool) -> dict:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(threads), VLLM_ENABLE_V1_MULTIPROCESSING="0" if in_process else "1")
    env.pop("TRITON_INTERPRET", None)  # vLLM's own Triton must not run interpreted
    env.pop("PYTHONPATH", None)
    return env


class VllmSession:
    """One vLLM instance kept alive in a `.venv-vllm` subprocess; `run(phase)` runs a phase
    on it and returns its result. For "steps" phases pass `in_process=True`: with vLLM's
    default separate engine-core process, the core keeps stepping on its own between the
    driver's `step()` calls, so arrival steps and token times would not be the core's. Benchmarks use it to interleave vLLM's timed runs with the
    course engine's, paying vLLM's start-up once.

        with VllmSession(vllm_job(model, [], threads=1, **engine_args)) as vs:
            res = vs.run({"name": "r1", "requests": [...]})
    """

    def __init__(self, job: dict, *, in_process: bool = False, log=None) -> None:
        py = vllm_python()
        if py is None:
            raise RuntimeError(MISSING)
        self._tmp = tempfile.TemporaryDirectory()
        job_path = Path(self._tmp.name, "job.json")
        job_path.write_text(json.dumps(job))
        self._log = log if log is not None else open(os.devnull, "w")
        cores = [int(c) for c in job["cpus"].split(",")]
        # Pinned like the course's engine in the benchmarks (vLLM also binds its OpenMP threads).
        self.proc = subprocess.Popen([str(py), str(RUNNER), "--session", str(job_path)],
                                     env=_env(len(cores), in_process), cwd=self._tmp.name,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, cores))
        self.info = self._read()  # {"vllm_version", "load_s"} once the engine is up

    def _read(self) -> dict:
        tail = []
        for line in self.proc.stdout:
            if line.startswith(RESULT_MARK):
                return json.loads(line[len(RESULT_MARK):])
            tail = (tail + [line.rstrip()])[-40:]
        raise RuntimeError(f"vLLM session exited with {self.proc.wait()}:\n" + "\n".join(tail))

    def run(self, phase: dict) -> dict:
        self.proc.stdin.write(json.dumps(phase) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self._tmp.cleanup()

    def __enter__(self) -> "VllmSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_vllm(model, phases: list[dict], *, dtype: str = "float32", threads: int = 1,
             in_process: bool = False, timeout: float = 1800, **engine_args) -> dict:
    """`run_vllm_jobs` for a single job."""
    job = vllm_job(model, phases, dtype=dtype, threads=threads, **engine_args)
    return run_vllm_jobs([job], in_process=in_process, timeout=timeout)[0]


def logprob_rows(rows) -> list | None:
    """Per position, [token_id, logprob, rank] rows sorted by rank; None where a position has
    none (a prompt's first token). Reads vLLM's and the course's Logprob dicts alike."""
    if rows is None:
        return None
    return [None if pos is None else sorted(([int(t), float(lp.logprob), int(lp.rank or 0)]
                                             for t, lp in pos.items()), key=lambda r: (r[2], r[0]))
            for pos in rows]


def request_result(out, added_s: float = 0.0, times: list[float] | None = None) -> dict:
    """One RequestOutput as JSON, the format both engines' results share. vLLM's and the
    course's RequestOutput / CompletionOutput have the same field names, so one reader serves
    vllm_runner.py (in .venv-vllm) and `run_mini` (in .venv)."""
    return {"outputs": [{"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason, "cumulative_logprob": c.cumulative_logprob,
                         "logprobs": logprob_rows(c.logprobs)}
                        for c in sorted(out.outputs, key=lambda c: c.index)],
            "prompt_logprobs": logprob_rows(getattr(out, "prompt_logprobs", None)),
            "num_cached_tokens": out.num_cached_tokens or 0,
            "added_s": added_s, "token_times_s": times or []}


def run_mini(model: str, phases: list[dict], *, dtype: str = "float32", **engine_args) -> dict:
    """The same phases through the course's `LLM` ("generate" mode), in this process, in the
    result format of vllm_runner.py, so that both engines' results compare field by field."""
    import time

    from mini_vllm import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(str(model), dtype=dtype, **engine_args)
    load_s = time.perf_counter() - t0
    out_phases = []
    for ph in phases:
        if ph.get("mode", "generate") != "generate":
            raise ValueError(f"run_mini runs mode 'generate' only, got {ph.get('mode')!r}")
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in ph["requests"]]
        params = [SamplingParams(**r.get("sampling", {})) for r in ph["requests"]]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        results = [request_result(o) for o in outs]
        out_phases.append({"name": ph.get("name", ""), "wall_s": wall, "results": results})
    llm.shutdown()
    return {"load_s": load_s, "phases": out_phases}


# vLLM's speculative-decoding counters (`vllm/v1/spec_decode/metrics.py`, `SpecDecodingProm`),
# as `LLM.get_metrics()` names them, and the keys this module reports them under.
SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts",
                 "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(metrics) -> dict:
    """vLLM's speculative-decoding counters from an `LLM.get_metrics()` snapshot, summed over
    label sets (one per engine, and one per model name if the process built several): the
    number of drafts (verify steps of one request that carried drafts), draft tokens,
    accepted draft tokens, and accepted tokens per draft position. Counters are cumulative
    since the process started; `spec_delta` of two snapshots gives one phase's. Reads the
    snapshot's objects by their fields (`name`, and `value` or `values`), not their types,
    so this module needs no vLLM."""
    out = {key: 0 for key in SPEC_COUNTERS.values()} | {"num_accepted_tokens_per_pos": []}
    for m in metrics:
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == SPEC_PER_POS:
            out["num_accepted_tokens_per_pos"] = _add(out["num_accepted_tokens_per_pos"], m.values, 1)
    return out


def _add(a: list[int], b: list[int], sign: int) -> list[int]:
    n = max(len(a), len(b))
    a, b = list(a) + [0] * (n - len(a)), list(b) + [0] * (n - len(b))
    return [x + sign * y for x, y in zip(a, b)]


def spec_delta(before: dict, after: dict) -> dict:
    """What the counters of `spec_counters` grew by between two snapshots, with
    `spec_summary`'s rates of that growth."""
    d = {key: after[key] - before[key] for key in SPEC_COUNTERS.values()}
    d["num_accepted_tokens_per_pos"] = _add(after["num_accepted_tokens_per_pos"],
                                            before["num_accepted_tokens_per_pos"], -1)
    return d | spec_summary(d)


def spec_summary(c: dict) -> dict:
    """The rates vLLM's spec-decode log line prints, from counters: mean acceptance length
    (tokens a verify step emits per draft: the accepted drafts plus the target's own token,
    1 + accepted / drafts), draft acceptance rate (accepted / draft tokens), and per position
    j the share of drafts whose first j + 1 tokens were all accepted (accepted at j / drafts).
    Rates are None before any draft."""
    drafts, tokens = c["num_drafts"], c["num_draft_tokens"]
    return {"mean_acceptance_length": 1 + c["num_accepted_tokens"] / drafts if drafts else None,
            "draft_acceptance_rate": c["num_accepted_tokens"] / tokens if tokens else None,
            "acceptance_rate_per_pos": [a / drafts if drafts else None
                                        for a in c["num_accepted_tokens_per_pos"]]}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


if __name__ == "__main__":
    print(vllm_python() or MISSING, file=sys.stderr)
