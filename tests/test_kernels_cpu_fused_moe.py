"""The CPU path of a mixture-of-experts layer (kernels/cpu_fused_moe.py) == the reference loop,
on every C++ build this CPU runs and with the C++ kernels off (F.linear)."""
import pytest
import torch
from hypothesis import given, settings

from kernel_cases import native_builds
from mini_vllm.kernels import cpu_layer_ops_native as native, cpu_native
from mini_vllm.kernels.cpu_fused_moe import fused_experts_cpu
from mini_vllm.models.fused_moe import dispatch
from moe_kernel_cases import Routing, assert_matches_reference, make_experts, make_routing, routings


@pytest.fixture(scope="module", params=[*(f"cpp-{b}" for b in native_builds()), "torch"])
def impl(request):
    """Each C++ build this CPU runs (cpu_native.use_isa: the AVX2 build on an AVX2 machine),
    and the F.linear fallback (cpu_native.numba_only switches the C++ kernels off)."""
    if request.param.startswith("cpp"):
        build = request.param[4:]
        if build == "None":
            pytest.skip(f"the C++ kernels do not run here: {cpu_native.unavailable_reason()}")
        with cpu_native.use_isa(build):
            if not native.handles(torch.float32):
                pytest.skip(f"the C++ kernels' {build} build failed")
            yield request.param
    else:
        with cpu_native.numba_only():
            yield request.param


CASES = {  # name -> (routing, H, I); H and 2I multiples of 32 so the C++ GEMM takes them
    "one_token_k1": (Routing(1, 8, 1, seed=1), 32, 16),
    "one_token_e64_k8": (Routing(1, 64, 8, seed=2), 64, 32),
    "e64_k8_most_experts_idle": (Routing(21, 64, 8, seed=4, skew=4.0), 64, 32),
    "expert_map_with_minus_one": (Routing(17, 12, 4, seed=6, num_local=5), 32, 16),
    "unrouted_slots": (Routing(13, 8, 3, seed=7, unrouted=0.3), 32, 48),
    "odd_width_takes_f_linear": (Routing(9, 6, 2, seed=8), 40, 20),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_path_equals_reference(impl, case, dtype):
    routing, hidden, inter = CASES[case]
    weights, ids, emap = make_routing(routing)
    x, w13, w2 = make_experts(routing.num_tokens, hidden, inter, routing.num_local or routing.num_experts,
                              dtype, routing.seed)
    got = fused_experts_cpu(x, w13, w2, weights, ids, emap)
    assert_matches_reference(got, x, w13, w2, weights, ids, emap, f"{impl} {case} {dtype}")


@settings(max_examples=15)
@given(routings(max_tokens=24))
def test_cpu_path_equals_reference_on_drawn_routings(impl, routing):
    weights, ids, emap = make_routing(routing)
    x, w13, w2 = make_experts(routing.num_tokens, 32, 16, routing.num_local or routing.num_experts,
                              torch.bfloat16 if routing.seed % 2 else torch.float32, routing.seed)
    got = fused_experts_cpu(x, w13, w2, weights, ids, emap)
    assert_matches_reference(got, x, w13, w2, weights, ids, emap, f"{impl} {routing}")


def test_packed_weights_follow_in_place_writes(impl):
    """The C++ path packs each expert stack once; a weight written in place (a reload)
    must be packed again, not read stale."""
    weights, ids, _ = make_routing(Routing(5, 4, 2, seed=11))
    x, w13, w2 = make_experts(5, 32, 16, 4, torch.float32, 11)
    fused_experts_cpu(x, w13, w2, weights, ids)
    with torch.no_grad():
        w13.mul_(-0.5)
        w2[1:].zero_()
    assert_matches_reference(fused_experts_cpu(x, w13, w2, weights, ids), x, w13, w2, weights, ids, None,
                             f"{impl} after the weights were written in place")


def test_cpu_path_rejects_what_it_does_not_run():
    weights, ids, _ = make_routing(Routing(3, 4, 2, seed=12))
    x, w13, w2 = make_experts(3, 32, 16, 4, torch.float16, 12)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        fused_experts_cpu(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[-1, num_experts=4\)"):
        fused_experts_cpu(x.float(), w13.float(), w2.float(), weights, ids + 4)


def test_dispatch_runs_the_cpu_path_on_cpu_tensors(monkeypatch):
    monkeypatch.delenv(dispatch.MOE_IMPL_ENV, raising=False)
    weights, ids, _ = make_routing(Routing(5, 4, 2, seed=13))
    for dtype in (torch.float32, torch.bfloat16):
        x, w13, w2 = make_experts(5, 32, 16, 4, dtype, 13)
        assert dispatch.select_impl(x) == "cpu", f"auto must pick the CPU path for {dtype} CPU tensors"
        assert_matches_reference(dispatch.fused_experts(x, w13, w2, weights, ids), x, w13, w2, weights, ids,
                                 None, f"dispatch auto, {dtype}")
    monkeypatch.setenv(dispatch.MOE_IMPL_ENV, "cpu")
    x, w13, w2 = make_experts(5, 32, 16, 4, torch.float32, 13)
    assert_matches_reference(dispatch.fused_experts(x, w13, w2, weights, ids), x, w13, w2, weights, ids,
                             None, "dispatch forced to cpu")
