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

``--compare`` trains the tables three ways instead, from the same initial
parameters on the same batches, Adam on the MLPs each time: dense
``optax.adam`` (table-sized gradients; every row and both moments of it
rewritten each step), lazy ``sparse_adam`` (only the rows a batch touches),
and ``sparse_adam(catch_up=True)`` (lazy, but each row first takes the
steps dense Adam gave it while no batch touched it, and the loss reads the
rows so), and prints their training and held-out losses and step times side
by side. The held-out batches are drawn from the same generator, not trained
on; the catch-up run is brought up to the current step (``osa.catch_up``)
before each evaluation.

    python examples/dlrm.py                      # 1,000,000-row cap, 300 steps
    python examples/dlrm.py --max-rows 20000 --steps 60 --multi-hot
    python examples/dlrm.py --compare --max-rows 100000 --steps 600 --json benchmarks/results/dlrm_catch_up.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
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
    parser.add_argument("--compare", action="store_true", help="dense Adam, lazy Adam and catch-up Adam on the tables")
    parser.add_argument("--table-lr", type=float, default=0.01, help="the tables' Adam learning rate (--compare)")
    parser.add_argument("--json", type=pathlib.Path, help="with --compare: write the losses and step times here")
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
    pairs = np.triu_indices(num_vectors, k=1)

    def loss_fn(p, bags, dense, labels):
        pooled = coll.pool(p["emb"], bags)
        x = mlp(p["bottom"], dense, final_relu=True)
        vectors = jnp.stack([x, *(pooled[n] for n in names)], axis=1)  # (batch, 27, width)
        dots = jnp.einsum("bid,bjd->bij", vectors, vectors)[:, pairs[0], pairs[1]]
        logits = mlp(p["top"], jnp.concatenate([x, dots], axis=1), final_relu=False)[:, 0]
        return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

    draw = make_data(rows, bag_sizes, args.batch, seed=1)
    print(
        f"DLRM on generated Criteo-shaped data: 26 tables ({sum(rows):,} rows, width {args.width}, one stack), "
        f"{'DLRMv2 multi-hot bags' if args.multi_hot else 'one id a feature'}, batch {args.batch}"
    )
    if args.compare:
        compare(args, coll, params, loss_fn, draw)
        return
    tx = osa.partition_tables(osa.sparse_rowwise_adagrad(0.05), optax.adam(1e-3), lambda p: p["emb"])
    state = tx.init(params)
    osa.advise_huge_pages((params, state))  # tables on 2 MiB pages (Linux): no page walk for each row a step touches

    @jax.jit(donate_argnums=(0, 1))
    def step(p, s, ids, dense, labels):
        bags = coll.bags(ids)
        loss, grads = osa.value_and_row_grad(loss_fn, lambda q: q["emb"])(p, bags, dense, labels)
        p, s = osa.update_and_apply(tx, grads, s, p)
        return p, s, loss

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


def compare(args, coll, params, loss_fn, draw) -> None:
    """Dense, lazy and catch-up Adam on the tables (Adam on the MLPs), on the same batches; losses and step times."""
    lr = args.table_lr
    tables = lambda p: p["emb"]  # noqa: E731
    lazy_tables, caught_tables = osa.sparse_adam(lr), osa.sparse_adam(lr, catch_up=True)
    row_grads = osa.value_and_row_grad(loss_fn, tables)
    caught_grads = osa.value_and_row_grad(loss_fn, tables, catch_up=caught_tables)

    def dense_step(p, s, ids, dense, labels):
        loss, grads = jax.value_and_grad(loss_fn)(p, coll.bags(ids), dense, labels)  # table-sized gradients
        return (*osa.update_and_apply(runs["optax.adam"][0], grads, s, p), loss)

    def lazy_step(p, s, ids, dense, labels):
        loss, grads = row_grads(p, coll.bags(ids), dense, labels)
        return (*osa.update_and_apply(runs["sparse_adam"][0], grads, s, p), loss)

    def caught_step(p, s, ids, dense, labels):
        loss, grads = caught_grads(p, coll.bags(ids), dense, labels, opt_state=s)  # rows as dense Adam holds them
        return (*osa.update_and_apply(runs["sparse_adam(catch_up=True)"][0], grads, s, p), loss)

    runs = {
        name: (osa.partition_tables(tables_tx, optax.adam(1e-3), tables), jax.jit(step, donate_argnums=(0, 1)))
        for name, tables_tx, step in [
            ("optax.adam", optax.adam(lr), dense_step),
            ("sparse_adam", lazy_tables, lazy_step),
            ("sparse_adam(catch_up=True)", caught_tables, caught_step),
        ]
    }
    held_out = [draw() for _ in range(8)]  # drawn before any training batch, never trained on
    evaluate = jax.jit(lambda p, ids, dense, labels: loss_fn(p, coll.bags(ids), dense, labels))
    bring_up_to_date = jax.jit(lambda p, s: osa.catch_up(caught_tables, p, s), donate_argnums=(0, 1))
    state = {name: [jax.tree.map(jnp.copy, params), tx.init(params)] for name, (tx, _) in runs.items()}
    losses = {name: [] for name in runs}
    times = {name: [] for name in runs}
    record = {name: {"step": [], "train": [], "held_out": []} for name in runs}
    every = max(1, args.steps // 6)
    print(f"tables: Adam at lr {args.table_lr} three ways; MLPs: optax.adam at 1e-3; {len(held_out)} held-out batches")
    print("  step   " + "   ".join(f"{n + ' train / held-out':>38}" for n in runs))
    for i in range(1, args.steps + 1):
        dense, ids, labels = draw()
        for name, (_, step) in runs.items():
            t0 = time.perf_counter()
            state[name][0], state[name][1], loss = step(*state[name], ids, dense, labels)
            losses[name].append(float(loss))  # waits for the step
            times[name].append(time.perf_counter() - t0)
        if i % every == 0 or i == args.steps:
            cells = []
            for name in runs:
                if name == "sparse_adam(catch_up=True)":  # every row up to this step before evaluating
                    state[name] = list(bring_up_to_date(*state[name]))
                held = np.mean([float(evaluate(state[name][0], ids, dense, labels)) for dense, ids, labels in held_out])
                train = float(np.mean(losses[name][-every:]))
                cells.append(f"{train:.4f} / {held:.4f}")
                record[name]["step"].append(i)
                record[name]["train"].append(train)
                record[name]["held_out"].append(float(held))
            print(f"  {i:4d}   " + "   ".join(f"{c:>38}" for c in cells))
    start = len(next(iter(times.values()))) // 5
    print("median step time: " + ", ".join(f"{n} {1e3 * np.median(t[start:]):.1f} ms" for n, t in times.items()))
    if args.json:
        for name, t in times.items():
            record[name]["median_step_ms"] = 1e3 * float(np.median(t[start:]))
        machine = {
            "commit": _commit(),
            "cores": os.cpu_count(),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "load_average_end": os.getloadavg(),
        }
        settings = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}
        doc = {"machine": machine, "settings": settings, "held_out_batches": len(held_out), "runs": record}
        doc["table_rows"] = sum(int(x.shape[0]) for x in jax.tree.leaves(params["emb"]))
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


def _commit() -> str:
    """The commit of the checkout this runs from, ``-dirty`` where it has changes; "unknown" outside one."""
    here = pathlib.Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    main()
