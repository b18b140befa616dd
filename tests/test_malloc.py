"""``tune_malloc``: a step with more than 32 MiB of temporaries stops faulting in fresh pages every call.

Each check runs in a subprocess: ``mallopt`` is process-wide, and the test process keeps glibc's defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import optax_sparse_adam as osa

SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import jax, jax.numpy as jnp
    import optax_sparse_adam as osa

    tuned = osa.tune_malloc() if sys.argv[1] == "tune" else None  # first thing, as its docs say

    @jax.jit
    def step(x):  # an outer product of 39 MiB, a temporary XLA:CPU allocates on every call
        return jnp.outer(x, x) @ x

    x = jnp.linspace(0.0, 1.0, 3200, dtype=jnp.float32)
    for _ in range(30):  # the heap settles over the first calls
        step(x).block_until_ready()
    faults = []  # each call's
    for _ in range(20):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step(x).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    report = osa.step_report(step, x)
    print(json.dumps({
        "tuned": tuned, "faults": faults, "temp_bytes": report.temp_bytes, "mapped": report.temporaries_mapped,
        "said": "osa.tune_malloc()" in str(report), "result": float(step(x)[7]),
    }))
    """
)


def _run(mode: str) -> dict:
    """The script in a process of its own, on the CPU (the heap it tunes is the host's, where XLA:CPU keeps a step's
    temporaries), also on a machine whose default device is a GPU."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=300, check=False, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _glibc() -> bool:
    return (
        sys.platform.startswith("linux")
        and "glibc" in subprocess.run(["ldd", "--version"], capture_output=True, text=True, check=False).stdout.lower()
    )


def test_tuned_malloc_keeps_a_steps_temporaries_in_the_heap():
    """Untuned, each call of a step with 39 MiB of temporaries (over glibc's 32 MiB limit) faults in every page of
    them, and the step report says so and what to do. With ``tune_malloc`` called first: once the heap has settled,
    the block is reused (few faults, most runs none), the report no longer says it, and the step's result is the
    same."""
    plain, tuned = _run("plain"), _run("tune")
    pages = plain["temp_bytes"] / 4096
    assert plain["temp_bytes"] > 32 * 2**20, plain
    assert min(plain["faults"]) >= 0.9 * pages and plain["mapped"] and plain["said"], plain  # every page, every call
    x = [i / 3199 for i in range(3200)]
    want = x[7] * sum(v * v for v in x)  # (x x^T) x = x |x|^2
    assert abs(plain["result"] - want) <= 1e-5 * want
    assert tuned["result"] == plain["result"]
    if not _glibc():
        assert tuned["tuned"] is False and min(tuned["faults"]) >= 0.9 * pages, tuned
        return
    assert tuned["tuned"] is True, tuned
    # Async dispatch can run one call's allocation before the last call's block is freed: now and then a call still
    # finds the heap short and grows it (none in most runs; a fifth to a quarter of the calls in some, on a loaded
    # machine). The typical call faults in none of the block.
    assert sorted(tuned["faults"])[len(tuned["faults"]) // 2] < 0.01 * pages, tuned
    assert not tuned["mapped"] and not tuned["said"], tuned


@pytest.mark.parametrize("threshold", [0, -1, 2**20, 2**25 - 1, 2**31, 1.5, True, "64"])
def test_tune_malloc_refuses_a_threshold_glibc_cannot_take_or_that_would_hurt(threshold):
    """Past int, or under glibc's own 32 MiB limit (a fixed threshold there stops glibc raising it: a 9.8 MiB
    temporary faulted every page every call at 1 MiB), refused before anything changes."""
    with pytest.raises(ValueError, match=r"threshold must be an int in \[32 MiB"):
        osa.tune_malloc(threshold)
    assert osa._malloc.malloc_tuned() is None
