"""Lists with holes: gradients of unused variables are None, collectives take tensors."""

from __future__ import annotations

from collections.abc import Sequence


class Holes:
    """A list with None entries (gradients of unused variables), split for collectives and
    control flow, which take tensors only: `values` are the present entries, `refill(values)`
    puts (transformed) values back in their places."""

    def __init__(self, items: Sequence):
        self.size = len(items)
        self.present = [i for i, x in enumerate(items) if x is not None]
        self.values = [items[i] for i in self.present]

    def refill(self, values: Sequence) -> list:
        out: list = [None] * self.size
        for i, v in zip(self.present, values):
            out[i] = v
        return out
