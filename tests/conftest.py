"""Test configuration: strict rank promotion, and 8 host devices for sharding tests."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
