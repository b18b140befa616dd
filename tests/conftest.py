"""Test configuration: strict rank promotion, and 8 host devices for sharding tests."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402

import optax_sparse_adam as osa  # noqa: E402


@pytest.fixture(params=["native-cpu", "xla"])
def kernel_path(request: pytest.FixtureRequest):
    """Runs a test on the native CPU kernels and again on the XLA path."""
    with osa.use_kernels(request.param == "native-cpu"):
        if osa.kernel_path() != request.param:
            pytest.skip("the native kernels were not built (no C++ compiler at install time)")
        yield request.param
