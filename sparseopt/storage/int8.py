"""Rows in Keras' int8 `Embedding` format, as the step reads and writes them.

An int8 table's codes and scales are layer state the optimizer can neither
read nor write inside a step on JAX (its stateless step sees trainable and
optimizer variables only: `sparseopt.storage.int8_table`). So this kind:

- reads the rows the step's lookups read (the step's record carries them,
  `RowGrads.read`: every occurrence of an id read the same row), picked
  for each distinct id at one of its positions in the record;
- writes new rows quantized (seeded stochastic rounding, keyed like 16-bit
  writes by seed, table, stream 0, step, global row and column) into the
  table's write buffer, which the layer's next call writes; a skipped step
  (`count` 0) buffers nothing;
- keeps the updater's state as in-memory variables (float32 or
  `state_dtype`), read and written in place like any table's.

Whole-table reads and writes (between steps) go through the `Int8Table`.
"""

from keras import ops

from sparseopt.storage import precision, quantization
from sparseopt.storage.memory import InMemory

# The stochastic-rounding stream of the table's codes (its slots use `1 + i`).
CODES_STREAM = 0


class Int8Rows(InMemory):
    """An int8 table's rows (read from its lookups, written through its buffer) and state."""

    reads_lookups = True
    reads_any_row = False  # (its write buffer holds a step's rows only)
    at_once = True

    def variables(self):
        # The codes are written by the layer (from the buffer), never in a step.
        return [self.slots[n] for n in self.per_row]

    def over(self, variables, row_offset=None):
        raise ValueError(f"Table '{self.table.path}' (int8): its step runs on all of its "
                         "distinct rows at once, never on a part of them.")

    def _read_rows(self, ids, context):
        if context is None or context.record.read is None:
            raise ValueError(f"Table '{self.table.path}' (int8): its step has no rows read "
                             "by its lookup; it can only be trained from `SparseLookup` calls.")
        return context.rows_read(ids)

    def _write_rows(self, put, ids, rows, step, count, stream, rounded):
        # (Padding entries, from `count` on, are never written: the buffer keeps `count`.)
        codes, scale = quantized(rows, ids, step, self.rounding)
        self.int8.hand_over(ids, codes, scale, count, self.table.path)

    def start(self, ids, rows, keep, step):
        # The rows given to new ids are written by the layer's next call (the
        # open vocabulary's hand-over), with the state started here.
        super().start(ids, None, keep, step)

    ends_fit = True

    def end_of_fit(self):
        self.int8.flush()  # (the last step's buffered rows, into the table)

    def values(self):
        return self.int8.whole()

    def values_as_built(self):
        # (The buffer is empty when the optimizer is built: it fills only in steps.)
        return self.int8.values()

    def assign_values(self, values, step):
        self.int8.assign_whole(values, lambda rows, ids: quantized(rows, ids, step,
                                                                   self.rounding))


def quantized(rows, ids, step, rounding):
    """`(codes, scale)` of float32 `rows` (rows `ids`) written at `step` with `rounding`.

    Stochastic rounding draws the documented bits of (seed, table, stream 0,
    step, global row, column), as a 16-bit table's writes do; else to nearest.
    """
    bits = None
    if rounding.stochastic:
        global_ids = ops.cast(ids, "int32") + ops.cast(rounding.row_offset, "int32")
        bits = precision.random_bits(
            precision.stream_key(rounding.seed, rounding.table_index, CODES_STREAM), step,
            global_ids, rows.shape[1])
    return quantization.quantize(rows, bits)
