"""`sparseopt.optimizer.routing.plan` on its own: which variable goes where, and who said so."""

import keras
import pytest

import sparseopt
from sparseopt.optimizer import routing
from sparseopt.optimizer.discovery import declared_tables


def _model():
    ids = keras.Input((3,), dtype="int32")
    emb = sparseopt.layers.SparseEmbedding(20, 4, updater=sparseopt.updaters.Adagrad(0.1),
                                           name="emb")
    out = keras.layers.Dense(1, name="head")(keras.layers.Flatten()(emb(ids)))
    return keras.Model(ids, out), emb


def _plan(model, optimizer_map=None, default=None):
    variables = list(model.trainable_variables)
    default = default or keras.optimizers.SGD(0.1)
    routes = routing.plan(variables, declared_tables(variables, model), optimizer_map or {},
                          default)
    return {r.variable.path: r for r in routes}, default


def test_tables_go_to_their_declared_updater_probes_to_no_one_the_rest_to_the_default():
    model, emb = _model()
    before = list(model.trainable_variables)
    routes, default = _plan(model)
    table = routes["emb/embeddings"]
    assert table.kind == routing.TABLE
    assert table.target is emb.variable_path_to_optimizer_map["emb/embeddings"]
    assert table.owner == "layer 'emb'" and table.lookup is emb.embeddings._sparseopt_lookup
    assert table.keras_rs_layer is None
    probe = emb.embeddings._sparseopt_lookup.probe
    assert probe.path in routes and routes[probe.path].kind == routing.PROBE
    for path in ("head/kernel", "head/bias"):
        assert routes[path].kind == routing.DENSE
        assert routes[path].target is default and routes[path].owner is None
    assert len(routes) == len(before)  # one route per variable, nothing added
    assert list(model.trainable_variables) == before  # planning changes nothing


def test_optimizer_map_wins_then_the_variables_own_optimizer():
    model, _ = _model()
    other, own, updater = keras.optimizers.Adam(), keras.optimizers.RMSprop(), \
        sparseopt.updaters.SGD(0.5)
    model.get_layer("head").bias.optimizer = own
    routes, _ = _plan(model, {"head/ker.*": other, "emb/embeddings": updater})
    assert (routes["head/kernel"].target, routes["head/kernel"].owner) == (other, "optimizer_map")
    assert routes["head/bias"].target is own
    assert routes["head/bias"].owner == "variable 'head/bias' (its `optimizer` attribute)"
    assert routes["emb/embeddings"].target is updater
    assert routes["emb/embeddings"].owner == "optimizer_map"


def test_what_cannot_be_routed_is_refused_naming_the_variable():
    model, _ = _model()
    with pytest.raises(ValueError, match="'emb/embeddings' is read by a sparse lookup but has "
                                         "no sparse updater"):
        _plan(model, {"emb/embeddings": keras.optimizers.Adam()})
    with pytest.raises(ValueError, match="'head/kernel' matches several optimizer_map keys"):
        _plan(model, {"head/.*": keras.optimizers.Adam(), ".*/kernel": keras.optimizers.SGD()})
    model.get_layer("head").bias.optimizer = "adam"
    with pytest.raises(TypeError, match="variable 'head/bias' \\(its `optimizer` attribute\\) "
                                        "must be a Keras optimizer"):
        _plan(model)


def test_variables_whose_gradient_is_their_new_value_are_installed():
    model, _ = _model()
    bias = model.get_layer("head").bias
    bias.overwrite_with_gradient = True
    try:
        routes, _ = _plan(model)
    finally:
        bias.overwrite_with_gradient = False
    assert routes["head/bias"].kind == routing.INSTALLED and routes["head/bias"].target is None
