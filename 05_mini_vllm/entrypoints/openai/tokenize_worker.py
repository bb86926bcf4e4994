"""`/tokenize` in a process of its own.

vLLM counterpart: none; vLLM tokenizes in a thread (`_tokenizer_executor` of
`vllm/entrypoints/openai/serving_engine.py`), as the rest of this server does.

Why a process: `/tokenize` has no length bound (a client asks it to count), and
a fast tokenizer releases the GIL while it encodes, but building the Python
objects of 900,000 tokens and freeing them again holds it for 0.1-0.5 s on a
busy machine, and the event loop cannot run meanwhile: every stream stalls. A
process holds a GIL of its own; the server receives the finished JSON bytes.

Invariants:
- the worker is forked on the first `/tokenize` and loads the tokenizer from
  the model folder itself (the server's tokenizer object may be in use by
  another thread at the fork); it answers one request at a time;
- it exits when the server process is gone (SIGKILL included), within
  _PARENT_POLL_S, and at the server's shutdown;
- its answers are those of the server's own tokenizer: the same folder, the
  same chat template;
- it runs at a lower CPU priority (nice WORKER_NICENESS): counting a huge text
  may take seconds of a core, and on a machine with fewer free cores than busy
  processes the streams being served come first.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor

_PARENT_POLL_S = 0.5
WORKER_NICENESS = 10
_worker: dict = {}  # in the worker process: the tokenizer and the chat template


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os._exit(0)  # the server is gone: nobody will read an answer


def _init(tokenizer_path: str, chat_template: str | None, parent_pid: int) -> None:
    from mini_vllm.engine.processor import load_tokenizer

    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    os.nice(WORKER_NICENESS)  # relative to the server's: never above it
    _worker["tok"], _worker["template"] = load_tokenizer(tokenizer_path), chat_template


def _tokenize(prompt: str | None, conv: list | None, add_special_tokens: bool, add_generation_prompt: bool,
              return_token_strs: bool, max_model_len: int) -> bytes:
    import msgspec
    from jinja2 import TemplateError

    tok = _worker["tok"]
    if conv is None:
        ids = list(tok(prompt, add_special_tokens=add_special_tokens)["input_ids"])
    else:
        try:  # as serving_chat.OpenAIServingChat._render: the text, then its tokens
            text = tok.apply_chat_template(conv, chat_template=_worker["template"], tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            raise ValueError(f"messages cannot be rendered by the chat template: {e}") from e
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
    strs = tok.convert_ids_to_tokens(ids) if return_token_strs else None
    return msgspec.json.encode({"tokens": ids, "count": len(ids), "max_model_len": max_model_len,
                                "token_strs": strs})


class TokenizeWorker:
    """The worker process behind `/tokenize` (started on first use)."""

    def __init__(self, tokenizer_path: str, chat_template: str | None) -> None:
        self.pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork"),
                                        initializer=_init, initargs=(tokenizer_path, chat_template, os.getpid()))

    def submit(self, prompt, conv, add_special_tokens: bool, add_generation_prompt: bool, return_token_strs: bool,
               max_model_len: int):
        """A concurrent.futures.Future of the answer's JSON bytes."""
        return self.pool.submit(_tokenize, prompt, conv, add_special_tokens, add_generation_prompt,
                                return_token_strs, max_model_len)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
