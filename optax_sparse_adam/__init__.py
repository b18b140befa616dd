"""Lazy (sparse) Adam for JAX and optax: update only the rows a gradient touches."""

import importlib.metadata as _metadata

from optax_sparse_adam._adagrad import scale_by_sparse_adagrad, sparse_adagrad
from optax_sparse_adam._adam import scale_by_sparse_adam, sparse_adam
from optax_sparse_adam._adamw import LazyWeightDecayState, lazy_decoupled_weight_decay, sparse_adamw
from optax_sparse_adam._amsgrad import CatchUpAmsgradState, scale_by_sparse_amsgrad, sparse_amsgrad
from optax_sparse_adam._apply import apply_updates
from optax_sparse_adam._catch_up import CatchUpAdamState, CatchUpAdamWState, IdleRecord, catch_up
from optax_sparse_adam._collection import EmbeddingCollection, FeatureSpec, TableSpec
from optax_sparse_adam._ftrl import FtrlState, sparse_ftrl
from optax_sparse_adam._fused import update_and_apply
from optax_sparse_adam._huge_pages import HugePages, advise_huge_pages
from optax_sparse_adam._if_finite import apply_if_finite
from optax_sparse_adam._indexed_rows import IndexedRows, is_sparse
from optax_sparse_adam._kernel_path import kernel_path, use_kernels
from optax_sparse_adam._malloc import tune_malloc
from optax_sparse_adam._partition import partition_tables
from optax_sparse_adam._pooled import Bags, bags, pool
from optax_sparse_adam._routing import RoutingInfo, all_gather_rows
from optax_sparse_adam._row_grad import RowLookup, lookup, value_and_row_grad
from optax_sparse_adam._row_sharding import RowSharding
from optax_sparse_adam._rowwise import (
    ScaleByRowwiseAdagradState,
    ScaleByRowwiseAdamState,
    scale_by_rowwise_adagrad,
    scale_by_rowwise_adam,
    sparse_rowwise_adagrad,
    sparse_rowwise_adam,
)
from optax_sparse_adam._sgd import CatchUpSgdState, sparse_sgd
from optax_sparse_adam._sparse_aware import sparse_aware
from optax_sparse_adam._step_report import StepReport, step_report
from optax_sparse_adam._stochastic_rounding import apply_updates_stochastic, stochastic_round

try:
    __version__ = _metadata.version("optax_sparse_adam")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"
del _metadata

__all__ = [
    "Bags",
    "CatchUpAdamState",
    "CatchUpAdamWState",
    "CatchUpAmsgradState",
    "CatchUpSgdState",
    "EmbeddingCollection",
    "FeatureSpec",
    "FtrlState",
    "HugePages",
    "IdleRecord",
    "IndexedRows",
    "LazyWeightDecayState",
    "RoutingInfo",
    "RowLookup",
    "RowSharding",
    "ScaleByRowwiseAdagradState",
    "ScaleByRowwiseAdamState",
    "StepReport",
    "TableSpec",
    "advise_huge_pages",
    "all_gather_rows",
    "apply_if_finite",
    "apply_updates",
    "apply_updates_stochastic",
    "bags",
    "catch_up",
    "is_sparse",
    "kernel_path",
    "lazy_decoupled_weight_decay",
    "lookup",
    "partition_tables",
    "pool",
    "scale_by_rowwise_adagrad",
    "scale_by_rowwise_adam",
    "scale_by_sparse_adagrad",
    "scale_by_sparse_adam",
    "scale_by_sparse_amsgrad",
    "sparse_adagrad",
    "sparse_adam",
    "sparse_adamw",
    "sparse_amsgrad",
    "sparse_aware",
    "sparse_ftrl",
    "sparse_rowwise_adagrad",
    "sparse_rowwise_adam",
    "sparse_sgd",
    "step_report",
    "stochastic_round",
    "tune_malloc",
    "update_and_apply",
    "use_kernels",
    "value_and_row_grad",
]
