"""The CPU path of a mixture-of-experts layer (kernels/cpu_fused_moe.py) == the reference loop,
on every C++ build this CPU runs and with the C++ kernels off (F.linear); the C++ grouped call
(kernels/cpu_fused_moe_native.py, csrc/cpu_moe.h) on one thread and split over two."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kernel_cases import native_builds, native_isa, torch_threads  # noqa: F401 (native_isa: a fixture)
from mini_vllm.kernels import cpu_fused_moe_native as native_moe, cpu_layer_ops_native as native, cpu_native
from mini_vllm.kernels.cpu_fused_moe import fused_experts_cpu
from mini_vllm.models.fused_moe import dispatch
from moe_kernel_cases import Routing, assert_matches_reference, make_experts, make_routing, routings


@pytest.fixture(params=[*(f"cpp-{b}" for b in native_builds()), "torch"])
def impl(request):
    """Each C++ build this CPU runs (cpu_native.use_isa: the AVX2 build on an AVX2 machine),
    and the F.linear fallback (cpu_native.numba_only switches the C++ kernels off). Per
    test, not per module: a module-scoped one stays entered (numba_only) while the module's
    other tests run, and would send them to F.linear."""
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


# Routings whose work is over the split threshold (pairs * 3 * H * I >= SPLIT_MACS), so that
# two threads share the items: ragged, experts without tokens, expert_map with -1, unrouted slots.
SPLIT_CASES = {
    "ragged_skewed": Routing(40, 16, 4, seed=21, skew=3.0),
    "expert_map_and_unrouted": Routing(37, 24, 6, seed=22, num_local=9, unrouted=0.2),
    "one_busy_expert": Routing(64, 8, 2, seed=23, skew=50.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_grouped_call_on_one_and_two_threads(native_isa, case, dtype, monkeypatch):
    """The one C++ call per layer equals the reference on one thread and split over two, and
    the two give the same bits (each value's arithmetic does not depend on the split)."""
    routing = SPLIT_CASES[case]
    weights, ids, emap = make_routing(routing)
    x, w13, w2 = make_experts(routing.num_tokens, 64, 96, routing.num_local or routing.num_experts, dtype,
                              routing.seed)
    assert routing.num_tokens * routing.top_k * 3 * 64 * 96 >= native.SPLIT_MACS, "case below the split threshold"
    calls, split = [], []
    grouped = native_moe.fused_experts
    monkeypatch.setattr(native_moe, "fused_experts", lambda *a: calls.append(1) or grouped(*a))
    fan_out = native_moe._FAN_OUT[native_isa]
    monkeypatch.setitem(native_moe._FAN_OUT, native_isa, lambda *a: split.append(a[1]) or fan_out(*a))
    outs = {}
    for threads in (1, 2):
        with torch_threads(threads):
            outs[threads] = fused_experts_cpu(x, w13, w2, weights, ids, emap)
        assert_matches_reference(outs[threads], x, w13, w2, weights, ids, emap,
                                 f"{native_isa} {case} {dtype} on {threads} thread(s)")
    assert len(calls) == 2, "the C++ grouped call did not run: the CPU path fell back to F.linear"
    assert split == [2], f"the two-thread call must wake two workers once, woke {split}"
    assert torch.equal(outs[1], outs[2]), \
        f"{case} {dtype}: two threads changed the output's bits (a value computed in another order, or read early)"


def test_grouped_call_reuses_and_grows_its_workspace(native_isa):
    """Calls of growing and shrinking sizes on one thread share a workspace: a smaller call
    after a larger one, and a larger one after that, read nothing left by the one before."""
    for num_tokens in (30, 3, 45, 1, 30):
        routing = Routing(num_tokens, 12, 3, seed=num_tokens)
        weights, ids, _ = make_routing(routing)
        x, w13, w2 = make_experts(num_tokens, 32, 48, 12, torch.float32, num_tokens)
        assert_matches_reference(fused_experts_cpu(x, w13, w2, weights, ids), x, w13, w2, weights, ids, None,
                                 f"{native_isa} {num_tokens} tokens after a call of another size")


# impl is per test, not per example: the build it forces holds for all the examples.
@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
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
