"""A NumPy reference of the lazy Adam rule, written loop by loop for clarity."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class LazyAdamReference:
    """Lazy Adam on one parameter, with sparse entries given as (key tuple, value) pairs.

    ``keys`` address the first ``len(key)`` axes of the parameter; a key with
    any component out of range is padding. Moments and parameters are kept in
    float64 and compared against float32 results with a tolerance.
    """

    def __init__(
        self,
        param: np.ndarray,
        lr: float,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float = 1e-8,
        eps_placement: str = "optax",
        maximize: bool = False,
        eps_root: float = 0.0,
        round_m: Callable[[np.ndarray], np.ndarray] = lambda m: m,
    ) -> None:
        self.p = np.array(param, dtype=np.float64)
        self.m = np.zeros_like(self.p)
        self.v = np.zeros_like(self.p)
        self.t = 0
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
        self.eps_placement, self.maximize = eps_placement, maximize
        self.eps_root, self.round_m = eps_root, round_m  # round_m: the first moment's storage dtype

    def step(self, keys: list[tuple[int, ...]], values: list[np.ndarray]) -> None:
        self.t += 1
        summed: dict[tuple[int, ...], np.ndarray] = {}
        for key, value in zip(keys, values, strict=True):
            if all(0 <= c < n for c, n in zip(key, self.p.shape, strict=False)):
                summed[key] = summed.get(key, 0.0) + np.asarray(value, np.float64)
        bc1, bc2 = 1 - self.b1**self.t, 1 - self.b2**self.t
        for key, g in summed.items():
            if self.maximize:
                g = -g
            self.m[key] = self.round_m(self.b1 * self.m[key] + (1 - self.b1) * g)
            self.v[key] = self.b2 * self.v[key] + (1 - self.b2) * g * g
            if self.eps_placement == "optax":
                u = (self.m[key] / bc1) / (np.sqrt(self.v[key] / bc2 + self.eps_root) + self.eps)
            else:
                u = np.sqrt(bc2) / bc1 * self.m[key] / (np.sqrt(self.v[key] + self.eps_root) + self.eps)
            self.p[key] = self.p[key] - self.lr * u
