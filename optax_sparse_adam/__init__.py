"""Lazy (sparse) Adam for JAX and optax: update only the rows a gradient touches."""

from importlib.metadata import PackageNotFoundError, version

from optax_sparse_adam._apply import apply_updates
from optax_sparse_adam._fast_path import RowLookup, lookup, value_and_row_grad
from optax_sparse_adam._fused import update_and_apply
from optax_sparse_adam._indexed_rows import IndexedRows, is_sparse
from optax_sparse_adam._native import kernel_path, use_kernels
from optax_sparse_adam._sharding import RoutingInfo, RowSharding, all_gather_rows
from optax_sparse_adam._sparse_aware import sparse_aware
from optax_sparse_adam._transform import scale_by_sparse_adam, sparse_adam

try:
    __version__ = version("optax_sparse_adam")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "IndexedRows",
    "RoutingInfo",
    "RowLookup",
    "RowSharding",
    "all_gather_rows",
    "apply_updates",
    "is_sparse",
    "kernel_path",
    "lookup",
    "scale_by_sparse_adam",
    "sparse_adam",
    "sparse_aware",
    "update_and_apply",
    "use_kernels",
    "value_and_row_grad",
]
