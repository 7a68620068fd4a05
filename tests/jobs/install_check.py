"""Installed as users install it: a small model trained from the wheel, outside the checkout.

Run by `make install-check` with the interpreter of a fresh virtual environment
into which the built wheel was installed (`sparseopt[jax,tensorflow]`), from a
folder outside the checkout, with an empty kernel cache. For the backend given:

- `sparseopt` is imported from that environment, not from the checkout;
- the JAX kernels come built in the wheel (nothing compiled at the first
  `fit`); the TensorFlow op is compiled at the first `fit` into the per-user
  cache (one logged line says so); both are used (where a C++ compiler is
  found), and nothing is written into the package;
- a two-table model (float32 and bfloat16 tables, Adagrad) trains, saves and
  loads, and the loaded model predicts what the trained one does.

Usage: KERAS_BACKEND=jax python install_check.py CHECKOUT
"""

import os
import pathlib
import shutil
import sys
import tempfile


def files_under(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if "__pycache__" not in p.parts)


def main(checkout):
    import keras
    import numpy as np

    import sparseopt
    import sparseopt.native

    package = pathlib.Path(sparseopt.__file__).parent
    assert not package.is_relative_to(pathlib.Path(checkout).resolve()), (
        f"imported from the checkout ({package}), not the installed wheel")
    before = files_under(package)
    ids = keras.Input((4,), dtype="int32")
    users = sparseopt.layers.SparseEmbedding(1000, 8, sparseopt.updaters.Adagrad(0.05),
                                             name="users")
    items = sparseopt.layers.SparseEmbedding(1000, 8, sparseopt.updaters.Adagrad(0.05),
                                             dtype="bfloat16", name="items")
    x = keras.layers.Concatenate()([keras.layers.Flatten()(users(ids[:, :2])),
                                    keras.layers.Flatten()(items(ids[:, 2:]))])
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model.compile(optimizer=sparseopt.DispatchOptimizer(keras.optimizers.Adam(1e-3)),
                  loss="mse")
    rng = np.random.default_rng(0)
    xs = rng.integers(0, 1000, (512, 4)).astype("int32")
    ys = rng.normal(size=(512, 1)).astype("float32")
    start = keras.ops.convert_to_numpy(users.embeddings).copy()
    model.fit(xs, ys, batch_size=64, epochs=2, verbose=0)
    assert not np.array_equal(keras.ops.convert_to_numpy(users.embeddings), start)
    framework = keras.backend.backend()
    cache = pathlib.Path(os.environ["XDG_CACHE_HOME"]) / "sparseopt" / "native"
    if shutil.which("g++") or shutil.which("c++"):  # (without one, the pure path runs)
        assert sparseopt.native.available(framework), sparseopt.native.build_error(framework)
        if framework == "jax":  # built into the wheel: nothing compiled at first use
            assert sparseopt.native.prebuilt_path().exists(), "no JAX kernels in the wheel"
            assert not list(cache.glob("libsparseopt_kernels_*")), "compiled at first use"
        else:  # the TensorFlow op: compiled at first use, into the per-user cache
            assert list(cache.glob("libsparseopt_tf_ops_*")), f"no op in the cache {cache}"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "m.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.predict(xs, verbose=0), model.predict(xs, verbose=0),
                               rtol=1e-6, atol=1e-6)
    assert files_under(package) == before, "the package's folder was written to"
    print(f"install check ({keras.backend.backend()}): sparseopt {package}, kernels in "
          f"{cache}: passed")


if __name__ == "__main__":
    main(sys.argv[1])
