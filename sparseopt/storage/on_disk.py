"""`OnDisk`: the settings of a table kept in files on disk, its hot rows cached in memory.

A `TableStorage` whose `kind` is `"disk"` (`sparseopt.storage.disk.DiskRows`):
the table's rows and every per-row slot of its updater live in files under
`path` (`sparseopt.disk.row_files`), and memory holds `cache_rows` rows with
their state (`sparseopt.disk.row_cache`). Given on a `SparseEmbedding`
(`storage=OnDisk(...)`), which then holds no `[V, D]` variable.
"""

import dataclasses
import os

import keras

from sparseopt.disk.row_cache import POLICIES
from sparseopt.storage.settings import TableStorage

DEFAULT_CACHE_ROWS = 1_000_000


@keras.saving.register_keras_serializable(package="sparseopt")
@dataclasses.dataclass(frozen=True, init=False)
class OnDisk(TableStorage):
    """A table's rows and per-row state in files under `path`, `cache_rows` of them in memory.

    Args:
        path: the table's folder (created if missing; a folder holding this
            table's files is reopened, one holding another table's is refused).
        cache_rows: how many rows, with their state, memory holds (rounded
            down to whole sets of 8).
        policy: which cached row a full set evicts: `"lru"` (used longest
            ago) or `"lfu"` (used least often since cached).
        fetch_ahead: whether `fit` (JAX and TensorFlow) brings the next step's rows
            into the cache while the current step runs (`sparseopt.disk.look_ahead`):
            it takes each batch from the data one step early, as Keras' JAX trainer
            does on accelerators (on TensorFlow from its `tf.data` pipeline, in
            Python, feeding the same compiled step). Off by default: on the one
            machine it was measured on (2 cores, the files in the page cache) it
            made the JAX step 9-15% faster and the TensorFlow one no faster, and on
            TensorFlow `fit` then takes its batches in Python, which costs a step in
            memory too (docs/disk.md, "What it gains"). False: rows are fetched in
            the step that reads them. What a step computes is the same either way.
        state_dtype, stochastic_rounding, rounding_seed: as for `TableStorage`.
    """

    path: str = None
    cache_rows: int = DEFAULT_CACHE_ROWS
    policy: str = "lru"
    fetch_ahead: bool = False

    kind = "disk"

    def __init__(self, path, cache_rows=DEFAULT_CACHE_ROWS, policy="lru", *, fetch_ahead=False,
                 state_dtype="float32", stochastic_rounding=True, rounding_seed=0):
        # (Written out: the folder comes first, before the inherited settings.)
        given = dict(path=path, cache_rows=cache_rows, policy=policy, fetch_ahead=fetch_ahead,
                     state_dtype=state_dtype,
                     stochastic_rounding=stochastic_rounding, rounding_seed=rounding_seed)
        for name, value in given.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ValueError(f"OnDisk: `path` must name the table's folder, got {self.path!r}.")
        object.__setattr__(self, "path", os.fspath(self.path))
        if (isinstance(self.cache_rows, bool) or not isinstance(self.cache_rows, int)
                or self.cache_rows < 1):
            raise ValueError(f"OnDisk: `cache_rows` must be a positive int, got "
                             f"{self.cache_rows!r}.")
        if self.policy not in POLICIES:
            raise ValueError(f"OnDisk: `policy` must be one of {POLICIES}, got "
                             f"{self.policy!r}.")
        if not isinstance(self.fetch_ahead, bool):
            raise ValueError(f"OnDisk: `fetch_ahead` must be True or False, got "
                             f"{self.fetch_ahead!r}.")
