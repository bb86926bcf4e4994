"""The read floor printed beside the CPU benchmarks (`benchmarks/cpu_floor.py`): its byte
count must be what the engine really holds, and its steps what the engine really ran, or
"x% of the floor" measures nothing. No timing is asserted (a floor is a ratio of two
measured rates; only the bookkeeping is checked)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cpu_floor  # noqa: E402
from engine_utils import model_runner  # noqa: E402
from gpu_check_parts.roofline import StepRecord  # noqa: E402
from mini_vllm import LLM  # noqa: E402
from mini_vllm.course.tiny_models import model_path  # noqa: E402

TARGET = model_path("tiny-py-target")


@pytest.fixture(scope="module")
def llm():
    engine = LLM(str(TARGET), dtype="float32", block_size=16, kv_cache_memory_bytes=8 << 20,
                 max_num_seqs=8, max_num_batched_tokens=256, multiprocess_mode=False)
    yield engine
    engine.shutdown()


def test_floor_bytes_are_what_the_engine_holds(llm):
    runner = model_runner(llm)
    cost = cpu_floor.model_cost(TARGET, "float32")
    linears = [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__.endswith(
        ("Linear", "LinearMethod", "ParallelLMHead"))]
    weights = {id(p): p for m in linears for name, p in m.named_parameters(recurse=False) if name == "weight"}
    embed = next(m.weight for m in runner.model.modules() if type(m).__name__ == "VocabParallelEmbedding")
    held = sum(p.numel() * p.element_size() for p in weights.values())
    if id(embed) not in weights:  # tied: the LM head reads the embedding table each step
        held += embed.numel() * embed.element_size()
    assert cost.weight_bytes == held, (
        f"the floor counts {cost.weight_bytes} weight bytes a step, the model's linears and LM head hold {held}: "
        "a projection or the LM head is missing from ModelCost (or counted twice)")
    k, v = runner.cache_engine.gpu_cache[0]
    slots = k.shape[0] * k.shape[1]
    per_token = len(runner.cache_engine.gpu_cache) * (k.numel() * k.element_size() + v.numel() * v.element_size()) // slots
    assert cost.kv_bytes_per_token == per_token, (
        f"the floor reads {cost.kv_bytes_per_token} KV bytes per cached token, the engine's cache holds {per_token}: "
        "a wrong layer count, KV head count or dtype in the cost")


def test_floor_run_records_every_step_the_engine_ran(llm):
    reqs = [([5 + i] * (3 + 7 * i), 4 + 3 * i) for i in range(5)]
    acc = cpu_floor.measure(llm, reqs, TARGET, "float32", threads=1)
    computed = sum(len(p) + m - 1 for p, m in reqs)  # the last sampled token is never fed back
    steps = acc["phases"]["prefill"]["tokens"] + acc["phases"]["decode"]["tokens"]
    assert steps == computed, (
        f"the recorded steps scheduled {steps} tokens, the requests needed {computed}: steps were lost "
        "(the recorder missed a schedule() call) or counted twice")
    decode = acc["phases"]["decode"]
    buckets = acc["decode_buckets"]
    assert sum(b["steps"] for b in buckets) == decode["steps"], "a decode step fell outside every batch bucket"
    assert sum(b["floor_s"] for b in buckets) == pytest.approx(decode["floor_s"]), \
        "the buckets' floors do not add up to the decode phase's"
    for b in buckets:
        assert b["fraction"] == pytest.approx(b["floor_s"] / b["wall_s"]), "fraction is not floor / wall"
    lines = cpu_floor.report_lines(acc)
    assert any("decode batch" in ln for ln in lines), "the report left out the decode buckets"


def test_decode_buckets_split_by_batch():
    m = cpu_floor.model_cost(TARGET, "float32")
    steps = [StepRecord(0.0, [(0, 10)], 1, 10),                  # prefill: not a decode step
             StepRecord(1.0, [(10, 1)], 1, 0),                   # batch 1
             StepRecord(2.0, [(11, 1), (3, 1), (4, 1)], 3, 0),   # batch 3
             StepRecord(4.0, [(c, 1) for c in range(20)], 20, 0)]  # batch 20
    rows = {r["batch"]: r for r in cpu_floor.decode_buckets(m, steps, 5.0, 1e10, 1e11)}
    assert set(rows) == {(1, 1), (2, 4), (17, 64)}, f"steps landed in the wrong buckets: {sorted(rows)}"
    assert [rows[b]["steps"] for b in ((1, 1), (2, 4), (17, 64))] == [1, 1, 1]
    assert rows[(2, 4)]["wall_s"] == pytest.approx(2.0), "a step lasts until the next one is scheduled"
    assert rows[(17, 64)]["wall_s"] == pytest.approx(1.0), "the last step lasts until the run's end"
    with pytest.raises(ValueError, match="dtype must be one of"):
        cpu_floor.model_cost(TARGET, "int4")
