// The SIMD layer a kernel source includes: simd_avx512.h when the compiler may use AVX-512
// F/BW/VL/DQ and AVX512_BF16, simd_avx2.h for AVX2 + FMA + F16C. kernels/cpu_native.py compiles each
// source once per instruction set it finds on the CPU (-m flags), into libraries whose names
// hash the sources and the flags, and loads the best one at run time.
//
// Two builds of one source may be loaded into one process (a test runs both), and numba finds
// a worker by its symbol name, so every exported name carries the build's suffix:
// MINI_VLLM_EXPORT(mini_vllm_attn_worker) is mini_vllm_attn_worker_avx2 in the AVX2 build.
// Everything else is hidden (-fvisibility=hidden): a template both builds instantiate, say
// mini_vllm_gemm::tile<3>, must not bind to the other build's copy once both are loaded.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__)
#include "simd_avx512.h"
#define MINI_VLLM_EXPORT(name) __attribute__((visibility("default"))) name##_avx512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd_avx2.h"
#define MINI_VLLM_EXPORT(name) __attribute__((visibility("default"))) name##_avx2
#else
#error "the C++ kernels need AVX-512 with AVX512_BF16, or AVX2 with FMA and F16C (kernels/cpu_native.py picks the flags)"
#endif
