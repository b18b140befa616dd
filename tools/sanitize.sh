#!/usr/bin/env bash
# The native kernels' tests under AddressSanitizer and UndefinedBehaviorSanitizer (`make sanitize`).
#
# The working tree (tracked files and untracked ones git does not ignore, as they are on disk now, uncommitted
# edits included) is copied into build/sanitize/src; the kernels are built there with setup.py, instrumented,
# and the kernel tests run from there, so that `import optax_sparse_adam` is the copy and the repository's own
# in-place optax_sparse_adam/_kernels.so is never touched.
#
# The tests: tests/test_kernels.py, tests/test_rowwise_kernels.py, tests/test_elementwise_kernels.py (and every other
# test module whose name holds "kernel"), tests/test_catch_up.py, tests/test_row_ops.py
# (the gather and distinct-ids kernels), and every other
# test under tests/ whose name mentions "kernel" or starts "test_catch_up" (the catch-up kernel's tests in the
# other optimizers' files), all without the slow ones (-m "not slow"); no -x, so every
# failure is reported. A sanitizer finding aborts the run (abort_on_error, halt_on_error) with its report.
#
# Environment: PY (default .venv/bin/python: jaxlib for the FFI headers, and the test extra), CXX (default
# g++; its own libasan and libubsan are preloaded), SANITIZE_TIMEOUT (seconds, default 2400). Arguments after
# the script's name go to pytest (e.g. `tools/sanitize.sh -k scatter`).
#
# Why each setting:
# - setup.py passes its flags as extra_compile_args, which come last on the compiler's line, and they hold -g0;
#   CXXFLAGS come before them, so -g there would be undone. The compiler is therefore a wrapper that appends the
#   sanitizer flags (and -g) after everything else, on the compile and the link line (the link line must name
#   -fsanitize too, so that the library needs libasan and libubsan). -O3 and the target_clones row loops stay
#   as they ship. -fno-wrapv undoes the -fwrapv that setuptools takes from Python's own CFLAGS: with it, signed
#   overflow is defined (wraps) and UBSan's signed-integer-overflow check is off; C++ does not define it, so
#   the kernels must not overflow, and this run checks that they do not.
# - Python is not linked with the sanitizers, so their runtimes are preloaded (ASan must be the first library
#   loaded, else "ASan runtime does not come first in initial library list").
# - detect_leaks=0: the interpreter and jaxlib keep memory until exit by design; those are no kernel's leaks.
# - No suppressions are needed (none is given): jaxlib, numpy and the interpreter are not instrumented, so
#   ASan and UBSan check the kernels' own code alone (ASan's malloc/free checks still see every library).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$ROOT/build/sanitize
SRC=$OUT/src
PY=${PY:-$ROOT/.venv/bin/python}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # absolute: the tests run in the copy
CXX_REAL=${CXX:-g++}
TIMEOUT=${SANITIZE_TIMEOUT:-2400}
SAN_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g -fno-wrapv"

[ -x "$PY" ] || { echo "sanitize: $PY not found (make test creates .venv; or set PY=...)"; exit 1; }
"$PY" -c 'import jaxlib, pytest' 2>/dev/null || { echo "sanitize: $PY lacks jaxlib or pytest (pip install -e '.[test]')"; exit 1; }

# 1. The copy: every tracked or untracked-but-not-ignored file that exists in the working tree now.
echo "sanitize: the working tree at $(git -C "$ROOT" rev-parse --short HEAD), $(git -C "$ROOT" status --porcelain | wc -l) paths changed"
rm -rf "$SRC"
mkdir -p "$SRC" "$OUT/bin"
git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
  | (cd "$ROOT" && while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done) \
  | tar -C "$ROOT" --null -T - -cf - | tar -C "$SRC" -xf -

# 2. The instrumented build, in place in the copy.
cat >"$OUT/bin/c++-sanitize" <<EOF
#!/bin/sh
exec $CXX_REAL "\$@" $SAN_FLAGS
EOF
chmod +x "$OUT/bin/c++-sanitize"
(cd "$SRC" && CC="$OUT/bin/c++-sanitize" CXX="$OUT/bin/c++-sanitize" OPTAX_SPARSE_ADAM_BUILD_KERNELS=1 \
  "$PY" setup.py -q build_ext --inplace --parallel 2) 2>&1 | tee "$OUT/build.log"
LIB=$SRC/optax_sparse_adam/_kernels.so
[ -f "$LIB" ] || { echo "sanitize: $LIB was not built (see $OUT/build.log)"; exit 1; }
for rt in libasan libubsan; do
  # grep -c reads all its input: grep -q would stop early and, under pipefail, fail the pipeline by SIGPIPE.
  [ "$(readelf -d "$LIB" | grep -c "NEEDED.*$rt")" -gt 0 ] || { echo "sanitize: $LIB does not need $rt: not instrumented"; exit 1; }
done
[ "$(nm -D "$LIB" | grep -c "__asan_report")" -gt 0 ] || { echo "sanitize: $LIB has no ASan checks"; exit 1; }

# 3. The runtime environment.
LD_PRELOAD="$($CXX_REAL -print-file-name=libasan.so) $($CXX_REAL -print-file-name=libubsan.so)"
export LD_PRELOAD
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
if command -v llvm-symbolizer >/dev/null 2>&1; then export ASAN_SYMBOLIZER_PATH=${ASAN_SYMBOLIZER_PATH:-$(command -v llvm-symbolizer)}; fi
export OPTAX_SPARSE_ADAM_REQUIRE_KERNELS=1
export PYTHONPATH=$SRC${PYTHONPATH:+:$PYTHONPATH}
cd "$SRC"

# The copy is what is imported, and its instrumented library is what is loaded.
"$PY" - "$SRC" <<'EOF'
import pathlib, sys
import optax_sparse_adam
from optax_sparse_adam import _kernel_path
src = pathlib.Path(sys.argv[1]).resolve()
mod = pathlib.Path(optax_sparse_adam.__file__).resolve()
print("sanitize: optax_sparse_adam from", mod)
assert src in mod.parents, f"optax_sparse_adam comes from {mod}, not the copy {src}"
assert _kernel_path.available(), "the kernels were not loaded"
lib = pathlib.Path(_kernel_path._LIB._name).resolve()
print("sanitize: kernels from", lib)
assert src in lib.parents, f"the kernels come from {lib}, not the copy"
maps = pathlib.Path("/proc/self/maps").read_text()
assert "libasan" in maps and "libubsan" in maps, "the sanitizer runtimes are not loaded"
EOF

# 4. The tests. -k selects by node name: the two kernel test modules and test_catch_up.py whole, and any
# test function elsewhere whose name holds "kernel" or "test_catch_up". The project's addopts (-q, --doctest-modules) are dropped:
# -v names each test as it starts, so that a sanitizer's abort shows which test triggered it.
PLUGINS=()
"$PY" -c 'import pytest_randomly' 2>/dev/null && PLUGINS=(-p no:randomly)
start=$(date +%s)
set +e
timeout "$TIMEOUT" "$PY" -m pytest "${PLUGINS[@]}" -p no:cacheprovider -o addopts="" -v -rfEs \
  -m "not slow" -k "kernel or test_catch_up or test_row_ops" tests "$@" 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
set -e
echo "sanitize: pytest exited $rc after $(($(date +%s) - start)) s (log: $OUT/pytest.log)"
exit "$rc"
