"""Tables larger than memory: rows and their optimizer state in files, hot rows cached.

In progress (issue 48). What is here is the host side of a table on disk,
usable on its own but not yet from a layer:

- `initial_rows.py`: the rows a table starts with, drawn lazily and
  reproducibly per row (a counter-based hash of seed, row and column), so a
  billion-row table costs nothing until rows are touched;
- `row_files.py`: `RowFiles`, a table's rows and per-row state in
  memory-mapped files, allocated on disk a chunk at a time as rows are first
  written (a full disk is an error naming the table, never a crash);
- `row_cache.py`: `RowCache`, a set-associative write-back cache of rows and
  their state in memory, LRU or LFU, with hit and byte counts.

Next: a row-storage kind (`sparseopt.storage`) that reads and writes a
step's distinct rows through the cache from inside the traced step, a
prefetch stage, consistent snapshots for saves, and both backends.
"""
