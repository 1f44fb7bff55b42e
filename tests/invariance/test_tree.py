"""The gradient tree in one process: each micro-batch's gradient a leaf, the sum the fixed pairwise tree, bit for bit
(signs of zero included), whether a right child is copied first or added straight into its left sibling."""

import pytest
import torch

from lightning_determinism.invariance.tree import GradientTree, tree_sum


def bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int32).tolist()


@pytest.mark.parametrize("leaves", [1, 2, 4, 8])
def test_the_tree_is_the_pairwise_sum_of_its_leaves_bit_for_bit(leaves):
    gen = torch.Generator().manual_seed(leaves)
    params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(2, 3))]
    tree = GradientTree(params, leaves=leaves)
    taken = []
    for leaf in range(leaves):
        grads = []
        for i, p in enumerate(params):
            if (leaf + i) % 3 == 2:  # a parameter this micro-batch did not use: no gradient
                p.grad = None
                grads.append(torch.zeros_like(p).reshape(-1))
                continue
            g = torch.randn(p.shape, generator=gen) * 1e-3
            g.view(-1)[0] = -0.0  # -0.0 + (+0.0) is +0.0: a skipped addition would keep the sign
            p.grad = g.clone()
            grads.append(g.reshape(-1))
        taken.append(torch.cat(grads))
        tree.add_leaf()
    tree.finish(divide_by=1)
    assert bits(torch.cat([p.grad.reshape(-1) for p in params])) == bits(tree_sum(taken))
