"""Test configuration: strict rank promotion, and 8 CPU devices for the sharding tests.

``jax_num_cpu_devices`` is set before jax first creates its backends; unlike an
``XLA_FLAGS`` default it cannot be silently overridden by the environment, and
the sharding tests fail (not skip) when the devices are missing.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
