#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA GPU, jax's CUDA plugin and the test extra's packages: the GPU benchmark
# (benchmarks/gpu.py) and the quick test suite on the GPU as jax's default device. The library runs its XLA path
# there (the native kernels are CPU-only and are not built). Each part is bounded in time; results go to $OUT.
#   OUT=build/gpu tools/gpu_check.sh
set -u
OUT=${OUT:-build/gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv
$PY -c "import jax, jaxlib, optax, torch; print(jax.devices(), 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'optax', optax.__version__, 'torch', torch.__version__, torch.cuda.is_available())"
$PY -m pip list 2>/dev/null | grep -iE "^(flax|chex|hypothesis|pytest|orbax-checkpoint|pytest-xdist|pytest-timeout|numpy) "
timeout -s INT "${BENCH_S:-300}" $PY benchmarks/gpu.py --json "$OUT/gpu.json" 2>&1 | tee "$OUT/bench.log" | tail -40
# Which parts of a training step repeat bit for bit there, with XLA's defaults and with deterministic ops.
timeout 90 $PY tools/gpu_repeat.py 2>&1 | tee "$OUT/repeat.log"
XLA_FLAGS="--xla_gpu_deterministic_ops=true ${XLA_FLAGS:-}" timeout 90 $PY tools/gpu_repeat.py 2>&1 | tee -a "$OUT/repeat.log"
# test_notebook needs nbformat, which a GPU image may lack: it is left out there.
NOTEBOOK=$($PY -c "import nbformat" 2>/dev/null || echo "--ignore tests/test_notebook.py")
# The sharding tests need the 8 simulated CPU devices that tests/conftest.py asks for, where the GPU is jax's one
# default device: most are left to the CPU runs (test_row_engine's place their meshes on those CPU devices). pytest-benchmark, where installed, warns under xdist (an error here).
timeout -s INT "${TEST_S:-330}" $PY -m pytest -m "not slow" -n "${WORKERS:-12}" -p no:cacheprovider -p no:benchmark \
  --timeout 120 --ignore tests/test_row_sharding.py $NOTEBOOK -k "not sharded" --junitxml "$OUT/junit.xml" -rfE --tb=line --durations 10 "$@" > "$OUT/tests.log" 2>&1
echo "pytest exit: $?"
grep -E "passed|failed" "$OUT/tests.log" | tail -3
