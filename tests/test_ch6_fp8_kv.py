"""Chapter 6's KV pool with an fp8 KV cache: engines with the same fp8 format share blocks and
keep the tokens and logprobs of an fp8 engine without the pool; another format or precision
never hits (the layout fingerprint names the cache dtype) and a value of another format stored
under this layout's key is refused by the block header's dtype code (CorruptBlockError naming
both), never loaded. Oracle: the same fp8 engine without a connector."""
import pytest
import torch

from engine_utils import make_llm
from global_cache_utils import BS, assert_same_as_reference, flush, greedy_logprobs, prompts_with_prefix
from mini_vllm.global_cache import drop_local_pool, get_local_pool
from mini_vllm.global_cache.layout import KVLayout
from mini_vllm.global_cache.serde import pack_block, unpack_block
from mini_vllm.global_cache.store import CorruptBlockError


def tc(pool):
    return {"kv_connector": "GlobalCacheConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"backend": "local", "pool_name": pool}}


@pytest.fixture
def pool_name(request):
    name = f"test-{request.node.name}"
    drop_local_pool(name)
    yield name
    drop_local_pool(name)


def test_fp8_blocks_are_shared_and_read_back_exactly(pool_name):
    prefix, a_prompts = prompts_with_prefix(1, 1, 96, 20)
    _, b_prompts = prompts_with_prefix(5, 2, 96, 17)
    b_prompts = [prefix + p[96:] for p in b_prompts]
    a = make_llm(kv_cache_dtype="fp8", kv_transfer_config=tc(pool_name))
    greedy_logprobs(a, a_prompts, 2)
    flush(a)
    b = make_llm(kv_cache_dtype="fp8", kv_transfer_config=tc(pool_name))
    got = greedy_logprobs(b, b_prompts, 6)
    st = b.llm_engine.engine_core.engine_core.kv_connector.stats
    assert st.blocks_loaded == 96 // BS and st.corrupt_blocks == 0, \
        f"engine B must load A's {96 // BS} fp8 prefix blocks: loaded {st.blocks_loaded}, corrupt {st.corrupt_blocks}"
    assert_same_as_reference(got, greedy_logprobs(make_llm(kv_cache_dtype="fp8"), b_prompts, 6), "fp8 engine B")


@pytest.mark.parametrize("other", [dict(kv_cache_dtype="fp8_e5m2"), dict(kv_cache_dtype="auto")],
                         ids=["e5m2", "fp32"])
def test_other_cache_format_never_hits(pool_name, other):
    _, prompts = prompts_with_prefix(3, 2, 96, 40)
    a = make_llm(kv_cache_dtype="fp8", kv_transfer_config=tc(pool_name))
    greedy_logprobs(a, prompts, 2)
    flush(a)
    assert len(get_local_pool(pool_name, 1)) > 0, "A saved nothing: the test checks nothing"
    b = make_llm(kv_transfer_config=tc(pool_name), **other)
    greedy_logprobs(b, prompts, 2)
    assert b.llm_engine.engine_core.engine_core.kv_connector.stats.hit_blocks == 0, \
        f"an engine with {other} loaded e4m3 blocks"


def test_header_refuses_another_fp8_format():
    layout = KVLayout("m", "float8_e4m3fn", 16, 2, 2, 8)
    block = torch.randn(layout.block_shape).to(torch.float8_e5m2)  # same size, other format
    data = pack_block("k", block)
    with pytest.raises(CorruptBlockError, match=r"dtype code 5 \(float8_e5m2\).*layout \(float8_e4m3fn"):
        unpack_block("k", data, layout)
    good = pack_block("k", block.view(torch.uint8).view(torch.float8_e4m3fn))
    assert torch.equal(unpack_block("k", good, layout).view(torch.uint8), block.view(torch.uint8)), \
        "an e4m3 block must come back bit for bit"
