"""Flags of `python -m mini_vllm serve` (vLLM: `vllm/entrypoints/openai/cli_args.py`).

Kept apart from `api_server` so that building the CLI parser never imports
FastAPI or uvicorn; the engine flags come from `mini_vllm.entrypoints.cli`.
"""
from __future__ import annotations


def add_serve_args(p) -> None:
    p.add_argument("model", help="folder with config.json and *.safetensors")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes "
                   "(or set MINI_VLLM_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use as `model` (default: the model path)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="with tool_choice 'none', do not show the request's tools to the chat template")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=10.0,
                   help="seconds to let in-flight requests finish after SIGINT/SIGTERM")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--generation-config", default="auto",
                   help="default sampling parameters: 'auto' (the model's generation_config.json), "
                        "'vllm' (none) or a folder holding a generation_config.json")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs / prompt_logprobs a request may ask for (-1: no cap)")
    p.add_argument("--structured-outputs-config", default=None,
                   help='JSON, e.g. \'{"disable_any_whitespace": true}\' (compact JSON outputs)')
    p.add_argument("--policy", default="fcfs", choices=["fcfs", "priority", "srtf", "two_level"],
                   help="scheduling policy; 'priority' honours the requests' priority field")
