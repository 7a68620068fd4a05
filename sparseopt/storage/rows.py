"""`RowStorage`: the one interface through which a table's rows and their state are reached.

A step works on the table's distinct rows of the batch: it reads each row and
its per-row state, the rule computes new ones, and they are written back.
Everything that reads or writes a table's rows goes through the table's
`RowStorage` (after FBGEMM's one load/store template, through which every
rule reaches rows of any storage tier): the step's stages, an open
vocabulary giving a row to a new id, Lookahead's sync, and the whole-table
writes of the end of `fit` (catch-up, moving and weight averages). Rules
never see it: they get float32 rows and state, and return new ones.

A kind is a subclass in its own module (`memory.py`, `int8.py`), registered
in `sparseopt.storage.kinds`. It owns the state's variables too (it creates
them: a kind that keeps rows elsewhere keeps their state there as well).

State slots come in two sorts (`SlotSpec.per_row`): per-row ones are read and
written with the rows here; whole ones (a column's or the table's) are
variables the rule's step reads and updates once (`whole`).
"""

from keras import ops


class RowStorage:
    """One table's rows and per-row optimizer state, read and written by row id.

    Args:
        table: the table's variable.
        specs: the updater's `SlotSpec`s, in order.
        settings: the table's `sparseopt.TableStorage`.
        rounding: how 16-bit values are written (`sparseopt.storage.precision.Rounding`).
        int8: the table's `sparseopt.storage.int8_table.Int8Table`, or None.
    """

    # Whether `read` needs the step's context (the rows its lookups read).
    reads_lookups = False
    # Whether a step can read rows its lookups did not read (Lookahead's sync of the
    # rows its window changed): always where `read` needs no context.
    reads_any_row = True
    # Whether Lookahead's window may keep an entry per table row in memory
    # (`engine.lookahead_window`); else a list bounded by a window's steps' ids
    # (`engine.lookahead_list`).
    lookahead_per_row = True
    # Whether a step reads and writes all of its distinct rows in one call
    # (never in a loop over chunks that carries `variables()`).
    at_once = False
    # Whether the table may be updated in a group with others (`TableGroup`),
    # which reads and writes its rows through this kind in the group's step.
    groups = True
    # Whether the step's dedup may use a workspace of one int32 per row (else a
    # hash of the step's ids: `sparseopt.engine.stages.distinct`).
    uses_workspace = True
    # Whether the table and its per-row state are plain variables, read and
    # written by nothing else, so that a native kernel may update them in place
    # instead of `read` and `write`. Declared by each class for itself (a
    # subclass that changes how rows are kept does not inherit it).
    _PLAIN = False

    @classmethod
    def plain(cls):
        """Whether a native kernel may update this kind's variables in place (`_PLAIN`)."""
        return cls.__dict__.get("_PLAIN", False)

    @classmethod
    def check(cls, updater, table, vocabulary):
        """Raises where this kind cannot keep `table` trained by `updater` (before any state
        exists); the base kind refuses nothing.

        Args:
            updater: the table's `Updater`.
            table: the table (its variable, or what its layer holds instead).
            vocabulary: its open vocabulary, or None.
        """

    # How a step's ids are numbered where the table has no dedup workspace: a
    # function of the step's int32 ids giving `sparseopt.engine.stages._Numbering`'s
    # fields (or None), or None: on the device, by a hash of the batch.
    numbering = None

    def __init__(self, table, specs, settings, rounding, int8=None):
        self.table, self.specs, self.settings = table, tuple(specs), settings
        self.rounding, self.int8 = rounding, int8
        self.slots = {}  # name -> variable, every slot (per-row and whole)
        # The rounding stream of each slot's writes (the table's is 0).
        self.streams = {spec.name: i + 1 for i, spec in enumerate(self.specs)}

    # -- the state's variables -------------------------------------------------

    def build(self, optimizer, prefix, initializer_of, layout_of):
        """Creates the state's variables with `optimizer.add_variable`.

        Args:
            optimizer: the optimizer that owns them.
            prefix: their names' prefix (the table's path).
            initializer_of: `initializer_of(spec)`, a slot's Keras initializer.
            layout_of: `layout_of(spec, shape)`, a slot's layout under a distribution.
        """
        for spec in self.specs:
            shape = spec.shape(self.table.shape)
            self.slots[spec.name] = optimizer.add_variable(
                shape=shape, initializer=initializer_of(spec),
                dtype=spec.dtype_for(self.settings.state_dtype),
                layout=layout_of(spec, shape), name=f"{prefix}_{spec.name}")

    @property
    def per_row(self):
        """The names of the per-row slots, in the order `variables` lists them."""
        kinds = {spec.name: spec for spec in self.specs}
        return sorted(n for n in self.slots if kinds[n].per_row)

    def variables(self):
        """What a step writes in place: the table, then the per-row slots (`per_row`).

        A loop over the step's rows carries these; a table split by rows
        holds a block of each on every device (`over`).
        """
        return [self.table] + [self.slots[n] for n in self.per_row]

    def over(self, variables, row_offset=None):
        """The same storage reading and writing `variables` instead (`variables()`'s order).

        Args:
            variables: stand-ins for `variables()` (a loop's carry, a shard's blocks).
            row_offset: the first global row of a shard's block, or None.
        """
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.table, rest = variables[0], variables[1:]
        view.slots = {**self.slots, **dict(zip(self.per_row, rest))}
        if row_offset is not None:
            view.rounding = self.rounding.at_offset(row_offset)
        return view

    # -- a step's rows ---------------------------------------------------------

    def read(self, ids, context=None):
        """`(rows, state)` of rows `ids`: float32 `[M, D]` and `{slot: [M, ...]}`.

        State is float32, or its own dtype for integer state (a row's last
        step). Ids past the table (a dedup's padding) read some real row.

        Args:
            ids: int32 `[M]` row ids.
            context: the step (`sparseopt.engine.stages.Context`), for kinds
                that read rows from it (`reads_lookups`).
        """
        raise NotImplementedError

    def write(self, ids, rows, state, step, count=None, keep=None, row_stream=0,
              rounded=True):
        """Writes new `rows` and `state` of rows `ids`, stored as the table keeps them.

        Args:
            ids: int32 `[M]` row ids; those past the table are not written.
            rows: float32 `[M, D]` new rows, or None to leave the rows.
            state: `{slot: [M, ...]}` new per-row state (float32 or the
                slot's integer dtype); slots left out keep their values.
            step: scalar int, the 1-based update count (16-bit rounding's bits).
            count: int32 scalar: entries from `count` on need not be written
                (a dedup's padding, or every entry of a skipped step, whose
                rows and state are handed back as read); None: every entry.
            keep: boolean `[M]`: only entries where it holds are written (the
                others not at all; ids may then repeat, with equal values).
            row_stream: the rounding stream of the rows' writes (0: a step's).
            rounded: False writes values as given (cast to the dtype), for
                values that are not a step's result (a row's fresh start).
        """
        raise NotImplementedError

    def start(self, ids, rows, keep, step):
        """Rows given to new ids start afresh: the rows, and every per-row slot at its start.

        What an open vocabulary does to a row it gives to another id; a slot
        starts at its `initial_value`, or at `step` where it `holds_step`.

        Args:
            ids: int32 `[M]` rows.
            rows: float32 `[M, D]` their first values.
            keep: boolean `[M]`: only where it holds.
            step: scalar int, the updates so far.
        """
        shape = (ops.shape(ids)[0],)
        state = {}
        for spec in self.specs:
            layout = self.slot_layout(spec.name) if spec.per_row else None
            if layout is not None:
                dtype, tail = layout
                value = step if spec.holds_step else spec.initial_value
                state[spec.name] = ops.broadcast_to(ops.cast(value, dtype), shape + tail)
        self.write(ids, rows, state, step, keep=keep, rounded=False)

    def slot_layout(self, name):
        """`(dtype, tail)` of per-row slot `name`'s rows, or None where the kind keeps
        none (the base kinds: its variable's)."""
        var = self.slots.get(name)
        return None if var is None else (var.dtype, tuple(var.shape[1:]))

    # -- the whole table, between steps ---------------------------------------

    # Whether `end_of_fit` has something to do.
    ends_fit = False

    def end_of_fit(self):
        """What the kind does once `fit` ends, after the wrappers' end of `fit`."""

    def each_part(self, work, writes=True):
        """Runs whole-table work `work(storage)` (row by row: each row's result depends on
        its own values and state) on every row: here on the whole table at once; a kind
        whose table is larger than memory hands it one part at a time (a `RowStorage`
        over some rows: `sparseopt.storage.disk_parts`).

        Args:
            work: reads and assigns the table through the storage it is given
                (`values`, `state_values`, `assign_values`, `assign_state`, `slots`).
            writes: False where the work only reads (an average): a kind may then
                keep what it caches.
        """
        work(self)

    def values(self):
        """float32 `[V, D]`: every row (whole-table work: the end of `fit`, averages)."""
        raise NotImplementedError

    def values_as_built(self):
        """float32 `[V, D]`: every row when the optimizer is built (a slot's start)."""
        return self.values()

    def assign_values(self, values, step):
        """Writes every row of float32 `values` `[V, D]`, rounded as a step's writes are."""
        raise NotImplementedError

    def assign_state(self, name, values, step, rounded=True):
        """Writes every row of slot `name`: rounded as a step's writes are, or (`rounded`
        False) as given, cast to its dtype."""
        var = self.slots[name]
        if rounded:
            ids = ops.arange(var.shape[0], dtype="int32")
            values = self.rounding.stored(values, var.dtype, step, ids, self.streams[name])
        var.assign(ops.cast(values, var.dtype))

    def state_values(self, name):
        """Slot `name` whole, as rules compute with it."""
        return as_computed(self.slots[name].value)


def as_computed(values):
    """State as rules compute with it: float32, or its own dtype for integer state."""
    return values if "int" in str(values.dtype) else ops.cast(values, "float32")

