"""EAGLE-2 dynamic draft trees, in plain PyTorch: the drafting, and tree attention in the target.

The engine drafts a chain (`05_mini_vllm/spec_decode/engine/eagle.py`): k tokens, each the head's argmax
after the one before. EAGLE-2 (Li et al., 2024; seed 002 section 9.2.3) drafts a tree instead and
lets the target verify every branch in one forward:

* **Expand.** Start from the root (the token the target just produced). For depth 1..D, take
  the `top_k` nodes of the current depth with the highest *value* (the product of the head's
  probabilities along the path from the root, its estimate that the whole path is accepted),
  run the head once over all of them, and give each its `top_k` most likely next tokens as
  children. The head's query for a node at depth d sits at position t + d and attends to the
  context and to the node's own ancestors only (the tree mask).
* **Rerank.** Of every node drafted, keep the `budget` with the highest value. A child's value
  never exceeds its parent's, so (ties going to the shallower node) the kept nodes form a tree.
* **Verify.** The target reads the root and the kept nodes in one forward, each node at position
  t + depth, attending to the context, its ancestors and itself (`tree_mask`); its logits at a
  node are those of a causal forward over the path to that node (`verify_tree`, checked against
  exactly that in `tests/test_eagle_tree.py`).
* **Accept (greedy).** Walk from the root: while a kept child carries the target's argmax at the
  current node, step into it. The tokens emitted are the path's and the target's token at its end.

A chain is the tree with top_k = 1 and budget = depth = k, and drafts what the engine drafts.
This module measures acceptance along the target's own greedy continuation, as
`train_eagle.evaluate_head` does for chains: with greedy verification a tree's accepted path is
the longest one matching the tokens the target would produce anyway.

vLLM counterpart: `vllm/v1/spec_decode/eagle.py` (`propose_tree`) and
`vllm/v1/attention/backends/tree_attn.py`, which draft and verify a *static* tree
(`speculative_token_tree`); EAGLE-2's tree is rebuilt at every step from the head's confidence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from eagle_head import EagleHead


@dataclass
class Node:
    token: int
    parent: int            # index into DraftTree.nodes; -1: a child of the root
    depth: int             # 1 for the root's children
    value: float           # product of the head's probabilities from the root to here
    children: list[int] = field(default_factory=list)


@dataclass
class DraftTree:
    nodes: list[Node]      # the kept nodes, parents before children

    def path(self, i: int) -> list[int]:
        """Node indices from depth 1 down to node i."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.nodes[i].parent
        return out[::-1]

    def accepted(self, continuation: list[int]) -> int:
        """How many drafts greedy verification accepts when the target's own next tokens
        are `continuation` (the token after the root first)."""
        level = [i for i, n in enumerate(self.nodes) if n.parent == -1]
        n = 0
        while n < len(continuation):
            hit = next((i for i in level if self.nodes[i].token == continuation[n]), None)
            if hit is None:
                break
            n += 1
            level = self.nodes[hit].children
        return n


def tree_mask(tree: DraftTree, context: int) -> torch.Tensor:
    """[1 + N, context + 1 + N] bool, True = may attend. Rows: the root, then the kept nodes;
    columns: the context, the root, the nodes. Every row sees the context and the root; a
    node also sees its ancestors and itself."""
    n = len(tree.nodes)
    mask = torch.zeros(1 + n, context + 1 + n, dtype=torch.bool)
    mask[:, : context + 1] = True
    for i in range(n):
        mask[1 + i, [context + 1 + j for j in tree.path(i)]] = True
    return mask


@torch.no_grad()
def verify_tree(target, context: torch.Tensor, root: int, tree: DraftTree) -> torch.Tensor:
    """The target's logits [1 + N, V] at the root and every kept node, in one forward with
    tree attention: positions by depth, the mask of `tree_mask` (a Hugging Face model takes a
    4-D float mask as given)."""
    n_ctx = len(context)
    ids = torch.cat([context, torch.tensor([root] + [nd.token for nd in tree.nodes])])
    pos = torch.cat([torch.arange(n_ctx + 1), torch.tensor([n_ctx + nd.depth for nd in tree.nodes])])
    causal = torch.ones(n_ctx, n_ctx, dtype=torch.bool).tril()
    allowed = torch.zeros(len(ids), len(ids), dtype=torch.bool)
    allowed[:n_ctx, :n_ctx] = causal
    allowed[n_ctx:] = tree_mask(tree, n_ctx)
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out = target(input_ids=ids[None], position_ids=pos[None], attention_mask=bias[None, None])
    return out.logits[0, n_ctx:]


class TreeDrafter:
    """EAGLE-2 drafting with the plain-PyTorch head over one sequence whose target features are
    known at every position (`feats` [L, H], `ids` [L]: the target's hidden states and tokens)."""

    def __init__(self, head: EagleHead, embed: torch.Tensor, ids: torch.Tensor, feats: torch.Tensor) -> None:
        self.head, self.embed = head, embed
        # (depth, head output) of every node the latest `draft` expanded, in order (for the tests)
        self.expanded: list[tuple[int, torch.Tensor]] = []
        L = len(ids)
        pos = torch.arange(L - 1)[None]
        # The context pass, causal, for every chain start at once: position p reads the token
        # at p + 1 and the target's feature at p (the shift), so g[p] drafts the token at p + 2.
        h0, q, self.k_ctx, self.v_ctx = head.qkv(F.embedding(ids[None, 1:], embed), feats[None, :L - 1], pos)
        self.g_ctx = head.finish(h0, q, self.k_ctx, self.v_ctx, torch.ones(L - 1, L - 1, dtype=torch.bool).tril())[0]

    def _children(self, g: torch.Tensor, top_k: int):
        probs = (g @ self.embed.T).softmax(-1)
        return probs.topk(top_k, dim=-1)

    @torch.no_grad()
    def draft(self, t: int, depth: int, top_k: int, budget: int) -> DraftTree:
        """The tree drafted after position t (the root is the token at t + 1)."""
        head = self.head
        nodes: list[Node] = []
        p, tok = self._children(self.g_ctx[t], top_k)
        nodes += [Node(int(x), -1, 1, float(v)) for v, x in zip(p, tok)]
        g_of: dict[int, torch.Tensor] = {}       # a node's head output, once expanded
        kv_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        frontier = list(range(len(nodes)))
        self.expanded = []
        for d in range(1, depth):
            chosen = sorted(frontier, key=lambda i: -nodes[i].value)[:top_k]
            # each chosen node's query at position t + d, over the context up to t and its path
            for i in chosen:
                nd = nodes[i]
                hidden = self.g_ctx[t] if nd.parent == -1 else g_of[nd.parent]
                h0, q, k, v = head.qkv(self.embed[nd.token][None, None], hidden[None, None],
                                       torch.tensor([[t + d]]))
                anc = DraftTree(nodes).path(i)[:-1]
                keys = torch.cat([self.k_ctx[:, : t + 1]] + [kv_of[a][0] for a in anc] + [k], 1)
                values = torch.cat([self.v_ctx[:, : t + 1]] + [kv_of[a][1] for a in anc] + [v], 1)
                kv_of[i] = (k, v)
                g_of[i] = head.finish(h0, q, keys, values, torch.ones(1, keys.shape[1], dtype=torch.bool))[0, 0]
                self.expanded.append((d, g_of[i]))
            frontier = []
            for i in chosen:
                p, tok = self._children(g_of[i], top_k)
                for v, x in zip(p, tok):
                    nodes.append(Node(int(x), i, d + 1, nodes[i].value * float(v)))
                    frontier.append(len(nodes) - 1)
        return self._rerank(nodes, budget)

    @staticmethod
    def _rerank(nodes: list[Node], budget: int) -> DraftTree:
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].value, nodes[i].depth, i))[:budget]
        keep = set(order)
        for i in order:  # a parent's value is never below its child's: every kept node's parent is kept
            assert nodes[i].parent == -1 or nodes[i].parent in keep, "rerank kept a node without its parent"
        order.sort(key=lambda i: (nodes[i].depth, i))  # parents before children
        new = {old: j for j, old in enumerate(order)}
        out = [Node(nodes[i].token, new.get(nodes[i].parent, -1), nodes[i].depth, nodes[i].value) for i in order]
        for j, nd in enumerate(out):
            if nd.parent >= 0:
                out[nd.parent].children.append(j)
        return DraftTree(out)
