"""End-to-end train step of an embedding model, three ways.

The model: each example is a bag of ids; its embedding rows are averaged and
fed to a small MLP that predicts a binary label (logistic loss). The same
model, initial values and batches are trained

* with :func:`optax.adam` on ordinary dense gradients (``jax.grad`` of the whole
  parameter tree, so the table's gradient is a dense table-sized array);
* with this library's fast path: differentiate with respect to the gathered rows
  ``table[ids]``, hand the table an :class:`optax_sparse_adam.IndexedRows`
  gradient (duplicates summed by the optimizer) and the MLP its dense
  gradient, in one jitted, donated step;
* the same with :func:`optax_sparse_adam.value_and_row_grad`, which deduplicates
  the ids first and gathers each distinct row once;
* with PyTorch: ``nn.Embedding(sparse=True)`` and ``SparseAdam`` for the table,
  ``Adam(fused=True)`` for the MLP.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from contenders import LEARNING_RATE, JaxStepper, Stepper, sample_ids

import optax_sparse_adam as osa


@dataclasses.dataclass(frozen=True)
class Model:
    """Sizes of the embedding model and its batches.

    Attributes:
      rows: Rows of the embedding table.
      width: Embedding width.
      hidden: Width of the MLP's two hidden layers.
      examples: Examples per batch.
      bag: Ids per example (``examples * bag`` ids per batch).
    """

    rows: int
    width: int
    hidden: int
    examples: int
    bag: int

    @property
    def ids_per_batch(self) -> int:
        return self.examples * self.bag

    @property
    def label(self) -> str:
        return (
            f"{self.rows} x {self.width} table + MLP {self.width}-{self.hidden}-{self.hidden}-1, "
            f"{self.examples} examples x {self.bag} ids = {self.ids_per_batch} ids per batch (Zipf 1.2)"
        )


@dataclasses.dataclass(frozen=True)
class Data:
    """Initial parameters and a pool of batches, as NumPy arrays shared by all three contenders."""

    table: np.ndarray
    mlp: list[tuple[np.ndarray, np.ndarray]]  # (weight (in, out), bias (out,)) per layer
    ids: list[np.ndarray]  # (examples, bag) int32
    labels: list[np.ndarray]  # (examples,) float32


def make_data(model: Model, pool: int, seed: int) -> Data:
    rng = np.random.default_rng(seed)
    table = (0.01 * rng.standard_normal((model.rows, model.width), dtype=np.float32)).astype(np.float32)
    sizes = [model.width, model.hidden, model.hidden, 1]
    mlp = [
        (
            (rng.standard_normal((n_in, n_out), dtype=np.float32) / np.sqrt(n_in)).astype(np.float32),
            np.zeros((n_out,), np.float32),
        )
        for n_in, n_out in itertools.pairwise(sizes)
    ]
    ids = [
        sample_ids(rng, model.rows, model.ids_per_batch, "zipf").reshape(model.examples, model.bag) for _ in range(pool)
    ]
    labels = [rng.integers(0, 2, size=model.examples).astype(np.float32) for _ in range(pool)]
    return Data(table=table, mlp=mlp, ids=ids, labels=labels)


MlpParams = list[tuple[jax.Array, jax.Array]]


def _mlp_loss(rows: jax.Array, mlp: MlpParams, labels: jax.Array) -> jax.Array:
    """Mean logistic loss of the MLP on bags of embedding rows ``(examples, bag, width)``."""
    x = rows.mean(axis=1)
    for i, (w, b) in enumerate(mlp):
        x = x @ w + b
        if i < len(mlp) - 1:
            x = jax.nn.relu(x)
    return optax.sigmoid_binary_cross_entropy(x[:, 0], labels).mean()


def _jax_params(data: Data) -> dict[str, Any]:
    return {"table": jnp.asarray(data.table), "mlp": [(jnp.asarray(w), jnp.asarray(b)) for w, b in data.mlp]}


def _jax_inputs(data: Data) -> list[tuple[np.ndarray, np.ndarray]]:
    return list(zip(data.ids, data.labels, strict=True))


def make_optax_dense(model: Model, data: Data) -> Stepper:
    """``optax.adam`` on the dense gradient of every parameter."""
    del model
    tx = optax.adam(LEARNING_RATE)

    def loss_fn(params: dict[str, Any], ids: jax.Array, labels: jax.Array) -> jax.Array:
        return _mlp_loss(params["table"][ids], params["mlp"], labels)

    def step(params: dict[str, Any], state: Any, ids: jax.Array, labels: jax.Array) -> tuple[dict[str, Any], Any]:
        grads = jax.grad(loss_fn)(params, ids, labels)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = _jax_params(data)
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params), _jax_inputs(data))


def make_osa_fast(model: Model, data: Data) -> Stepper:
    """This library's fast path: gradients of the gathered rows as ``IndexedRows``, then ``update_and_apply``."""
    tx = osa.sparse_adam(LEARNING_RATE)

    def step(params: dict[str, Any], state: Any, ids: jax.Array, labels: jax.Array) -> tuple[dict[str, Any], Any]:
        rows = params["table"][ids]
        d_rows, d_mlp = jax.grad(_mlp_loss, argnums=(0, 1))(rows, params["mlp"], labels)
        grads = {
            "table": osa.IndexedRows(ids.reshape(-1), d_rows.reshape(-1, model.width), model.rows),
            "mlp": d_mlp,
        }
        return osa.update_and_apply(tx, grads, state, params)

    params = _jax_params(data)
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params), _jax_inputs(data))


def make_osa_row_grad(model: Model, data: Data) -> Stepper:
    """:func:`optax_sparse_adam.value_and_row_grad`: ids deduplicated, each distinct row gathered once."""
    del model
    tx = osa.sparse_adam(LEARNING_RATE)

    def loss_fn(params: dict[str, Any], ids: jax.Array, labels: jax.Array) -> jax.Array:
        return _mlp_loss(params["table"][ids], params["mlp"], labels)

    grad_fn = osa.value_and_row_grad(loss_fn, lambda p: p["table"])

    def step(params: dict[str, Any], state: Any, ids: jax.Array, labels: jax.Array) -> tuple[dict[str, Any], Any]:
        _, grads = grad_fn(params, ids, labels)
        return osa.update_and_apply(tx, grads, state, params)

    params = _jax_params(data)
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params), _jax_inputs(data))


def make_jax_grad_only(model: Model, data: Data) -> Stepper:
    """The JAX step without the optimizer: gather, forward and backward (the part every JAX contender pays)."""
    del model

    def step(params: dict[str, Any], state: Any, ids: jax.Array, labels: jax.Array) -> tuple[dict[str, Any], Any]:
        del state
        rows = params["table"][ids]
        return params, jax.grad(_mlp_loss, argnums=(0, 1))(rows, params["mlp"], labels)

    params = _jax_params(data)
    ids, labels = _jax_inputs(data)[0]
    state = jax.eval_shape(step, params, None, ids, labels)[1]
    state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), state)
    return JaxStepper(jax.jit(step, donate_argnums=(0, 1)), params, state, _jax_inputs(data))


def _torch_model(data: Data) -> tuple[torch.nn.Embedding, torch.nn.Sequential]:
    """The embedding table and the MLP, initialized from ``data``."""
    emb = torch.nn.Embedding(data.table.shape[0], data.table.shape[1], sparse=True)
    layers: list[torch.nn.Module] = []
    for i, (w, _) in enumerate(data.mlp):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(*w.shape))
    mlp = torch.nn.Sequential(*layers)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(data.table))
        linears = [m for m in mlp if isinstance(m, torch.nn.Linear)]
        for linear, (w, b) in zip(linears, data.mlp, strict=True):
            linear.weight.copy_(torch.from_numpy(w.T.copy()))
            linear.bias.copy_(torch.from_numpy(b))
    return emb, mlp


def _torch_loss(emb: torch.nn.Embedding, mlp: torch.nn.Sequential, ids: torch.Tensor, labels: torch.Tensor):
    logits = mlp(emb(ids).mean(dim=1))[:, 0]
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


def make_torch(model: Model, data: Data) -> Stepper:
    """``nn.Embedding(sparse=True)`` with ``SparseAdam``, and ``Adam(fused=True)`` for the MLP."""
    del model
    emb, mlp = _torch_model(data)
    sparse_opt = torch.optim.SparseAdam(list(emb.parameters()), lr=LEARNING_RATE)
    dense_opt = torch.optim.Adam(mlp.parameters(), lr=LEARNING_RATE, fused=True)
    ids = [torch.from_numpy(i).long() for i in data.ids]
    labels = [torch.from_numpy(y) for y in data.labels]

    def run(i: int) -> None:
        k = i % len(ids)
        sparse_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
        _torch_loss(emb, mlp, ids[k], labels[k]).backward()
        sparse_opt.step()
        dense_opt.step()

    return run


def make_torch_grad_only(model: Model, data: Data) -> Stepper:
    """The PyTorch step without the optimizers: forward and backward."""
    del model
    emb, mlp = _torch_model(data)
    params = [*emb.parameters(), *mlp.parameters()]
    ids = [torch.from_numpy(i).long() for i in data.ids]
    labels = [torch.from_numpy(y) for y in data.labels]

    def run(i: int) -> None:
        k = i % len(ids)
        for p in params:
            p.grad = None
        _torch_loss(emb, mlp, ids[k], labels[k]).backward()

    return run


class E2EContender(NamedTuple):
    """A way of running the train step: key, label and a builder of its stepper."""

    name: str
    label: str
    make: Callable[[Model, Data], Stepper]


E2E_CONTENDERS: tuple[E2EContender, ...] = (
    E2EContender("osa_sparse", "optax_sparse_adam: grad of table[ids], IndexedRows(ids, d_rows)", make_osa_fast),
    E2EContender("osa_row_grad", "optax_sparse_adam: value_and_row_grad (ids deduplicated first)", make_osa_row_grad),
    E2EContender("torch_sparse", "PyTorch nn.Embedding(sparse=True) + SparseAdam + Adam(fused=True)", make_torch),
    E2EContender("optax_adam", "optax.adam on dense gradients", make_optax_dense),
    E2EContender("jax_grad_only", "JAX gather + forward + backward, no optimizer step", make_jax_grad_only),
    E2EContender("torch_grad_only", "PyTorch forward + backward, no optimizer step", make_torch_grad_only),
)
