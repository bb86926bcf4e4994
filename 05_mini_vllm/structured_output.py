"""Structured outputs: a grammar per request masks the tokens it may sample.

vLLM counterpart: `vllm/v1/structured_output/` (`StructuredOutputManager` in
`__init__.py`, `backend_xgrammar.py`'s `XgrammarBackend` / `XgrammarGrammar`,
`apply_grammar_bitmask` in `utils.py`). The library is xgrammar, vLLM's
default backend: it compiles a JSON schema, a regex or an EBNF grammar against
the tokenizer's vocabulary into an automaton, and a `GrammarMatcher` walks it
token by token and fills a bitmask of the tokens allowed next.

How it plugs into the engine:
- `Processor.process_inputs` (`engine/processor.py`) compiles the request's constraint once, so a
  schema or regex that does not compile, or that accepts no output at all (its
  first step allows no token, not even the end), is a ValueError (a 400) before
  the request is queued; the compiler caches it for the runner.
- The model runner keeps one `Grammar` per constrained request (`StructuredOutputs`,
  which the runner's `StepSampler` asks for each step's bitmask). Before each
  sampling step it feeds the matcher the output tokens it has not seen (from
  the runner's own token list, which the scheduler keeps exact on every rank),
  then fills that request's row of one bitmask for the whole batch; the
  sampler applies the bitmask before anything else. Unconstrained rows stay
  all ones, so their logits are untouched.
- After the grammar accepted a stop token (it is complete) only the stop
  tokens stay allowed, so `ignore_eos` cannot push it past its end.
- Speculative decoding: constrained requests get no drafts (see
  `spec_decode.engine.verifier.spec_eligible`), so every token is sampled under the mask.
"""
from __future__ import annotations

import json
import logging
import threading

import torch

logger = logging.getLogger("mini_vllm")

_backends: dict[tuple, "XgrammarBackend"] = {}
_lock = threading.Lock()


def get_backend(tokenizer_path: str, vocab_size: int, tokenizer=None) -> "XgrammarBackend":
    """One backend per tokenizer folder and vocabulary size in a process, so the
    engine's validation and the runner share one compiler cache. The runner
    passes no tokenizer: it is loaded from the folder on first use (a worker
    process of tensor parallelism has none of its own)."""
    key = (str(tokenizer_path), vocab_size)
    with _lock:
        if key not in _backends:
            if tokenizer is None:
                from transformers import AutoTokenizer
                tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path), local_files_only=True)
            _backends[key] = XgrammarBackend(tokenizer, vocab_size)
        return _backends[key]


def choice_as_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings (JSON escaping is a valid
    xgrammar string literal)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def constraint_kind(so) -> str:
    for name in ("json", "regex", "choice", "grammar", "json_object"):
        if getattr(so, name) not in (None, False):
            return name
    raise ValueError("structured_outputs sets no constraint")


class XgrammarBackend:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        try:
            import xgrammar as xgr
        except ImportError as e:  # a dependency in pyproject.toml; a broken install lands here
            raise ValueError(f"structured_outputs needs the xgrammar package: {e}") from e
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self.stop_token_ids = list(info.stop_token_ids)

    def compile(self, so):
        kind = constraint_kind(so)
        try:
            ws = not so.disable_any_whitespace
            seps = None if ws else (",", ":")  # vLLM's compact separators
            if kind == "json":
                schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
                return self.compiler.compile_json_schema(schema, any_whitespace=ws, separators=seps)
            if kind == "json_object":  # any JSON object (vLLM compiles the same schema)
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=ws,
                                                    separators=seps)
            if kind == "regex":
                return self.compiler.compile_regex(so.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_as_grammar(list(so.choice)))
            return self.compiler.compile_grammar(so.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {msg}") from None

    def validate(self, so) -> None:
        """Compile the constraint (a ValueError naming it when it does not compile) and
        refuse one that accepts no output at all: a grammar whose first step allows no
        token of this vocabulary, not even the end of the text (an empty language, such
        as the regex [^\\s\\S] or a schema that only refers to itself, or one that needs
        characters no token has). Served, its first step would mask every token, and the
        sampler would pick an arbitrary one that reads as a normal answer."""
        compiled = self.compile(so)
        matcher = self.xgr.GrammarMatcher(compiled)
        mask = self.allocate_bitmask(1)
        mask.zero_()
        matcher.fill_next_token_bitmask(mask, 0)
        bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        if not bool(bits.flatten()[:self.vocab_size].any()):
            kind = constraint_kind(so)
            raise ValueError(f"structured_outputs.{kind} accepts no output: no token of this model's vocabulary "
                             "can begin a string it matches, and it does not match the empty string (its "
                             "language is empty, or needs characters no token has)")

    def new_grammar(self, so) -> "Grammar":
        return Grammar(self.xgr.GrammarMatcher(self.compile(so)), self.stop_token_ids)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """All ones: every token allowed, until a grammar fills its row."""
        return torch.full((rows, self.num_words), -1, dtype=torch.int32)


class Grammar:
    """One request's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher, stop_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.num_consumed = 0
        self.failed = False

    def advance(self, output_token_ids: list[int]) -> None:
        for tok in output_token_ids[self.num_consumed:]:
            self.num_consumed += 1
            if self.failed or self.matcher.is_terminated():
                continue  # tokens after the end (ignore_eos) or after a failure
            if not self.matcher.accept_token(int(tok)):
                # Cannot happen when every token was sampled under this grammar's mask.
                logger.error("structured output: token %d rejected by the grammar", tok)
                self.failed = True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.failed:
            return  # leave the row unconstrained rather than mask every token
        if self.matcher.is_terminated():
            bitmask[row] = 0
            for t in self.stop_token_ids:
                bit = 1 << (t % 32)
                bitmask[row, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 two's complement
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputs:
    """The runner's grammars, one per constrained request, built on its first sampling step."""

    def __init__(self, tokenizer_path: str | None, vocab_size: int) -> None:
        self.tokenizer_path, self.vocab_size = tokenizer_path, vocab_size
        self.grammars: dict[str, Grammar] = {}

    def bitmask(self, states) -> torch.Tensor | None:
        """One bitmask row per sampling request (`states`: their `CachedRequestState`s, in
        the rows' order); None when none is constrained."""
        rows = [(j, st) for j, st in enumerate(states) if st.sampling_params.structured_outputs is not None]
        if not rows:
            return None
        backend = get_backend(self.tokenizer_path, self.vocab_size)
        bitmask = backend.allocate_bitmask(len(states))
        for j, st in rows:
            g = self.grammars.get(st.req_id)
            if g is None:
                g = self.grammars[st.req_id] = backend.new_grammar(st.sampling_params.structured_outputs)
            g.advance(st.output_token_ids)
            g.fill_bitmask(bitmask, j)
        return bitmask

    def forget(self, req_id: str) -> None:
        """The request finished: its matcher goes."""
        self.grammars.pop(req_id, None)
