"""Which parts of a Flax training step repeat bit for bit on jax's default device: the forward pass, ``jax.grad`` of
the dense model, ``value_and_row_grad``, ``tx.update`` and ``update_and_apply``, each jitted and run 20 times on the
same inputs (the model of ``tests/test_nnx.py``: pooled multi-hot features, repeated ids). ``tools/gpu_check.sh``
runs it with XLA's defaults and with ``--xla_gpu_deterministic_ops=true``.

    PYTHONPATH=. python tools/gpu_repeat.py
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import optax_sparse_adam as osa
from tests.test_nnx import Model, _batch, _loss


def repeats(name: str, f: Any, *args: Any, times: int = 20) -> bool:
    first = [np.asarray(x).tobytes() for x in jax.tree.leaves(f(*args))]
    for i in range(times):
        again = [np.asarray(x).tobytes() for x in jax.tree.leaves(f(*args))]
        if again != first:
            differ = [k for k, (a, b) in enumerate(zip(first, again, strict=True)) if a != b]
            print(f"{name}: differs at rerun {i + 1} (leaves {differ})", flush=True)
            return False
    print(f"{name}: bitwise the same over {times} reruns", flush=True)
    return True


def main() -> None:
    print("backend:", jax.default_backend(), jax.devices()[0].device_kind)
    graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(2)
    batch, labels = _batch(rng), jnp.asarray(rng.standard_normal(16), jnp.float32)

    def loss(p: Any, b: Any) -> jax.Array:
        return _loss(nnx.merge(graphdef, p), b, labels)

    repeats("forward", jax.jit(lambda p, b: nnx.merge(graphdef, p)(b)), params, batch)
    repeats("jax.grad, dense model", jax.jit(jax.grad(loss)), params, batch)
    row_grad = jax.jit(osa.value_and_row_grad(loss, lambda p: p["emb"]["stacks"]))
    repeats("value_and_row_grad", row_grad, params, batch)
    _, grads = row_grad(params, batch)
    tx = osa.sparse_adam(1e-2)
    state = tx.init(params)
    repeats("tx.update", jax.jit(lambda p, s, g: tx.update(g, s, p)), params, state, grads)
    repeats("update_and_apply", jax.jit(lambda p, s, g: osa.update_and_apply(tx, g, s, p)), params, state, grads)


if __name__ == "__main__":
    main()
