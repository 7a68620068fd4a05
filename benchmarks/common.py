"""What every benchmark shares: table shapes, the id and click generators, and the
recommender model builder.

Each benchmark imports this module (they run as scripts from this folder,
which Python puts first on the import path), so a change to how ids are drawn
or how the toy recommender is built reaches all of them.
"""


HOT_ROWS = 8192

# Rows of the 26 categorical features of the Criteo Kaggle display advertising
# challenge dataset (the counts DLRM's Kaggle preprocessing produces).
CRITEO_KAGGLE = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683,
                 8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15,
                 286181, 105, 142572]


def hot_ids(rng, rows, shape, hot_rows=HOT_ROWS, hot=None):
    """Ids drawn uniformly from one fixed set of `hot_rows` rows spread over the table.

    Every batch then touches about the same number of distinct rows at any
    table size: equal work, which is what "cost does not grow with the
    vocabulary" is about.

    Args:
        rng: a NumPy `Generator`.
        rows: the table's row count.
        shape: the shape of the id array.
        hot_rows: how many rows ids are drawn from.
        hot: the hot set to draw from (`hot_set`), to share it between calls.

    Returns:
        int32 ids of `shape`.
    """
    if hot is None:
        hot = hot_set(rng, rows, hot_rows)
    return hot[rng.integers(0, hot.size, size=shape)].astype("int32")


def hot_set(rng, rows, hot_rows=HOT_ROWS):
    """`min(hot_rows, rows)` distinct random rows of a `rows`-row table."""
    return rng.choice(rows, size=min(hot_rows, rows), replace=False)


def zipf_ids(rng, rows, shape, a, start=1):
    """Skewed ids, as real features are: Zipf(`a`) ranks folded into `[0, rows)`.

    Args:
        rng: a NumPy `Generator`.
        rows: the table's row count.
        shape: the shape of the id array.
        a: the Zipf exponent (> 1; smaller is more skewed).
        start: the rank that maps to row 0 (1: the most frequent id is row 0).
    """
    return ((rng.zipf(a, size=shape) - start) % rows).astype("int32")


def clicks(rng, table_rows, examples, dense_features, a=1.2):
    """Synthetic click data with a signal a model can learn, for quality comparisons.

    Each table's ids are Zipf(`a`)-skewed (`zipf_ids`); each id has a hidden
    propensity, and the click probability is the logistic of those of the
    example's ids plus a linear function of the dense features.

    Args:
        rng: a NumPy `Generator`.
        table_rows: `{name: rows}`.
        examples: how many examples.
        dense_features: how many dense features (input `dense`).
        a: the Zipf exponent of the ids.

    Returns:
        `(x, y)`: `{name: int32 [examples, 1], "dense": float32 [examples, dense_features]}`
        and float32 labels `[examples, 1]`.
    """
    import numpy as np

    x = {"dense": rng.normal(size=(examples, dense_features)).astype("float32")}
    logit = x["dense"] @ rng.normal(scale=0.3, size=dense_features) - 1.0
    for name, rows in table_rows.items():
        x[name] = zipf_ids(rng, rows, (examples, 1), a)
        propensity = rng.normal(scale=0.6, size=rows)
        logit += propensity[x[name][:, 0]] / np.sqrt(len(table_rows) / 4)
    y = rng.random(examples) < 1 / (1 + np.exp(-logit))
    return x, y.astype("float32")[:, None]


def recommender(tables, width, *, sparse=True, combiner="sum", initializer="uniform",
                dense_features=0, bottom=None, top=(), loss="mse", dense_optimizer=None,
                metrics=None, table_dtype=None, storage=None, rows_per_step=None):
    """The toy recommender every benchmark trains, compiled.

    One input `<name>` per table (ids `[batch, bag]`; a model of one table and
    no dense features takes the id array itself), each table read with
    `combiner`, concatenated with an optional bottom MLP over `dense_features`
    dense inputs (input `dense`), then `top` ReLU layers and a `Dense(1)` named
    `out`.

    Args:
        tables: `{name: (rows, rule, bag)}`; `rule` is a sparseopt updater
            (`sparse=True`) or a Keras optimizer for that table (`sparse=False`:
            a plain `keras.layers.Embedding`, trained through `MultiOptimizer`).
        width: embedding width.
        sparse: sparseopt (`SparseEmbedding` + `DispatchOptimizer`) or plain Keras.
        combiner: `"sum"` or `"mean"` over each bag.
        initializer: the tables' initializer.
        dense_features: number of dense input features (0: none).
        bottom: units of the bottom layer over the dense features.
        top: units of the hidden layers on top.
        loss: the Keras loss.
        dense_optimizer: the Keras optimizer of the dense layers (default Adam 1e-3).
        metrics: Keras metrics to compile with.
        table_dtype: the sparseopt tables' dtype (None: float32).
        storage: the sparseopt tables' `sparseopt.TableStorage` (None: the default).
        rows_per_step: int8 tables' write buffer rows (`SparseEmbedding`'s;
            None: its default).

    Returns:
        The compiled `keras.Model`.
    """
    import keras

    import sparseopt

    dense_optimizer = dense_optimizer or keras.optimizers.Adam(1e-3)
    inputs, pooled, table_optimizers = {}, [], {}
    for name, (rows, rule, bag) in tables.items():
        inputs[name] = keras.Input((bag,), dtype="int32", name=name)
        if sparse:
            pooled.append(sparseopt.layers.SparseEmbedding(
                rows, width, updater=rule, combiner=combiner, name=f"{name}_table",
                embeddings_initializer=initializer, dtype=table_dtype, storage=storage,
                **({"rows_per_step": rows_per_step} if table_dtype == "int8" else {}))(
                    inputs[name]))
        else:
            rows_read = keras.layers.Embedding(rows, width, name=f"{name}_table",
                                               embeddings_initializer=initializer)(inputs[name])
            reduce = keras.ops.mean if combiner == "mean" else keras.ops.sum
            pooled.append(reduce(rows_read, axis=1))
            table_optimizers[f"{name}_table/embeddings"] = rule
    if dense_features:
        inputs["dense"] = keras.Input((dense_features,), name="dense")
        pooled.append(keras.layers.Dense(bottom, activation="relu", name="bottom")(
            inputs["dense"]))
    x = pooled[0] if len(pooled) == 1 else keras.layers.Concatenate()(pooled)
    for i, units in enumerate(top):
        x = keras.layers.Dense(units, activation="relu", name=f"top{i}")(x)
    if len(inputs) == 1:
        inputs = next(iter(inputs.values()))
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(x))
    if sparse:
        optimizer = sparseopt.DispatchOptimizer(dense_optimizer)
    else:
        optimizer = keras.optimizers.MultiOptimizer(
            keras.optimizers.OptimizerMap(dense_optimizer, table_optimizers))
    model.compile(optimizer=optimizer, loss=loss, metrics=metrics)
    return model


def plot_loss_and_auc(curves, path, title, xlabel, ylabels, style=None):
    """Two panels, loss and AUC, one line per variant, saved to `path`.

    Args:
        curves: `{variant: [(x, loss, auc), ...]}`.
        path: the PNG to write.
        title: the figure's title.
        xlabel: the x axis' label.
        ylabels: `(loss label, AUC label)`.
        style: `style(variant)` -> matplotlib line keywords (default: dots).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve in curves.items():
        x, loss, auc = zip(*curve)
        kwargs = style(name) if style else dict(marker="o", markersize=3)
        axes[0].plot(x, loss, label=name, **kwargs)
        axes[1].plot(x, auc, label=name, **kwargs)
    for ax, label in zip(axes, ylabels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
