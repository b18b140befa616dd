"""NumPy references of the lazy optimizer variants, row by row in float64, written for clarity."""

from __future__ import annotations

import numpy as np


class LazyVariantReference:
    """One parameter of shape ``(rows, ...)`` trained by one lazy rule; entries are (row, value) pairs.

    ``rule`` is one of ``"adamw"``, ``"adamw_catch_up"``, ``"amsgrad"``,
    ``"rowwise_adam"``, ``"rowwise_adam_per_row"``, ``"rowwise_adagrad"``,
    ``"rowwise_adagrad_decoupled"``. A row index out of range is padding.
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
        self.t = 0

    def step(self, rows: list[int], values: list[np.ndarray]) -> None:
        self.t += 1
        t = self.t
        summed: dict[int, np.ndarray] = {}
        for r, value in zip(rows, values, strict=True):
            if 0 <= r < self.p.shape[0]:
                summed[r] = summed.get(r, 0.0) + np.asarray(value, np.float64)
        b1, b2, eps, lr, wd = self.b1, self.b2, self.eps, self.lr, self.wd
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
            if self.rule == "adamw_catch_up":
                self.p[r] = self.p[r] * (1 - lr * wd) ** (t - self.last[r] - 1)
                self.last[r] = t
            self.p[r] = self.p[r] - lr * (u + wd * self.p[r])
