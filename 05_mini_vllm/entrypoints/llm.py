"""The offline API: `LLM(model).generate(prompts, sampling_params)`.

vLLM counterpart: `vllm/entrypoints/llm.py` (`LLM.generate`, `LLM.chat`,
`_validate_and_add_requests`, `_run_engine` with its tqdm bar).

All requests of one call are validated (`LLMEngine.processor`) before any is
added, so a bad prompt raises without leaving half a batch inside the engine;
the validated requests are then added as they are, tokenized once. Outputs
come back in the order of the prompts.
"""
from __future__ import annotations

import itertools
import time

from mini_vllm.beam_search import run_beam_search
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.inputs import as_prompt_list
from mini_vllm.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, *, tokenizer=None, executor_class=None, **engine_args) -> None:
        """`engine_args` are EngineConfig's fields; `executor_class` (an
        `mini_vllm.executor.abstract.Executor` subclass) replaces the default one,
        for tools that watch execution."""
        self.llm_engine = LLMEngine.from_engine_args(str(model), tokenizer_obj=tokenizer,
                                                     executor_class=executor_class, **engine_args)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor_parallel_size > 1); idempotent."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without sampling_params: SamplingParams' defaults,
        overridden by the checkpoint's generation_config.json (vLLM's
        `LLM.get_default_sampling_params`, with `--generation-config`)."""
        return SamplingParams(**self.llm_engine.default_sampling_params)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, priority=None):
        prompts = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params must be one SamplingParams or a list of "
                                 f"{len(prompts)} (one per prompt), got {len(params)}")
        eng = self.llm_engine
        # All or nothing: every prompt is validated (and tokenized, once) before any is added.
        requests = [eng.processor.process_inputs(str(next(self._counter)), p, sp,
                                                 priority=0 if priority is None else priority[i])
                    for i, (p, sp) in enumerate(zip(prompts, params))]
        ids = []
        try:
            for req in requests:
                eng.add_request(req.request_id, req, output_kind="final_only")
                ids.append(req.request_id)
        except BaseException:
            eng.abort_request(ids)  # the core may still refuse one (larger than the KV cache)
            raise
        return self._run_engine(ids, use_tqdm)

    def beam_search(self, prompts, params, use_tqdm: bool = False):
        """Beam search (vLLM's `LLM.beam_search`): each round re-submits every live
        beam as a one-token request, and prefix caching shares their common
        prefix (`mini_vllm/beam_search.py`). Returns one BeamSearchOutput per
        prompt, best first."""
        return run_beam_search(self.llm_engine, prompts, params)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, chat_template=None,
             add_generation_prompt: bool = True):
        """One conversation (a list of {"role", "content"}) or a list of them."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if chat_template is None and tok.chat_template is None:
            raise ValueError("the tokenizer has no chat_template; pass chat_template=...")
        prompts = []
        for conv in convs:
            ids = tok.apply_chat_template(conv, chat_template=chat_template, tokenize=True,
                                          add_generation_prompt=add_generation_prompt)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool):
        eng = self.llm_engine
        wanted = set(ids)
        done: dict[str, object] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start = time.perf_counter()
        n_in = n_out = 0
        while len(done) < len(wanted) and eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    n_in += len(out.prompt_token_ids)
                    n_out += sum(len(o.token_ids) for o in out.outputs)
                    if bar is not None:
                        el = time.perf_counter() - start
                        bar.set_postfix_str(f"est. speed input: {n_in / el:.1f} toks/s, "
                                            f"output: {n_out / el:.1f} toks/s", refresh=False)
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]
