"""Hypothesis strategies shared by every chapter's tests.

Kept in one place so that a block table, a ragged batch or a GQA shape means the
same thing everywhere in the course.
"""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

BLOCK_SIZES = (8, 16, 32)
GQA_RATIOS = (1, 2, 4, 8)


@dataclass(frozen=True)
class GQAShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@st.composite
def gqa_shapes(draw, head_dims=(16, 32), max_kv_heads: int = 2, ratios=GQA_RATIOS) -> GQAShape:
    """num_heads = ratio * num_kv_heads; ratio 1 is MHA, num_kv_heads 1 is MQA."""
    ratio = draw(st.sampled_from(ratios))
    num_kv_heads = draw(st.integers(1, max_kv_heads))
    head_dim = draw(st.sampled_from(head_dims))
    return GQAShape(ratio * num_kv_heads, num_kv_heads, head_dim)


def block_sizes(sizes=BLOCK_SIZES):
    return st.sampled_from(sizes)


@dataclass(frozen=True)
class RaggedBatch:
    """A ragged batch: sequence i has seq_lens[i] tokens in the KV cache, and
    its last q_lens[i] positions are the queries of this step."""

    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def cu_seqlens_q(self) -> list[int]:
        out = [0]
        for q in self.q_lens:
            out.append(out[-1] + q)
        return out


@st.composite
def ragged_batches(draw, max_seqs: int = 4, max_seq_len: int = 64, decode_only: bool = False) -> RaggedBatch:
    """Mixes decodes (q_len 1), whole prefills (q_len == seq_len) and chunks
    after earlier chunks or prefix hits (1 < q_len < seq_len)."""
    n = draw(st.integers(1, max_seqs))
    seq_lens, q_lens = [], []
    for _ in range(n):
        s = draw(st.integers(1, max_seq_len))
        if decode_only:
            q = 1
        else:
            q = draw(st.one_of(st.just(1), st.just(s), st.integers(1, s)))
        seq_lens.append(s)
        q_lens.append(q)
    return RaggedBatch(tuple(seq_lens), tuple(q_lens))


@dataclass(frozen=True)
class BlockLayout:
    """Physical placement of a batch in a paged cache.

    block_tables[i][j] is the physical block holding logical block j of
    sequence i; rows are padded with -1 (never read) up to max_blocks.
    """

    num_blocks: int
    block_size: int
    block_tables: tuple[tuple[int, ...], ...]


@st.composite
def block_layouts(draw, seq_lens, block_size: int, max_extra_blocks: int = 4) -> BlockLayout:
    """Random, non-contiguous block tables: every sequence gets distinct
    physical blocks drawn from a shuffled pool with spare blocks left over."""
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + draw(st.integers(0, max_extra_blocks))
    ids = draw(st.permutations(range(num_blocks)))
    max_blocks = max(needed) + draw(st.integers(0, 2))
    tables, pos = [], 0
    for k in needed:
        row = list(ids[pos:pos + k]) + [-1] * (max_blocks - k)
        pos += k
        tables.append(tuple(row))
    return BlockLayout(num_blocks, block_size, tuple(tables))


def token_id_lists(vocab_size: int = 50, min_size: int = 0, max_size: int = 64):
    return st.lists(st.integers(0, vocab_size - 1), min_size=min_size, max_size=max_size)


# --- Chapter 4: speculative decoding ------------------------------------------

@dataclass(frozen=True)
class VerifyBatchSpec:
    """Shape of a synthetic verify batch: drafts per request, greedy flags, vocab."""

    num_draft_tokens: tuple[int, ...]
    is_greedy: tuple[bool, ...]
    vocab_size: int
    with_draft_probs: bool
    seed: int


@st.composite
def verify_batch_specs(draw, max_batch: int = 6, max_k: int = 4, max_vocab: int = 16) -> VerifyBatchSpec:
    """Ragged drafts (0..max_k per request, empty drafts included), mixed greedy/random."""
    batch = draw(st.integers(1, max_batch))
    num = tuple(draw(st.lists(st.integers(0, max_k), min_size=batch, max_size=batch)))
    greedy = tuple(draw(st.lists(st.booleans(), min_size=batch, max_size=batch)))
    return VerifyBatchSpec(num, greedy, draw(st.integers(1, max_vocab)), draw(st.booleans()), draw(st.integers(0, 2**31 - 1)))
