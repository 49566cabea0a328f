"""routing_disagreement: per position and MoE layer, whether the router's own top-k set
differs from the recorded one (hand-worked; order within a layer's k does not matter)."""

from __future__ import annotations

import torch

from rltool.training.recompute import routing_disagreement


def test_sets_are_compared_per_layer_and_unrouted_rows_never_differ():
    recorded = torch.tensor(
        [
            [[0, 1], [2, 3]],  # same sets, other order below: no disagreement
            [[0, 1], [2, 3]],  # layer 1 differs
            [[4, 5], [6, 7]],  # both layers differ
            [[-1, -1], [-1, -1]],  # never fed: never differs
        ]
    )  # [N=4, L=2, k=2]
    own = torch.tensor(
        [
            [[1, 0], [3, 2]],
            [[0, 1], [2, 4]],
            [[4, 6], [0, 7]],
            [[0, 1], [2, 3]],
        ]
    )
    got = routing_disagreement(own, recorded)
    assert got.tolist() == [[False, False], [False, True], [True, True], [False, False]]
