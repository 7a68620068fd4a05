"""`Int8Table`: the variables of an 8-bit table, its reads, and how its writes arrive.

An int8 table is two weights of its layer, in Keras' own int8 `Embedding`
format (`sparseopt.quantization`): `embeddings` (int8 `[V, D]` codes) and
`embeddings_scale` (float32 `[V]`), both non-trainable: Keras' JAX train
step differentiates every trainable variable, and JAX differentiates no
integer array.

Its optimizer step cannot write them on JAX (a stateless step returns only
trainable and optimizer variables), so the step's new rows travel through a
write buffer, which the layer's next call writes into the table before it
reads anything (the hand-over open vocabularies use for their map):

- the optimizer quantizes the step's new rows (stochastic rounding, seeded
  like 16-bit writes) and puts codes, scales and row ids in `buffer`
  (float32 `[H, D + 3]`: codes, scale, the id's two 16-bit halves, all exact
  in float32) and their number in `buffered`;
- every call of the layer first writes the buffered rows into the table
  (again and again until the next step replaces them: the same values, so
  nothing changes);
- a skipped step buffers nothing. Saving and the end of `fit` write the
  buffer first (`flush`), so files and the table after training are current.

The buffer holds `H = min(V, rows_per_step)` rows, the most distinct rows
one step may update: more is an error naming the table and the fix, never a
lost write. On TensorFlow the same path runs (one behaviour to test; the
buffer is then plain layer state). Since the optimizer cannot read the
table either, the rows it updates are the ones the forward pass read
(`RowGrads.read`).
"""

import keras
import numpy as np
from keras import ops

from sparseopt import backend, distribution
from sparseopt.storage import quantization
from sparseopt.storage import block_init
from sparseopt.halves import decode_step, encode_step, join_halves, split_halves

DEFAULT_ROWS_PER_STEP = 16384


class Int8Table:
    """The int8 codes, row scales and write buffer of one table.

    Args:
        rows_per_step: the most distinct rows one step may update (the write
            buffer's rows, at most the table's); None: `min(V, 16384)`.
    """

    def __init__(self, rows_per_step=None):
        if rows_per_step is not None and (isinstance(rows_per_step, bool)
                                          or int(rows_per_step) != rows_per_step
                                          or rows_per_step <= 0):
            raise ValueError(f"`rows_per_step` must be a positive int, got {rows_per_step!r}.")
        self.rows_per_step = None if rows_per_step is None else int(rows_per_step)
        self.codes = self.scale = self.buffer = self.buffered = None

    def build(self, layer, shape, initializer, add_state):
        """Creates the table's weights on `layer` and its write buffer.

        Args:
            layer: the owning layer.
            shape: `(V, D)`.
            initializer: the float initializer of the table; its values are
                quantized (to nearest) block by block.
            add_state: `add_state(name, shape, dtype, trainable)` creating layer
                state that is not a weight.
        """
        num_rows, width = shape
        codes, scale = _initial(initializer, shape)
        self.codes = layer.add_weight(shape=shape, dtype="int8", trainable=False,
                                      initializer=_Given(codes), name="embeddings",
                                      autocast=False)
        layout = distribution.rows_like(self.codes, 1)
        if layout is None:
            self.scale = layer.add_weight(shape=(num_rows,), dtype="float32", trainable=False,
                                          initializer=_Given(scale), name="embeddings_scale",
                                          autocast=False)
        else:  # split by rows like the codes (a row's scale lives with its codes)
            with keras.name_scope(layer.name, caller=layer):
                self.scale = keras.Variable(_Given(scale), shape=(num_rows,), dtype="float32",
                                            trainable=False, name="embeddings_scale",
                                            layout=layout)
        rows = min(num_rows, self.rows_per_step or DEFAULT_ROWS_PER_STEP)
        # Written by the optimizer: trainable where only trainable variables
        # can be (JAX); never trained.
        written = not backend.STATEFUL_APPLY
        self.buffer = add_state("embeddings_writes", (rows, width + 3), "float32", written)
        self.buffered = add_state("embeddings_writes_count", (2,), "float32", written)

    @property
    def written_variables(self):
        """The variables the optimizer writes (the buffer)."""
        return [self.buffer, self.buffered]

    # -- the layer's side -------------------------------------------------

    def read(self, ids):
        """float32 rows `ids` (any shape of valid int ids), `codes / scale`."""
        # (The backend's gather: a TF resource gather, never a read of the whole table.)
        return quantization.dequantize(backend.gather(self.codes.value, ids),
                                       backend.gather(self.scale.value, ids))

    def flush(self):
        """Writes the buffered rows into the table (idempotent: the same rows each time)."""
        count = decode_step(ops.stop_gradient(self.buffered.value))
        buffer = ops.stop_gradient(self.buffer.value)
        num_rows, width = self.codes.shape

        def write(variables, positions):
            codes, scale = variables
            entries = ops.take(buffer, positions, axis=0)
            keep = ops.less(positions, count)
            ids = join_halves(entries[:, width + 1], entries[:, width + 2])
            ids = ops.where(keep, ids, num_rows)
            backend.scatter_where(codes, ids, ops.cast(entries[:, :width], "int8"), keep)
            backend.scatter_where(scale, ids, entries[:, width], keep)

        positions = ops.arange(buffer.shape[0], dtype="int32")
        backend.for_listed_rows(write, [self.codes, self.scale], positions, count)

    def write(self, rows, values, keep):
        """Writes float32 `values` `[M, D]` into rows `rows` where `keep`, quantized to
        nearest (a row's fresh start: an open vocabulary's new rows, on the layer's side;
        writing the same again changes nothing)."""
        codes, scale = quantization.quantize(values)
        backend.scatter_where(self.codes, rows, codes, keep)
        backend.scatter_where(self.scale, rows, scale, keep)

    def clear(self):
        """Forgets the buffered rows (after the table was loaded or written whole)."""
        self.buffered.assign(ops.zeros((2,), "float32"))

    # -- whole-table reads and writes, between steps --------------------------

    def whole(self):
        """float32 `[V, D]`: every row, the buffered ones written first.

        For the whole-table work of the end of `fit` (catch-up, averages),
        outside the train step; it holds a float32 copy of the table.
        """
        self.flush()
        return self.values()

    def values(self):
        """float32 `[V, D]`: every row as stored (buffered rows not written)."""
        return quantization.dequantize(self.codes.value, self.scale.value)

    def assign_whole(self, values, quantize):
        """Writes every row of float32 `values` `[V, D]` that differs from the table's.

        Rows whose values are what the table reads keep their codes and scale
        bit for bit (a row written again would be requantized). Empties the
        buffer: its rows are in `values`.

        Args:
            values: the new rows.
            quantize: `quantize(values, ids)` -> `(codes, scale)` of the rows.
        """
        new = quantize(values, ops.arange(values.shape[0], dtype="int32"))
        codes, scale = quantization.where_changed(values, self.whole(),
                                                  (self.codes.value, self.scale.value), new)
        self.codes.assign(codes)
        self.scale.assign(scale)
        self.clear()

    # -- the optimizer's side ---------------------------------------------

    def hand_over(self, ids, codes, scale, count, table):
        """Buffers the step's new rows for the layer's next call.

        Args:
            ids: int32 `[M]` distinct row ids, the `count` first real.
            codes: int8 `[M, D]`, scale: float32 `[M]`: their new values.
            count: int32 scalar, the rows to write (0 for a skipped step).
            table: the table's path, for messages.
        """
        size = self.buffer.shape[0]
        fix = (f"Table '{table}' (int8) buffers at most {size:,} updated rows per step "
               f"until the next call writes them; this step updates more. Pass "
               f"`rows_per_step=` at least the ids one step looks up, times "
               f"`gradient_accumulation_steps` if set "
               f"(`SparseEmbedding(..., dtype='int8', rows_per_step=...)`).")
        if ids.shape[0] is not None and ids.shape[0] > size:
            # JAX: the step's distinct ids are bounded statically (min(ids, V)).
            raise ValueError(fix + f" This step can update {ids.shape[0]:,}.")
        # (TF: checked when the step runs; the buffer's slice would fail less clearly.)
        count = size - backend.at_least_zero(size - count, fix)
        entries = ops.concatenate(
            [ops.cast(codes, "float32"), ops.expand_dims(ops.cast(scale, "float32"), 1),
             ops.stack(split_halves(ids), axis=1)], axis=1)
        # The check first: a step over the buffer raises before writing any of it
        # (the buffer's rows still wait for the next call).
        backend.write_rows(self.buffer, 0, backend.after(count, entries))
        self.buffered.assign(encode_step(count))


class _Given(keras.initializers.Initializer):
    """The values computed when the layer was built (one draw for codes and scale)."""

    def __init__(self, values):
        self.values = values

    def __call__(self, shape, dtype=None):
        # Once: the layer's variable then holds the only copy.
        values, self.values = self.values, None
        return ops.convert_to_tensor(values, dtype=dtype)


def _initial(initializer, shape):
    """NumPy `(codes, scale)` of `initializer`'s values, quantized to nearest.

    Large tables of an element-wise initializer are drawn block by block
    (`block_init`), so that memory peaks at the int8 table plus one float32
    block; others are drawn whole (their values depend on the whole shape).
    """
    num_rows, width = shape
    codes = np.empty(shape, np.int8)
    scale = np.empty((num_rows,), np.float32)
    blocks = (isinstance(initializer, block_init.ELEMENTWISE)
              and num_rows * width >= block_init.MIN_ELEMENTS)
    step = block_init.BLOCK_ROWS if blocks else num_rows
    for i, start in enumerate(range(0, num_rows, step)):
        rows = min(step, num_rows - start)
        draw = block_init.for_block(initializer, i) if blocks else initializer
        block_codes, block_scale = quantization.quantize(draw((rows, width), dtype="float32"))
        codes[start:start + rows] = ops.convert_to_numpy(block_codes)
        scale[start:start + rows] = ops.convert_to_numpy(block_scale)
    return codes, scale
