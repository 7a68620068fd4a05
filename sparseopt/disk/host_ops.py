"""The host's passes over a step's ids for a table on disk: native where built, else NumPy.

Each function has two paths with one result: the host library's loop
(`sparseopt/native/disk_host.cc`, through ctypes; `sparseopt.native`'s
`disk_host` switch) and NumPy's vectorized passes, which run where the
library is off or could not be built. `number` has no NumPy path: without
the library the step numbers its ids on the device
(`sparseopt.engine.stages`).
"""

import ctypes
import math

import numpy as np

from sparseopt import native

_I64 = ctypes.POINTER(ctypes.c_int64)
_I32 = ctypes.POINTER(ctypes.c_int32)


def library():
    """The host library (ctypes), where it is switched on and built; else None."""
    return native.host_library() if native.enabled("disk_host") else None


def row_bytes(array):
    """Bytes of one row of `array` (its first dimension is rows)."""
    return array.itemsize * math.prod(array.shape[1:])  # (math's: a step calls it often)


def ptr(array, kind=_I64):
    """A ctypes pointer to contiguous `array`'s data, as `kind` (elements of its width).

    Raises:
        TypeError: the array's elements are not `kind`'s width, or it is not
            contiguous (C would read other values than the array holds).
    """
    width = ctypes.sizeof(kind._type_)
    if array.dtype.itemsize != width or not array.flags.c_contiguous:
        raise TypeError(f"host library: an array of {array.dtype} ({array.dtype.itemsize}-byte "
                        f"elements{'' if array.flags.c_contiguous else ', not contiguous'}) "
                        f"where C reads {width}-byte elements, contiguous.")
    return array.ctypes.data_as(kind)


class Distinct:
    """The distinct valid ids of a batch, in the order each first occurs.

    Args:
        ids: int64 `[M]`, the distinct ids.
        first: int64 `[M]`, where each first occurs in the batch.
        inverse: int64 `[N]`, each entry's index in `ids` (-1: invalid).
        finder: a function of int64 wanted ids giving their indices in `ids`
            (-1 where absent).
    """

    def __init__(self, ids, first, inverse, finder):
        self.ids, self.first, self.inverse, self._finder = ids, first, inverse, finder

    def find(self, wanted):
        """Int64 indices in `ids` of `wanted` (int64 ids), -1 where absent."""
        return self._finder(np.ascontiguousarray(wanted, np.int64))

    def positions(self, wanted):
        """Int64 indices in `ids` of `wanted` (int64 ids), or None if one is not there."""
        at = self.find(wanted)
        return None if (at < 0).any() else at


def distinct(ids, num_rows):
    """The `Distinct` ids of int `ids` `[N]` inside `[0, num_rows)`.

    Args:
        ids: int ids of a batch (repeats and invalid ids allowed).
        num_rows: the table's rows.
    """
    ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
    lib = library()
    if lib is None:
        return _distinct_numpy(ids, num_rows)
    n = ids.size
    capacity = 1 << max(1, int(2 * n - 1).bit_length())  # a power of two >= 2n
    uniq, first = np.empty(n, np.int64), np.empty(n, np.int64)
    inverse = np.empty(n, np.int64)
    keys, values = np.empty(capacity, np.int64), np.empty(capacity, np.int64)
    count = lib.so_unique(ptr(ids), ctypes.c_int64(n), ctypes.c_int64(num_rows), ptr(uniq),
                          ptr(first), ptr(inverse), ptr(keys), ptr(values),
                          ctypes.c_int64(capacity))

    def finder(wanted):
        out = np.empty(wanted.size, np.int64)
        lib.so_find(ptr(keys), ptr(values), ctypes.c_int64(capacity), ptr(wanted),
                    ctypes.c_int64(wanted.size), ptr(out))
        return out

    return Distinct(uniq[:count], first[:count], inverse, finder)


def _distinct_numpy(ids, num_rows):
    valid = (ids >= 0) & (ids < num_rows)
    where = np.flatnonzero(valid)
    ordered, first, inverse = np.unique(ids[where], return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # (sorted ids -> first-occurrence order)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    full = np.full(ids.size, -1, np.int64)
    full[where] = rank[inverse.reshape(-1)]

    def finder(wanted):
        at = np.minimum(np.searchsorted(ordered, wanted), max(ordered.size - 1, 0))
        if ordered.size == 0:
            return np.full(wanted.size, -1, np.int64)
        return np.where(ordered[at] == wanted, rank[at], -1)

    return Distinct(ordered[order], where[first[order]], full, finder)


def gather(source, index):
    """`source[index]` (rows of any dtype), zeros where `index` is -1.

    Args:
        source: an array whose first dimension is rows (C-contiguous).
        index: int64 `[K]`.
    """
    index = np.ascontiguousarray(index, np.int64)
    if index.size and index.max() >= source.shape[0]:
        raise IndexError(f"gather: index {int(index.max())} of an array of "
                         f"{source.shape[0]} rows")
    out = np.empty((index.size,) + source.shape[1:], source.dtype)
    lib = library()
    if lib is None or not source.flags.c_contiguous:
        out[...] = source[np.maximum(index, 0)] if source.shape[0] else 0
        out[index < 0] = 0
        return out
    lib.so_gather(ctypes.c_void_p(source.ctypes.data), ctypes.c_int64(row_bytes(source)),
                  ptr(index),
                  ctypes.c_int64(index.size), ctypes.c_void_p(out.ctypes.data))
    return out


def uniform(ids, width, key, minval, span, high):
    """float32 `[M, width]`: the initial values of rows `ids` of a `RandomUniform` table, by
    the host library (`initial_rows.InitialRows`' NumPy draw, bit for bit); None where the
    library is off.

    Args:
        ids: int64 `[M]` rows.
        width: the table's width.
        key: uint64, the draw's key (`initial_rows.draw_key`).
        minval: the initializer's lower bound.
        span: `maxval - minval` as the NumPy draw works it out (in the bounds' own
            type: float32 bounds subtract in float32).
        high: float32, the largest value drawn (just below `maxval`).
    """
    lib = library()
    if lib is None:
        return None
    ids = np.ascontiguousarray(ids, np.int64)
    out = np.empty((ids.size, int(width)), np.float32)
    lib.so_uniform(ptr(ids), ctypes.c_int64(ids.size), ctypes.c_int64(width),
                   ctypes.c_uint64(int(key)), ctypes.c_double(float(minval)),
                   ctypes.c_double(float(span)), ctypes.c_float(float(high)),
                   ctypes.c_void_p(out.ctypes.data))
    return out


def unreserved(ids, row_bytes, block_bytes, reserved):
    """The blocks of `block_bytes` of a file that rows `ids` lie on and that `reserved` does
    not hold: int64, sorted, each once (`sparseopt.disk.row_files.RowFiles.reserve`).

    Args:
        ids: int64 rows `[n]`.
        row_bytes: the bytes of a row in the file (rows one after another), or 0 for
            the written-rows bitmap (a bit per row: row `i` on byte `i >> 3`).
        block_bytes: the bytes of a block.
        reserved: bool `[blocks]`, the file's blocks reserved so far.
    """
    ids = np.ascontiguousarray(ids, np.int64)
    if ids.size:  # (C reads `reserved` at each row's blocks: none may lie outside it)
        last = int(ids.max()) * row_bytes + row_bytes - 1 if row_bytes else int(ids.max()) >> 3
        if ids.min() < 0 or last // block_bytes >= reserved.size:
            raise IndexError(f"unreserved: rows {int(ids.min())} to {int(ids.max())} lie "
                             f"outside a file of {reserved.size} blocks")
    lib = library()
    if lib is None:
        return _unreserved_numpy(ids, row_bytes, block_bytes, reserved)
    per_row = (row_bytes - 1) // block_bytes + 2 if row_bytes else 1  # (the most blocks)
    out = np.empty(ids.size * per_row, np.int64)
    count = lib.so_unreserved(ptr(ids), ctypes.c_int64(ids.size), ctypes.c_int64(row_bytes),
                              ctypes.c_int64(block_bytes),
                              ctypes.c_void_p(reserved.ctypes.data), ptr(out))
    return out[:count]


def _unreserved_numpy(ids, row_bytes, block_bytes, reserved):
    if row_bytes == 0:  # the bitmap's byte of each row
        first = last = ids >> 3
    else:
        first, last = ids * row_bytes, ids * row_bytes + (row_bytes - 1)
    start, stop = first // block_bytes, last // block_bytes
    # Most rows' blocks are reserved already (a step's rows are mostly rows written
    # before): only the others go on. A row lies on one or two blocks, unless it is
    # wider than a block: blocks inside it only it can have had reserved, so such
    # rows always go on.
    need = ~(reserved[start] & reserved[stop]) | (stop - start > 1)
    start, stop = start[need], stop[need]
    spans = stop - start + 1  # (a row may lie on several blocks)
    blocks = (np.repeat(start, spans)
              + np.arange(int(spans.sum())) - np.repeat(np.cumsum(spans) - spans, spans))
    return np.unique(blocks[~reserved[blocks]])


def number(ids, num_rows, lib):
    """`(number, ids_of, positions, count)` of int32 `ids` `[N]`: the valid ids numbered in
    the order of their last occurrence (`sparseopt.engine.stages._Numbering`), by the host
    library.

    Args:
        ids: int32 ids of the step.
        num_rows: the table's rows.
        lib: the host library (`library()`, where it is on: a step traced to number its
            ids on the host keeps doing so).
    """
    ids = np.ascontiguousarray(ids, np.int32).reshape(-1)
    n = ids.size
    number_, ids_of, positions = (np.empty(n, np.int32) for _ in range(3))
    count = lib.so_number(ptr(ids, _I32), ctypes.c_int64(n), ctypes.c_int64(num_rows),
                          ptr(number_, _I32), ptr(ids_of, _I32), ptr(positions, _I32))
    return number_, ids_of, positions, np.int32(count)

