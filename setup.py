"""Builds the optional native CPU kernels of optax_sparse_adam (XLA FFI handlers, ``optax_sparse_adam/csrc``).

The XLA FFI headers come from the installed jaxlib (a build requirement), never
from this repository. Without a C++17 compiler, without the headers, or with
``OPTAX_SPARSE_ADAM_BUILD_KERNELS=0``, the install still succeeds and the
library runs its portable XLA path. The code is built for the baseline x86-64
(or the compiler's default target elsewhere), with AVX2/FMA and AVX-512
versions of the row loops chosen at load time (``target_clones``).
"""

import os
import pathlib

from setuptools import Extension, setup

CSRC = pathlib.Path("optax_sparse_adam") / "csrc"


def ffi_include_dir() -> str | None:
    try:
        import jaxlib
    except ImportError:
        return None
    include = pathlib.Path(jaxlib.__file__).resolve().parent / "include"
    return str(include) if (include / "xla" / "ffi" / "api" / "ffi.h").exists() else None


def extensions() -> list[Extension]:
    include = ffi_include_dir()
    if os.environ.get("OPTAX_SPARSE_ADAM_BUILD_KERNELS", "1") == "0" or include is None:
        return []
    return [
        Extension(
            "optax_sparse_adam._kernels",
            sources=[str(p) for p in sorted(CSRC.glob("*.cc"))],
            depends=[str(p) for p in sorted(CSRC.glob("*.h"))],
            include_dirs=[str(CSRC)],
            language="c++",
            # No fast-math and no contraction: the kernels' rounding must equal the XLA path's.
            # -fno-math-errno after -fno-fast-math (which turns errno back on): with errno,
            # sqrt is a branch and the row loops are not vectorized.
            extra_compile_args=[
                "-isystem",
                include,
                "-std=c++17",
                "-O3",
                "-ffp-contract=off",
                "-fno-fast-math",
                "-fno-math-errno",
            ],
            optional=True,
        )
    ]


setup(ext_modules=extensions())
