"""Installing without a C++ compiler still succeeds, and the library then runs its XLA path."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_sparse_adam as osa

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parent.parent

STEP = """
import json, sys
import jax.numpy as jnp
import optax_sparse_adam as osa

tx = osa.sparse_adam(0.1)
p = jnp.ones((6, 2), jnp.float32)
g = osa.IndexedRows(jnp.array([1, 1, 4, -1], jnp.int32), jnp.arange(8, dtype=jnp.float32).reshape(4, 2), 6)
p, s = osa.update_and_apply(tx, g, tx.init(p), p)
print(json.dumps({"file": osa.__file__, "path": osa.kernel_path(), "p": p.tolist(), "nu": s[0].nu.tolist()}))
"""


def _clean_copy(dest: pathlib.Path) -> pathlib.Path:
    """The working tree without ignored files (no built extension, no build directory), as a fresh clone has it."""
    files = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / os.fsdecode(name)
        if src.is_file():
            (dest / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / os.fsdecode(name))
    return dest


def test_install_without_a_compiler_runs_the_xla_path(tmp_path):
    source = _clean_copy(tmp_path / "src")
    target = tmp_path / "site"
    env = {**os.environ, "CC": "/bin/false", "CXX": "/bin/false", "LDSHARED": "/bin/false", "PIP_NO_INPUT": "1"}
    env.pop("OPTAX_SPARSE_ADAM_BUILD_KERNELS", None)
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps"]
    subprocess.run([*install, "--target", str(target), str(source)], env=env, check=True, timeout=600)
    assert not list((target / "optax_sparse_adam").glob("_kernels*")), "the extension was built without a compiler"

    out = subprocess.run(
        [sys.executable, "-c", STEP],
        env={**os.environ, "PYTHONPATH": str(target)},
        cwd=tmp_path,
        check=True,
        timeout=300,
        capture_output=True,
        text=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert pathlib.Path(got["file"]).is_relative_to(target)
    assert got["path"] == "xla"

    with osa.use_kernels(False):  # the same step here, on the XLA path
        tx = osa.sparse_adam(0.1)
        p = jnp.ones((6, 2), jnp.float32)
        g = osa.IndexedRows(jnp.array([1, 1, 4, -1], jnp.int32), jnp.arange(8, dtype=jnp.float32).reshape(4, 2), 6)
        p, s = jax.jit(lambda p, s: osa.update_and_apply(tx, g, s, p))(p, tx.init(p))
    np.testing.assert_array_equal(np.asarray(got["p"], np.float32), p)
    np.testing.assert_array_equal(np.asarray(got["nu"], np.float32), s[0].nu)
