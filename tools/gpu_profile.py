"""Profiles a step's two doors on jax's default device (1e6 x 64, 8,192 Zipf ids a step): timings, each door's
compiled program and a perfetto trace of its kernels (``{door}.trace.json.gz``), to $OUT. VARIANT picks the
optimizer (``plain``: ``sparse_adam``; ``catch_up``; ``catch_up_schedule``; ``adamw_catch_up_schedule``), WARM the
steps each door takes on its own table before the timing (so that rows have idle histories).

    OUT=build/gpu VARIANT=catch_up_schedule PYTHONPATH=. python tools/gpu_profile.py
"""

from __future__ import annotations

import os
import pathlib
import shutil
import statistics
import sys
import time

import jax
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
from contenders import sample_ids, sparse_step

import optax_sparse_adam as osa

OUT = pathlib.Path(os.environ.get("OUT", "build/gpu"))
ROWS, WIDTH, BATCH = 10**6, 64, int(os.environ.get("BATCH", 8192))
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 100_000)
VARIANTS = {
    "plain": lambda: osa.sparse_adam(1e-3),
    "catch_up": lambda: osa.sparse_adam(1e-3, catch_up=True),
    "catch_up_schedule": lambda: osa.sparse_adam(SCHEDULE, catch_up=True),
    "adamw_catch_up_schedule": lambda: osa.sparse_adamw(SCHEDULE, weight_decay=1e-4, catch_up=True),
}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    ids = [jax.device_put(sample_ids(rng, ROWS, BATCH, "zipf")) for _ in range(16)]
    values = jax.device_put(rng.standard_normal((BATCH, WIDTH), dtype=np.float32))
    steps = {}
    for name, fused in (("fused", True), ("two_calls", False)):
        tx = VARIANTS[os.environ.get("VARIANT", "plain")]()
        _, step = sparse_step(ROWS, fused, tx)
        jitted = jax.jit(step, donate_argnums=(0, 1))
        params = jax.numpy.full((ROWS, WIDTH), 0.01, jax.numpy.float32)
        state = tx.init(params)
        compiled = jitted.lower(params, state, ids[0], values).compile()
        (OUT / f"{name}.hlo.txt").write_text(compiled.as_text())
        for i in range(int(os.environ.get("WARM", 0))):
            params, state = jitted(params, state, ids[i % 16], values)
        steps[name] = [jitted, params, state]
    times: dict[str, list[float]] = {k: [] for k in steps}
    for rnd in range(int(os.environ.get("ROUNDS", 6))):
        for name, s in steps.items():
            for i in range(int(os.environ.get("STEPS", 200))):
                start = time.perf_counter()
                s[1], s[2] = s[0](s[1], s[2], ids[i % 16], values)
                jax.block_until_ready(s[1])
                if rnd:
                    times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"{name}: median {1e3 * statistics.median(t):.4f} ms, min {1e3 * min(t):.4f}", flush=True)
    # Back to back, no wait between steps: the device's own time per step.
    for name, s in steps.items():
        jax.block_until_ready(s[1])
        start = time.perf_counter()
        for i in range(500):
            s[1], s[2] = s[0](s[1], s[2], ids[i % 16], values)
        jax.block_until_ready(s[1])
        print(f"{name}: pipelined {1e3 * (time.perf_counter() - start) / 500:.4f} ms/step", flush=True)
    for name, s in steps.items():
        with jax.profiler.trace(str(OUT / f"trace_{name}"), create_perfetto_trace=True):
            for i in range(5):
                s[1], s[2] = s[0](s[1], s[2], ids[i % 16], values)
                jax.block_until_ready(s[1])
        for trace in (OUT / f"trace_{name}").rglob("perfetto_trace.json.gz"):
            shutil.copy(trace, OUT / f"{name}.trace.json.gz")
        shutil.rmtree(OUT / f"trace_{name}")


if __name__ == "__main__":
    main()
