"""Tree plumbing shared by every stage: sparse leaves as leaves, and errors that name the path."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from optax_sparse_adam._indexed_rows import is_sparse


def is_leaf(x: Any) -> bool:
    """``is_leaf`` for tree functions: sparse leaves and ``None`` are leaves."""
    return x is None or is_sparse(x)


def path_str(path: Any) -> str:
    return jax.tree_util.keystr(tuple(path)) or "<root>"


def leaf_paths(treedef: Any) -> list[tuple[Any, ...]]:
    """The key paths of a tree structure's leaves. Two structures of one layout with different node types (an nnx
    state's ``Param`` nodes and an ``nnx.Optimizer`` state's ``OptVariable`` ones) have the same."""
    return [path for path, _ in jax.tree_util.tree_leaves_with_path(treedef.unflatten([0] * treedef.num_leaves))]


def param_error(kind: type[Exception], where: str, path: Any, msg: str) -> Exception:
    """``kind("<where>: parameter <path>: <msg>")``, the form of every error about one leaf."""
    return kind(f"{where}: parameter {path_str(path)}: {msg}")


def describe(x: Any) -> str:
    """A short description of a tree node for error messages, never its values."""
    if x is None:
        return "None"
    if is_sparse(x):
        return f"a {type(x).__name__} of shape {tuple(x.shape)}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        # A container with an array's attributes (flax's nnx.Param, a ShapeDtypeStruct) is named by its type:
        # beside a bare array, the type is the difference.
        kind = "an array" if isinstance(x, jax.Array | np.ndarray | np.generic) else f"a {type(x).__name__}"
        return f"{kind} of shape {tuple(x.shape)} and dtype {x.dtype}"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    if isinstance(x, list | tuple):
        return f"a {type(x).__name__} of length {len(x)}"
    if isinstance(x, int | float | complex | np.number):
        return f"a scalar {type(x).__name__}"
    return f"a {type(x).__name__}"


def _is_tree_leaf(x: Any) -> bool:
    structure: Any = jax.tree.structure(x, is_leaf=is_leaf)
    return structure.num_nodes == 1 and structure.num_leaves == 1


def _children(x: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """One level of ``x``: ``(key, child)`` pairs and the node's type and metadata."""
    treedef: Any
    pairs, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    return [(path[0], child) for path, child in pairs], treedef.node_data()


def first_difference(prefix: Any, tree: Any, path: tuple[Any, ...] = ()) -> tuple[tuple[Any, ...], str, str] | None:
    """Where ``tree`` does not have the structure of ``prefix`` up to ``prefix``'s leaves.

    Returns ``(path, what prefix has there, what tree has there)``, or ``None``.
    """
    if _is_tree_leaf(prefix):
        return None
    if _is_tree_leaf(tree):
        return path, describe(prefix), describe(tree)
    pre_children, pre_node = _children(prefix)
    tree_children, tree_node = _children(tree)
    if pre_node != tree_node:
        pre_keys = [k for k, _ in pre_children]
        tree_keys = [k for k, _ in tree_children]
        if type(prefix) is type(tree) and isinstance(prefix, dict):
            for k in pre_keys:
                if k not in tree_keys:
                    return (*path, k), describe(dict(pre_children)[k]), "nothing"
            for k in tree_keys:
                if k not in pre_keys:
                    return (*path, k), "nothing", describe(dict(tree_children)[k])
        return path, describe(prefix), describe(tree)
    for (k, a), (_, b) in zip(pre_children, tree_children, strict=True):
        found = first_difference(a, b, (*path, k))
        if found is not None:
            return found
    return None


def leaves_like(treedef: Any, prefix: Any, tree: Any, where: str, what: str, prefix_name: str) -> list[Any]:
    """``tree``'s subtrees at the leaves of ``treedef`` (the structure of ``prefix``), or a clear error."""
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError):
        found = first_difference(prefix, tree)
        if found is None:  # pragma: no cover - flatten_up_to and first_difference disagree
            raise
        path, has, other = found
        raise ValueError(
            f"{where}: the {prefix_name} and the {what} differ at {path_str(path)}: the {what} hold {other} "
            f"there, the {prefix_name} holds {has}; give both trees the same structure"
        ) from None


def map_leaves(
    fn: Callable[..., tuple[Any, ...]],
    tree: Any,
    others: Sequence[tuple[Any, str]],
    *,
    where: str,
    tree_name: str,
    n_out: int,
) -> tuple[Any, ...]:
    """Maps ``fn(path, leaf, *other_subtrees)`` over the leaves of ``tree`` and unzips its results.

    Sparse leaves and ``None`` are leaves of ``tree``; each of ``others`` (a
    tree and its name for errors) is cut at those leaves, so a ``None`` over a
    subtree hands ``fn`` the whole subtree. ``fn`` returns ``n_out`` values per
    leaf; the result is ``n_out`` trees of ``tree``'s structure.
    """
    treedef: Any  # jax's PyTreeDef, whose methods type checkers do not see
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    columns = [leaves_like(treedef, tree, other, where, name, tree_name) for other, name in others]
    results = [fn(path, leaf, *rest) for (path, leaf), *rest in zip(pairs, *columns, strict=True)]
    return tuple(treedef.unflatten([r[i] for r in results]) for i in range(n_out))


def broadcast_rows(mask: jax.Array, ndim: int) -> jax.Array:
    """A per-row mask of shape ``(k,)`` reshaped to broadcast against ``(k, ...)`` with ``ndim`` axes."""
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def compiled_on_arrays(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn(tx, *args)`` (returning a tree shaped as the args at ``like``) run as one compiled program where it is
    called on jax arrays alone: kept for the next call with the same ``tx``, shapes and kernel setting (part of
    jit's key), for the last 8 transformations used (each program holds its ``tx`` and a compiled step). Run op by
    op, the conditionals and loops ``fn`` builds anew on each call compiled again every time. Under a trace (the
    caller's ``jit``, ``vmap``, ``shard_map``), on NumPy arrays or Python numbers, or with a ``tx`` that cannot be
    hashed, ``fn`` runs as it is."""

    @functools.lru_cache(maxsize=8)
    def compiled(tx: Any) -> Callable[..., Any]:
        step = jax.jit(functools.partial(fn, tx))
        step.__name__ = name  # type: ignore[attr-defined]
        return step

    def call(tx: Any, *args: Any, like: tuple[int, ...]) -> Any:
        if not on_arrays(*args) or not _hashable(tx):
            return fn(tx, *args)
        return laid_out_as(compiled(tx)(*args), tuple(args[i] for i in like))

    return call


def on_arrays(*args: Any) -> bool:
    """Whether ``args`` hold jax arrays alone, none of them traced: what a compiled program may take in place of a
    function run op by op. Not NumPy arrays: jit would take 64-bit ids as int32 (x64 off), where the library reads
    them in their own dtype (an id past int32's range is padding, not wrapped onto a row)."""
    return all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))


def laid_out_as(out: Any, inputs: Any) -> Any:
    """A program's outputs as the caller laid out its inputs (trees of one structure; else ``out`` as it is): on an
    Auto mesh, XLA may lay an output that its input's layout does not reach (a per-row record written by a
    scatter) out whole on every device."""
    structure: Any = jax.tree.structure(out)  # jax's PyTreeDef, which type checkers do not see
    if structure != jax.tree.structure(inputs):
        return out
    return jax.tree.map(_laid_out_as, out, inputs)


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _laid_out_as(out: Any, given: Any) -> Any:
    """``out`` moved to ``given``'s sharding where both are arrays of one shape laid out otherwise."""
    if (
        isinstance(out, jax.Array)
        and not isinstance(out, jax.core.Tracer)  # arrays a function closes over, called under its trace
        and isinstance(given, jax.Array)
        # An uncommitted input (a state's count from tx.init) may go wherever a program puts it: moved back to its
        # device, the output would be committed there and refused next to arrays on a mesh.
        and given.committed
        and out.shape == given.shape
        and not given.is_deleted()
        and out.is_fully_addressable
        and out.sharding != given.sharding
    ):
        return jax.device_put(out, given.sharding)
    return out
