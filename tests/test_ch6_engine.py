"""Chapter 6 through the engine, with the in-process pool: engine B computes
only what engine A did not, its tokens equal an engine without the pool, and
nothing crosses a cache salt, a model or a dtype. Oracle: the same engine
without a connector (itself checked against HF transformers in Chapter 5)."""
import pathlib
import shutil
import time

import pytest
import torch

from engine_utils import assert_pool_full, make_llm, run_greedy, target_path
from global_cache_utils import (BS, assert_same_as_reference, computed_per_request, flush,
                                greedy_logprobs, prompts_with_prefix, recording_llm, with_impl)
from mini_vllm import SamplingParams
from mini_vllm.global_cache import drop_local_pool, get_local_pool
from mini_vllm.engine import EngineCoreRequest


@pytest.fixture
def tc(impl):
    def build(pool, role="kv_both", **extra):
        return with_impl({"kv_connector": "GlobalCacheConnector", "kv_role": role,
                          "kv_connector_extra_config": {"backend": "local", "pool_name": pool, **extra}}, impl)
    return build


@pytest.fixture
def pool_name(request):
    name = f"test-{request.node.name}"
    drop_local_pool(name)
    yield name
    drop_local_pool(name)


@pytest.fixture(scope="module")
def reference():
    return make_llm()


@pytest.mark.parametrize("chunk", [None, 64])
def test_engine_b_computes_only_the_uncached_tail(pool_name, reference, chunk, tc):
    kw = {} if chunk is None else {"max_num_batched_tokens": chunk}
    prefix, a_prompts = prompts_with_prefix(1, 1, 200, 30)
    _, b_prompts = prompts_with_prefix(11, 3, 200, 21)  # other tails
    b_prompts = [prefix + p[200:] for p in b_prompts]
    a = make_llm(kv_transfer_config=tc(pool_name), **kw)
    a_out = run_greedy(a, a_prompts, 4)
    flush(a)
    b, log = recording_llm(kv_transfer_config=tc(pool_name), **kw)
    b_out = greedy_logprobs(b, b_prompts, 6)
    assert a_out == run_greedy(reference, a_prompts, 4), "saving changed engine A's tokens"
    assert_same_as_reference(b_out, greedy_logprobs(reference, b_prompts, 6), "engine B")
    shared = (200 // BS) * BS
    per_req = computed_per_request(log)
    for rid, p in zip(sorted(per_req, key=int), b_prompts):
        # 6 outputs: the first comes with the prompt step, 5 decode steps follow.
        assert per_req[rid] == len(p) - shared + 5, (
            f"request {rid} computed {per_req[rid] - 5} prompt tokens; only the tail "
            f"{len(p) - shared} beyond A's {shared} cached tokens should be")
    st = b.llm_engine.engine_core.engine_core.kv_connector.stats
    assert st.external_hit_tokens >= shared and st.blocks_loaded == shared // BS, (
        f"engine B must find A's {shared} shared tokens and load their {shared // BS} blocks once (later requests hit "
        f"them locally): hit tokens {st.external_hit_tokens}, blocks loaded {st.blocks_loaded}")
    assert st.corrupt_blocks == 0 and st.store_errors == 0, (
        f"a clean pool reported corrupt blocks or store errors: {st.corrupt_blocks} corrupt, {st.store_errors} errors")
    assert_pool_full(b)


def _core_run(llm, reqs, max_tokens=4):
    """Drive the engine core directly (Requests carry a cache salt)."""
    core = llm.llm_engine.engine_core.engine_core
    for r in reqs:
        core.add_request(r)
    out = {r.request_id: [] for r in reqs}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            out[o.request_id].extend(o.new_token_ids)
    core.kv_connector_worker.flush(10)
    return out


def _req(rid, prompt, salt=None):
    return EngineCoreRequest(rid, None, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                             arrival_time=time.monotonic(), cache_salt=salt)


def test_cache_salt_isolates_tenants(pool_name, tc):
    _, (p,) = prompts_with_prefix(2, 1, 160, 9)
    a = make_llm(kv_transfer_config=tc(pool_name))
    ref = _core_run(a, [_req("a", p, "tenant-1")])
    b = make_llm(kv_transfer_config=tc(pool_name))
    st = b.llm_engine.engine_core.engine_core.kv_connector.stats
    got = _core_run(b, [_req("b1", p, "tenant-2"), _req("b2", p, None)])
    assert st.hit_blocks == 0, "a block saved under one cache salt was found under another"
    assert got["b1"] == got["b2"] == ref["a"], (
        "a request under another cache salt (or none) changed the greedy tokens: it read the other tenant's KV")
    got = _core_run(b, [_req("b3", p, "tenant-1")])
    assert st.hit_blocks == len(p) // BS and got["b3"] == ref["a"], "same salt must hit"


def test_other_dtype_never_hits(pool_name, tc):
    _, prompts = prompts_with_prefix(3, 2, 96, 40)
    a = make_llm(kv_transfer_config=tc(pool_name))
    run_greedy(a, prompts, 2)
    flush(a)
    # 137 tokens with KV per request: 8 full blocks, the first 6 shared.
    assert len(get_local_pool(pool_name, 1)) == 6 + 2 * 2, "A should have saved every full block once"
    b16 = make_llm(kv_transfer_config=tc(pool_name), dtype="bfloat16")
    run_greedy(b16, prompts, 2)
    assert b16.llm_engine.engine_core.engine_core.kv_connector.stats.hit_blocks == 0, \
        "a bfloat16 engine loaded float32 blocks"


def _model_with_one_tensor_changed(dest: pathlib.Path) -> str:
    """The tiny target with one weight scaled: same architecture, dtype and files."""
    from safetensors.torch import load_file, save_file
    src = pathlib.Path(target_path())
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    for f in src.glob("*.safetensors"):
        w = load_file(f)
        name = sorted(k for k in w if "layers.2." in k and "weight" in k)[0]
        w[name] = w[name] * 1.5
        save_file(w, dest / f.name, metadata={"format": "pt"})
    return str(dest)


def test_other_model_never_loads_this_models_blocks(pool_name, tmp_path, tc):
    """Engine A writes the pool, then an engine with other weights (same layout:
    only the model fingerprint differs) reads it with nothing written in
    between: none of A's blocks may load, whatever the serialised header says."""
    from mini_vllm.global_cache import model_content_id
    other_path = _model_with_one_tensor_changed(tmp_path)
    same = tmp_path / "copy"
    shutil.copytree(target_path(), same)
    assert model_content_id(str(same)) == model_content_id(target_path()), \
        "the fingerprint must follow content, not the path (machines mount models elsewhere)"
    assert model_content_id(other_path) != model_content_id(target_path()), (
        "the model fingerprint ignores the weights: a model with a changed tensor got the same content id")
    _, prompts = prompts_with_prefix(3, 2, 96, 40)
    a = make_llm(kv_transfer_config=tc(pool_name))
    run_greedy(a, prompts, 2)
    flush(a)
    assert len(get_local_pool(pool_name, 1)) == 6 + 2 * 2, "A should have saved every full block once"
    other = make_llm(other_path, kv_transfer_config=tc(pool_name))
    out = run_greedy(other, prompts, 2)
    assert other.llm_engine.engine_core.engine_core.kv_connector.stats.hit_blocks == 0, (
        "an engine with other weights loaded this model's blocks: the store key must include the model "
        "fingerprint")
    assert out == run_greedy(make_llm(other_path), prompts, 2), (
        "an engine with other weights gave other tokens with the pool than without it: it read this model's KV")


def test_corrupted_value_is_a_miss_and_output_stays_correct(pool_name, reference, tc):
    _, (p,) = prompts_with_prefix(4, 1, 128, 5)
    a = make_llm(kv_transfer_config=tc(pool_name))
    run_greedy(a, [p], 2)
    flush(a)
    pool = get_local_pool(pool_name, 1)
    conn = a.llm_engine.engine_core.engine_core.kv_connector
    key = conn.keys_for(p)[3]  # the fourth block
    data = bytearray(pool.batch_get([key])[0])
    data[len(data) // 2] ^= 0x40
    pool.raw_set(key, bytes(data))
    b, log = recording_llm(kv_transfer_config=tc(pool_name))
    assert run_greedy(b, [p], 3) == run_greedy(reference, [p], 3), "a corrupted block was loaded"
    st = b.llm_engine.engine_core.engine_core.kv_connector.stats
    assert st.corrupt_blocks == 1 and st.hit_blocks == 3, (
        f"the corrupted fourth block must be a miss and only the three before it hits: {st.corrupt_blocks} corrupt, "
        f"{st.hit_blocks} hits")
    assert computed_per_request(log)["0"] == len(p) - 3 * BS + 2, \
        "blocks from the corrupted one onwards must be recomputed"


def test_tiny_pool_evicts_and_preemption_stays_correct(pool_name, reference, tc):
    """A pool of 5 blocks and a KV cache small enough to preempt: every token
    still matches, and no local block leaks."""
    _, prompts = prompts_with_prefix(5, 6, 64, 40)
    kw = dict(num_gpu_blocks_override=24, max_num_seqs=6)
    a = make_llm(kv_transfer_config=tc(pool_name, capacity_bytes=5 * 82_000), **kw)
    want = run_greedy(reference, prompts, 16)
    assert run_greedy(a, prompts, 16) == want, "saving to a tiny pool under preemption changed engine A's tokens"
    flush(a)
    assert len(get_local_pool(pool_name, 1)) <= 5, (
        f"a pool sized for 5 blocks holds {len(get_local_pool(pool_name, 1))}: eviction did not keep it under "
        "capacity_bytes")
    b = make_llm(kv_transfer_config=tc(pool_name), **kw)
    assert run_greedy(b, prompts, 16) == want, (
        "loading from a pool that evicted blocks changed engine B's tokens (an evicted or partial prefix was loaded?)")
    assert a.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0, "the test should preempt"
    assert_pool_full(a)
    assert_pool_full(b)


def test_bad_kv_transfer_config_through_the_engine():
    with pytest.raises(ValueError, match="kv_role"):
        make_llm(kv_transfer_config={"kv_role": "kv_sender"})
    with pytest.raises(ValueError, match="kv_connector_module_path"):
        make_llm(kv_transfer_config={"kv_connector_module_path": "no.such.module"})
    with pytest.raises(ValueError, match="kv_connector_module_path"):
        make_llm(kv_transfer_config={"kv_connector_module_path": "mini_vllm.global_cache.keys"})
    with pytest.raises(ValueError, match="kv_transfer_config must be a dict"):
        make_llm(kv_transfer_config="GlobalCacheConnector")
