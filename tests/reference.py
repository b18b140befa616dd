"""NumPy references of the lazy rules, written loop by loop in float64 for clarity: Adam, and its variants."""

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


class LazyVariantReference:
    """One parameter of shape ``(rows, ...)`` trained by one lazy rule; entries are (row, value) pairs.

    ``rule`` is one of ``"adamw"``, ``"adamw_catch_up"``, ``"amsgrad"``,
    ``"rowwise_adam"``, ``"rowwise_adam_per_row"``, ``"rowwise_adagrad"``,
    ``"rowwise_adagrad_decoupled"``. A row index out of range is padding.
    ``"adamw_catch_up"`` is dense AdamW on every row (zeros where no
    gradient is), of which ``p`` shows a row as of the last step that
    touched it: the rows the optimizer stores.
    """

    def __init__(
        self,
        param: np.ndarray,
        rule: str,
        lr: float,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
    ) -> None:
        self.p = np.array(param, dtype=np.float64)
        self.rule, self.lr, self.b1, self.b2, self.eps, self.wd = rule, lr, b1, b2, eps, weight_decay
        n = self.p.shape[0]
        self.m = np.zeros_like(self.p)
        self.v = np.zeros_like(self.p)
        self.v_max = np.zeros_like(self.p)
        self.row_v = np.zeros(n)
        self.acc = np.full(n, initial_accumulator_value, np.float64)
        self.row_count = np.zeros(n, np.int64)
        self.last = np.zeros(n, np.int64)
        self.dense = self.p.copy()
        self.t = 0

    def step(self, rows: list[int], values: list[np.ndarray]) -> None:
        self.t += 1
        t = self.t
        summed: dict[int, np.ndarray] = {}
        for r, value in zip(rows, values, strict=True):
            if 0 <= r < self.p.shape[0]:
                summed[r] = summed.get(r, 0.0) + np.asarray(value, np.float64)
        b1, b2, eps, lr, wd = self.b1, self.b2, self.eps, self.lr, self.wd
        if self.rule == "adamw_catch_up":
            full = np.zeros_like(self.dense)
            for r, g in summed.items():
                full[r] = g
            self.m = b1 * self.m + (1 - b1) * full
            self.v = b2 * self.v + (1 - b2) * full * full
            u = (self.m / (1 - b1**t)) / (np.sqrt(self.v / (1 - b2**t)) + eps)
            self.dense = self.dense - lr * (u + wd * self.dense)
            for r in summed:
                self.p[r] = self.dense[r]
            return
        for r, g in summed.items():
            if self.rule.startswith("rowwise_adagrad"):
                if self.rule == "rowwise_adagrad":
                    g = g + wd * self.p[r]
                self.acc[r] += np.mean(g * g)
                u = g / (np.sqrt(self.acc[r]) + eps)
                if self.rule == "rowwise_adagrad_decoupled":
                    u = u + wd * self.p[r]
                self.p[r] = self.p[r] - lr * u
                continue
            self.m[r] = b1 * self.m[r] + (1 - b1) * g
            if self.rule.startswith("rowwise_adam"):
                self.row_v[r] = b2 * self.row_v[r] + (1 - b2) * np.mean(g * g)
                self.row_count[r] += 1
                tr = self.row_count[r] if self.rule == "rowwise_adam_per_row" else t
                u = (self.m[r] / (1 - b1**tr)) / (np.sqrt(self.row_v[r] / (1 - b2**tr)) + eps)
                self.p[r] = self.p[r] - lr * u
                continue
            self.v[r] = b2 * self.v[r] + (1 - b2) * g * g
            if self.rule == "amsgrad":
                self.v_max[r] = np.maximum(self.v_max[r], self.v[r] / (1 - b2**t))
                u = (self.m[r] / (1 - b1**t)) / (np.sqrt(self.v_max[r]) + eps)
                self.p[r] = self.p[r] - lr * u
                continue
            u = (self.m[r] / (1 - b1**t)) / (np.sqrt(self.v[r] / (1 - b2**t)) + eps)
            self.p[r] = self.p[r] - lr * (u + wd * self.p[r])
