"""The optimizers that are ``chain(stage, sparse_aware(scale_by_learning_rate))`` apply their learning rate inside
the stage's pass (``_learning_rate.with_learning_rate``), and ``sparse_adamw`` and decoupled
``sparse_rowwise_adagrad``, which are ``chain(stage, sparse_aware(add_decayed_weights),
sparse_aware(scale_by_learning_rate))``, their decay too: the chain's numbers and state, a pass or two fewer."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from optax_sparse_adam._sgd import _lazy_trace
from tests.helpers import assert_trees_equal

ROWS, WIDTH, BATCH = 40, 4, 24


_TABLES = {"emb": True, "w": False}  # a decay mask: the table decays, the dense layer does not


# name -> (the optimizer at a learning rate, the stage it chains with that rate).
STAGES: dict[str, tuple[Callable[[Any], optax.GradientTransformation], Callable[[], optax.GradientTransformation]]] = {
    "adam": (lambda lr: osa.sparse_adam(lr), lambda: osa.scale_by_sparse_adam()),
    "amsgrad": (lambda lr: osa.sparse_amsgrad(lr), lambda: osa.scale_by_sparse_amsgrad()),
    "adagrad": (lambda lr: osa.sparse_adagrad(lr), lambda: osa.scale_by_sparse_adagrad()),
    "rowwise_adagrad": (lambda lr: osa.sparse_rowwise_adagrad(lr), lambda: osa.scale_by_rowwise_adagrad()),
    "rowwise_adagrad_l2": (
        lambda lr: osa.sparse_rowwise_adagrad(lr, weight_decay=0.01),
        lambda: osa.scale_by_rowwise_adagrad(weight_decay=0.01),
    ),
    "rowwise_adam": (lambda lr: osa.sparse_rowwise_adam(lr), lambda: osa.scale_by_rowwise_adam()),
    "rowwise_adam_per_row": (
        lambda lr: osa.sparse_rowwise_adam(lr, per_row_bias_correction=True),
        lambda: osa.scale_by_rowwise_adam(per_row_bias_correction=True),
    ),
    "momentum": (lambda lr: osa.sparse_sgd(lr, momentum=0.9), lambda: _lazy_trace(0.9, False, None)),
    "nesterov": (lambda lr: osa.sparse_sgd(lr, momentum=0.9, nesterov=True), lambda: _lazy_trace(0.9, True, None)),
    "rowwise_adagrad_decoupled": (
        lambda lr: osa.sparse_rowwise_adagrad(lr, weight_decay=0.01, weight_decay_mode="decoupled"),
        lambda: osa.scale_by_rowwise_adagrad(),
    ),
    "adamw": (lambda lr: osa.sparse_adamw(lr, weight_decay=0.01), lambda: osa.scale_by_sparse_adam()),
    "adamw_masked": (
        lambda lr: osa.sparse_adamw(lr, weight_decay=0.01, mask=_TABLES),
        lambda: osa.scale_by_sparse_adam(),
    ),
    # float32 parameters, bfloat16 first moments: the rows kernel does not take them, the XLA rule does.
    "adamw_mu_bf16": (
        lambda lr: osa.sparse_adamw(lr, weight_decay=0.01, mu_dtype=jnp.bfloat16),
        lambda: osa.scale_by_sparse_adam(mu_dtype=jnp.bfloat16),
    ),
}
# name -> the stages between the stage and the learning rate in the chain (the decoupled weight decays).
BETWEEN: dict[str, Callable[[], list[optax.GradientTransformation]]] = {
    "rowwise_adagrad_decoupled": lambda: [osa.sparse_aware(optax.add_decayed_weights(0.01))],
    "adamw": lambda: [osa.sparse_aware(optax.add_decayed_weights(0.01))],
    "adamw_masked": lambda: [osa.sparse_aware(optax.add_decayed_weights(0.01, _TABLES))],
    "adamw_mu_bf16": lambda: [osa.sparse_aware(optax.add_decayed_weights(0.01))],
}
RATES = {"constant": 0.05, "schedule": optax.linear_schedule(0.05, 0.01, 4)}


def _pair(name: str, learning_rate: Any) -> tuple[optax.GradientTransformation, optax.GradientTransformation]:
    """The optimizer, and the chain it stands for."""
    make, make_stage = STAGES[name]
    between = BETWEEN.get(name, list)()
    scale = osa.sparse_aware(optax.scale_by_learning_rate(learning_rate))
    return make(learning_rate), optax.chain(make_stage(), *between, scale)


def _grads(rng: np.random.Generator) -> dict[str, Any]:
    """A table's rows with duplicates and padding (ids below 0 and past the table), and a dense leaf."""
    ids = jnp.asarray(rng.integers(-2, ROWS + 3, BATCH), jnp.int32)
    return {
        "emb": osa.IndexedRows(ids, jnp.asarray(rng.standard_normal((BATCH, WIDTH)), jnp.float32), ROWS),
        "w": jnp.asarray(rng.standard_normal((3, WIDTH)), jnp.float32),
    }


@pytest.mark.parametrize("rate", list(RATES))
@pytest.mark.parametrize("name", list(STAGES))
def test_the_learning_rate_inside_the_stages_pass_is_the_chain(kernel_path, name, rate):
    """Each optimizer's tx.update, its learning rate applied inside the stage's pass (on the CPU, by the rows kernel
    to the step rows it writes), gives bitwise the updates and state of the chain of its stage and
    sparse_aware(scale_by_learning_rate), step after step, on a table's rows and on a dense leaf."""
    ours, chain = _pair(name, RATES[rate])
    rng = np.random.default_rng(5)
    params = {
        "emb": jnp.asarray(rng.standard_normal((ROWS, WIDTH)), jnp.float32),
        "w": jnp.asarray(rng.standard_normal((3, WIDTH)), jnp.float32),
    }
    states = [ours.init(params), chain.init(params)]
    steps = [jax.jit(tx.update) for tx in (ours, chain)]
    for _ in range(4):
        grads = _grads(rng)
        (u1, s1), (u2, s2) = (step(grads, s, params) for step, s in zip(steps, states, strict=True))
        assert_trees_equal((s1, u1["w"]), (s2, u2["w"]))
        np.testing.assert_array_equal(u1["emb"].indices, u2["emb"].indices)
        np.testing.assert_array_equal(u1["emb"].values, u2["emb"].values)
        states = [s1, s2]
        params = osa.apply_updates(params, u1)


def _row_passes(tx: optax.GradientTransformation, params: jax.Array, grads: osa.IndexedRows) -> list[str]:
    """The operations of tx.update's compiled program (on the CPU) that produce an array of the update rows' shape,
    other than the kernel's own results: each is a pass of XLA's over the rows."""
    text = jax.jit(tx.update).lower(grads, tx.init(params), params).compile().as_text()
    entry = text[text.index("ENTRY") :]
    shape = "f32[{},{}]".format(*grads.values.shape)
    ops = re.findall(r"^\s*(?:ROOT )?%\S+ = " + re.escape(shape) + r"\{[^}]*\} (\S+?)\(", entry, re.MULTILINE)
    return [op for op in ops if op not in ("custom-call", "get-tuple-element", "parameter", "bitcast")]


# The stages a rows kernel takes on one float32 table (a mask of two leaves needs their tree).
KERNEL_STAGES = [name for name in STAGES if name not in ("adamw_masked", "adamw_mu_bf16")]


@pytest.mark.parametrize("name", KERNEL_STAGES)
def test_two_calls_take_no_pass_of_their_own_to_scale_the_rows(name):
    """On the CPU the rows kernel writes the scaled step rows: tx.update's program holds no operation over them of
    its own, where the chain written out multiplies them in a second pass."""
    with osa.use_kernels(True):
        if osa.kernel_path() != "native-cpu":
            pytest.skip("the native kernels were not built (no C++ compiler at install time)")
        ours, chain = _pair(name, 0.05)
        params = jnp.zeros((ROWS, WIDTH), jnp.float32)
        grads = osa.IndexedRows(jnp.zeros((BATCH,), jnp.int32), jnp.ones((BATCH, WIDTH), jnp.float32), ROWS)
        assert _row_passes(ours, params, grads) == []
        assert _row_passes(chain, params, grads) != []  # the check sees the pass it is there to rule out
