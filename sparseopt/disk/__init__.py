"""Tables larger than memory: rows and their optimizer state in files, hot rows cached.

In progress (issue 48). A `SparseEmbedding` given `storage=OnDisk(...)`
(`sparseopt.storage.on_disk`) holds a `table.DiskTable` instead of a
variable; the row-storage kind `sparseopt.storage.disk_rows.DiskRows` reads
and writes a step's rows through it. The modules:

- `initial_rows.py`: the rows a table starts with, drawn lazily and
  reproducibly per row (a counter-based hash of seed, row and column), so a
  billion-row table costs nothing until rows are touched;
- `row_files.py`: `RowFiles`, a table's rows and per-row state in
  memory-mapped files, allocated on disk page by page as rows are first
  written (a full disk is an error naming the table, never a crash);
- `row_cache.py`: `RowCache`, a set-associative write-back cache of rows and
  their state in memory, LRU or LFU, with hit and byte counts (NumPy);
- `native_cache.py`: `NativeRowCache`, the same cache run by the host
  library (`sparseopt/native/disk_host.cc`), its evicted rows staged;
- `host_ops.py`: a batch's distinct ids, row gathers and the step's
  numbering, native where the library is on, else NumPy;
- `background.py`: the thread beside the step that writes a step's rows into
  the cache and evicted rows into the files;
- `table.py`: `DiskTable`, the files and cache of one table as a layer holds
  it, read and written from traced code through the backend's host calls;
- `sharded.py`: `ShardedDiskTable`, a table split by rows into shards (where a
  distribution splits its rows over devices), each a `DiskTable` of its own
  folder, files and cache; `layout.py`: a split table's folder, locked and
  recording its split (`shards.json`);
- `snapshots.py`: what a save holds of a table on disk: sparse, crash-safe
  copies of its files in its folder, which a load copies back.

Next: shards over several processes, and the open vocabulary's map on disk
(docs/disk.md).
"""
