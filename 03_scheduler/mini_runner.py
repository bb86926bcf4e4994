"""A model-free runner that checks the scheduler's messages (the role of
`vllm/v1/worker/gpu_model_runner.py`, minus the model).

It keeps a persistent batch built from SchedulerOutputs alone (seed 001
§4.6.2), executes swap-out, swap-in and copy lists on real KV tensors from
Chapter 1 (`allocate_kv_cache`, `reshape_and_cache`), and samples tokens.

The KV written for token t at position p is the number t * 4096 + p, so the
cache contents can be checked against the tokens: any block-table, swap or
copy-on-write mistake shows up as a wrong number.
"""
from __future__ import annotations

import random

import torch

from mini_vllm.paged_attention import allocate_kv_cache, reshape_and_cache

from .output import ModelRunnerOutput
from .swap import copy_blocks


def kv_value(token: int, pos: int) -> float:
    return float(token * 4096 + pos)


def update_block_tables(tables: dict[str, list[int]], out) -> None:
    """Apply one SchedulerOutput to a runner's {req_id: block ids}: finished and
    preempted requests leave; new requests bring their whole table; a resumed
    request, or one whose shared block was copied on write, sends its whole
    table again; any other cached request sends only its newly allocated blocks."""
    for rid in out.finished_req_ids | out.preempted_req_ids:
        tables.pop(rid, None)
    for nr in out.scheduled_new_reqs:
        tables[nr.req_id] = list(nr.block_ids)
    for cr in out.scheduled_cached_reqs:
        if cr.resumed_from_preemption or cr.replace_block_ids:
            tables[cr.req_id] = list(cr.new_block_ids)
        else:
            tables[cr.req_id].extend(cr.new_block_ids)


class MiniRunner:
    def __init__(self, sched, with_tensors: bool = False, vocab: int = 8,
                 seed: int = 0) -> None:
        self.sched = sched
        self.tables: dict[str, list[int]] = {}
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.cache = self.cpu_cache = None
        if with_tensors:
            bs = sched.block_size
            self.cache = allocate_kv_cache(sched.num_gpu_blocks, bs, 1, 2)
            n_cpu = max(sched.config.num_cpu_blocks, 1)
            self.cpu_cache = allocate_kv_cache(n_cpu, bs, 1, 2)

    def execute(self, out, requests: dict, draft_fn=None):
        """Apply block tables, swaps, copies; write KV; sample tokens."""
        update_block_tables(self.tables, out)
        if self.cache is not None:
            copy_blocks([self.cache], [self.cpu_cache], out.blocks_to_swap_out)
            copy_blocks([self.cpu_cache], [self.cache], out.blocks_to_swap_in)
            copy_blocks([self.cache], [self.cache], out.blocks_to_copy)
        sampled = {}
        bs = self.sched.block_size
        for rid, n in out.num_scheduled_tokens.items():
            req = requests[rid]
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            end = req.num_computed_tokens  # already advanced by schedule()
            start = end - n
            toks = list(req.all_token_ids) + list(drafts)
            assert len(self.tables[rid]) * bs >= end, \
                f"{rid}: block table covers {len(self.tables[rid]) * bs} slots < {end} tokens"
            if self.cache is not None:
                pos = torch.arange(start, end)
                slots = torch.tensor([self.tables[rid][p // bs] * bs + p % bs for p in pos.tolist()])
                vals = torch.tensor([kv_value(toks[p], p) for p in pos.tolist()])
                kv = vals.view(-1, 1, 1).expand(-1, 1, 2).contiguous()
                reshape_and_cache(kv, kv.clone(), self.cache[0], self.cache[1], slots)
            if end - len(drafts) >= req.num_tokens:  # reached the end: sample
                accepted = self.rng.randint(0, len(drafts)) if drafts else 0
                sampled[rid] = list(drafts[:accepted]) + [self.rng.randrange(self.vocab)]
            else:
                sampled[rid] = []
        return ModelRunnerOutput.from_dict(sampled)

    def check_cache(self, requests: dict) -> None:
        """Every computed token of every running request reads back right."""
        bs = self.sched.block_size
        for rid, req in requests.items():
            if req.status.name != "RUNNING":
                continue
            table = self.tables[rid]
            assert table == list(self.sched.kv_cache_manager.get_block_ids(rid)), \
                f"{rid}: runner's incremental block table diverged from the KV manager's"
            for p in range(req.num_computed_tokens):
                got = float(self.cache[0][table[p // bs], p % bs, 0, 0])
                want = kv_value(req.all_token_ids[p], p)
                assert got == want, (f"{rid} pos {p}: KV {got} != {want} (lost by swap, "
                                     "copy or a wrong block table)")
