"""Trains a DLRM (the MLPerf recommender's model) on generated Criteo-shaped data.

The data is generated, not downloaded: 26 categorical features with the
cardinalities of the Criteo Kaggle dataset (capped by ``--max-rows``), ids
drawn from a Zipf law over each table and scattered over its rows by a fixed
permutation, and 13 dense features drawn from a normal law. The label of an
example is drawn from a hidden logistic model: a random weight per id of each
feature (summed over a multi-hot bag) plus a linear term in the dense
features, so there is something to learn and the loss can fall below the
label entropy. ``--multi-hot`` gives each feature DLRMv2's bag sizes
(1 to 100 ids, pooled by sum) instead of one id.

The model: a bottom MLP on the dense features, the pooled embeddings of the
26 features (one :class:`optax_sparse_adam.EmbeddingCollection`: one stacked
table, one lookup per step), the dot-product interaction of the 27 vectors, a
top MLP, binary cross-entropy. Row-wise Adagrad trains the tables and Adam
the MLPs (:func:`optax_sparse_adam.partition_tables`), in one jitted,
donated step (:func:`optax_sparse_adam.update_and_apply`).

    python examples/dlrm.py                      # 1,000,000-row cap, 300 steps
    python examples/dlrm.py --max-rows 20000 --steps 60 --multi-hot
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_sparse_adam as osa

CARDINALITIES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
BAG_SIZES = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]  # DLRMv2
NUM_DENSE = 13


def make_data(rows: list[int], bag_sizes: list[int], batch: int, seed: int):
    """A function returning fresh batches ``(dense, ids per feature, labels)``, and the labels' base rate."""
    rng = np.random.default_rng(seed)
    perms = [rng.permutation(n).astype(np.int32) for n in rows]  # Zipf ranks scattered over each table
    true_w = [rng.normal(0.0, 1.0, n).astype(np.float32) for n in rows]
    true_dense = rng.normal(0.0, 0.5, NUM_DENSE).astype(np.float32)

    def draw():
        dense = rng.standard_normal((batch, NUM_DENSE)).astype(np.float32)
        ids, logit = {}, dense @ true_dense
        for f, (n, size) in enumerate(zip(rows, bag_sizes, strict=True)):
            x = perms[f][(rng.zipf(1.15, (batch, size)) - 1) % n]
            ids[f"f{f}"] = x
            logit = logit + true_w[f][x].sum(1) / np.sqrt(size)
        labels = (rng.random(batch) < 1.0 / (1.0 + np.exp(-logit / 2))).astype(np.float32)
        return dense, ids, labels

    return draw


def mlp_init(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b), jnp.float32) * np.sqrt(2.0 / a), "b": jnp.zeros((b,), jnp.float32)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp(layers: list[dict[str, jax.Array]], x: jax.Array, final_relu: bool) -> jax.Array:
    for i, layer in enumerate(layers):
        x = x @ layer["w"] + layer["b"]
        if i < len(layers) - 1 or final_relu:
            x = jax.nn.relu(x)
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-rows", type=int, default=1_000_000, help="cap on each table's rows")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--multi-hot", action="store_true", help="DLRMv2's bag sizes instead of one id a feature")
    args = parser.parse_args()

    rows = [min(n, args.max_rows) for n in CARDINALITIES]
    bag_sizes = BAG_SIZES if args.multi_hot else [1] * len(rows)
    names = [f"f{f}" for f in range(len(rows))]
    coll = osa.EmbeddingCollection(
        tables={n: osa.TableSpec(r, args.width) for n, r in zip(names, rows, strict=True)},
        features={n: osa.FeatureSpec(n, "sum") for n in names},
    )
    k_emb, k_bot, k_top = jax.random.split(jax.random.key(0), 3)
    num_vectors = len(names) + 1
    num_pairs = num_vectors * (num_vectors - 1) // 2
    params = {
        "emb": coll.init(k_emb),
        "bottom": mlp_init(k_bot, [NUM_DENSE, 64, args.width]),
        "top": mlp_init(k_top, [args.width + num_pairs, 64, 1]),
    }
    tx = osa.partition_tables(osa.sparse_rowwise_adagrad(0.05), optax.adam(1e-3), lambda p: p["emb"])
    state = tx.init(params)
    pairs = np.triu_indices(num_vectors, k=1)

    def loss_fn(p, bags, dense, labels):
        pooled = coll.pool(p["emb"], bags)
        x = mlp(p["bottom"], dense, final_relu=True)
        vectors = jnp.stack([x, *(pooled[n] for n in names)], axis=1)  # (batch, 27, width)
        dots = jnp.einsum("bid,bjd->bij", vectors, vectors)[:, pairs[0], pairs[1]]
        logits = mlp(p["top"], jnp.concatenate([x, dots], axis=1), final_relu=False)[:, 0]
        return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

    @jax.jit(donate_argnums=(0, 1))
    def step(p, s, ids, dense, labels):
        bags = coll.bags(ids)
        loss, grads = osa.value_and_row_grad(loss_fn, lambda q: q["emb"])(p, bags, dense, labels)
        p, s = osa.update_and_apply(tx, grads, s, p)
        return p, s, loss

    draw = make_data(rows, bag_sizes, args.batch, seed=1)
    print(
        f"DLRM on generated Criteo-shaped data: 26 tables ({sum(rows):,} rows, width {args.width}, one stack), "
        f"{'DLRMv2 multi-hot bags' if args.multi_hot else 'one id a feature'}, batch {args.batch}"
    )
    print("  step   train loss (mean of the last 20 steps)")
    losses, times = [], []
    for i in range(1, args.steps + 1):
        dense, ids, labels = draw()
        t0 = time.perf_counter()
        params, state, loss = step(params, state, ids, dense, labels)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t0)
        if i == 1 or i % max(1, args.steps // 5) == 0:
            print(f"  {i:4d}   {np.mean(losses[-20:]):.4f}")
    print(f"median step time {1e3 * np.median(times[len(times) // 5 :]):.1f} ms (including the host's batch transfer)")


if __name__ == "__main__":
    main()
