"""Builds the optional native CPU kernels of optax_sparse_adam (XLA FFI handlers, ``optax_sparse_adam/csrc``).

The XLA FFI headers come from the installed jaxlib (a build requirement), never
from this repository. Without a C++17 compiler, without the headers, or with
``OPTAX_SPARSE_ADAM_BUILD_KERNELS=0``, the install still succeeds and the
library runs its portable XLA path. The code is built for the baseline x86-64
(or the compiler's default target elsewhere), with AVX2/FMA and AVX-512
versions of the row loops chosen at load time (``target_clones``);
``OPTAX_SPARSE_ADAM_BUILD_KERNELS=baseline`` builds the baseline code alone,
in about half the time: the same numbers, slower where the CPU has AVX2 or
AVX-512. With a Unix compiler (GCC, Clang) the sources compile side by side,
as many at once as the build has CPUs and memory for, about 1 GB each
(``OPTAX_SPARSE_ADAM_BUILD_JOBS=N`` for another number).

The library is a plain shared library that ``_kernel_path`` loads with ctypes:
it uses no Python C API, so its file name carries no Python version
(``_kernels.so``) and a wheel holding it is tagged ``py3-none-<platform>``
(``py3-none-any`` when it was not built).
"""

import functools
import os
import pathlib
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

CSRC = pathlib.Path("optax_sparse_adam") / "csrc"
SUFFIX = ".pyd" if sys.platform == "win32" else ".so"  # one that _kernel_path looks for on every Python version


def ffi_include_dir() -> str | None:
    try:
        import jaxlib
    except ImportError:
        return None
    include = pathlib.Path(jaxlib.__file__).resolve().parent / "include"
    return str(include) if (include / "xla" / "ffi" / "api" / "ffi.h").exists() else None


def available_cpus() -> int:
    affinity = getattr(os, "sched_getaffinity", None)  # Linux: the CPUs this process may run on
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


JOB_BYTES = 1 << 30  # what a compile may hold: the largest of the kernels' sources peaks at about 650 MB with g++


def jobs_memory_allows() -> int | None:
    """How many compiles of JOB_BYTES the memory available now holds, on Linux (the system's MemAvailable, and a
    cgroup v2 limit where the build runs under one, as in a container); ``None`` where it cannot tell."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        free = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        cgroup = pathlib.Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(1, free // JOB_BYTES)


def compile_in_parallel(
    compiler,
    jobs,
    sources,
    output_dir=None,
    macros=None,
    include_dirs=None,
    debug=False,
    extra_preargs=None,
    extra_postargs=None,
    depends=None,
):
    """``compiler.compile``, with up to ``jobs`` sources compiling at once: CCompiler.compile's own steps, its loop
    over the out-of-date objects run on a thread pool (each compile is a process of its own)."""
    try:
        setup_compile, cc_args_of, compile_object = compiler._setup_compile, compiler._get_cc_args, compiler._compile
    except AttributeError:  # a setuptools whose compilers no longer have these: its own loop
        return type(compiler).compile(
            compiler, sources, output_dir, macros, include_dirs, debug, extra_preargs, extra_postargs, depends
        )
    macros, objects, extra_postargs, pp_opts, build = setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs
    )
    cc_args = cc_args_of(pp_opts, debug, extra_preargs)

    def compile_one(obj):
        src, ext = build[obj]
        compile_object(obj, src, ext, cc_args, extra_postargs, pp_opts)

    todo = [obj for obj in objects if obj in build]
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(compile_one, todo))
    except RuntimeError:  # no thread could be started (a process limit): one after another
        for obj in todo:
            compile_one(obj)
    return objects


class BuildKernels(build_ext):
    """Builds the kernels where they can be built, under a file name without a Python tag."""

    def run(self) -> None:
        # Whatever an earlier build left (under another name, or not built now) would be packed, or loaded, too.
        folders = [pathlib.Path(self.build_lib) / "optax_sparse_adam"]
        if self.inplace:  # an editable install: the library goes next to the sources
            folders.append(CSRC.parent)
        for old in [lib for folder in folders for lib in folder.glob("_kernels.*")]:
            old.unlink()
        include = ffi_include_dir()
        if os.environ.get("OPTAX_SPARSE_ADAM_BUILD_KERNELS", "1") == "0":
            self.announce("OPTAX_SPARSE_ADAM_BUILD_KERNELS=0: the native kernels are not built", level=2)
            return
        if include is None:
            self.announce("jaxlib's XLA FFI headers were not found: the native kernels are not built", level=2)
            return
        baseline = os.environ.get("OPTAX_SPARSE_ADAM_BUILD_KERNELS") == "baseline"
        for ext in self.extensions:
            ext.extra_compile_args = ["-isystem", include, *ext.extra_compile_args]
            if baseline:  # rows.h: no AVX2 or AVX-512 clones of the row loops
                ext.extra_compile_args.append("-DOSA_BASELINE_ONLY")
        super().run()

    def build_extensions(self) -> None:
        # setuptools compiles an extension's sources one after another; the kernels' compile side by side, as many
        # at once as this process has CPUs and the memory holds (OPTAX_SPARSE_ADAM_BUILD_JOBS to choose).
        asked = os.environ.get("OPTAX_SPARSE_ADAM_BUILD_JOBS", "")
        if asked and not (asked.isdigit() and int(asked) > 0):
            raise ValueError(f"OPTAX_SPARSE_ADAM_BUILD_JOBS={asked!r}: the number of compiles at once, 1 or more")
        jobs = int(asked) if asked else available_cpus()
        if not asked and (memory := jobs_memory_allows()) is not None:
            jobs = min(jobs, memory)
        # A Unix compiler's compile() loops over _compile(); MSVC's has a loop of its own, left as it is.
        if jobs > 1 and self.compiler.compiler_type == "unix":
            self.compiler.compile = functools.partial(compile_in_parallel, self.compiler, jobs)
        super().build_extensions()

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + SUFFIX


class BdistWheel(bdist_wheel):
    """Tags the wheel for any Python 3 on this platform: the library is loaded with ctypes, not imported."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        built = any((pathlib.Path(self.bdist_dir or "") / "optax_sparse_adam").glob("_kernels*"))
        return "py3", "none", platform if built else "any"


KERNELS = Extension(
    "optax_sparse_adam._kernels",
    sources=[str(p) for p in sorted(CSRC.glob("*.cc"))],
    depends=[str(p) for p in sorted(CSRC.glob("*.h"))],  # listed, so that the sdist holds them too
    include_dirs=[str(CSRC)],
    language="c++",
    # No fast-math and no contraction: the kernels' rounding must equal the XLA path's.
    # -fno-math-errno after -fno-fast-math (which turns errno back on): with errno,
    # sqrt is a branch and the row loops are not vectorized. -fno-trapping-math: no
    # floating-point exceptions are looked at, so both sides of a select may be
    # computed (the float16 conversions' loops vectorize; values are unchanged). No
    # debug information: it is 15 times the code's size.
    extra_compile_args=[
        "-std=c++17",
        "-O3",
        "-ffp-contract=off",
        "-fno-fast-math",
        "-fno-math-errno",
        "-fno-trapping-math",
        "-g0",
    ],
    optional=True,
)

setup(ext_modules=[KERNELS], cmdclass={"build_ext": BuildKernels, "bdist_wheel": BdistWheel})
