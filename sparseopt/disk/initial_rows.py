"""The rows a table on disk starts with: drawn per row, lazily and reproducibly.

Keras draws a table's initial values in one piece from its random generator.
A table on disk may have a billion rows, most never touched, so its rows are
drawn only when first read, and each row's values depend on nothing but the
table's seed, the row and the column: a counter-based hash (the counter times
splitmix64's golden gamma, then splitmix64's finalizer, as counter-based
generators such as Philox hash a counter) of `(seed, row * width + column)`,
turned into the initializer's distribution. Same seed, same rows, in any
order; uniform draws are exact integer arithmetic, the same on any machine
(normal ones go through `log` and `cos`, which may differ in the last bit
between NumPy builds).

The distributions are Keras' (`RandomUniform`, `RandomNormal`,
`TruncatedNormal`, constants); the draws are not Keras' draws.
"""

import keras
import numpy as np

from sparseopt.disk import host_ops

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
# Rounds of redrawing for `TruncatedNormal` (values beyond 2 standard
# deviations are drawn again); after these, the few left are clipped.
_TRUNCATION_ROUNDS = 16


def mix(values):
    """uint64 `values` times splitmix64's golden gamma, then its finalizer (a bijection)."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def draw_key(seed, stream):
    """The uint64 key of draw `stream` of a table of `seed` (`uniform01`'s)."""
    with np.errstate(over="ignore"):
        return (mix(np.asarray([seed], np.uint64))
                ^ mix(np.asarray([stream + 1], np.uint64) * _M1))[0]


def uniform01(seed, stream, counters):
    """float64 in `[0, 1)` from `(seed, stream, counter)`: 53 bits of the mixed word.

    Args:
        seed: int, the table's seed.
        stream: int, which draw (0: the first uniform, 1: the second, ...).
        counters: uint64 array, one per value (`row * width + column`).
    """
    words = mix(counters.astype(np.uint64) ^ draw_key(seed, stream))
    return (words >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _normal(seed, stream, counters):
    # Box-Muller on two independent uniforms (1 - u keeps the log finite).
    u1 = 1.0 - uniform01(seed, stream, counters)
    u2 = uniform01(seed, stream + 1, counters)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


class InitialRows:
    """Draws rows of a table as its initializer's distribution, row by row.

    Args:
        initializer: a Keras initializer (instance, name or config):
            `RandomUniform` (`"uniform"`), `RandomNormal`, `TruncatedNormal`,
            `Zeros`, `Ones` or `Constant`.
        width: the table's width.
        seed: int seed; None: the seed given to the initializer, else 0 (never
            the one Keras draws for an unseeded initializer).
        owner: who asks (a table), for messages.

    Raises:
        ValueError: any other initializer (its values depend on the whole
            table's shape, or on a generator that cannot draw one row alone).
    """

    def __init__(self, initializer, width, seed=None, owner="table"):
        self.initializer = keras.initializers.get(initializer)
        self.width = int(width)
        init = self.initializer
        if seed is None:
            # The seed the user gave (None in the config when none was: Keras
            # then draws one per instance, which a reopened table could not repeat).
            seed = init.get_config().get("seed")
            seed = seed if isinstance(seed, int) else 0
        self.seed = int(seed) % (1 << 63)
        kinds = (keras.initializers.RandomUniform, keras.initializers.RandomNormal,
                 keras.initializers.TruncatedNormal, keras.initializers.Zeros,
                 keras.initializers.Ones, keras.initializers.Constant)
        if type(init) not in kinds:
            raise ValueError(
                f"{owner}: a table on disk draws each row when it is first read, which "
                f"{type(init).__name__} cannot do (its values depend on the whole table). "
                "Use RandomUniform, RandomNormal, TruncatedNormal or a constant, e.g. "
                "`embeddings_initializer=keras.initializers.RandomUniform(-0.05, 0.05)`.")

    def __call__(self, ids):
        """float32 `[M, width]`: the initial values of rows `ids` (int `[M]`)."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        init = self.initializer
        if isinstance(init, keras.initializers.RandomUniform):
            return self._uniform(ids)
        if not isinstance(init, (keras.initializers.RandomNormal,
                                 keras.initializers.TruncatedNormal)):  # (a constant)
            value = {keras.initializers.Zeros: 0.0, keras.initializers.Ones: 1.0}.get(
                type(init), getattr(init, "value", 0.0))
            return np.full((ids.size, self.width), value, np.float64).astype(np.float32)
        counters = self._counters(ids)
        if isinstance(init, keras.initializers.TruncatedNormal):
            values = self._truncated(counters)
        else:
            values = _normal(self.seed, 0, counters)
        return (init.mean + init.stddev * values).astype(np.float32)

    def _counters(self, ids):
        """uint64 `[M, width]`: each value's counter, `row * width + column`."""
        return (ids[:, None].astype(np.uint64) * np.uint64(self.width)
                + np.arange(self.width, dtype=np.uint64)[None, :])

    def _uniform(self, ids):
        """A `RandomUniform`'s rows: drawn by the host library where it is on, else by
        NumPy, to the same values bit for bit."""
        init = self.initializer
        # (float32 could round a value just below maxval up to it.)
        high = np.nextafter(np.float32(init.maxval), np.float32(init.minval))
        span = init.maxval - init.minval  # (in the bounds' own type: float32's in float32)
        drawn = host_ops.uniform(ids, self.width, draw_key(self.seed, 0), init.minval, span,
                                 high)
        if drawn is not None:
            return drawn
        values = init.minval + span * uniform01(self.seed, 0, self._counters(ids))
        return np.minimum(values.astype(np.float32), high)

    def _truncated(self, counters):
        values = _normal(self.seed, 0, counters)
        for k in range(1, _TRUNCATION_ROUNDS):
            out = np.abs(values) > 2.0
            if not out.any():
                break
            values[out] = _normal(self.seed, 2 * k, counters[out])
        return np.clip(values, -2.0, 2.0)

    def get_config(self):
        """What a reopened table checks: the initializer's config and the seed."""
        return {"initializer": keras.initializers.serialize(self.initializer),
                "seed": self.seed}
