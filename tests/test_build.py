"""The sdist installs without a C++ compiler, and the library then runs its XLA path; the wheel holds the kernels.

Both build with this environment's setuptools and jaxlib (``--no-build-isolation``) and install with
``--target``, run through ``PYTHONPATH`` by this Python: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import numpy as np
import pytest

import optax_sparse_adam as osa

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parent.parent

# Two steps of an optimizer of each kernel source (Adam, Adam's catch-up, row-wise Adagrad on a float32 table and on
# a bfloat16 one rounded stochastically, element-wise Adagrad and FTRL, global-norm clipping) on a table of width 37
# (vector bodies and a tail on every ISA), with duplicate ids and padding: the tables and moments, run where the
# package is installed and here. ``run()`` gives them by optimizer.
STEPS = """
import jax, jax.numpy as jnp, optax
import optax_sparse_adam as osa

def run():
    opts = {
        "adam": (osa.sparse_adam(0.1), jnp.float32),
        "adam catch_up": (osa.sparse_adam(0.1, catch_up=True), jnp.float32),
        "rowwise_adagrad": (osa.sparse_rowwise_adagrad(0.1), jnp.float32),
        "rowwise_adagrad bfloat16": (osa.sparse_rowwise_adagrad(0.1), jnp.bfloat16),
        "adagrad": (osa.sparse_adagrad(0.1), jnp.float32),
        "ftrl": (osa.sparse_ftrl(0.1, l1_regularization_strength=0.01), jnp.float32),
        "clipped adam": (
            optax.chain(osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_adam(0.1)),
            jnp.float32,
        ),
    }
    ids = jnp.array([[3, 7, 3, -1, 50, 7, 7, 0], [7, 2, 2, 9, 60, 3, -1, 5]], jnp.int32)
    values = jnp.sin(jnp.arange(2 * 8 * 37, dtype=jnp.float32)).reshape(2, 8, 37)
    out = {}
    for name, (tx, dtype) in opts.items():
        p = jnp.cos(jnp.arange(64 * 37, dtype=jnp.float32)).reshape(64, 37).astype(dtype)
        s = tx.init(p)
        step = jax.jit(lambda p, s, i, v, k: osa.update_and_apply(tx, osa.IndexedRows(i, v, 64), s, p, key=k))
        for t in range(2):
            key = jax.random.key(t) if dtype == jnp.bfloat16 else None
            p, s = step(p, s, ids[t], values[t], key)
        out[name] = [x.astype(jnp.float32).tolist() for x in jax.tree.leaves((p, s))]
    return out
"""

STEP = (
    STEPS
    + """
import json
print(json.dumps({"file": osa.__file__, "path": osa.kernel_path(), "steps": run()}))
"""
)


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


def _sdist(source: pathlib.Path, dist: pathlib.Path) -> pathlib.Path:
    """The sdist of ``source``, built by setuptools' PEP 517 hook (what ``python -m build --sdist`` calls)."""
    hook = f"import setuptools.build_meta as b; print(b.build_sdist({str(dist)!r}))"
    name = subprocess.run(
        [sys.executable, "-c", hook], cwd=source, check=True, timeout=300, capture_output=True, text=True
    ).stdout.split()[-1]
    return dist / name


def _run(code: list[str], target: pathlib.Path, cwd: pathlib.Path) -> str:
    """``python *code`` with the package installed in ``target`` first on the path: its standard output."""
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("OPTAX_SPARSE_ADAM_KERNELS", None)
    return subprocess.run(
        [sys.executable, *code], env=env, cwd=cwd, check=True, timeout=300, capture_output=True, text=True
    ).stdout


def _step(target: pathlib.Path, cwd: pathlib.Path) -> dict:
    got = json.loads(_run(["-c", STEP], target, cwd).strip().splitlines()[-1])
    assert pathlib.Path(got["file"]).is_relative_to(target)
    return got


def _same_step_here(got: dict, kernels: bool) -> None:
    """``got`` equals the same steps run here, on the native kernels or the XLA path, bitwise."""
    scope: dict = {}
    exec(STEPS, scope)
    with osa.use_kernels(kernels):
        here = scope["run"]()
    assert set(got["steps"]) == set(here)
    for name, leaves in here.items():
        for a, b in zip(got["steps"][name], leaves, strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


def test_sdist_installs_without_a_compiler_and_runs_the_xla_path(tmp_path):
    sdist = _sdist(_clean_copy(tmp_path / "src"), tmp_path / "dist")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[-1] for n in tar.getnames()}  # inside optax_sparse_adam-<version>/
    assert {"setup.py", "optax_sparse_adam/csrc/sparse_adam.cc", "optax_sparse_adam/csrc/rows.h"} <= names

    target = tmp_path / "site"
    env = {**os.environ, "CC": "/bin/false", "CXX": "/bin/false", "LDSHARED": "/bin/false", "PIP_NO_INPUT": "1"}
    env.pop("OPTAX_SPARSE_ADAM_BUILD_KERNELS", None)
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps"]
    subprocess.run([*install, "--target", str(target), str(sdist)], env=env, check=True, timeout=600)
    assert not list((target / "optax_sparse_adam").glob("_kernels*")), "the extension was built without a compiler"

    got = _step(target, tmp_path)
    assert got["path"] == "xla"
    _same_step_here(got, kernels=False)
    report = dict(line.split(":", 1) for line in _run(["-m", "optax_sparse_adam"], target, tmp_path).splitlines())
    assert report["kernel path"].strip().startswith("xla: the native kernels were not built"), report


def test_wheel_holds_the_kernels_for_any_python_3_and_runs_them(tmp_path):
    """The wheel, built with ``OPTAX_SPARSE_ADAM_BUILD_KERNELS=baseline``: the portable code alone, in half the time
    of the full build (``make test``'s install builds that one), and on this machine a check that the baseline x86-64
    code computes what the AVX2 or AVX-512 clones this process runs compute, bitwise (no other test runs it)."""
    if not osa._kernel_path.available():
        pytest.skip("the native kernels were not built here (no C++ compiler at install time)")
    env = {**os.environ, "PIP_NO_INPUT": "1", "OPTAX_SPARSE_ADAM_BUILD_KERNELS": "baseline"}
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps"]
    subprocess.run(
        [*build, "-w", str(tmp_path / "dist"), str(_clean_copy(tmp_path / "src"))], env=env, check=True, timeout=600
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    # Loaded with ctypes, the library uses no Python C API: one wheel serves every Python 3 on this platform.
    assert wheel.name.endswith("-py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_") + ".whl")
    with zipfile.ZipFile(wheel) as zf:
        assert [n for n in zf.namelist() if "_kernels" in n] == ["optax_sparse_adam/_kernels.so"]

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    got = _step(target, tmp_path)
    assert got["path"] == "native-cpu"
    _same_step_here(got, kernels=True)


@pytest.mark.parametrize("jobs", ["0", "two", "-1"])
def test_a_build_asked_for_no_sensible_number_of_compiles_says_so(tmp_path, jobs):
    """``OPTAX_SPARSE_ADAM_BUILD_JOBS`` (the sources compiling at once; by default one a CPU) must be 1 or more: any
    other value stops the build with the variable's name, before anything compiles."""
    env = {**os.environ, "OPTAX_SPARSE_ADAM_BUILD_JOBS": jobs}
    env.pop("OPTAX_SPARSE_ADAM_BUILD_KERNELS", None)
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=_clean_copy(tmp_path / "src"),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert f"OPTAX_SPARSE_ADAM_BUILD_JOBS={jobs!r}: the number of compiles at once, 1 or more" in done.stderr
    assert "g++" not in done.stdout + done.stderr and "gcc" not in done.stdout + done.stderr


# What the kernels' AVX2 and AVX-512 clones may call: the C library, the C++ runtime, powf (the per-row bias
# corrections call it as XLA:CPU does), expf (AdamW's catch-up, a long-idle row's decay under a schedule, once a
# row), the constructors of std::vector<float> (a clone's buffers, made once a call:
# GCC may keep one out-of-line copy of them for all the clones) and other clones of their own ISA. Any other call is
# a row helper that was not inlined into them (rows.h's OSA_ROW_INLINE), running the baseline build, or reached
# through the PLT, once per element.
_CLONE_MAY_CALL = re.compile(
    r"<(?:(?:memset|memcpy|memmove|powf|expf|_Unwind_Resume)@plt|operator new|operator delete|std::__throw_\w+"
    r"|std::vector<float, std::allocator<float> >::vector\(|.*\[clone \.arch_x86_64_v[34]\])"
)


def out_of_line_calls(library: str) -> tuple[int, dict[str, set[str]]]:
    """The AVX2 and AVX-512 clones in ``library``'s disassembly, and for each that calls anything else, the callees."""
    text = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", library], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    clones, found, clone = 0, {}, None
    for line in text.splitlines():
        if line.endswith(">:"):
            clone = line if re.search(r"\[clone \.arch_x86_64_v[34]\]>:$", line) else None
            clones += clone is not None
        elif clone is not None and "\tcall " in line and not _CLONE_MAY_CALL.search(line):
            found.setdefault(clone.split(" <", 1)[1][:160], set()).add(line.split("<", 1)[1].rstrip(">"))
    return clones, found


def test_the_kernels_isa_clones_call_no_row_helper_out_of_line():
    if not osa._kernel_path.available():
        pytest.skip("the native kernels were not built here (no C++ compiler at install time)")
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    clones, found = out_of_line_calls(osa._kernel_path._LIB._name)
    if clones == 0:
        pytest.skip("the kernels were built without ISA clones (not GCC on x86-64, or the baseline build)")
    assert not found, found
