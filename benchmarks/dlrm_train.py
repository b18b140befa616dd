"""The whole DLRM train step: the library against the same model in PyTorch.

The model of ``examples/dlrm.py``: a bottom MLP (13 -> 64 -> width, ReLU) on
13 dense features, the 26 features' pooled embeddings (sum), the dot
products of the 27 vectors' pairs (351), a top MLP (width + 351 -> 64 -> 1)
and binary cross-entropy on the logits. One training step: forward,
backward, and the optimizers' updates of the tables and the MLPs. Every
contender starts from the same parameters and takes the same batches
(``benchmarks/dlrm.py``'s Zipf ids, dense features drawn from a normal law,
labels from a fair coin: the step's cost does not depend on what it learns).

Contenders:

- **library Adam**: an ``EmbeddingCollection`` (one stack),
  ``partition_tables(sparse_adam(eps_placement="torch"), optax.adam)``, ``value_and_row_grad`` and
  ``update_and_apply`` in one jitted, donated step;
- **library row-wise Adagrad**: the same, the tables trained by
  ``sparse_rowwise_adagrad``;
- **PyTorch**: 26 ``nn.EmbeddingBag(mode="sum", sparse=True)`` with
  ``torch.optim.SparseAdam``, the MLPs with ``torch.optim.Adam(fused=True)``;
- **dense optax.adam**: ``jax.grad`` of the same loss (table-sized gradients)
  and ``optax.adam`` on every parameter, jitted, donated; timed apart, with
  fewer steps.

Before timing, the library's Adam step and PyTorch's are run side by side for
a few steps from the same parameters on small tables, and their losses and
tables compared (``agreement``).

    python benchmarks/dlrm_train.py            # writes benchmarks/results/dlrm_train.json
    python benchmarks/dlrm_train.py --quick    # small tables, a few steps: dlrm_train_quick.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as benchmarks/dlrm.py: PyTorch's threads sleep, not spin

import dlrm
import jax
import jax.numpy as jnp
import numpy as np
import optax
import report
import torch
from contenders import JaxStepper, Stepper, TimingPlan, release, time_steppers

import optax_sparse_adam as osa

FEATURES = dlrm.FEATURES
HIDDEN = 64  # the example's MLPs' hidden width
MLP_LR = 1e-3
PAIRS = np.triu_indices(len(FEATURES) + 1, k=1)


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    label: str
    make: Callable[..., Stepper]
    dense: bool = False


@dataclasses.dataclass
class Batches:
    """Each batch's ids (feature name to ``(batch,)`` or ``(batch, bag)``), dense features and labels."""

    ids: list[dict[str, np.ndarray]]
    dense: list[np.ndarray]
    labels: list[np.ndarray]


def make_batches(cfg: dlrm.DlrmConfig, pool: int, seed: int) -> Batches:
    rng = np.random.default_rng(seed + 1)
    ids = dlrm.make_data(cfg, pool, seed).ids
    dense = [rng.standard_normal((cfg.batch, NUM_DENSE), dtype=np.float32) for _ in ids]
    labels = [(rng.random(cfg.batch) < 0.5).astype(np.float32) for _ in ids]
    return Batches(ids, dense, labels)


# ---------------------------------------------------------------------------------------------------------------------
# The model, in JAX.


def _example() -> Any:
    """``examples/dlrm.py``, whose model this is (its MLPs' initializer and layers)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "dlrm.py"
    spec = importlib.util.spec_from_file_location("dlrm_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()
NUM_DENSE, _mlp = EXAMPLE.NUM_DENSE, EXAMPLE.mlp


def init_params(cfg: dlrm.DlrmConfig, seed: int) -> dict[str, Any]:
    """The stacked tables and the MLPs (He-normal weights, zero biases), as ``examples/dlrm.py`` draws them."""
    k_emb, k_bot, k_top = jax.random.split(jax.random.key(seed), 3)
    return {
        "emb": dlrm.collection(cfg).init(k_emb),
        "bottom": EXAMPLE.mlp_init(k_bot, [NUM_DENSE, HIDDEN, cfg.width]),
        "top": EXAMPLE.mlp_init(k_top, [cfg.width + PAIRS[0].size, HIDDEN, 1]),
    }


def loss_fn(coll: osa.EmbeddingCollection) -> Callable[..., jax.Array]:
    def loss(p: Any, bags: Any, dense: jax.Array, labels: jax.Array) -> jax.Array:
        pooled = coll.pool(p["emb"], bags)
        x = _mlp(p["bottom"], dense, final_relu=True)
        vectors = jnp.stack([x, *(pooled[f] for f in FEATURES)], axis=1)  # (batch, 27, width)
        dots = jnp.einsum("bid,bjd->bij", vectors, vectors)[:, PAIRS[0], PAIRS[1]]
        logits = _mlp(p["top"], jnp.concatenate([x, dots], axis=1), final_relu=False)[:, 0]
        return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

    return loss


def _library_step(cfg: dlrm.DlrmConfig, tables_tx: optax.GradientTransformation) -> tuple[Callable[..., Any], Any]:
    coll = dlrm.collection(cfg)
    tx = osa.partition_tables(tables_tx, optax.adam(MLP_LR), lambda p: p["emb"])
    grad_fn = osa.value_and_row_grad(loss_fn(coll), lambda p: p["emb"])

    def step(p: Any, s: Any, ids: Any, dense: jax.Array, labels: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = grad_fn(p, coll.bags(ids), dense, labels)
        p, s = osa.update_and_apply(tx, grads, s, p)
        return p, s, loss

    return step, tx


def _jax_inputs(b: Batches) -> list[tuple[Any, ...]]:
    return [
        ({f: jnp.asarray(x) for f, x in ids.items()}, jnp.asarray(d), jnp.asarray(y))
        for ids, d, y in zip(b.ids, b.dense, b.labels, strict=True)
    ]


def _jax_stepper(step: Callable[..., Any], tx: Any, cfg: dlrm.DlrmConfig, b: Batches, seed: int) -> Stepper:
    def without_loss(p: Any, s: Any, *inputs: Any) -> tuple[Any, Any]:
        return step(p, s, *inputs)[:2]

    params = init_params(cfg, seed)
    return JaxStepper(jax.jit(without_loss, donate_argnums=(0, 1)), params, tx.init(params), _jax_inputs(b))


def library_adam() -> optax.GradientTransformation:
    """Lazy Adam with ``torch.optim.SparseAdam``'s ``eps`` (added to ``sqrt(v)`` before its bias correction): a
    gradient element near ``eps`` moves a row as PyTorch moves it."""
    return osa.sparse_adam(dlrm.ADAM_LR, eps_placement="torch")


def make_osa_adam(cfg: dlrm.DlrmConfig, b: Batches, seed: int) -> Stepper:
    return _jax_stepper(*_library_step(cfg, library_adam()), cfg, b, seed)


def make_osa_rowwise_adagrad(cfg: dlrm.DlrmConfig, b: Batches, seed: int) -> Stepper:
    tables_tx = osa.sparse_rowwise_adagrad(dlrm.ADAGRAD_LR, eps=dlrm.ADAGRAD_EPS)
    return _jax_stepper(*_library_step(cfg, tables_tx), cfg, b, seed)


def make_optax_adam(cfg: dlrm.DlrmConfig, b: Batches, seed: int) -> Stepper:
    coll = dlrm.collection(cfg)
    tx = optax.adam(MLP_LR)
    loss = loss_fn(coll)

    def step(p: Any, s: Any, ids: Any, dense: jax.Array, labels: jax.Array) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(p, coll.bags(ids), dense, labels)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    return _jax_stepper(step, tx, cfg, b, seed)


# ---------------------------------------------------------------------------------------------------------------------
# The model, in PyTorch.


class TorchDLRM(torch.nn.Module):
    """The same model: 26 ``EmbeddingBag(mode="sum", sparse=True)``, the MLPs, the pairs' dot products."""

    def __init__(self, cfg: dlrm.DlrmConfig, params: dict[str, Any]) -> None:
        super().__init__()
        coll = dlrm.collection(cfg)
        stacks = jax.device_get(params["emb"])
        self.emb = torch.nn.ModuleList()
        for f, rows in zip(FEATURES, cfg.rows, strict=True):
            bag = torch.nn.EmbeddingBag(rows, cfg.width, mode="sum", sparse=True)
            with torch.no_grad():
                bag.weight.copy_(torch.from_numpy(np.array(coll.table(stacks, f))))
            self.emb.append(bag)
        self.bottom = self._mlp(params["bottom"], final_relu=True)
        self.top = self._mlp(params["top"], final_relu=False)
        self.pairs = (torch.from_numpy(PAIRS[0]), torch.from_numpy(PAIRS[1]))

    @staticmethod
    def _mlp(layers: list[dict[str, Any]], final_relu: bool) -> torch.nn.Sequential:
        modules: list[torch.nn.Module] = []
        for i, layer in enumerate(layers):
            w, b = np.asarray(layer["w"]), np.asarray(layer["b"])
            linear = torch.nn.Linear(*w.shape)
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(np.array(w.T)))
                linear.bias.copy_(torch.from_numpy(np.array(b)))
            modules.append(linear)
            if i < len(layers) - 1 or final_relu:
                modules.append(torch.nn.ReLU())
        return torch.nn.Sequential(*modules)

    def forward(self, ids: list[torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x, *(e(i) for e, i in zip(self.emb, ids, strict=True))], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, dots], dim=1))[:, 0]


def _torch_inputs(b: Batches) -> list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]]:
    return [
        (
            [torch.from_numpy(ids[f].astype(np.int64)).reshape(d.shape[0], -1) for f in FEATURES],
            torch.from_numpy(d),
            torch.from_numpy(y),
        )
        for ids, d, y in zip(b.ids, b.dense, b.labels, strict=True)
    ]


def torch_trainer(cfg: dlrm.DlrmConfig, seed: int) -> tuple[TorchDLRM, Callable[..., torch.Tensor]]:
    """The PyTorch model from the library's initial parameters, and its step (returning the loss)."""
    model = TorchDLRM(cfg, init_params(cfg, seed))
    sparse = torch.optim.SparseAdam(list(model.emb.parameters()), lr=dlrm.ADAM_LR)
    dense = torch.optim.Adam([*model.bottom.parameters(), *model.top.parameters()], lr=MLP_LR, fused=True)
    bce = torch.nn.BCEWithLogitsLoss()

    def step(ids: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = bce(model(ids, x), y)
        sparse.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
        loss.backward()
        sparse.step()
        dense.step()
        return loss

    return model, step


def make_torch(cfg: dlrm.DlrmConfig, b: Batches, seed: int) -> Stepper:
    _, step = torch_trainer(cfg, seed)
    inputs = _torch_inputs(b)

    def run(i: int) -> None:
        step(*inputs[i % len(inputs)])

    return run


CONTENDERS = (
    Contender("osa_adam", "library Adam (tables) + Adam (MLPs)", make_osa_adam),
    Contender("osa_rowwise_adagrad", "library row-wise Adagrad (tables) + Adam (MLPs)", make_osa_rowwise_adagrad),
    Contender("torch", "PyTorch EmbeddingBag + SparseAdam, Adam(fused=True)", make_torch),
    Contender("optax_adam", "dense optax.adam", make_optax_adam, dense=True),
)


# ---------------------------------------------------------------------------------------------------------------------
# Agreement, timing, the report.


def agreement(seed: int, steps: int = 5) -> dict[str, Any]:
    """The library's Adam step and PyTorch's, ``steps`` steps from the same parameters on the same batches (tables
    capped at 1,000 rows, 64 examples of DLRMv2's bags): each step's loss, and the largest difference of the tables
    after the last."""
    cfg = dlrm.DlrmConfig("agreement", 64, dlrm.DLRMV2_BAGS, 1000, 16)
    b = make_batches(cfg, steps, seed)
    step, tx = _library_step(cfg, library_adam())
    params = init_params(cfg, seed)
    state = tx.init(params)
    model, torch_step = torch_trainer(cfg, seed)
    ours, theirs = [], []
    for inputs, t_inputs in zip(_jax_inputs(b), _torch_inputs(b), strict=True):
        params, state, loss = jax.jit(step)(params, state, *inputs)
        ours.append(float(loss))
        theirs.append(float(torch_step(*t_inputs).detach()))
    coll = dlrm.collection(cfg)
    stacks = jax.device_get(params["emb"])
    diff = max(
        float(np.abs(np.asarray(coll.table(stacks, f)) - e.weight.detach().numpy()).max())
        for f, e in zip(FEATURES, model.emb, strict=True)
    )
    return {
        "steps": steps,
        "library_losses": ours,
        "torch_losses": theirs,
        "max_rel_loss_diff": max(abs(a - t) / abs(t) for a, t in zip(ours, theirs, strict=True)),
        "max_abs_table_diff": diff,
    }


def run_config(cfg: dlrm.DlrmConfig, args: argparse.Namespace, plan: TimingPlan, dense_plan: TimingPlan) -> dict:
    b = make_batches(cfg, args.pool, args.seed)
    steppers: dict[str, Stepper] = {}
    results: dict[str, Any] = {}
    for c in CONTENDERS:
        if c.dense or c.name not in args.contenders:
            continue
        print(f"  building {c.name}", file=sys.stderr)
        steppers[c.name] = c.make(cfg, b, args.seed)
        for i in (args.pool - 2, args.pool - 1):  # compilation and first steps, untimed
            steppers[c.name](i)
    print(f"  {dlrm.load()}", file=sys.stderr)
    for name, samples in time_steppers(steppers, plan).items():
        results[name] = dlrm.summarize(samples)
    del steppers
    release()
    for c in CONTENDERS:
        if c.dense and c.name in args.contenders:
            print(f"  timing {c.name} (dense, fewer steps)", file=sys.stderr)
            results[c.name] = dlrm.summarize(time_steppers({c.name: c.make(cfg, b, args.seed)}, dense_plan)[c.name])
            release()
    torch_ms = results.get("torch", {}).get("median_ms")
    return {
        "config": dataclasses.asdict(cfg),
        "label": cfg.label,
        "results": results,
        "torch_over": {n: torch_ms / r["median_ms"] for n, r in results.items()} if torch_ms else {},
    }


def markdown(doc: dict[str, Any]) -> str:
    """The body of the docs' section: the agreement, then a table per configuration."""
    a = doc["agreement"]
    m = doc["machine"]
    info = m.get("optax_sparse_adam", {})
    lines = [
        f"Measured at commit `{str(info.get('commit', 'unknown'))[:7]}`"
        f"{' (modified tree)' if info.get('modified') else ''} on {m.get('cores')} cores ({m.get('cpu')}), "
        f"{m.get('date_utc')}, load average {', '.join(f'{x:.2f}' for x in m.get('load_average_start', []))} at "
        f"the start; PyTorch on {doc['settings']['threads']} threads. `python benchmarks/dlrm_train.py` rewrites "
        "the results file.",
        "",
        f"Agreement: {a['steps']} steps of the library's Adam step and PyTorch's from the same parameters (tables "
        "capped at 1,000 rows, 64 examples of DLRMv2's bags): the losses differ by at most "
        f"{a['max_rel_loss_diff']:.1e} (relative), the tables by at most {a['max_abs_table_diff']:.1e} after the "
        "last step.",
    ]
    labels = {c.name: c.label for c in CONTENDERS}
    for record in doc["configs"]:
        lines += [
            "",
            f"### {record['label']}",
            "",
            "| contender | median ms | min ms | q1 - q3 ms | steps | PyTorch / this |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, r in record["results"].items():
            over = record["torch_over"].get(name)
            lines.append(
                f"| {labels[name]} | {dlrm._ms(r['median_ms'])} | {dlrm._ms(r['min_ms'])} | "
                f"{dlrm._ms(r['q1_ms'])} - {dlrm._ms(r['q3_ms'])} | {r['n']} | "
                f"{'-' if over is None else f'{over:.2f}x'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20,000-row caps and a few steps: a smoke run")
    parser.add_argument("--cap", type=int, default=None, help="rows per table at most (default 1e6; 20,000 quick)")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--pool", type=int, default=16, help="batches drawn per configuration, cycled")
    parser.add_argument("--threads", type=int, default=2, help="PyTorch's threads and the library's kernel threads")
    parser.add_argument("--configs", nargs="+", choices=("kaggle", "dlrmv2"), default=["kaggle", "dlrmv2"])
    names = [c.name for c in CONTENDERS]
    parser.add_argument("--contenders", nargs="+", choices=names, default=names)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    cap = args.cap or (20_000 if args.quick else 10**6)
    if args.quick:
        plan = TimingPlan(warmup=2, timed=4, min_timed=2, budget_s=1.0, rounds=2)
        dense_plan = TimingPlan(warmup=2, timed=2, min_timed=2, budget_s=1.0, rounds=1)
    else:
        plan = TimingPlan(warmup=5, timed=60, min_timed=10, budget_s=4.0, rounds=12)
        dense_plan = TimingPlan(warmup=3, timed=10, min_timed=5, budget_s=6.0, rounds=1)
    configs = dlrm.standard_configs(cap, args.width)
    machine = report.machine_info(args.threads)
    with osa.use_kernels(True, threads=min(args.threads, 16)):
        agree = agreement(args.seed)
        print(f"agreement: {json.dumps(agree)}", flush=True)
        records = []
        for name in args.configs:
            print(configs[name].label, file=sys.stderr)
            records.append(run_config(configs[name], args, plan, dense_plan))
    machine["load_average_end"] = os.getloadavg()
    doc = {
        "quick": args.quick,
        "machine": machine,
        "settings": {
            "plan": dataclasses.asdict(plan),
            "dense_plan": dataclasses.asdict(dense_plan),
            "pool": args.pool,
            "threads": args.threads,
            "seed": args.seed,
            "adam_lr": dlrm.ADAM_LR,
            "mlp_lr": MLP_LR,
            "adagrad_lr": dlrm.ADAGRAD_LR,
            "kernel_path": osa.kernel_path(),
            "wall_s": time.perf_counter() - started,
        },
        "agreement": agree,
        "configs": records,
    }
    print("\n" + markdown(doc), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = ("_quick" if args.quick else "") + ("" if args.width == 16 else f"_w{args.width}")
    path = args.out / f"dlrm_train{suffix}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path} in {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
