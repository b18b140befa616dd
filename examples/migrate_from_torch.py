"""From ``torch.optim.SparseAdam`` + ``torch.optim.Adam`` to one ``osa.sparse_adam``: a recipe, checked.

A PyTorch model with a sparse embedding table is usually trained with two optimizers: ``SparseAdam`` for the table
(``nn.Embedding(..., sparse=True)``) and ``Adam`` for the rest. In JAX the same training is one optimizer,
``osa.sparse_adam(lr, eps_placement="torch")``, which applies ``SparseAdam``'s rule to the sparse leaves and
``Adam``'s to the dense ones, with torch's bias corrections. The table's gradient comes from
``osa.value_and_row_grad`` as rows, never as a table-sized array.

The script trains both from the same initial weights on the same batches and checks that the losses and the final
parameters agree (to float32 rounding, which the two frameworks' forward passes order differently).

    python examples/migrate_from_torch.py --steps 200
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import torch

import optax_sparse_adam as osa


class TorchModel(torch.nn.Module):
    """A sum-pooled embedding table and a small MLP."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(rows, dim, sparse=True)
        self.fc1 = torch.nn.Linear(dim, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.emb(ids).sum(1)))).squeeze(-1)


def jax_loss(params: dict, ids: jax.Array, target: jax.Array) -> jax.Array:
    """The torch model's forward and ``mse_loss``; torch's ``Linear`` computes ``x @ W.T + b``."""
    h = jnp.tanh(params["fc1.weight"] @ params["emb.weight"][ids].sum(1).T + params["fc1.bias"][:, None])
    pred = (params["fc2.weight"] @ h + params["fc2.bias"][:, None])[0]
    return jnp.mean((pred - target) ** 2)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)

    # PyTorch: two optimizers.
    model = TorchModel(args.rows, args.dim)
    sparse_opt = torch.optim.SparseAdam([model.emb.weight], lr=args.lr)
    dense_opt = torch.optim.Adam([p for n, p in model.named_parameters() if n != "emb.weight"], lr=args.lr)

    # JAX: one optimizer, the same initial weights.
    params = {name: jnp.asarray(p.detach().numpy()) for name, p in model.named_parameters()}
    tx = osa.sparse_adam(args.lr, eps_placement="torch")
    state = tx.init(params)
    grad_fn = osa.value_and_row_grad(jax_loss, lambda p: p["emb.weight"])

    @jax.jit
    def step(params: dict, state: object, ids: jax.Array, target: jax.Array) -> tuple[dict, object, jax.Array]:
        loss, grads = grad_fn(params, ids, target)
        params, state = osa.update_and_apply(tx, grads, state, params)
        return params, state, loss

    worst_loss = 0.0
    for _ in range(args.steps):
        ids = rng.integers(0, args.rows, size=(args.batch, 3))
        target = rng.standard_normal(args.batch).astype(np.float32)
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        torch_loss = torch.nn.functional.mse_loss(model(torch.tensor(ids)), torch.tensor(target))
        torch_loss.backward()
        sparse_opt.step()
        dense_opt.step()
        params, state, loss = step(params, state, jnp.asarray(ids, jnp.int32), jnp.asarray(target))
        worst_loss = max(worst_loss, abs(float(loss) - torch_loss.item()) / torch_loss.item())

    worst_param = max(
        float(np.max(np.abs(np.asarray(params[n]) - p.detach().numpy())) / np.max(np.abs(p.detach().numpy())))
        for n, p in model.named_parameters()
    )
    print(
        f"{args.steps} steps: loss within {worst_loss:.1e} of torch's (relative), parameters within {worst_param:.1e}"
    )
    return {"loss": worst_loss, "params": worst_param}


if __name__ == "__main__":
    main()
