"""Trains a small recommender with ``sparse_adam`` next to ``optax.adam``.

A rating model: a user table and an item table (1,000,000 rows each), the two
looked-up rows fed to a small MLP. Ids follow a Zipf law, as in real
recommendation logs. Both optimizers start from the same parameters and see
the same batches; the demo prints both losses and the median step time.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_sparse_adam as osa

# The test suite runs the demo small through these variables.
NUM_ROWS = int(os.environ.get("DEMO_ROWS", 1_000_000))
STEPS = int(os.environ.get("DEMO_STEPS", 100))
DIM, HIDDEN, BATCH = 32, 64, 4096


def make_data(rng: np.random.Generator):
    """Ratings from hidden user and item factors; ids drawn from Zipf(1.1)."""
    true_u = rng.standard_normal((NUM_ROWS, 4)).astype(np.float32)
    true_i = rng.standard_normal((NUM_ROWS, 4)).astype(np.float32)

    def batch():
        users = ((rng.zipf(1.1, BATCH) - 1) % NUM_ROWS).astype(np.int32)
        items = ((rng.zipf(1.1, BATCH) - 1) % NUM_ROWS).astype(np.int32)
        ratings = np.sum(true_u[users] * true_i[items], axis=1).astype(np.float32)
        return jnp.asarray(users), jnp.asarray(items), jnp.asarray(ratings)

    return batch


def init_params(key: jax.Array):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {
        "users": 0.1 * jax.random.normal(k1, (NUM_ROWS, DIM), jnp.float32),
        "items": 0.1 * jax.random.normal(k2, (NUM_ROWS, DIM), jnp.float32),
        "mlp": {
            "w1": jax.random.normal(k3, (2 * DIM, HIDDEN), jnp.float32) / np.sqrt(2 * DIM),
            "b1": jnp.zeros((HIDDEN,), jnp.float32),
            "w2": jax.random.normal(k4, (HIDDEN, 1), jnp.float32) / np.sqrt(HIDDEN),
        },
    }


def predict(mlp, user_rows, item_rows):
    h = jax.nn.relu(jnp.concatenate([user_rows, item_rows], axis=1) @ mlp["w1"] + mlp["b1"])
    return (h @ mlp["w2"])[:, 0]


def loss_from_rows(mlp, user_rows, item_rows, ratings):
    return jnp.mean((predict(mlp, user_rows, item_rows) - ratings) ** 2)


def dense_loss(params, users, items, ratings):
    return loss_from_rows(params["mlp"], params["users"][users], params["items"][items], ratings)


adam = optax.adam(1e-2)
sparse = osa.sparse_adam(1e-2)


def _adam_step(params, state, users, items, ratings):
    loss, grads = jax.value_and_grad(dense_loss)(params, users, items, ratings)
    updates, state = adam.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def _sparse_step(params, state, users, items, ratings):
    # Differentiate with respect to the looked-up rows, not the whole tables.
    user_rows, item_rows = params["users"][users], params["items"][items]
    loss, (g_mlp, g_users, g_items) = jax.value_and_grad(loss_from_rows, argnums=(0, 1, 2))(
        params["mlp"], user_rows, item_rows, ratings
    )
    grads = {
        "users": osa.IndexedRows(users, g_users, NUM_ROWS),
        "items": osa.IndexedRows(items, g_items, NUM_ROWS),
        "mlp": g_mlp,
    }
    # tx.update followed by osa.apply_updates, in one pass over each touched row.
    params, state = osa.update_and_apply(sparse, grads, state, params)
    return params, state, loss


# Donating params and state lets XLA update the tables in place.
adam_step = jax.jit(_adam_step, donate_argnums=(0, 1))
sparse_step = jax.jit(_sparse_step, donate_argnums=(0, 1))


def main() -> None:
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; tables 2 x {NUM_ROWS:,} x {DIM}, batch {BATCH}")
    batch = make_data(np.random.default_rng(0))
    params = init_params(jax.random.key(0))
    runs = {
        "optax.adam": [adam_step, jax.tree.map(jnp.copy, params), None, []],
        "sparse_adam": [sparse_step, params, None, []],
    }
    runs["optax.adam"][2] = adam.init(runs["optax.adam"][1])
    runs["sparse_adam"][2] = sparse.init(runs["sparse_adam"][1])
    print(f"{'step':>5} {'optax.adam loss':>16} {'sparse_adam loss':>17}")
    for step in range(1, STEPS + 1):
        data = batch()
        losses = []
        for run in runs.values():
            fn, p, s, times = run
            t0 = time.perf_counter()
            p, s, loss = fn(p, s, *data)
            loss = float(loss)  # waits for the step
            times.append(time.perf_counter() - t0)
            run[1], run[2] = p, s
            losses.append(loss)
        if step == 1 or step % 25 == 0:
            print(f"{step:5d} {losses[0]:16.4f} {losses[1]:17.4f}")
    med = {name: 1e3 * float(np.median(run[3][5:])) for name, run in runs.items()}
    print(
        f"median step time: optax.adam {med['optax.adam']:.2f} ms, sparse_adam {med['sparse_adam']:.2f} ms "
        f"({med['optax.adam'] / med['sparse_adam']:.1f}x faster)"
    )


if __name__ == "__main__":
    main()
