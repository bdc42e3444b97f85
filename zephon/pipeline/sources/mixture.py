"""mixture: components interleaved by a deterministic schedule.

The schedule (:class:`~zephon.options.MixtureReadConfig`) is smooth weighted
round-robin or seeded weighted random; every component sample appears once per
epoch. A mixture of file sources (Parquet, WebDataset, ...) checkpoints and
restores like any source: the schedule is a pure function of the component
lengths, weights and config.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.pipeline.sources.base import Source

__all__ = ["MixtureSource"]


class MixtureSource(Source):
    def __init__(self, components: Mapping[str, Source], weights: Mapping[str, float] | None,
                 config, name: str) -> None:
        from zephon.options import MixtureReadConfig

        if not components:
            raise ZephonConfigError("mixture: at least one component is needed")
        self.names = list(components)
        self.components = [components[k] for k in self.names]
        weights = weights or {k: 1.0 for k in self.names}
        unknown = set(weights) - set(self.names)
        if unknown or set(self.names) - set(weights):
            raise ZephonConfigError(f"mixture: weights must name exactly the components "
                                    f"{self.names}, got {sorted(weights)}")
        self.weights = np.array([float(weights[k]) for k in self.names])
        if not np.all(np.isfinite(self.weights)) or np.any(self.weights <= 0):
            raise ZephonConfigError(f"mixture: weights must be positive, got {dict(weights)}")
        self.own_config = config is not None  # else RuntimeOptions.mixture_config applies
        self.config, self.name = config or MixtureReadConfig(), name
        self.comp, self.comp_index = self._schedule()

    def configured(self, opts) -> "Source":
        components = {n: c.configured(opts) for n, c in zip(self.names, self.components, strict=True)}
        changed = any(a is not b for a, b in zip(components.values(), self.components, strict=True))
        if self.own_config or opts.mixture_config is None or \
                opts.mixture_config == self.config:
            if not changed:
                return self
            clone = copy.copy(self)
            clone.components = list(components.values())
            return clone
        weights = dict(zip(self.names, self.weights.tolist(), strict=True))
        return MixtureSource(components, weights, opts.mixture_config, self.name)

    def _schedule(self) -> tuple[np.ndarray, np.ndarray]:
        sizes = np.array([len(c) for c in self.components], dtype=np.int64)
        total = int(sizes.sum())
        comp = np.empty(total, dtype=np.int32)
        left = sizes.copy()
        w = self.weights / self.weights.sum()
        rng = np.random.default_rng(self.config.seed)
        credit = np.zeros(len(sizes))
        for i in range(total):
            live = left > 0
            if self.config.mode == "weighted_random":
                p = np.where(live, w, 0.0)
                k = int(rng.choice(len(sizes), p=p / p.sum()))
            else:  # smooth weighted round robin over the components that have samples left
                credit[live] += w[live]
                k = int(np.argmax(np.where(live, credit, -np.inf)))
                credit[k] -= w[live].sum()
            comp[i] = k
            left[k] -= 1
        index = np.empty(total, dtype=np.int64)
        for k, size in enumerate(sizes):
            order = np.arange(size)
            if self.config.within_component == "shuffle":
                order = np.random.default_rng([self.config.seed, k]).permutation(size)
            index[comp == k] = order
        return comp, index

    def __len__(self) -> int:
        return len(self.comp)

    def get(self, i: int) -> Any:
        return self.components[self.comp[i]].get(int(self.comp_index[i]))

    def identity(self, i: int) -> tuple[str, int]:
        return self.names[self.comp[i]], int(self.comp_index[i])

    def describe(self) -> str:
        parts = ", ".join(f"{n}: {c.describe()} x{w:g}" for n, c, w in
                          zip(self.names, self.components, self.weights, strict=True))
        return f"MixtureSource({parts}; {self.config.to_dict()})"


