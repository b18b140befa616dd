"""bfloat16 embedding tables: stochastic rounding tracks float32 training where round-to-nearest stalls.

A matrix-factorization model (Zipf-distributed user and item ids, targets from
a hidden low-rank model plus noise) is trained three times with the same
batches and ``sparse_rowwise_adam`` (moments in float32), each step one
``osa.update_and_apply``: with float32 tables, with bfloat16 tables rounded to
nearest, and with bfloat16 tables rounded stochastically (``key=``, as
``osa.apply_updates_stochastic`` rounds). Adam's steps (about the learning
rate) are smaller than half of bfloat16's spacing near the embeddings' values,
so round-to-nearest drops most of them.

    python examples/bf16_stochastic_rounding.py            # 3,000 steps, writes the PNG and JSON next to this file
    python examples/bf16_stochastic_rounding.py --steps 100 --out /tmp/x.png --json /tmp/x.json
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import subprocess
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import optax_sparse_adam as osa

USERS, ITEMS, WIDTH, BATCH, LR = 5000, 1000, 16, 512, 2e-3


def data(steps: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    true_u = rng.standard_normal((USERS, WIDTH)) / WIDTH**0.25
    true_i = rng.standard_normal((ITEMS, WIDTH)) / WIDTH**0.25
    users = (rng.zipf(1.3, size=(steps, BATCH)) - 1) % USERS
    items = (rng.zipf(1.3, size=(steps, BATCH)) - 1) % ITEMS
    y = np.sum(true_u[users] * true_i[items], axis=-1) + 0.1 * rng.standard_normal((steps, BATCH))
    return users.astype(np.int32), items.astype(np.int32), y.astype(np.float32)


def loss_fn(params: Any, ids: Any, y: jax.Array) -> jax.Array:
    users, items = ids
    pred = jnp.sum(params["users"][users].astype(jnp.float32) * params["items"][items].astype(jnp.float32), axis=1)
    return jnp.mean((pred - y) ** 2)


def train(dtype: Any, stochastic: bool, steps: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    params = {
        "users": jnp.asarray(rng.standard_normal((USERS, WIDTH)) * 0.5, dtype),
        "items": jnp.asarray(rng.standard_normal((ITEMS, WIDTH)) * 0.5, dtype),
    }
    tx = osa.sparse_rowwise_adam(LR, mu_dtype=jnp.float32)
    state = tx.init(params)
    grad_fn = osa.value_and_row_grad(loss_fn, lambda p: (p["users"], p["items"]))
    keys = jax.random.split(jax.random.key(0), steps)  # a new key every step, split once

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params: Any, state: Any, users: Any, items: Any, y: Any, i: Any) -> Any:
        loss, grads = grad_fn(params, (users, items), y)
        key = keys[i] if stochastic else None
        params, state = osa.update_and_apply(tx, grads, state, params, key=key)
        return params, state, loss

    users, items, y = data(steps)
    losses = []
    for i in range(steps):
        params, state, loss = step(params, state, users[i], items[i], y[i], jnp.int32(i))
        losses.append(loss)
    return np.asarray(jax.device_get(losses))


def smooth(x: np.ndarray, n: int = 50) -> np.ndarray:
    n = max(1, min(n, len(x)))
    return np.convolve(x, np.ones(n) / n, mode="valid")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).with_suffix(".png"))
    parser.add_argument(
        "--json", type=pathlib.Path, default=pathlib.Path(__file__).with_suffix(".json"), help="the mean losses"
    )
    args = parser.parse_args()
    runs = {
        "float32": train(jnp.float32, False, args.steps),
        "bfloat16, round to nearest": train(jnp.bfloat16, False, args.steps),
        "bfloat16, stochastic rounding": train(jnp.bfloat16, True, args.steps),
    }
    tail = max(1, args.steps // 10)
    for name, losses in runs.items():
        print(f"{name:32s} loss: first {losses[:tail].mean():.4f}, last {tail} steps {losses[-tail:].mean():.4f}")
    git = functools.partial(
        subprocess.run, capture_output=True, text=True, check=False, cwd=pathlib.Path(__file__).parent
    )
    summary = {
        "steps": args.steps,
        "tail": tail,
        "commit": git(["git", "rev-parse", "HEAD"]).stdout.strip(),
        "modified": bool(git(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()),
        "runs": {n: {"first": float(x[:tail].mean()), "last": float(x[-tail:].mean())} for n, x in runs.items()},
    }
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.json}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, losses), style in zip(runs.items(), ["-", "-", "--"], strict=True):
        ax.plot(smooth(losses), style, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (moving mean of 50 steps)")
    ax.set_yscale("log")
    ax.set_title(f"sparse_rowwise_adam, lr {LR}: {USERS} x {WIDTH} and {ITEMS} x {WIDTH} tables")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
