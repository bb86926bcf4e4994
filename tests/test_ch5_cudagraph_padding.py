"""CUDA graphs' padded-bucket path, exercised on the CPU (`worker/model_forward.py`).

On a CPU nothing is captured, but a graph mode runs every step it covers
through the same code as on a GPU: the step is copied into the static
buffers, padded to a capture size, and the runnable that a replay would
stand for runs on those buffers. These tests pin what makes a replay
correct: the tokens of the unpadded path, no KV write from a padded row,
one graph per capture size (captured largest first), inputs that never move
after capture, and the configuration's errors. On CUDA, `make gpu-check`
compares real replays with `enforce_eager=True`.
"""
from __future__ import annotations

import pytest
import torch

from engine_utils import greedy, make_llm, model_runner, run_greedy
from mini_vllm.compilation.config import CompilationConfig, CUDAGraphMode, default_capture_sizes
from mini_vllm.worker.cudagraph_dispatcher import CudagraphDispatcher

SIZES = [1, 2, 4, 8]
PROMPTS = [list(range(5 + i, 14 + 3 * i)) for i in range(5)]  # 5 requests: decode batches of 5 pad to 8


@pytest.fixture(scope="module")
def eager_and_full():
    eager = make_llm(enforce_eager=True)
    full = make_llm(compilation_config={"cudagraph_mode": "FULL", "cudagraph_capture_sizes": SIZES})
    yield eager, full
    eager.shutdown()
    full.shutdown()


def test_full_graph_steps_give_the_unpadded_tokens_and_logprobs(eager_and_full):
    eager, full = eager_and_full
    params = [greedy(10, logprobs=3) for _ in PROMPTS]
    want = eager.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = full.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, \
            "a padded FULL-graph decode step changed the greedy tokens: padding leaked into the real rows"
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            for tok, lp in lw.items():
                assert abs(lg[tok].logprob - lp.logprob) < 1e-4, \
                    "padded decode changed the logprobs beyond fp32 noise: the real rows saw other inputs"
    mf = model_runner(full).model_forward
    assert mf.full_graph is not None and sorted(mf.full_graph.entries) == SIZES, \
        "a FULL graph must exist for every capture size after start-up"


def test_graphs_are_captured_largest_first(eager_and_full):
    mf = model_runner(eager_and_full[1]).model_forward
    assert list(mf.full_graph.entries) == sorted(SIZES, reverse=True), \
        "capture must go from the largest size down, so smaller graphs reuse the largest one's pool"


def test_decode_steps_run_as_full_graphs_padded_to_a_capture_size(eager_and_full):
    full = eager_and_full[1]
    mf = model_runner(full).model_forward
    seen = []
    real_fill = mf.static.fill_decode_metadata

    def spy(md, padded):  # called on every FULL step, replayed (CUDA) or run in place (CPU)
        seen.append((md.num_seqs, padded))
        return real_fill(md, padded)

    mf.static.fill_decode_metadata = spy
    try:
        run_greedy(full, PROMPTS[:3], 4)  # 3 decoding requests: every decode step pads 3 -> 4
    finally:
        mf.static.fill_decode_metadata = real_fill
    assert seen and all(p in SIZES for _, p in seen), f"graph steps must run at a capture size, saw {seen}"
    assert (3, 4) in seen, f"3 decoding requests must run as a FULL step padded to 4, saw {seen}"


def test_padded_rows_write_no_kv_slot(eager_and_full):
    """Decode steps of 3 requests (padded to 4): the only cache rows that change
    after the first FULL step begins are the slots the scheduler gave the real
    rows; block 0, which the padded row reads, stays. The caches are snapshotted
    inside the first FULL step, so the check holds with asynchronous scheduling
    too (the default on CUDA), where `engine.step()` does not map to one forward."""
    full = eager_and_full[1]
    runner = model_runner(full)
    engine = full.llm_engine
    caches = [t for pair in runner.cache_engine.gpu_cache for t in pair]
    before: list[torch.Tensor] = []
    steps: list[list[int]] = []
    real_fill = runner.model_forward.static.fill_decode_metadata

    def record(md, padded):
        if not before:  # the prefill's writes are already in (same stream on CUDA)
            before.extend(c.clone() for c in caches)
        steps.append(md.slot_mapping.tolist())
        return real_fill(md, padded)

    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"pad-{i}", {"prompt_token_ids": p}, greedy(3))
    runner.model_forward.static.fill_decode_metadata = record
    try:
        for _ in range(20):  # bounded: 3 short requests finish in a few steps
            if not engine.has_unfinished_requests():
                break
            engine.step()
    finally:
        runner.model_forward.static.fill_decode_metadata = real_fill
    assert steps, "3 decoding requests must run FULL-graph steps"
    assert len(steps[0]) == 3 and min(steps[0]) >= 0, \
        f"the first decode step's real rows must have 3 real slots, got {steps[0]}"
    slots = {s for step in steps for s in step}
    assert min(slots) >= 0, f"a real row was given slot -1 (its KV would be lost): {steps}"
    block_size = caches[0].shape[1]
    for c, b in zip(caches, before):
        changed = (c != b).reshape(c.shape[0] * block_size, -1).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) <= slots, \
            f"a padded row wrote KV slots {sorted(set(changed) - slots)}: padding must use slot -1"


def test_static_buffer_reallocated_after_capture_is_refused(eager_and_full):
    full = eager_and_full[1]
    static = model_runner(full).model_forward.static
    old = static.input_ids
    static.input_ids = torch.zeros_like(old)
    try:
        with pytest.raises(RuntimeError, match="moved since capture"):
            run_greedy(full, PROMPTS[:2], 3)
    finally:
        static.input_ids = old


def test_batches_beyond_the_largest_size_and_prefills_run_without_graphs():
    d = CudagraphDispatcher(CompilationConfig(cudagraph_mode="FULL", cudagraph_capture_sizes=[1, 2, 4, 8])
                            .resolve("cuda", 16, False))
    assert d.dispatch(3, True)[0] == CUDAGraphMode.FULL and d.dispatch(3, True)[1].num_tokens == 4, \
        "3 decode tokens must pad to the capture size 4"
    assert d.dispatch(9, True)[0] == CUDAGraphMode.NONE, "a decode batch above the largest size must run eagerly"
    assert d.dispatch(3, False)[0] == CUDAGraphMode.NONE, "FULL graphs are for pure-decode steps only"


def test_default_capture_sizes_follow_vllm_ladder():
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20], (
        "capture ladder must be 1, 2, 4, multiples of 8, then max_size itself (else a full batch runs eagerly): "
        f"{default_capture_sizes(20)}")
    assert default_capture_sizes(512)[:5] == [1, 2, 4, 8, 16] and default_capture_sizes(512)[-1] == 512, (
        "capture ladder for 512 must start 1, 2, 4, 8, 16 and end at 512 (small sizes skipped or the top cut off?)")
    cfg = CompilationConfig().resolve("cuda", 48, False)
    assert cfg.cudagraph_mode == CUDAGraphMode.FULL and cfg.cudagraph_capture_sizes[-1] == 48, \
        "on CUDA the default is FULL graphs up to max_num_seqs"
    assert CompilationConfig().resolve("cpu", 48, False).cudagraph_mode == CUDAGraphMode.NONE, \
        "a CPU has nothing to capture: graphs are off by default there"


@pytest.mark.parametrize("kwargs, match", [
    (dict(enforce_eager=True, compilation_config={"cudagraph_mode": "FULL"}), "enforce_eager=True"),
    (dict(compilation_config={"cudagraph_mode": "PIECEWISE"}), "needs mode VLLM_COMPILE"),
    (dict(compilation_config={"cudagraph_mode": "SOMETIMES"}), "cudagraph_mode must be one of"),
    (dict(compilation_config={"mode": 2}), "DYNAMO_TRACE_ONCE"),
    (dict(compilation_config={"cudagraph_capture_sizes": [0, 4]}), "cudagraph_capture_sizes"),
    (dict(compilation_config={"cudagraph_capture_sizes": [4, 64], "max_cudagraph_capture_size": 8}),
     "<= max_cudagraph_capture_size"),
    (dict(compilation_config={"splitting_ops": []}), None),
    (dict(compilation_config={"capture": True}), "unknown field"),
    (dict(tensor_parallel_size=2, compilation_config={"cudagraph_mode": "FULL"}), "tensor_parallel_size > 1"),
])
def test_bad_compilation_configs_are_refused(kwargs, match):
    from mini_vllm.config import EngineConfig

    if match is None:  # no split needed without VLLM_COMPILE: accepted
        EngineConfig.from_kwargs("m", device="cpu", **kwargs)
        return
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs("m", device="cpu", **kwargs)


def test_cli_flags_reach_the_engine_config():
    from mini_vllm.entrypoints.cli import _engine_kwargs, build_parser

    base = ["generate", "--model", "m", "--prompt", "p"]
    kw = _engine_kwargs(build_parser().parse_args(base + ["-O", '{"cudagraph_mode": "FULL"}', "--enforce-eager"]))
    assert kw["compilation_config"] == {"cudagraph_mode": "FULL"} and kw["enforce_eager"] is True, \
        "--compilation-config / --enforce-eager were parsed but not passed to the engine"
    assert _engine_kwargs(build_parser().parse_args(base + ["-O3"]))["compilation_config"] == 3, \
        "-O3 must mean compilation mode 3 (VLLM_COMPILE), as in vLLM"
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["-O", "[1, 2]"])


@pytest.mark.parametrize("graph_mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_piecewise_steps_give_the_eager_tokens(eager_and_full, graph_mode):
    """Compiled pieces (inductor) with attention between them, every step padded to a
    capture size: mixed prefill + decode steps run PIECEWISE, pure decodes FULL when
    the mode has both; greedy tokens equal the eager engine's (fp32)."""
    eager = eager_and_full[0]
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    llm = make_llm(compilation_config={"mode": 3, "cudagraph_mode": graph_mode, "cudagraph_capture_sizes": sizes})
    try:
        mf = model_runner(llm).model_forward
        modes = []
        real = mf.dispatcher.dispatch

        def spy(num_tokens, uniform_decode):
            mode, batch = real(num_tokens, uniform_decode)
            modes.append((mode.name, num_tokens, batch and batch.num_tokens))
            return mode, batch

        mf.dispatcher.dispatch = spy
        want = run_greedy(eager, PROMPTS, 8)
        got = run_greedy(llm, PROMPTS, 8)
        assert got == want, f"{graph_mode}: the padded, compiled steps changed the greedy tokens"
        kinds = {m for m, _, _ in modes}
        assert "PIECEWISE" in kinds, f"{graph_mode}: no step ran as PIECEWISE graphs: {modes}"
        assert ("FULL" in kinds) == (graph_mode == "FULL_AND_PIECEWISE"), \
            f"{graph_mode}: pure-decode steps must run FULL exactly when the mode has FULL graphs: {modes}"
        assert all(p in sizes and p >= n for m, n, p in modes if m != "NONE"), \
            f"a graph step ran at a size that is not its padded capture size: {modes}"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("asked, backend, want", [
    (None, "torch", "NONE"),                                   # default FULL: the torch backend cannot be captured
    ({"mode": 3}, "torch", "PIECEWISE"),                       # default FULL_AND_PIECEWISE keeps its pieces
    (None, "triton", "FULL"),                                  # the triton backend is capture-safe
    ({"cudagraph_mode": "FULL"}, "torch", ValueError),         # asked for by name: an error, not a silent change
])
def test_full_graphs_only_with_a_capture_safe_backend(asked, backend, want):
    from types import SimpleNamespace

    from mini_vllm.config import EngineConfig
    from mini_vllm.worker.worker import Worker

    cfg = EngineConfig.from_kwargs("m", device="cuda", attention_backend=backend, compilation_config=asked)
    fake = SimpleNamespace(device=torch.device("cuda"), attention_backend=backend)
    if want is ValueError:
        with pytest.raises(ValueError, match="cannot run inside a CUDA graph"):
            Worker._graph_modes_for_backend(fake, cfg)
        return
    got = Worker._graph_modes_for_backend(fake, cfg).cudagraph_mode.name
    assert got == want, f"{backend} backend with {asked}: cudagraph_mode {got}, expected {want}"
