"""Where a table's rows and their optimizer state live, and how a step reads and writes them.

Two things a table has, kept apart:

- its settings (`TableStorage`, `settings.py`): the dtype of its updater's
  state, how 16-bit values are rounded, the seed of the rounding's bits;
  given on the table (`SparseEmbedding(..., storage=TableStorage(...))`);
- its kind of row storage (`rows.py`: the interface; one module per kind):
  how the step's distinct rows and their per-row state are read and
  written back. `memory.py`: variables in memory, float32 or 16-bit
  (`precision.py`); `int8.py`: Keras' int8 `Embedding` format
  (`quantization.py`, `int8_table.py`); `disk_rows.py`: files on disk
  with a cache of hot rows (`on_disk.py`'s `OnDisk` settings,
  `sparseopt.disk`). Rules, the step engine and the
  dispatcher reach rows only through this interface, so a new kind is a
  new module and a `register` call.

`block_init.py` draws large tables block by block; `dtypes.py` names the
dtypes a table or its state may have.
"""

from sparseopt.storage.settings import (  # noqa: F401 (the settings' API)
    DEFAULTS, TableStorage, checked, from_argument, of_table)
from sparseopt.storage.kinds import kind_for, register, registered  # noqa: F401
from sparseopt.storage.on_disk import OnDisk  # noqa: F401
