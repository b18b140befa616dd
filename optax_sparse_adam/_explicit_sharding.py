"""Row gathers and scatters that also trace on meshes with ``Explicit`` axes.

``jax.make_mesh`` gives ``Explicit`` axes by default. On such a mesh a gather
from, or a scatter into, an array whose rows are sharded (``P("x", None)``)
needs its output sharding spelled out (``out_sharding=``), and ids or values
sharded over a batch axis must be made whole before they can index anything.
Every row gather and scatter of the library goes through the three functions
here; on a single device, an ``Auto`` mesh, or inside ``shard_map`` they are
the plain ``.at[...]`` operations.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["explicit_sharding", "replicate", "scatter_rows", "take_rows"]


def explicit_sharding(x: Any) -> NamedSharding | None:
    """``x``'s sharding while tracing when it names an ``Explicit`` mesh axis, else ``None``."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
        return None
    explicit = {
        name
        for name, kind in zip(sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True)
        if kind == jax.sharding.AxisType.Explicit
    }
    for entry in sharding.spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        if any(name in explicit for name in names if name is not None):
            return sharding
    return None


def replicate(x: jax.Array, like: jax.Array | None = None) -> jax.Array:
    """``x`` whole on every device when it (or ``like``) is sharded over an ``Explicit`` axis, else ``x``.

    For ``x`` itself sharded this is an all-gather; with ``like`` it puts ``x`` on ``like``'s mesh, so
    that it can receive rows gathered from ``like`` (``dynamic_update_slice`` wants one mesh).
    """
    sharding = explicit_sharding(x if like is None else like)
    if sharding is None:
        return x
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec()))


def take_rows(x: jax.Array, index: Any) -> jax.Array:
    """``x.at[index].get(mode="fill", fill_value=0)``, replicated when ``x`` is sharded over an ``Explicit`` axis."""
    x = jnp.asarray(x)
    sharding = explicit_sharding(x)
    if sharding is None:
        return x.at[index].get(mode="fill", fill_value=0)
    return x.at[index].get(mode="fill", fill_value=0, out_sharding=NamedSharding(sharding.mesh, PartitionSpec()))


def scatter_rows(x: jax.Array, index: Any, values: jax.Array, op: Literal["set", "add"]) -> jax.Array:
    """``x.at[index].set(values)`` or ``.add(values)`` (out-of-range dropped), keeping ``x``'s sharding."""
    ref = x.at[index]
    update = ref.set if op == "set" else ref.add
    sharding = explicit_sharding(x)
    if sharding is None:
        return update(values, mode="drop")
    return update(values, mode="drop", out_sharding=sharding)
