"""EAGLE-2 dynamic draft trees and tree attention (`training/eagle_tree.py`).

Oracles:
* tree attention: the target's logits at every node of a tree verified in one forward equal
  a plain causal forward over the context, the root and that node's path;
* drafting: a tree of top_k = 1 and budget = depth = k is the engine's chain, so its
  accepted counts along the target's greedy continuation equal those of the training
  script's independent unrolled chain (`train_eagle.unroll`, the training-time-test masks);
* the acceptance walk and the mask on trees written out by hand.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mini_vllm.course.tiny_models import model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from eagle_head import load_head  # noqa: E402
from eagle_tree import DraftTree, Node, TreeDrafter, tree_mask, verify_tree  # noqa: E402
from train_eagle import target_features, unroll  # noqa: E402


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(str(model_path("tiny-py-target")), dtype=torch.float32,
                                                local_files_only=True).eval()


@pytest.fixture(scope="module")
def sequence(target):
    """A prompt of held-out-like code and the target's own greedy continuation, with its features."""
    from mini_vllm.course.tiny_models import load_tiny_tokenizer
    tok = load_tiny_tokenizer()
    prompt = torch.tensor(tok.encode("import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n"))
    seq = target.generate(prompt[None], max_new_tokens=40, do_sample=False,
                          pad_token_id=target.config.pad_token_id)[0]
    feats, _ = target_features(target, seq[None])
    return len(prompt), seq, feats[0]


def _tree() -> DraftTree:
    """root -> a(7) -> c(9), root -> b(8) -> d(9) -> e(3): two branches, equal tokens at depth 2."""
    nodes = [Node(7, -1, 1, 0.6), Node(8, -1, 1, 0.3), Node(9, 0, 2, 0.5), Node(9, 1, 2, 0.2), Node(3, 3, 3, 0.1)]
    for i, n in enumerate(nodes):
        if n.parent >= 0:
            nodes[n.parent].children.append(i)
    return DraftTree(nodes)


def test_tree_mask_sees_the_context_the_root_and_the_path_only():
    m = tree_mask(_tree(), context=2)
    want = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0],      # root
                         [1, 1, 1, 1, 0, 0, 0, 0],      # a
                         [1, 1, 1, 0, 1, 0, 0, 0],      # b
                         [1, 1, 1, 1, 0, 1, 0, 0],      # c: a, itself
                         [1, 1, 1, 0, 1, 0, 1, 0],      # d: b, itself
                         [1, 1, 1, 0, 1, 0, 1, 1]], dtype=torch.bool)  # e: b, d, itself
    assert torch.equal(m, want), f"a node must see the context, the root, its ancestors and itself only:\n{m.int()}"


def test_acceptance_walks_the_branch_the_target_takes():
    t = _tree()
    assert t.accepted([8, 9, 3, 5]) == 3, "the target's tokens 8, 9, 3 follow branch b -> d -> e"
    assert t.accepted([7, 9, 3]) == 2, "branch a -> c matches 7, 9; c has no child 3"
    assert t.accepted([9]) == 0, "9 is not a child of the root"
    assert t.path(4) == [1, 3, 4]


def test_one_forward_with_tree_attention_gives_each_paths_causal_logits(target, sequence):
    n0, seq, _ = sequence
    context, root = seq[:n0], int(seq[n0])
    tree = _tree()
    got = verify_tree(target, context, root, tree)
    for row, i in [(0, None)] + [(1 + i, i) for i in range(len(tree.nodes))]:
        path = [] if i is None else [tree.nodes[j].token for j in tree.path(i)]
        ids = torch.cat([context, torch.tensor([root] + path)])
        want = target(input_ids=ids[None]).logits[0, -1]
        torch.testing.assert_close(got[row], want, atol=1e-4, rtol=1e-4, msg=lambda m: (
            f"node {i}: tree attention's logits differ from a causal forward over its path (a sibling seen, "
            f"or a position not by depth): {m}"))


def test_a_top1_tree_is_the_engines_chain(target, sequence):
    n0, seq, feats = sequence
    head = load_head(model_path("tiny-py-eagle"))
    embed = target.model.embed_tokens.weight
    k = 3
    T = len(seq) - k - 1
    outs = unroll(head, embed, seq[None], feats[None], T, k)
    chain = torch.stack([(g @ embed.T).argmax(-1)[0] for g in outs])  # [k, T]: the drafts after each t
    drafter = TreeDrafter(head, embed, seq, feats)
    deep = 0
    for t in range(n0 - 1, T):
        tree = drafter.draft(t, depth=k, top_k=1, budget=k)
        mine, theirs = [n.token for n in tree.nodes], chain[:, t].tolist()
        # unroll feeds the true continuation (teacher forcing), the drafter its own drafts: the
        # two chains read the same tokens up to the first draft that misses, and must agree there
        accepted = tree.accepted(seq[t + 2:].tolist())
        upto = min(k, accepted + 1)
        deep += upto == k
        assert mine[:upto] == theirs[:upto], (
            f"start {t}: a top-1 tree must draft the chain's tokens up to its first miss, got {mine} against "
            f"{theirs} (the shift, or the head's own output fed back, differs from the chain's)")
        assert [n.depth for n in tree.nodes] == list(range(1, k + 1))
        for d, g in drafter.expanded:  # the head's output at depth d read the same inputs while d <= accepted
            if d <= accepted:
                torch.testing.assert_close(g, outs[d][0, t], atol=1e-5, rtol=1e-5, msg=lambda m: (
                    f"start {t}, depth {d}: the head's output differs from the chain's (a query at the wrong "
                    f"position, or attending to the wrong keys): {m}"))
    assert deep >= 3, f"only {deep} starts compare all {k} drafts: too few to check the later steps"


def test_reranked_trees_are_trees_within_budget(target, sequence):
    n0, seq, feats = sequence
    head = load_head(model_path("tiny-py-eagle"))
    drafter = TreeDrafter(head, target.model.embed_tokens.weight, seq, feats)
    for t in range(n0 - 1, n0 + 8):
        tree = drafter.draft(t, depth=4, top_k=3, budget=7)
        assert len(tree.nodes) == 7
        for i, n in enumerate(tree.nodes):
            assert n.parent < i, "parents must come before children"
            assert n.parent == -1 and n.depth == 1 or tree.nodes[n.parent].depth == n.depth - 1
            assert n.parent == -1 or tree.nodes[n.parent].value >= n.value
        assert len({(n.parent, n.token) for n in tree.nodes}) == len(tree.nodes), "two siblings share a token"
