"""Tables that share an updater configuration are updated together (one dedup).

What the group changes is the work per step, never the result: the property
test (test_properties.py) checks grouped tables against the NumPy reference;
these check who is grouped with whom, and that results, state and checkpoint
entries are those of updating each table alone.
"""

import keras
import numpy as np
import pytest

import sparseopt
from tests.conftest import to_np
from tests.helpers import dot_loss

WIDTH, N_IDS, BATCH = 3, 4, 6


class MyRule(sparseopt.updaters.SGD):
    """A user's updater class: its config may not hold all it reads."""


def _model(specs, group_tables=True, build_first=True):
    """One SparseEmbedding per `(name, rows, width, updater)`, concatenated."""
    inputs, outs = {}, []
    for name, rows, width, updater in specs:
        inputs[name] = keras.Input((N_IDS,), dtype="int32", name=f"{name}_ids")
        layer = sparseopt.layers.SparseEmbedding(rows, width, updater=updater, name=name)
        outs.append(keras.layers.Flatten()(layer(inputs[name])))
    model = keras.Model(inputs, keras.layers.Concatenate()(outs))
    opt = sparseopt.DispatchOptimizer(keras.optimizers.SGD(), group_tables=group_tables)
    model.compile(optimizer=opt, loss=dot_loss)
    if build_first:
        # Built first (a shortcut, not the users' path): reads the groups and their
        # workspaces before any step.
        opt.build(model.trainable_variables)
    return model, opt


def test_groups_follow_width_dtype_and_updater_configuration():
    shared = MyRule(0.1)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    _, opt = _model([
        ("a", 10, 3, sparseopt.updaters.Adagrad(0.1)),
        ("b", 20, 3, sparseopt.updaters.Adagrad(0.1, name="mine")),  # names do not matter
        ("c", 30, 3, sparseopt.updaters.Adagrad(0.2)),  # another learning rate
        ("d", 40, 4, sparseopt.updaters.Adagrad(0.1)),  # another width
        ("e", 50, 3, sparseopt.updaters.RowwiseAdagrad(0.1)),
        ("f", 60, 3, sparseopt.updaters.Adagrad(0.1)),
        ("g", 70, 3, MyRule(0.1)),  # a user class: grouped by object only
        ("h", 80, 3, MyRule(0.1)),
        ("i", 90, 3, shared),
        ("j", 99, 3, shared),
        # Schedules: the same object groups; an equal config alone does not.
        ("k", 11, 3, sparseopt.updaters.SGD(schedule)),
        ("l", 12, 3, sparseopt.updaters.SGD(schedule)),
        ("m", 13, 3, sparseopt.updaters.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5))),
    ])
    assert opt.table_groups == [["a/embeddings", "b/embeddings", "f/embeddings"],
                                ["i/embeddings", "j/embeddings"],
                                ["k/embeddings", "l/embeddings"]]
    # One dedup workspace per group, sized for its tables together (TF: + a sink).
    from sparseopt import backend

    rows = sorted(v.shape[0] for v in opt.scratch_variables())
    assert rows == sorted(r + backend.WORKSPACE_SINK
                          for r in [10 + 20 + 60, 90 + 99, 11 + 12, 30, 40, 50, 70, 80, 13])


def _train(group_tables):
    keras.utils.set_random_seed(3)
    specs = [(name, rows, WIDTH, sparseopt.updaters.Ftrl(0.2, l1_regularization_strength=0.01))
             for name, rows in (("a", 7, ), ("b", 1), ("c", 40))]
    model, opt = _model(specs, group_tables, build_first=False)  # Keras builds it
    rng = np.random.default_rng(0)
    for step in range(4):
        x = {name: rng.integers(-2, rows + 2, size=(BATCH, N_IDS)).astype("int32")
             for name, rows, _, _ in specs}
        y = rng.normal(size=(BATCH, len(specs) * N_IDS * WIDTH)).astype("float32")
        if step == 2:
            y[0, -1] = np.nan  # in table c's rows: c skips this step, a and b do not
        model.train_on_batch(x, y)
    return model, opt


def test_grouped_tables_end_where_ungrouped_ones_do():
    grouped, opt = _train(True)
    alone, opt_alone = _train(False)
    assert len(opt.table_groups) == 1 and opt_alone.table_groups == []
    # Equal up to float rounding: the two are different compiled programs,
    # and XLA may fuse (and contract) the same arithmetic differently.
    for v, w in zip(grouped.weights, alone.weights):
        np.testing.assert_allclose(to_np(v), to_np(w), rtol=1e-6, atol=1e-7, err_msg=v.path)
    # The same checkpoint entries, in the same order, with the same values.
    saved, saved_alone = opt.state_variables(), opt_alone.state_variables()
    assert [v.path.split("/", 1)[1] for v in saved] == \
        [v.path.split("/", 1)[1] for v in saved_alone]
    for v, w in zip(saved, saved_alone):
        np.testing.assert_allclose(to_np(v), to_np(w), rtol=1e-6, atol=1e-7, err_msg=v.path)
    assert opt.skipped_steps() == {"a/embeddings": 0, "b/embeddings": 0, "c/embeddings": 1}
    assert opt.skipped_steps() == opt_alone.skipped_steps()


def test_group_tables_is_off_by_default_and_part_of_the_config():
    assert sparseopt.DispatchOptimizer("adam").group_tables is False
    opt = sparseopt.DispatchOptimizer("adam", group_tables=True)
    again = sparseopt.DispatchOptimizer.from_config(opt.get_config())
    assert again.group_tables is True


@pytest.mark.parametrize("rows", [2**29, 2**29 + 1])
def test_groups_stay_within_the_int32_id_space(rows):
    from sparseopt.engine.group import group_trainers

    class Stub:  # only what grouping reads: a table's shape and the group key
        def __init__(self, i):
            self.table = type("T", (), {"shape": (rows, 4)})()
            self.i, self.updater = i, None

        def group_key(self):
            return "same"

    groups, alone = group_trainers([Stub(i) for i in range(3)])
    # 2**30 rows in all fit one group; one more row and the third table waits.
    if rows == 2**29:
        assert [[t.i for t in g.trainers] for g in groups] == [[0, 1]] and [t.i for t in alone] == [2]
    else:
        assert groups == [] and [t.i for t in alone] == [0, 1, 2]
