"""Helpers for the compiled-path tests: a recording backend and small decode batches."""

import torch

from graphplan.models.tiny_llama import make_batch


def batch(model, n):
    """One decode token for each of ``n`` requests (cache rows 0-7)."""
    return make_batch(model, [(row % 8, 3 + row, [1 + 5 * row]) for row in range(n)])


class Recording:
    """A backend that keeps the graphs it is given and runs them as they are. ``whole_only``:
    refuse the graphs of regions (runtime/compiled/regions.py names their inputs ``input_i``)."""

    def __init__(self, whole_only=False):
        self.graphs = []
        self.whole_only = whole_only

    def __call__(self, gm, example_inputs):
        if self.whole_only and any(n.name.startswith("input_") for n in gm.graph.nodes):
            raise RuntimeError("this backend takes whole graphs only")
        self.graphs.append(gm)
        return gm.forward

    def linears(self) -> int:
        return sum(
            n.op == "call_function" and n.target is torch._C._nn.linear
            for gm in self.graphs
            for n in gm.graph.nodes
        )
