"""Chapter 1: hand-built examples, one per classic mistake, with answers worked out by hand.

The property tests beside this file find the same bugs; these pin each one to a
tiny case whose right answer is obvious, and say which mistake a failure means.
Trick used throughout: with a zero query every visible key gets the same score,
so attention returns the plain mean of the visible values. Value = position
number then makes "which positions were visible" readable from the output.
"""
import torch

B = 4  # block size in every example


def positional_cache(pa, table_row, seq_len, num_blocks=8, kv_heads=1, head_dim=2, stale=1000.0):
    """Caches whose value at position j is j (written by hand, not by the code under test);
    every other slot holds `stale`, so reading one shows up as a huge mean."""
    kc, vc = pa.allocate_kv_cache(num_blocks, B, kv_heads, head_dim)
    kc.fill_(stale)
    vc.fill_(stale)
    for j in range(seq_len):
        kc[table_row[j // B], j % B] = 0.0
        vc[table_row[j // B], j % B] = float(j)
    return kc, vc


def test_slot_mapping_slot_by_slot(chapter):
    """Table [7, 1, 3, 0], B = 4: positions 0-3 in block 7, 4-7 in block 1, 8 in block 3."""
    pa = chapter("paged_attention")
    row = [7, 1, 3, 0]
    table = torch.tensor([row], dtype=torch.int32)
    pos = list(range(9))
    got = pa.compute_slot_mapping(table, torch.zeros(9, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32),
                                  B).tolist()
    want = [28, 29, 30, 31, 4, 5, 6, 7, 12]
    assert got != [w + 1 for w in want], f"every slot is one too far: off-by-one offset; got {got}"
    assert got != [row[p % B] * B + p % B for p in pos], (
        f"block looked up with pos % B: the logical block of position pos is pos // B; got {got}")
    assert got == want, f"slot_mapping {got} != {want}: slot = table[pos // B] * B + pos % B"


def test_decode_sees_every_cached_position_and_nothing_else(chapter):
    """seq_len 5 in blocks [3, 6]: the decode query is position 4 and sees 0..4 (mean 2.0).
    Slots 5-7 of block 6 and every other block hold 1000."""
    pa = chapter("paged_attention")
    row = [3, 6]
    kc, vc = positional_cache(pa, row, 5)
    table = torch.tensor([row + [-1]], dtype=torch.int32)
    got = float(pa.paged_attention_decode(torch.zeros(1, 1, 2), kc, vc, table,
                                          torch.tensor([5], dtype=torch.int32), 1.0)[0, 0, 0])
    assert got != 0.0, ("decode saw only position 0: its query is position seq_len - 1 and sees every earlier "
                        "position (no causal offset for the last q_len queries?)")
    assert got != 1.5, "decode saw only positions 0..3 (mean 1.5): it must also see its own token at seq_len - 1"
    assert got < 100, (f"mean {got}: stale slots were read, either past seq_len (keep exactly seq_len "
                       "positions) or from a block not in the table (blocks are not contiguous)")
    assert got == 2.0, f"decode over positions 0..4 must give mean 2.0, got {got}"


def test_full_last_block_never_reads_minus_one_padding(chapter):
    """seq_len 8 = two full blocks [1, 2], then -1. A -1 used as an index is the LAST
    block (7), which holds 1000s: reading ceil(8 / 4) = 2 blocks, not 8 // 4 + 1 = 3, is right."""
    pa = chapter("paged_attention")
    row = [1, 2]
    kc, vc = positional_cache(pa, row, 8)
    table = torch.tensor([row + [-1, -1]], dtype=torch.int32)
    got = float(pa.paged_attention_decode(torch.zeros(1, 1, 2), kc, vc, table,
                                          torch.tensor([8], dtype=torch.int32), 1.0)[0, 0, 0])
    assert got < 100, f"mean {got}: a -1 table entry was used as a block id (it wraps to the last block)"
    assert got == 3.5, f"decode over positions 0..7 must give mean 3.5, got {got}"


def test_chunked_queries_are_the_last_positions(chapter):
    """seq_len 6, q_len 2 (a chunk of a prompt whose first 4 tokens are cached): query 0 is
    position 4 and sees positions 0..4 (mean 2.0); query 1 sees 0..5 (mean 2.5)."""
    pa = chapter("paged_attention")
    row = [2, 5]
    kc, vc = positional_cache(pa, row, 6)
    table = torch.tensor([row], dtype=torch.int32)
    out = pa.paged_attention_varlen(torch.zeros(2, 1, 2), kc, vc, table, torch.tensor([0, 2], dtype=torch.int32),
                                    torch.tensor([6], dtype=torch.int32), 1.0)
    got = out[:, 0, 0].tolist()
    assert max(got) < 100, f"means {got}: a slot outside the table's blocks was read (follow block_tables[i])"
    assert got[0] != 0.0 and got[0] != 0.5, (
        f"query 0 saw only the first positions (means {got}): no causal offset; the q_len queries are the "
        "LAST q_len of seq_len positions, query t sees keys 0 .. seq_len - q_len + t")
    assert got[0] != 2.5, f"query 0 saw position 5, which comes after it (means {got}): causal mask missing"
    assert got == [2.0, 2.5], f"causal chunk means must be [2.0, 2.5], got {got}"


def test_gqa_query_head_reads_kv_head_h_div_group(chapter):
    """4 query heads, 2 KV heads (group 2): heads 0, 1 read KV head 0 and heads 2, 3 read KV head 1."""
    pa = chapter("paged_attention")
    kc, vc = pa.allocate_kv_cache(2, B, 2, 2)
    vc[0, :, 0] = 10.0  # KV head 0 holds 10s
    vc[0, :, 1] = 20.0  # KV head 1 holds 20s
    table = torch.tensor([[0]], dtype=torch.int32)
    out = pa.paged_attention_decode(torch.zeros(1, 4, 2), kc, vc, table, torch.tensor([4], dtype=torch.int32), 1.0)
    heads = out[0, :, 0].tolist()
    assert heads != [10.0, 20.0, 10.0, 20.0], (
        f"query heads read KV heads {heads}: that is h % num_kv_heads; GQA maps query head h to KV head h // group")
    assert heads == [10.0, 10.0, 20.0, 20.0], f"query heads 0..3 must read KV heads 0, 0, 1, 1; got values {heads}"


def test_softmax_scale_is_applied(chapter):
    """One head, head_dim 1: q = 2, keys 0 and 1, values 0 and 1, scale 0.5.
    Scores 0 and 1 -> output e / (1 + e) = 0.7311; without the scale, e^2 / (1 + e^2) = 0.8808."""
    pa = chapter("paged_attention")
    kc, vc = pa.allocate_kv_cache(1, B, 1, 1)
    kc[0, 1] = 1.0
    vc[0, 1] = 1.0
    table = torch.tensor([[0]], dtype=torch.int32)
    got = float(pa.paged_attention_decode(torch.full((1, 1, 1), 2.0), kc, vc, table,
                                          torch.tensor([2], dtype=torch.int32), 0.5)[0, 0, 0])
    assert abs(got - 0.8808) > 1e-3, "output 0.8808 means the scores were not multiplied by `scale`"
    assert abs(got - 0.7311) < 1e-4, f"softmax([0, 1]) @ [0, 1] = 0.7311 expected, got {got:.4f}"


def test_padding_slot_writes_nothing(chapter):
    """slot_mapping [1, -1]: token 0 goes to slot 1, token 1 is padding and must not be
    written anywhere (as an index, -1 would be the cache's last slot)."""
    pa = chapter("paged_attention")
    kc, vc = pa.allocate_kv_cache(2, B, 1, 1)
    key = torch.tensor([[[5.0]], [[9.0]]])
    pa.reshape_and_cache(key, key.clone(), kc, vc, torch.tensor([1, -1]))
    flat = kc.flatten().tolist()
    assert flat[-1] == 0.0, f"the padding token (slot -1) was written to the last slot: cache {flat}"
    assert flat == [0.0, 5.0] + [0.0] * 6, f"only slot 1 may change; cache {flat}"
