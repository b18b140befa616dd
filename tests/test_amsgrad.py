"""``sparse_amsgrad``: the lazy AMSGrad rule (``_amsgrad.py``)."""

from __future__ import annotations

import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_sparse_adam as osa
from tests import variant_checks
from tests.variant_checks import LR

COMPARE_STATE = True  # the same ScaleByAmsgradState as optax's
NAMES = ["amsgrad"]


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=10, deadline=None)
@given(problem=variant_checks.problems(), seed=st.integers(0, 2**31 - 1))
def test_matches_numpy_reference(name, problem, seed):
    variant_checks.check_matches_reference(name, problem, seed)


EQUIVALENTS = [
    ("amsgrad", lambda: osa.sparse_amsgrad(LR), lambda: optax.amsgrad(LR), 3),
]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize(("name", "ours", "theirs", "width"), EQUIVALENTS, ids=[e[0] for e in EQUIVALENTS])
def test_equals_optax_when_every_row_is_touched(name, ours, theirs, width, sparse):
    variant_checks.check_equals_optax_when_every_row_is_touched(ours, theirs, width, sparse, COMPARE_STATE)


@pytest.mark.parametrize("name", NAMES)
def test_jit_compiles_once(name):
    variant_checks.check_compiles_once(name)


@pytest.mark.parametrize("name", NAMES)
def test_bad_gradients_raise_naming_the_path(name):
    variant_checks.check_bad_gradients_raise_naming_the_path(name)


INJECTED = [
    ("amsgrad", osa.sparse_amsgrad, {"learning_rate": 0.05, "b2": 0.99}),
]


@pytest.mark.parametrize(("name", "factory", "kwargs"), INJECTED, ids=[i[0] for i in INJECTED])
def test_inject_hyperparams_matches_and_does_not_recompile(name, factory, kwargs):
    variant_checks.check_inject_hyperparams_matches_and_does_not_recompile(factory, kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_extra_args_are_accepted(name):
    variant_checks.check_extra_args_are_accepted(name)


def test_bad_hyperparameters_raise():
    with pytest.raises(ValueError, match="b2"):
        osa.sparse_amsgrad(0.1, b2=1.0)
