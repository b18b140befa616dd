"""The package's namespace and import: only ``__all__`` is public, and importing it loads no more than it needs."""

from __future__ import annotations

import subprocess
import sys
import types

import optax_sparse_adam as osa


def test_public_names_are_exactly_all():
    public = {n for n in dir(osa) if not n.startswith("_") and not isinstance(getattr(osa, n), types.ModuleType)}
    assert public == set(osa.__all__)
    assert isinstance(osa.__version__, str)


def test_import_does_not_load_jax_experimental_sparse():
    """BCOO support costs nothing until a BCOO exists (jax.experimental.sparse pulls scipy.sparse, ~0.4 s)."""
    code = (
        "import sys, optax_sparse_adam; "
        "print(sorted(m for m in sys.modules if m.startswith(('jax.experimental.sparse', 'scipy.sparse'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
