"""``EmbeddingCollection``: stacked tables against the same model on one array per table."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_sparse_adam as osa
from tests.helpers import assert_trees_equal

TABLES = {
    "user": osa.TableSpec(50, 4),
    "item": osa.TableSpec(30, 4),
    "tag": osa.TableSpec(20, 2),
    "city": osa.TableSpec(10, 4, jnp.bfloat16),
}
FEATURES = {
    "user": osa.FeatureSpec("user"),
    "history": osa.FeatureSpec("item", "mean"),
    "candidate": osa.FeatureSpec("item"),
    "tags": osa.FeatureSpec("tag", "sqrtn"),
    "city": osa.FeatureSpec("city"),
}
BATCH = 6


def _collection(shards: int = 1) -> osa.EmbeddingCollection:
    return osa.EmbeddingCollection(TABLES, FEATURES, shards)


def _inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    def ids(rows: int, shape: tuple[int, ...]) -> np.ndarray:
        return rng.integers(-2, rows + 2, size=shape).astype(np.int32)  # padding both ways

    return {
        "user": ids(50, (BATCH,)),
        "history": ids(30, (BATCH, 5)),
        "candidate": ids(30, (BATCH,)),
        "tags": ids(20, (BATCH, 3)),
        "city": ids(10, (BATCH,)),
    }


def _per_table_model(tables: dict[str, jax.Array], inputs: dict[str, np.ndarray], weights: dict[str, np.ndarray]):
    """The pooled features from one array per table, with a bags per feature: the reference."""
    out = {}
    for name, spec in FEATURES.items():
        table = tables[spec.table]
        b = osa.bags(inputs[name], table.shape[0], weights=weights.get(name), combiner=spec.combiner)
        out[name] = osa.pool(table, b)
    return out


def _head(pooled: dict[str, jax.Array], w: jax.Array) -> jax.Array:
    x = jnp.concatenate(
        [pooled["user"] * pooled["candidate"], pooled["history"], pooled["city"].astype(jnp.float32)], 1
    )
    return jnp.sum(jnp.tanh(x @ w)) + jnp.sum(pooled["tags"] ** 2)


def test_stacks_by_width_and_dtype_and_tables_are_blocks_of_them():
    coll = _collection()
    assert coll.stacks == {"float32_4": ("user", "item"), "float32_2": ("tag",), "bfloat16_4": ("city",)}
    params = coll.init(jax.random.key(0))
    assert {k: (v.shape, v.dtype) for k, v in params.items()} == {
        "float32_4": ((80, 4), jnp.float32),
        "float32_2": ((20, 2), jnp.float32),
        "bfloat16_4": ((10, 4), jnp.bfloat16),
    }
    assert_trees_equal(coll.table(params, "item"), params["float32_4"][50:80])
    # Each table is drawn from its own key: a table's values do not depend on the others.
    alone = osa.EmbeddingCollection({"item": TABLES["item"]}).init(jax.random.key(0))
    assert alone["float32_4"].shape == (30, 4)
    std = float(jnp.std(coll.table(params, "user")))
    assert 0.3 < std < 0.7  # variance scaling over the width: 1/sqrt(4)


def test_laid_out_for_devices_each_block_holds_a_share_of_every_table():
    """With ``shards=3`` a table's row ``i`` is in block ``i // ceil(rows / 3)`` of its stack, the tables one after
    another in each block (padded with zero rows); ``table`` reads each table back as ``init`` drew it, and
    ``stack_ids`` finds its rows."""
    flat, split = _collection().init(jax.random.key(0)), _collection(3).init(jax.random.key(0))
    coll = _collection(3)
    assert {k: v.shape for k, v in split.items()} == {
        "float32_4_shards3": (3 * (17 + 10), 4),
        "float32_2_shards3": (3 * 7, 2),
        "bfloat16_4_shards3": (3 * 4, 4),
    }
    for name, spec in TABLES.items():
        assert_trees_equal(coll.table(split, name), _collection().table(flat, name))
        stack = np.asarray(split[coll._stack_of(name)], np.float32)
        share = -(-spec.num_rows // 3)
        block = stack.shape[0] // 3
        start = {"user": 0, "item": 17}.get(name, 0)
        for i in (0, share - 1, share, spec.num_rows - 1):
            want = stack[i // share * block + start + i % share]
            assert int(coll.stack_ids(name, i)) == i // share * block + start + i % share
            np.testing.assert_array_equal(want, np.asarray(coll.table(split, name)[i], np.float32))
        pad = [b * block + start + j for b in range(3) for j in range(share) if b * share + j >= spec.num_rows]
        np.testing.assert_array_equal(stack[pad], 0.0)
        assert int(coll.stack_ids(name, -1)) == int(coll.stack_ids(name, spec.num_rows)) == stack.shape[0]


def test_bags_that_cannot_split_by_examples_are_laid_out_in_one_part_and_pool_alike():
    """A ragged feature, or a batch that does not divide by ``shards`` (an evaluation batch): the stack's bags are
    one part (pooling anywhere, and refused by a data-parallel step), and they pool as the collection without
    shards does."""
    inputs = _inputs(np.random.default_rng(0))
    ragged = osa.bags(np.arange(8, dtype=np.int32), 30, lengths=np.array([2, 0, 5, 1, 0, 0], np.int32), combiner="mean")
    for shards, given in ((3, {**inputs, "history": ragged}), (4, inputs)):
        coll, flat = _collection(shards), _collection()
        params = coll.init(jax.random.key(2))
        batch = coll.bags(given)
        assert {b.parts for b in batch.values()} == {1}, shards
        got, want = coll.pool(params, batch), flat.pool(flat.init(jax.random.key(2)), flat.bags(given))
        for name in FEATURES:
            assert_trees_equal(got[name], want[name], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="shards must be a positive int"):
        osa.EmbeddingCollection(TABLES, FEATURES, 0)


def test_parameters_of_another_layout_are_refused_and_stack_moves_them():
    """A stack's name says its layout, so parameters of ``shards=3`` do not pass for ``shards=1``'s (whose rows are
    elsewhere); ``stack`` lays tables out for a collection, which moves parameters between layouts."""
    three, one = _collection(3), _collection()
    params = three.init(jax.random.key(3))
    with pytest.raises(KeyError, match=r"no stack 'float32_4'.*move them with EmbeddingCollection.stack"):
        one.table(params, "user")
    moved = one.stack({n: three.table(params, n) for n in TABLES})
    for name in TABLES:
        assert_trees_equal(one.table(moved, name), three.table(params, name))
    assert_trees_equal(three.stack({n: one.table(moved, n) for n in TABLES}), params)
    other = osa.EmbeddingCollection({"user": osa.TableSpec(60, 4)})
    with pytest.raises(ValueError, match=r"stack 'float32_4' is \[60, 4\]; this collection's is \[80, 4\]"):
        one.table(other.init(jax.random.key(0)), "user")
    with pytest.raises(ValueError, match=r"table 'user' must be float32\[50, 4\], got float32\[49, 4\]"):
        one.stack({**{n: one.table(moved, n) for n in TABLES}, "user": jnp.zeros((49, 4))})


def test_stack_ids_make_padding_of_any_id_outside_the_table():
    coll = _collection(3)
    ids = np.array([2**32 + 3, -(2**32) + 5, -1, 50, 3], np.int64)
    padding = int(coll.stack_ids("user", 50))
    np.testing.assert_array_equal(np.asarray(coll.stack_ids("user", ids))[:4], padding)
    assert int(coll.stack_ids("user", ids)[4]) == int(coll.stack_ids("user", 3))
    with pytest.raises(TypeError, match="ids must be integers"):
        coll.stack_ids("user", np.array([1.7]))


def test_a_stack_no_feature_reads_takes_a_step():
    """A table no feature reads: its stack's bags are empty, and the step gives it an empty row gradient."""
    coll = osa.EmbeddingCollection(TABLES, {"user": osa.FeatureSpec("user")})
    params = coll.init(jax.random.key(4))
    batch = coll.bags({"user": np.arange(6, dtype=np.int32)})
    value, grads = osa.value_and_row_grad(lambda p, b: jnp.sum(coll.pool(p, b)["user"] ** 2), lambda p: p)(
        params, batch
    )
    assert not np.any(np.asarray(grads["float32_2"].todense()))
    want = jnp.sum(coll.table(params, "user")[:6] ** 2)
    np.testing.assert_allclose(value, want, rtol=1e-6)


def test_each_table_is_its_initializer_applied_to_its_own_key():
    """``init`` draws the tables left to the default initializer in one program, and runs a table's own initializer
    as given: each table is bitwise its initializer applied to its key, eagerly and one table at a time."""
    tables = dict(TABLES, tag=osa.TableSpec(20, 2, initializer=jax.nn.initializers.uniform(0.1)))
    coll = osa.EmbeddingCollection(tables)
    params = coll.init(jax.random.key(7))
    default = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
    for (name, spec), key in zip(tables.items(), jax.random.split(jax.random.key(7), len(tables)), strict=True):
        want = (spec.initializer or default)(key, (spec.num_rows, spec.width), spec.dtype)
        assert_trees_equal(coll.table(params, name), jnp.asarray(want, spec.dtype))


@functools.cache
def _example(
    weighted: bool, shards: int = 1
) -> tuple[dict[str, np.ndarray], np.ndarray, dict, dict, dict[str, osa.Bags]]:
    """The tables (on the host), the head's weights, the inputs, their weights and bags: built once, each in one
    program, for both kernel paths (op by op, each operation would compile again under each kernel path)."""
    rng = np.random.default_rng(weighted)
    coll = _collection(shards)
    emb = jax.device_get(jax.jit(coll.init)(jax.random.key(1)))
    w = rng.standard_normal((12, 1)).astype(np.float32)
    inputs = _inputs(rng)
    weights = {"history": rng.uniform(0.1, 2.0, (BATCH, 5)).astype(np.float32)} if weighted else {}
    return emb, w, inputs, weights, jax.jit(coll.bags)(inputs, weights)


@pytest.mark.parametrize(("weighted", "shards"), [(False, 1), (True, 1), (True, 3)])
def test_pool_and_row_gradients_equal_one_array_per_table(weighted, shards, kernel_path):
    """The stacks pool each feature and take its row gradients as one array per table does; laid out for 3
    devices (each block a share of every table, the bags one part a device), alike."""
    coll = _collection(shards)
    emb, w, inputs, weights, batch = _example(weighted, shards)
    assert all(b.parts == shards for b in batch.values())
    params = {"emb": jax.tree.map(lambda x: jnp.asarray(np.array(x)), emb), "w": jnp.asarray(w)}  # donated: copies
    tables = {name: jnp.asarray(coll.table(emb, name)) for name in TABLES}

    def loss(p, batch):
        return _head(coll.pool(p["emb"], batch), p["w"])

    def reference(p):
        pooled = _per_table_model(p["tables"], inputs, weights)
        return _head(pooled, p["w"]), pooled

    order = []

    def pool_and_reference(emb, ref_params):
        got = coll.pool(emb, batch)
        order.append(list(got))  # a jitted function's dicts come back sorted
        return got, jax.value_and_grad(reference, has_aux=True)(ref_params)

    got, ((want_value, want), want_grads) = jax.jit(pool_and_reference)(
        params["emb"], {"tables": tables, "w": params["w"]}
    )
    assert order == [list(FEATURES)]
    for name in FEATURES:
        assert got[name].shape == (BATCH, TABLES[FEATURES[name].table].width), name
        assert_trees_equal(got[name], want[name], rtol=1e-6, atol=1e-7)

    def row_grads(p, batch):
        value, grads = osa.value_and_row_grad(loss, lambda p: p["emb"])(p, batch)
        return value, grads, {k: v.todense() for k, v in grads["emb"].items()}

    value, grads, dense_stacks = jax.jit(row_grads)(params, batch)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grads["w"], want_grads["w"], rtol=1e-5, atol=1e-6)
    dense = {name: coll.table(jax.device_get(dense_stacks), name) for name in TABLES}
    for name in TABLES:
        stack = grads["emb"][coll._stack_of(name)]
        assert isinstance(stack, osa.IndexedRows)
        np.testing.assert_allclose(
            np.asarray(dense[name], np.float32),
            np.asarray(want_grads["tables"][name], np.float32),
            rtol=1e-5,
            atol=1e-6,
        )

    # One jitted, donated step for every table at once; a step the table of which holds bf16 runs too.
    tx = osa.sparse_adam(1e-2)
    state = tx.init(params)
    step = jax.jit(osa.update_and_apply, static_argnums=0, donate_argnums=(2, 3))
    new_params, _ = step(tx, grads, state, params)
    untouched = np.setdiff1d(np.arange(50), inputs["user"])
    user = coll.table(jax.device_get(new_params["emb"]), "user")  # on the host: NumPy indexing compiles nothing
    assert_trees_equal(user[untouched], np.asarray(tables["user"])[untouched])


def test_one_lookup_per_stack():
    """A step over the five features of three stacks does three deduplications, not five."""
    coll = _collection()
    params = {"emb": coll.init(jax.random.key(1))}
    batch = coll.bags(_inputs(np.random.default_rng(0)))
    assert {k: b.num_bags for k, b in batch.items()} == {
        "float32_4": 3 * BATCH,
        "float32_2": BATCH,
        "bfloat16_4": BATCH,
    }
    calls = []
    real = osa._row_grad.lookup

    def counting(table, ids):
        calls.append(table.shape)
        return real(table, ids)

    osa._row_grad.lookup = counting
    try:
        osa.value_and_row_grad(lambda p, b: sum(x.sum() for x in coll.pool(p["emb"], b).values()), lambda p: p["emb"])(
            params, batch
        )
    finally:
        osa._row_grad.lookup = real
    assert sorted(calls) == sorted([(80, 4), (20, 2), (10, 4)])


def test_prebuilt_bags_take_the_offsets_form():
    coll = osa.EmbeddingCollection({"item": osa.TableSpec(30, 4)}, {"h": osa.FeatureSpec("item", "mean")})
    params = coll.init(jax.random.key(2))
    b = osa.bags(jnp.array([1, 2, 3, 9], jnp.int32), 30, offsets=jnp.array([0, 3, 3, 4]), combiner="mean")
    got = coll.pool(params, coll.bags({"h": b}))["h"]
    t = coll.table(params, "item")
    assert_trees_equal(got, jnp.stack([(t[1] + t[2] + t[3]) / 3, jnp.zeros(4), t[9]]), rtol=1e-6)


def test_checkpoints_as_plain_arrays(tmp_path):
    from flax import serialization

    coll = _collection()
    params = coll.init(jax.random.key(3))
    tx = optax.chain(osa.sparse_aware(optax.clip_by_global_norm(1.0)), osa.sparse_adam(1e-3))
    state = tx.init(params)
    restored = serialization.from_bytes((params, state), serialization.to_bytes((params, state)))
    assert_trees_equal(restored, (params, state))


def test_bad_specs_and_inputs_raise():
    with pytest.raises(ValueError, match="reads table 'nope'"):
        osa.EmbeddingCollection(TABLES, {"f": osa.FeatureSpec("nope")})
    table = next(iter(TABLES))
    with pytest.raises(ValueError, match="feature 'f' combines its bags by 'max'"):  # at the declaration, by name
        osa.EmbeddingCollection(TABLES, {"f": osa.FeatureSpec(table, "max")})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="TableSpec"):
        osa.EmbeddingCollection({"t": (10, 4)})
    with pytest.raises(ValueError, match="num_rows"):
        osa.TableSpec(-1, 4)
    with pytest.raises(ValueError, match="width"):
        osa.TableSpec(10, 0)
    with pytest.raises(TypeError, match="floating"):
        osa.TableSpec(10, 4, jnp.int32)
    coll = _collection()
    inputs = _inputs(np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"missing \['user'\]"):
        coll.bags({k: v for k, v in inputs.items() if k != "user"})
    with pytest.raises(ValueError, match=r"unknown \['nope'\]"):
        coll.bags({**inputs, "nope": inputs["user"]})
    with pytest.raises(ValueError, match="batch size"):
        coll.bags({**inputs, "user": inputs["user"][:3]})
    with pytest.raises(ValueError, match="built for 31 rows"):
        coll.bags({**inputs, "history": osa.bags(inputs["history"], 31, combiner="mean")})
    # The combiner is folded into a Bags' weights: one built with another was pooled by it, without a word.
    for combiner in ("sum", "sqrtn"):
        with pytest.raises(ValueError, match=rf"'history' combine by '{combiner}' but its FeatureSpec says 'mean'"):
            coll.bags({**inputs, "history": osa.bags(inputs["history"], 30, combiner=combiner)})
    with pytest.raises(KeyError, match="no table"):
        coll.table(coll.init(jax.random.key(0)), "nope")
    # osa.bags' own checks of a feature's input, which did not say which feature it was.
    history = inputs["history"]
    for bad, error, says in [
        (history.astype(np.float32), TypeError, "ids must be integers"),
        (history[None], ValueError, "ids must be"),
    ]:
        with pytest.raises(error, match=f"feature 'history': bags: {says}"):
            coll.bags({**inputs, "history": bad})
    with pytest.raises(ValueError, match="feature 'history': bags: weights must have the shape of ids"):
        coll.bags(inputs, {"history": np.ones((history.shape[0], history.shape[1] + 1), np.float32)})
    # pool takes the dict of Bags by stack that coll.bags returns: a Bags alone, or a dict by feature, failed
    # inside it ("'Bags' object is not subscriptable", a KeyError of a stack's name).
    params, batch = coll.init(jax.random.key(0)), coll.bags(inputs)
    with pytest.raises(TypeError, match=r"bags must be what EmbeddingCollection\.bags returns, a Bags for each stack"):
        coll.pool(params, next(iter(batch.values())))
    with pytest.raises(ValueError, match=r"bags holds no Bags for stack\(s\) \['float32_4'"):
        coll.pool(params, {"history": next(iter(batch.values()))})


def test_a_table_of_no_rows_takes_the_default_initializer():
    """TableSpec takes 0 rows; the default initializer (fan-in scaled) divided by them and ``init`` raised
    ZeroDivisionError. Every other table is still its initializer applied to its own key (within float32
    rounding: drawn in one program beside another table, XLA may fuse the draws' arithmetic otherwise)."""
    tables = dict(TABLES, empty=osa.TableSpec(0, 4))
    coll = osa.EmbeddingCollection(tables)
    params = coll.init(jax.random.key(7))
    default = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
    for (name, spec), key in zip(tables.items(), jax.random.split(jax.random.key(7), len(tables)), strict=True):
        shape = (spec.num_rows, spec.width)
        want = default(key, shape, spec.dtype) if spec.num_rows else jnp.zeros(shape, spec.dtype)
        np.testing.assert_allclose(coll.table(params, name), want, rtol=1e-6, atol=1e-7)


def test_a_ragged_feature_among_padded_ones_pools_alike():
    """Padded and one-id features pool by reshape; one ragged feature makes its stack take the segment sum."""
    rng = np.random.default_rng(4)
    coll = _collection()
    params = coll.init(jax.random.key(5))
    inputs = _inputs(rng)
    regular = coll.bags(inputs)
    assert regular["float32_4"].blocks == ((BATCH, 1), (BATCH, 5), (BATCH, 1))
    lengths = np.array([2, 0, 5, 1, 3, 4], np.int32)
    flat = rng.integers(-1, 30, size=int(lengths.sum()) + 3).astype(np.int32)
    ragged = coll.bags({**inputs, "history": osa.bags(flat, 30, lengths=lengths, combiner="mean")})
    assert ragged["float32_4"].blocks is None and ragged["float32_2"].blocks == ((BATCH, 3),)
    got = coll.pool(params, ragged)
    tables = {name: coll.table(params, name) for name in TABLES}
    want = osa.pool(tables["item"], osa.bags(flat, 30, lengths=lengths, combiner="mean"))
    assert_trees_equal(got["history"], want, rtol=1e-6, atol=1e-7)
    for name in ("user", "candidate", "tags", "city"):
        assert_trees_equal(got[name], coll.pool(params, regular)[name])


@pytest.mark.parametrize("tables_tx", ["adam", "rowwise_adagrad"])
def test_collection_step_is_in_place_and_its_temporaries_do_not_grow_with_the_tables(tables_tx, kernel_path):
    """The quick start's step, with 26 one-hot and multi-hot features: same temporaries at two table sizes."""

    def report(rows: int) -> osa.StepReport:
        coll = osa.EmbeddingCollection(
            {f"t{i}": osa.TableSpec(rows, 16) for i in range(4)},
            {f"f{i}": osa.FeatureSpec(f"t{i % 4}", "mean" if i % 2 else "sum") for i in range(26)},
        )
        # Abstract arguments (as in tests/test_documented_steps.py): the same lowered step as with the arrays
        # themselves, without initializing tables that are only compiled for.
        params = jax.eval_shape(
            lambda key: {"emb": coll.init(key), "w": jnp.ones((16,), jnp.float32)}, jax.random.key(0)
        )
        rule = osa.sparse_adam(1e-3) if tables_tx == "adam" else osa.sparse_rowwise_adagrad(1e-2)
        tx = osa.partition_tables(rule, optax.adam(1e-3), lambda p: p["emb"])

        def loss(p, bags):
            return sum(jnp.sum(v @ p["w"]) for v in coll.pool(p["emb"], bags).values())

        def step(p, s, ids):
            _, g = osa.value_and_row_grad(loss, lambda q: q["emb"])(p, coll.bags(ids))
            return osa.update_and_apply(tx, g, s, p)

        ids = {f"f{i}": jnp.zeros((64, 1 + i % 3), jnp.int32) for i in range(26)}
        return osa.step_report(jax.jit(step, donate_argnums=(0, 1)), params, jax.eval_shape(tx.init, params), ids)

    small, large = report(50_000), report(100_000)
    assert small.in_place and large.in_place, str(large)
    assert small.temp_bytes == large.temp_bytes


def test_the_step_compiles_once_per_batch_shape():
    from tests.helpers import jit_once

    coll = _collection()
    params = {"emb": coll.init(jax.random.key(0)), "w": jnp.ones((12, 1), jnp.float32)}
    tx = osa.partition_tables(osa.sparse_rowwise_adagrad(1e-2), optax.adam(1e-3), lambda p: p["emb"])

    def step(p, s, ids):
        _, g = osa.value_and_row_grad(lambda q, b: _head(coll.pool(q["emb"], b), q["w"]), lambda q: q["emb"])(
            p, coll.bags(ids)
        )
        return osa.update_and_apply(tx, g, s, p)

    step = jit_once(step, donate_argnums=(0, 1))
    state = tx.init(params)
    rng = np.random.default_rng(9)
    for _ in range(3):  # fresh ids each step, one shape
        params, state = step(params, state, _inputs(rng))


def test_the_gradient_of_pooling_builds_no_stack_sized_pads():
    """Cutting a stack into 26 features (and its blocks into bags) by slices made the gradient 26 stack-sized pads
    summed (3.5 of a 5.5 ms step at 2,048 examples); one split's gradient is one concatenation."""
    coll = osa.EmbeddingCollection({f"t{i}": osa.TableSpec(1000, 16) for i in range(26)})
    params = coll.init(jax.random.key(0))
    batch = coll.bags({f"t{i}": jnp.zeros((256, 1 + i % 3), jnp.int32) for i in range(26)})

    def loss(p, b):
        return sum(jnp.sum(v) for v in coll.pool(p, b).values())

    hlo = jax.jit(osa.value_and_row_grad(loss, lambda p: p)).lower(params, batch).compile().as_text()
    entries = batch["float32_16"].ids.shape[0]
    assert not [line for line in hlo.splitlines() if " pad(" in line and f"[{entries}," in line]
