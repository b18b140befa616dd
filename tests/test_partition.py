"""``partition_tables``: equal to ``optax.multi_transform`` with hand-written labels, and fused per part."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from tests.helpers import assert_trees_equal, jit_once

ROWS, WIDTH = 200, 8


def _params():
    rng = np.random.default_rng(0)
    return {
        "emb": {
            "user": jnp.asarray(rng.standard_normal((ROWS, WIDTH)), jnp.float32),
            "item": jnp.asarray(rng.standard_normal((ROWS // 2, WIDTH)), jnp.float32),
        },
        "mlp": {"w": jnp.asarray(rng.standard_normal((WIDTH, 3)), jnp.float32), "b": jnp.zeros((3,), jnp.float32)},
    }


def _grads(rng: np.random.Generator, params):
    def rows(n):
        ids = rng.integers(-1, n, size=32).astype(np.int32)
        return osa.IndexedRows(jnp.asarray(ids), jnp.asarray(rng.standard_normal((32, WIDTH)), jnp.float32), n)

    return {
        "emb": {"user": rows(ROWS), "item": rows(ROWS // 2)},
        "mlp": jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params["mlp"]),
    }


TABLE_RULES = {
    "adam": lambda: osa.sparse_adam(1e-2),
    "rowwise_adagrad": lambda: osa.sparse_rowwise_adagrad(1e-1),
}


@pytest.mark.parametrize("rule", sorted(TABLE_RULES))
def test_equals_multi_transform_with_hand_written_labels(rule, kernel_path):
    params = _params()
    tx = osa.partition_tables(TABLE_RULES[rule](), optax.adam(1e-3), lambda p: p["emb"])
    labels = {"emb": {"user": "tables", "item": "tables"}, "mlp": {"w": "rest", "b": "rest"}}
    ref = optax.multi_transform({"tables": TABLE_RULES[rule](), "rest": optax.adam(1e-3)}, labels)
    state, ref_state = tx.init(params), ref.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)

    two_calls = jit_once(lambda g, s, p: (lambda u, s: (osa.apply_updates(p, u), s))(*tx.update(g, s, p)))
    ref_step = jit_once(lambda g, s, p: (lambda u, s: (osa.apply_updates(p, u), s))(*ref.update(g, s, p)))
    fused = jit_once(lambda g, s, p: osa.update_and_apply(tx, g, s, p))
    rng = np.random.default_rng(1)
    p1 = p2 = p3 = params
    s1, s2, s3 = state, ref_state, state
    for _ in range(4):
        g = _grads(rng, params)
        p1, s1 = two_calls(g, s1, p1)
        p2, s2 = ref_step(g, s2, p2)
        p3, s3 = fused(g, s3, p3)
    assert_trees_equal((p1, s1), (p2, s2))
    # The fused step: the kernels' documented tolerance (update_and_apply's docstring) on the tables.
    assert_trees_equal(p3, p1, rtol=1e-6, atol=1e-6)
    assert_trees_equal(s3, s1, rtol=1e-6, atol=1e-7)


def test_a_sparse_adam_part_runs_the_fused_kernel(kernel_path):
    params = _params()
    tx = osa.partition_tables(osa.sparse_adam(1e-2), optax.adam(1e-3), lambda p: p["emb"])
    state = tx.init(params)
    g = _grads(np.random.default_rng(2), params)
    hlo = jax.jit(lambda g, s, p: osa.update_and_apply(tx, g, s, p)).lower(g, state, params).as_text()
    assert ("sparse_adam_apply" in hlo) == (kernel_path == "native-cpu")
    assert "sparse_adam_rows" not in hlo  # the tables' step is not also taken by the plain path


def test_selector_errors_name_the_function():
    with pytest.raises(TypeError, match="partition_tables: tables must be a function"):
        osa.partition_tables(osa.sparse_adam(1e-2), optax.adam(1e-3), "emb")
    tx = osa.partition_tables(osa.sparse_adam(1e-2), optax.adam(1e-3), lambda p: p["emb"] * 2)
    with pytest.raises(TypeError, match="partition_tables: `tables` must select leaves"):
        tx.init(_params())
