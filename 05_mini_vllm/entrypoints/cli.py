"""Command line: `python -m mini_vllm generate --model PATH --prompt ... [sampling flags]`
and `python -m mini_vllm serve MODEL_PATH [--port 8000] [engine flags]` (the OpenAI API).

vLLM counterpart: `vllm/entrypoints/cli/` (`vllm serve`, `vllm bench`); the
offline `generate` subcommand is this course's own, for trying the engine
without writing Python.
"""
from __future__ import annotations

import argparse
import json
import sys


def _add_engine_args(p: argparse.ArgumentParser, model_flag: bool = True) -> None:
    if model_flag:  # `serve` takes the model as a positional argument, as `vllm serve` does
        p.add_argument("--model", required=True, help="folder with config.json and *.safetensors")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    from mini_vllm.models.quantization import QUANTIZATION_METHODS  # torch: only once a parser is built

    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="8-bit linear weights (default: the checkpoint's quantization_config, else none)")
    from mini_vllm.kernels.kv_cache_dtype import KV_CACHE_DTYPES

    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8 KV cache: per-layer scales from the first prefill (default: checkpoint's, else 1.0)")
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default=None, choices=["torch", "triton", "cpu"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks (processes; one GPU each on CUDA) that split every layer")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="a mixture of experts puts num_experts / tp whole experts on each rank")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while this one runs (placeholders for tokens in flight); "
                        "default: on for CUDA when compatible, off on a CPU, as vLLM decides")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile and no CUDA graphs")
    p.add_argument("--compilation-config", "-O", default=None, type=_compilation_config,
                   help='an int mode (-O3: VLLM_COMPILE) or JSON, e.g. \'{"mode": 3, "cudagraph_mode": '
                        '"FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8]}\'')
    p.add_argument("--speculative-config", default=None, type=_json_object,
                   help='speculative decoding, vLLM\'s JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 3}\'')


def _json_object(text: str) -> dict:
    """A JSON-object flag (argparse names the flag in its error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _compilation_config(text: str):
    """`-O3` or JSON, as vLLM's --compilation-config reads it."""
    if text.strip().lstrip("-").isdigit():
        return int(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--compilation-config must be an int or a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--compilation-config must be an int or a JSON object, got {text!r}")
    return value


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for one or more prompts")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    gen.add_argument("--json", action="store_true", help="print one JSON object per completion")
    from mini_vllm.entrypoints.openai.cli_args import add_serve_args

    srv = sub.add_parser("serve", help="serve the model with an OpenAI-compatible HTTP API")
    add_serve_args(srv)
    _add_engine_args(srv, model_flag=False)
    return parser


def _engine_kwargs(args) -> dict:
    return dict(dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                calculate_kv_scales=args.calculate_kv_scales, device=args.device,
                attention_backend=args.attention_backend,
                block_size=args.block_size, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching,
                kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization,
                tensor_parallel_size=args.tensor_parallel_size, async_scheduling=args.async_scheduling,
                enable_expert_parallel=args.enable_expert_parallel,
                enforce_eager=args.enforce_eager, compilation_config=args.compilation_config,
                speculative_config=args.speculative_config)


def _generate(args) -> int:
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    llm = LLM(args.model, **_engine_kwargs(args))
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                        seed=args.seed, n=args.n, stop=args.stop, ignore_eos=args.ignore_eos)
    if args.stream:
        eng = llm.llm_engine
        for i, p in enumerate(args.prompt):
            eng.add_request(str(i), p, sp, output_kind="delta")
        while eng.has_unfinished_requests():
            for out in eng.step():
                for c in out.outputs:
                    sys.stdout.write(c.text)
                sys.stdout.flush()
                if out.finished:
                    sys.stdout.write("\n")
        return 0
    for out in llm.generate(args.prompt, sp, use_tqdm=False):
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": out.prompt, "index": c.index, "text": c.text,
                                  "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
            else:
                print(f"--- prompt: {out.prompt!r} [{c.index}] ({c.finish_reason})")
                print(out.prompt + c.text)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            from mini_vllm.entrypoints.openai.api_server import run_server

            return run_server(args, _engine_kwargs(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1
