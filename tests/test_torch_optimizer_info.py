"""torch's own ``SparseAdam`` test suite, ported: the ``OptimizerInfo`` of ``torch.optim.SparseAdam``
(``optim_inputs_func_sparseadam``, ``optim_error_inputs_func_sparseadam`` and the error inputs every optimizer shares,
in ``torch/testing/_internal/common_optimizers.py``) and the tests of ``test/test_optim.py`` that run on it
(``test_errors``, ``test_forloop_goes_right_direction``, ``test_param_group_with_lrscheduler_goes_right_direction``,
``test_tensor_lr``, ``test_param_groups_lr``, ``test_step_is_noop_when_params_have_no_grad``,
``test_step_is_noop_for_zero_grads``), each run on the real ``torch.optim.SparseAdam`` and on
``sparse_adam(eps_placement="torch")`` side by side. torch's sparse Rosenbrock test is in ``test_torch_parity.py``."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.experimental import sparse as jsparse
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

import optax_sparse_adam as osa
from tests.test_torch_parity import ATOL, RTOL, _batches, _pad

pytestmark = pytest.mark.slow

torch.set_num_threads(1)

# --------------------------------------------------------------------------- the optimizer inputs torch defines

# optim_inputs_func_sparseadam: (description, SparseAdam kwargs); a tensor lr is built per use (schedulers mutate it).
OPTIM_INPUTS: list[tuple[str, Callable[[], dict[str, Any]]]] = [
    ("default", lambda: {}),
    ("non-default lr", lambda: {"lr": 0.01}),
    ("Tensor lr", lambda: {"lr": torch.tensor(0.001)}),
    ("maximize", lambda: {"maximize": True}),
]
INPUT_IDS = [desc for desc, _ in OPTIM_INPUTS]


def _osa_kwargs(torch_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``sparse_adam``'s arguments for SparseAdam's: a tensor lr becomes a 0-d float32 array of the same value."""
    lr = torch_kwargs.get("lr", 1e-3)
    lr = jnp.asarray(lr.item(), jnp.float32) if isinstance(lr, torch.Tensor) else lr
    b1, b2 = torch_kwargs.get("betas", (0.9, 0.999))
    return {
        "learning_rate": lr,
        "b1": b1,
        "b2": b2,
        "eps": torch_kwargs.get("eps", 1e-8),
        "maximize": torch_kwargs.get("maximize", False),
        "eps_placement": "torch",
    }


# --------------------------------------------------------------------------- test_errors: the error inputs


def _sparse_param_torch() -> torch.Tensor:
    return torch.zeros(3, layout=torch.sparse_coo)


ROW = osa.IndexedRows(jnp.array([0], jnp.int32), jnp.ones((1,), jnp.float32), 3)  # a sparse leaf of shape (3,)


@pytest.mark.parametrize(
    ("torch_call", "torch_error", "torch_regex", "osa_call", "osa_error", "osa_regex"),
    [
        pytest.param(  # beta1 should be between 0 and 1
            lambda: torch.optim.SparseAdam([torch.zeros(2, requires_grad=True)], lr=1e-2, betas=(1.0, 0.0)),
            ValueError,
            "Invalid beta parameter at index 0: 1.0",
            lambda: osa.sparse_adam(1e-2, b1=1.0, b2=0.0),
            ValueError,
            r"Invalid b1: 1.0; it must be in \[0, 1\)",
            id="beta1=1",
        ),
        pytest.param(  # SparseAdam's constructor checks beta2, lr and eps alike
            lambda: torch.optim.SparseAdam([torch.zeros(2, requires_grad=True)], betas=(0.9, 1.0)),
            ValueError,
            "Invalid beta parameter at index 1: 1.0",
            lambda: osa.sparse_adam(1e-3, b2=1.0),
            ValueError,
            r"Invalid b2: 1.0; it must be in \[0, 1\)",
            id="beta2=1",
        ),
        pytest.param(
            lambda: torch.optim.SparseAdam([torch.zeros(2, requires_grad=True)], betas=(-0.1, 0.999)),
            ValueError,
            "Invalid beta parameter at index 0: -0.1",
            lambda: osa.sparse_adam(1e-3, b1=-0.1),
            ValueError,
            "Invalid b1: -0.1",
            id="beta1<0",
        ),
        pytest.param(
            lambda: torch.optim.SparseAdam([torch.zeros(2, requires_grad=True)], lr=0.0),
            ValueError,
            "Invalid learning rate: 0.0",
            lambda: osa.sparse_adam(0.0),
            ValueError,
            "Invalid learning_rate: 0.0",
            id="lr=0",
        ),
        pytest.param(
            lambda: torch.optim.SparseAdam([torch.zeros(2, requires_grad=True)], lr=-1e-3),
            ValueError,
            "Invalid learning rate: -0.001",
            lambda: osa.sparse_adam(-1e-3),
            ValueError,
            "Invalid learning_rate: -0.001",
            id="lr<0",
        ),
        pytest.param(
            lambda: torch.optim.SparseAdam([torch.zeros(2, requires_grad=True)], lr=math.nan),
            ValueError,
            "Invalid learning rate: nan",
            lambda: osa.sparse_adam(math.nan),
            ValueError,
            "Invalid learning_rate: nan",
            id="lr=nan",
        ),
        pytest.param(
            lambda: torch.optim.SparseAdam([torch.zeros(2, requires_grad=True)], eps=0.0),
            ValueError,
            "Invalid epsilon value: 0.0",
            lambda: osa.sparse_adam(1e-3, eps=0.0),
            ValueError,
            "Invalid eps: 0.0",
            id="eps=0",
        ),
        pytest.param(
            lambda: torch.optim.SparseAdam([torch.zeros(2, requires_grad=True)], eps=-1e-8),
            ValueError,
            "Invalid epsilon value: -1e-08",
            lambda: osa.sparse_adam(1e-3, eps=-1e-8),
            ValueError,
            "Invalid eps: -1e-08",
            id="eps<0",
        ),
        pytest.param(  # Tensor lr must be 1-element (the error input every optimizer shares)
            lambda: torch.optim.SparseAdam([torch.zeros(2, requires_grad=True)], lr=torch.tensor([0.001, 0.001])),
            ValueError,
            "Tensor lr must be 1-element",
            lambda: osa.sparse_adam(jnp.array([0.001, 0.001])),
            ValueError,
            r"Invalid learning_rate: an array of shape \(2,\); it must be a scalar",
            id="tensor-lr-2-elements",
        ),
        pytest.param(  # dense params required
            lambda: torch.optim.SparseAdam([_sparse_param_torch()]),
            ValueError,
            "SparseAdam requires dense parameter tensors",
            lambda: osa.sparse_adam(1e-3).init(ROW),
            TypeError,
            r"scale_by_sparse_adam: parameter <root>: the parameter is a sparse IndexedRows; parameters must be dense",
            id="sparse-param",
        ),
        pytest.param(
            lambda: torch.optim.SparseAdam([_sparse_param_torch()]),
            ValueError,
            "SparseAdam requires dense parameter tensors",
            lambda: osa.sparse_adam(1e-3).init({"w": jsparse.BCOO.fromdense(jnp.zeros(3, jnp.float32))}),
            TypeError,
            r"parameter \['w'\]: the parameter is a sparse BCOO; parameters must be dense",
            id="sparse-param-bcoo",
        ),
        pytest.param(  # dense params required in param_groups: a nested tree here, the error names the path
            lambda: torch.optim.SparseAdam([{"params": [_sparse_param_torch()]}]),
            ValueError,
            "SparseAdam requires dense parameter tensors",
            lambda: osa.sparse_adam(1e-3).init({"group0": {"w": jnp.zeros(3)}, "group1": {"w": ROW}}),
            TypeError,
            r"parameter \['group1'\]\['w'\]: the parameter is a sparse IndexedRows",
            id="sparse-param-in-group",
        ),
    ],
)
def test_errors(torch_call, torch_error, torch_regex, osa_call, osa_error, osa_regex):
    """Each error input torch gives SparseAdam, on torch and on the library: both refuse it, at construction or
    ``init`` (the library raises ``TypeError`` for a sparse parameter: the wrong kind of leaf, not a bad value)."""
    with pytest.raises(torch_error, match=torch_regex):
        torch_call()
    with pytest.raises(osa_error, match=osa_regex):
        osa_call()


def test_one_element_tensor_lr_of_shape_1_is_refused():
    # Intentional difference: torch accepts any 1-element tensor lr; the library refuses a non-0-d array (documented:
    # it would broadcast every update to that shape).
    torch.optim.SparseAdam([torch.zeros(2, requires_grad=True)], lr=torch.tensor([0.001]))
    with pytest.raises(ValueError, match=re.escape("Invalid learning_rate: an array of shape (1,)")):
        osa.sparse_adam(np.array([0.001], np.float32))
    osa.sparse_adam(np.array(0.001, np.float32))  # a 0-d array is a scalar


def test_complex_params_are_adam_with_optax_complex_rule():
    """torch refuses complex parameters; the library accepts them with optax's ``|g|^2`` (documented), so a sparse
    gradient touching every row equals ``optax.adam`` on the dense gradient."""
    with pytest.raises(ValueError, match="SparseAdam does not support complex parameters"):
        torch.optim.SparseAdam([torch.rand(2, 3, dtype=torch.complex64)])
    # Intentional difference: complex parameters are supported (optax.adam's rule), not refused.
    rng = np.random.default_rng(0)
    shape = (4, 3)
    init = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)
    p_sparse = p_dense = {"w": jnp.asarray(init)}
    tx, ref = osa.sparse_adam(0.05), optax.adam(0.05)
    s_sparse, s_dense = tx.init(p_sparse), ref.init(p_dense)

    @jax.jit
    def step(p_sparse, s_sparse, p_dense, s_dense, values):
        g = osa.IndexedRows(jnp.array([0, 1, 2, 3, 1, 0], jnp.int32), values, 4)
        u, s_sparse = tx.update({"w": g}, s_sparse, p_sparse)
        du, s_dense = ref.update({"w": g.todense()}, s_dense, p_dense)
        return osa.apply_updates(p_sparse, u), s_sparse, optax.apply_updates(p_dense, du), s_dense

    for _ in range(3):
        values = (rng.standard_normal((6, 3)) + 1j * rng.standard_normal((6, 3))).astype(np.complex64)
        p_sparse, s_sparse, p_dense, s_dense = step(p_sparse, s_sparse, p_dense, s_dense, jnp.asarray(values))
    assert p_sparse["w"].dtype == jnp.complex64
    np.testing.assert_allclose(p_sparse["w"], p_dense["w"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(s_sparse[0].nu["w"], s_dense[0].nu["w"], rtol=1e-6)


def test_params_need_not_be_an_iterable():
    """torch refuses a bare ``Parameter`` ("params argument given to the optimizer should be an iterable")."""
    with pytest.raises(TypeError, match="params argument given to the optimizer should be an iterable of Tensors"):
        torch.optim.SparseAdam(torch.nn.Parameter(torch.zeros(3, 2)))
    # Intentional difference: any pytree is a parameter tree, a single array included.
    tx = osa.sparse_adam(0.1, eps_placement="torch")
    p = jnp.zeros((3, 2), jnp.float32)
    u, _ = tx.update(osa.IndexedRows(jnp.array([1], jnp.int32), jnp.ones((1, 2), jnp.float32), 3), tx.init(p), p)
    new = np.asarray(osa.apply_updates(p, u))
    np.testing.assert_array_equal(new[[0, 2]], 0.0)
    np.testing.assert_allclose(new[1], -0.1, rtol=1e-6)


@pytest.mark.usefixtures("kernel_path")
def test_dense_gradient_is_torch_adam():
    """torch's SparseAdam raises at ``step`` on a dense gradient; the library runs ``torch.optim.Adam``'s rule."""
    rng = np.random.default_rng(3)
    init = rng.standard_normal((5, 3)).astype(np.float32)
    tp = torch.nn.Parameter(torch.tensor(init))
    topt = torch.optim.SparseAdam([tp])
    tp.grad = torch.ones(5, 3)
    with pytest.raises(RuntimeError, match="SparseAdam does not support dense gradients"):
        topt.step()
    # Intentional difference: a dense gradient is accepted and gets Adam (documented: SparseAdam + Adam as one).
    tp = torch.nn.Parameter(torch.tensor(init))
    adam = torch.optim.Adam([tp], lr=0.01)
    tx = osa.sparse_adam(0.01, eps_placement="torch")
    p = jnp.asarray(init)
    s = tx.init(p)
    update = jax.jit(tx.update)  # one compilation, not one dispatch per operation
    for _ in range(4):
        g = rng.standard_normal((5, 3)).astype(np.float32)
        tp.grad = torch.tensor(g)
        adam.step()
        u, s = update(jnp.asarray(g), s, p)
        p = osa.apply_updates(p, u)
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- each optimizer input, on sparse gradients


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize(("desc", "make_kwargs"), OPTIM_INPUTS, ids=INPUT_IDS)
def test_optim_inputs_match_torch_sparse_adam(desc, make_kwargs):
    """Every input torch's OptimizerInfo defines, on uncoalesced row-sparse gradients with duplicates and padding."""
    kwargs = make_kwargs()
    shape, capacity = (20, 4), 24
    rng = np.random.default_rng(len(desc))
    init = rng.standard_normal(shape).astype(np.float32)
    tp = torch.nn.Parameter(torch.tensor(init))
    topt = torch.optim.SparseAdam([tp], **kwargs)
    tx = osa.sparse_adam(**_osa_kwargs(kwargs))
    params = {"w": jnp.asarray(init)}
    state = tx.init(params)

    @jax.jit
    def step(params, state, keys, values):
        updates, state = tx.update({"w": osa.IndexedRows(keys[:, 0], values, shape[0])}, state, params)
        return osa.apply_updates(params, updates), state

    for keys, values in _batches(rng, shape, 1, steps=10, capacity=capacity):
        tp.grad = torch.sparse_coo_tensor(
            torch.tensor(keys.T.copy()), torch.tensor(values), size=shape, check_invariants=True
        )
        topt.step()
        params, state = step(params, state, *map(jnp.asarray, _pad(keys, values, capacity, shape)))

    assert not np.array_equal(tp.detach().numpy(), init)
    np.testing.assert_allclose(params["w"], tp.detach().numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(state[0].mu["w"], topt.state[tp]["exp_avg"].numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(state[0].nu["w"], topt.state[tp]["exp_avg_sq"].numpy(), rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- torch's linear problem


def _problem(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """test_optim's problem: ``loss = sum((weight @ input + bias)^2)``, weight (10, 5), bias (10,)."""
    g = torch.Generator().manual_seed(seed)
    weight, bias, inp = torch.randn((10, 5), generator=g), torch.randn(10, generator=g), torch.randn(5, generator=g)
    return weight.numpy(), bias.numpy(), inp.numpy()


def _torch_loss(weight: torch.Tensor, bias: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    loss = (weight.mv(inp) + bias).pow(2).sum()
    weight.grad, bias.grad = None, None
    loss.backward()
    # As torch's tests do for SparseAdam: the dense gradients, naively made sparse (one entry per element).
    weight.grad, bias.grad = weight.grad.to_sparse(), bias.grad.to_sparse()
    return loss.detach()


def _jax_loss(params: dict[str, jax.Array], inp: jax.Array) -> jax.Array:
    return jnp.sum((params["weight"] @ inp + params["bias"]) ** 2)


def _jax_step(tx: optax.GradientTransformation) -> Callable[..., Any]:
    """One step of the library on its own loss, the gradients made sparse as ``to_sparse`` makes them."""

    @jax.jit
    def step(params, state, inp):
        loss, grads = jax.value_and_grad(_jax_loss)(params, inp)
        grads = jax.tree.map(lambda g: jsparse.BCOO.fromdense(g, nse=g.size), grads)  # element-sparse, like torch's
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state, loss

    return step


@functools.cache
def _injected(maximize: bool, path: str) -> tuple[optax.GradientTransformation, Callable[..., Any]]:
    """``sparse_adam`` with only the learning rate injected (the betas stay Python floats, as torch's are), and its
    jitted step, built once per kernel path: the learning rate is state, so the inputs share one compilation."""
    static = ("b1", "b2", "eps", "eps_placement", "maximize")
    tx = optax.inject_hyperparams(osa.sparse_adam, static_args=static)(**_osa_kwargs({"maximize": maximize}))
    return tx, _jax_step(tx)


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("with_lrsched", [False, True])
@pytest.mark.parametrize(("desc", "make_kwargs"), OPTIM_INPUTS, ids=INPUT_IDS)
def test_forloop_goes_right_direction(desc, make_kwargs, with_lrsched):
    """20 steps on torch's linear problem: the loss goes down (up with ``maximize``), and the library's parameters,
    run on their own gradients, stay with torch's. ``with_lrsched`` runs torch's scheduler inputs for SparseAdam,
    StepLR and ReduceLROnPlateau together; optax has no scheduler objects, so the library gets the learning rate they
    set, injected (``inject_hyperparams``) before each step."""
    kwargs = make_kwargs()
    weight0, bias0, inp = _problem(seed=len(desc) + 10 * with_lrsched)
    weight, bias = torch.nn.Parameter(torch.tensor(weight0)), torch.nn.Parameter(torch.tensor(bias0))
    optimizer = torch.optim.SparseAdam([weight, bias], **kwargs)
    schedulers = [StepLR(optimizer, gamma=0.9, step_size=10), ReduceLROnPlateau(optimizer)] if with_lrsched else []

    tx, step = _injected(kwargs.get("maximize", False), osa.kernel_path())
    params = {"weight": jnp.asarray(weight0), "bias": jnp.asarray(bias0)}
    state = tx.init(params)
    lrs = []

    initial = _torch_loss(weight, bias, torch.tensor(inp)).item()
    for _ in range(20):
        lr = float(optimizer.param_groups[0]["lr"])
        lrs.append(lr)
        state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
        params, state, _ = step(params, state, jnp.asarray(inp))
        loss = _torch_loss(weight, bias, torch.tensor(inp))
        optimizer.step()
        for scheduler in schedulers:
            if isinstance(scheduler, ReduceLROnPlateau):
                scheduler.step(loss)
            else:
                scheduler.step()

    final_torch = _torch_loss(weight, bias, torch.tensor(inp)).item()
    final = float(_jax_loss(params, jnp.asarray(inp)))
    if kwargs.get("maximize", False):
        assert final_torch > initial
        assert final > initial
    else:
        assert final_torch < initial
        assert final < initial
    if with_lrsched:
        assert len(set(lrs)) > 1  # the schedulers did change the learning rate
    np.testing.assert_allclose(params["weight"], weight.detach().numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(params["bias"], bias.detach().numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.usefixtures("kernel_path")
def test_param_group_with_lrscheduler_goes_right_direction():
    """Two parameter groups (weight at the default lr, bias at 0.01) under StepLR and ReduceLROnPlateau: in the library
    an ``optax.partition`` of two ``sparse_adam``, each with StepLR's schedule (ReduceLROnPlateau does not fire on a
    loss that keeps going down, which is checked)."""
    weight0, bias0, inp = _problem(seed=7)
    weight, bias = torch.nn.Parameter(torch.tensor(weight0)), torch.nn.Parameter(torch.tensor(bias0))
    optimizer = torch.optim.SparseAdam([{"params": [weight]}, {"params": [bias], "lr": 0.01}])
    schedulers = [StepLR(optimizer, gamma=0.9, step_size=10), ReduceLROnPlateau(optimizer)]

    def group(lr: float) -> optax.GradientTransformation:
        return osa.sparse_adam(optax.exponential_decay(lr, 10, 0.9, staircase=True), eps_placement="torch")

    tx = optax.partition({"weight": group(1e-3), "bias": group(0.01)}, {"weight": "weight", "bias": "bias"})
    params = {"weight": jnp.asarray(weight0), "bias": jnp.asarray(bias0)}
    state = tx.init(params)
    step = _jax_step(tx)

    initial = _torch_loss(weight, bias, torch.tensor(inp)).item()
    for _ in range(20):
        params, state, _ = step(params, state, jnp.asarray(inp))
        loss = _torch_loss(weight, bias, torch.tensor(inp))
        optimizer.step()
        schedulers[0].step()
        schedulers[1].step(loss)

    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-3 * 0.81, 0.01 * 0.81])
    assert _torch_loss(weight, bias, torch.tensor(inp)).item() < initial
    assert float(_jax_loss(params, jnp.asarray(inp))) < initial
    np.testing.assert_allclose(params["weight"], weight.detach().numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(params["bias"], bias.detach().numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("maximize", [False, True], ids=["default", "maximize"])  # inputs without their lr: 2 remain
def test_tensor_lr(maximize):
    """A tensor lr gives what the float lr gives. In the library the tensor lr is a 0-d array, or an injected
    hyperparameter: all three are bitwise equal, and equal to torch's SparseAdam with ``lr=torch.tensor(1e-3)``."""
    kwargs = {"maximize": maximize}
    weight0, bias0, inp = _problem(seed=100 + maximize)
    weight, bias = torch.nn.Parameter(torch.tensor(weight0)), torch.nn.Parameter(torch.tensor(bias0))
    optimizer = torch.optim.SparseAdam([weight, bias], lr=torch.tensor(1e-3), **kwargs)

    base = _osa_kwargs(kwargs)
    float_lr = {**base, "learning_rate": 1e-3}
    array_lr = {**base, "learning_rate": jnp.asarray(1e-3, jnp.float32)}
    injected, injected_step = _injected(base["maximize"], osa.kernel_path())
    params0 = {"weight": jnp.asarray(weight0), "bias": jnp.asarray(bias0)}
    txs = [osa.sparse_adam(**float_lr), osa.sparse_adam(**array_lr)]
    runs = [(params0, tx.init(params0), _jax_step(tx)) for tx in txs]
    runs.append((params0, injected.init(params0), injected_step))  # its learning rate is 1e-3 from init
    for _ in range(5):
        runs = [(*step(p, s, jnp.asarray(inp))[:2], step) for p, s, step in runs]
        _torch_loss(weight, bias, torch.tensor(inp))
        optimizer.step()

    results = [p for p, _, _ in runs]
    for other in results[1:]:
        for name in ("weight", "bias"):
            np.testing.assert_array_equal(other[name], results[0][name])
    np.testing.assert_allclose(results[0]["weight"], weight.detach().numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(results[0]["bias"], bias.detach().numpy(), rtol=RTOL, atol=ATOL)


@functools.cache
def _two_groups(maximize: bool, path: str) -> tuple[optax.GradientTransformation, Callable[..., Any]]:
    """test_param_groups_lr's groups as an ``optax.partition``: ``main`` with an injected learning rate (one
    compilation for every lr), ``outer`` at ``lr=1e-28``; and its jitted step, built once per kernel path."""
    static = ("b1", "b2", "eps", "eps_placement", "maximize")
    main = optax.inject_hyperparams(osa.sparse_adam, static_args=static)(**_osa_kwargs({"maximize": maximize}))
    labels = {"weight": "main", "bias": "main", "irrelevant": "outer"}
    tx = optax.partition({"main": main, "outer": osa.sparse_adam(1e-28, eps_placement="torch")}, labels)

    @jax.jit
    def step(params, state, inp, irrelevant_grad):
        grads = jax.grad(_jax_loss)(params, inp)
        grads["irrelevant"] = irrelevant_grad
        grads = jax.tree.map(lambda g: jsparse.BCOO.fromdense(g, nse=g.size), grads)
        updates, state = tx.update(grads, state, params)
        return osa.apply_updates(params, updates), state

    return tx, step


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize(("desc", "make_kwargs"), OPTIM_INPUTS, ids=INPUT_IDS)
def test_param_groups_lr(desc, make_kwargs):
    """A group with the input's lr (1e-3 if it has none) moves the loss the right way; a group left at the outer
    ``lr=1e-28`` is bitwise unchanged although it has gradients. The library's groups are an ``optax.partition``."""
    kwargs = make_kwargs()
    kwargs.setdefault("lr", 1e-3)
    weight0, bias0, inp = _problem(seed=200 + len(desc))
    irrelevant0 = np.random.default_rng(5).standard_normal(2).astype(np.float32)
    weight, bias = torch.nn.Parameter(torch.tensor(weight0)), torch.nn.Parameter(torch.tensor(bias0))
    irrelevant = torch.nn.Parameter(torch.tensor(irrelevant0))
    optimizer = torch.optim.SparseAdam([{"params": [weight, bias], **kwargs}, {"params": [irrelevant]}], lr=1e-28)

    tx, step = _two_groups(kwargs.get("maximize", False), osa.kernel_path())
    params = {"weight": jnp.asarray(weight0), "bias": jnp.asarray(bias0), "irrelevant": jnp.asarray(irrelevant0)}
    state = tx.init(params)
    lr = jnp.asarray(_osa_kwargs(kwargs)["learning_rate"], jnp.float32)
    state.inner_states["main"].inner_state.hyperparams["learning_rate"] = lr

    rng = np.random.default_rng(6)
    initial = _torch_loss(weight, bias, torch.tensor(inp)).item()
    for _ in range(20):
        irrelevant_grad = rng.random(2).astype(np.float32)
        params, state = step(params, state, jnp.asarray(inp), jnp.asarray(irrelevant_grad))
        _torch_loss(weight, bias, torch.tensor(inp))
        irrelevant.grad = torch.tensor(irrelevant_grad).to_sparse()
        optimizer.step()

    final_torch, final = _torch_loss(weight, bias, torch.tensor(inp)).item(), float(_jax_loss(params, jnp.asarray(inp)))
    if kwargs.get("maximize", False):
        assert final_torch > initial and final > initial
    else:
        assert final_torch < initial and final < initial
    np.testing.assert_array_equal(irrelevant.detach().numpy(), irrelevant0)
    np.testing.assert_array_equal(params["irrelevant"], irrelevant0)
    assert not np.array_equal(state.inner_states["outer"].inner_state[0].mu["irrelevant"], 0.0)  # it had gradients
    np.testing.assert_allclose(params["weight"], weight.detach().numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(params["bias"], bias.detach().numpy(), rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- steps that must not move anything


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize(("desc", "make_kwargs"), OPTIM_INPUTS, ids=INPUT_IDS)
def test_step_is_noop_when_params_have_no_grad(desc, make_kwargs):
    """Parameters without a gradient (``None`` here) do not move, and their moments stay zero."""
    kwargs = make_kwargs()
    init = [np.random.default_rng(i).standard_normal((2, 3)).astype(np.float32) for i in range(2)]
    tparams = [torch.tensor(x) for x in init]  # requires_grad=False, as torch's test has them
    torch.optim.SparseAdam(tparams, **kwargs).step(lambda: torch.tensor([1.0]))
    for tp, x in zip(tparams, init, strict=True):
        np.testing.assert_array_equal(tp.numpy(), x)

    tx = osa.sparse_adam(**_osa_kwargs(kwargs))
    params = [jnp.asarray(x) for x in init]
    state = tx.init(params)
    updates, state = tx.update([None, None], state, params)
    for p, x in zip(osa.apply_updates(params, updates), init, strict=True):
        np.testing.assert_array_equal(p, x)
    for leaf in (*state[0].mu, *state[0].nu):
        np.testing.assert_array_equal(leaf, 0.0)
    # Intentional difference: the step count is global (optax's layout, documented) and advances on every call.
    assert int(state[0].count) == 1


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("form", ["empty", "all-padding", "empty-bcoo"])
@pytest.mark.parametrize(("desc", "make_kwargs"), OPTIM_INPUTS, ids=INPUT_IDS)
def test_step_is_noop_for_zero_grads(desc, make_kwargs, form):
    """An empty sparse gradient with multidimensional values (torch's regression test for pytorch#82486): the
    parameter is bitwise unchanged, and the step is counted, as torch counts it."""
    kwargs = make_kwargs()
    init = np.random.default_rng(8).standard_normal((5, 1)).astype(np.float32)
    tp = torch.nn.Parameter(torch.tensor(init))
    optimizer = torch.optim.SparseAdam([tp], **kwargs)
    tp.grad = torch.sparse_coo_tensor(torch.empty((1, 0)), torch.empty((0, 1)), (5, 1), check_invariants=True)
    optimizer.step(lambda: torch.tensor([1.0]))
    np.testing.assert_array_equal(tp.detach().numpy(), init)

    if form == "empty":
        g = osa.IndexedRows(jnp.zeros((0,), jnp.int32), jnp.zeros((0, 1), jnp.float32), 5)
    elif form == "all-padding":  # a padded batch with no real id: nonzero values that must be ignored
        g = osa.IndexedRows(jnp.array([-1, 5, -1], jnp.int32), jnp.full((3, 1), 7.0, jnp.float32), 5)
    else:
        g = jsparse.BCOO((jnp.zeros((0, 1), jnp.float32), jnp.zeros((0, 1), jnp.int32)), shape=(5, 1))
    tx = osa.sparse_adam(**_osa_kwargs(kwargs))
    p = jnp.asarray(init)
    state = tx.init(p)
    updates, state = tx.update(g, state, p)
    np.testing.assert_array_equal(osa.apply_updates(p, updates), init)
    np.testing.assert_array_equal(state[0].mu, 0.0)
    np.testing.assert_array_equal(state[0].nu, 0.0)
    assert int(state[0].count) == int(optimizer.state[tp]["step"]) == 1
