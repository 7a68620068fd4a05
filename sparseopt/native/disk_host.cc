// The host side of a table on disk (sparseopt/disk), called from Python through ctypes.
//
// A step of a table on disk runs on the host between its compiled parts: its
// batch's ids deduplicated, their rows found in the cache or read from the
// files, rows evicted written back. NumPy does this in a dozen vectorized
// passes over the ids, each with its own temporary arrays (about 20 ms a step
// for 13k distinct ids of 32k); these loops make one or two passes each (the
// cache's: entries found, then rows copied with the next entries' lines asked
// for ahead). A C interface, no framework headers: the library serves JAX and
// TensorFlow alike.
//
// Every function computes what its NumPy counterpart in sparseopt/disk does,
// to the same result (tests/test_disk_native.py compares them):
//
// so_unique     the distinct valid ids of a batch, in first-occurrence order,
//               each entry's index among them, and a hash index of them;
// so_find       positions of ids in such an index;
// so_number     the step's ids numbered in the order of their last occurrence
//               (sparseopt.engine.stages._numbered);
// so_gather     rows of an array by index (-1: zeros);
// so_unreserved the blocks of a file that rows lie on and that are not yet
//               reserved on disk (RowFiles.reserve);
// so_uniform    rows a RandomUniform table starts with (InitialRows: the same
//               integer hash, the same roundings, so the same floats);
// so_cache_*    RowCache's read, write and insert (set-associative, LRU/LFU),
//               evicted dirty rows staged for so_stage_flush, which writes
//               them into the files' memory maps;
// so_files_read a read's missed rows from the files' memory maps (RowFiles.read).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "id_index.h"

namespace {

constexpr int kTickBits = 40;
constexpr int64_t kMaxUses = (int64_t{1} << 22) - 1;

using sparseopt::Index;
using sparseopt::Mix;

// How many ids ahead a loop asks for the lines it will need: a call's ids lie
// at random (in a hash index, the cache's sets, a large array's rows), and
// loads asked for ahead overlap the work on the ids before.
constexpr int64_t kAhead = 8;

}  // namespace

extern "C" {

// Distinct ids of `ids` [n] inside [0, num_rows), in the order each first
// occurs, into `uniq`, and where each first occurs into `first`; `inverse[i]`
// the index of ids[i] among them (-1 where invalid). `keys`/`values`
// [capacity] (a power of two >= 2n) receive the index of the distinct ids
// (key: id, value: its index), for so_find. Returns how many are distinct.
int64_t so_unique(const int64_t* ids, int64_t n, int64_t num_rows, int64_t* uniq,
                  int64_t* first, int64_t* inverse, int64_t* keys, int64_t* values,
                  int64_t capacity) {
  Index index{keys, values, static_cast<uint64_t>(capacity - 1)};
  std::memset(keys, 0xff, sizeof(int64_t) * capacity);
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) index.Prefetch(ids[i + kAhead]);
    const int64_t id = ids[i];
    if (id < 0 || id >= num_rows) {
      inverse[i] = -1;
      continue;
    }
    const uint64_t at = index.Slot(id);
    if (keys[at] == -1) {
      keys[at] = id;
      values[at] = count;
      first[count] = i;
      uniq[count++] = id;
    }
    inverse[i] = values[at];
  }
  return count;
}

// `out[k]`: the index of `wanted[k]` in an index so_unique wrote (-1 where it
// is not there). Returns how many are not there.
int64_t so_find(const int64_t* keys, const int64_t* values, int64_t capacity,
                const int64_t* wanted, int64_t m, int64_t* out) {
  Index index{const_cast<int64_t*>(keys), const_cast<int64_t*>(values),
              static_cast<uint64_t>(capacity - 1)};
  int64_t absent = 0;
  for (int64_t k = 0; k < m; ++k) {
    if (k + kAhead < m) index.Prefetch(wanted[k + kAhead]);
    const uint64_t at = index.Slot(wanted[k]);
    out[k] = keys[at] == -1 ? -1 : values[at];
    absent += out[k] < 0;
  }
  return absent;
}

// sparseopt::NumberIds (id_index.h), for the host's calls.
int64_t so_number(const int32_t* ids, int64_t n, int64_t num_rows, int32_t* number,
                  int32_t* ids_of, int32_t* positions) {
  return sparseopt::NumberIds(ids, n, num_rows, number, ids_of, positions);
}

// out[k] = src[index[k]] (rows of `row_bytes`), zeros where index[k] < 0.
void so_gather(const uint8_t* src, int64_t row_bytes, const int64_t* index, int64_t m,
               uint8_t* out) {
  for (int64_t k = 0; k < m; ++k) {
    if (k + kAhead < m && index[k + kAhead] >= 0) {
      const uint8_t* next = src + index[k + kAhead] * row_bytes;
      __builtin_prefetch(next);
      __builtin_prefetch(next + row_bytes - 1);  // (a row need not start on a line)
    }
    if (index[k] < 0) {
      std::memset(out + k * row_bytes, 0, row_bytes);
    } else {
      std::memcpy(out + k * row_bytes, src + index[k] * row_bytes, row_bytes);
    }
  }
}

// The blocks of `block_bytes` of a file that rows `ids` [n] lie on (rows of
// `row_bytes` one after another; `row_bytes` 0: the written-rows bitmap, a
// bit per row) and that `reserved` (a flag per block) does not hold, sorted,
// each once, into `out` (room for n times the most blocks a row lies on).
// Returns how many.
int64_t so_unreserved(const int64_t* ids, int64_t n, int64_t row_bytes, int64_t block_bytes,
                      const uint8_t* reserved, int64_t* out) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t first = row_bytes ? ids[i] * row_bytes : ids[i] >> 3;
    const int64_t last = row_bytes ? first + row_bytes - 1 : first;
    for (int64_t b = first / block_bytes; b <= last / block_bytes; ++b) {
      if (!reserved[b]) out[count++] = b;
    }
  }
  std::sort(out, out + count);
  return std::unique(out, out + count) - out;
}

// A RowCache's arrays (NumPy's, which Python keeps alive), its files' maps,
// and its counters. Mirrored by sparseopt.disk.native_cache._Cache.
struct SoCache {
  int64_t* tags;      // [sets * ways] row id, -1: empty
  uint8_t* dirty;     // [sets * ways]
  int64_t* last;      // [sets * ways] tick of last use
  int64_t* uses;      // [sets * ways]
  int64_t* rounds;    // [sets] zeros between calls (a call's per-set counter)
  int64_t sets, ways, lfu;
  int64_t columns;
  uint8_t** data;     // [columns] the cache's rows, [sets * ways] rows each
  int64_t* row_bytes; // [columns]
  uint8_t** files;    // [columns] the files' maps, [num_rows] rows each
  uint8_t* written;   // the files' written-rows bitmap
  int64_t* tick;      // [1]
  int64_t* counts;    // [2] hits, misses
  // Where evicted dirty rows wait for the files (so_stage_flush): a call's
  // evictions are copied one after another into memory at hand, and their
  // scattered writes into the files' maps are left to a thread beside the step.
  int64_t* stage_ids;    // [stage_capacity]
  uint8_t** stage;       // [columns] rows, [stage_capacity] each
  int64_t stage_capacity;
  int64_t* staged;       // [1] how many wait
};

namespace {

inline int64_t SetOf(const SoCache& c, int64_t id) {
  return static_cast<int64_t>(Mix(static_cast<uint64_t>(id)) % static_cast<uint64_t>(c.sets));
}

// Asks for the lines of the set of `id`: its tags, ticks, uses and dirty flags
// (a set's tags, ticks or uses may straddle two lines: both ends are asked for).
inline void Prefetch(const SoCache& c, int64_t id) {
  const int64_t base = SetOf(c, id) * c.ways, end = base + c.ways - 1;
  __builtin_prefetch(c.tags + base);
  __builtin_prefetch(c.tags + end);
  __builtin_prefetch(c.last + base);
  __builtin_prefetch(c.last + end);
  __builtin_prefetch(c.uses + base);
  __builtin_prefetch(c.uses + end);
  __builtin_prefetch(c.dirty + base);
}

// Asks for the lines of row `at` of each column of `rows` (`write`: to be written).
inline void PrefetchRow(const SoCache& c, uint8_t* const* rows, int64_t at, bool write) {
  for (int64_t j = 0; j < c.columns; ++j) {
    const uint8_t* row = rows[j] + at * c.row_bytes[j];
    if (write) {
      __builtin_prefetch(row, 1);
      __builtin_prefetch(row + c.row_bytes[j] - 1, 1);  // (a row need not start on a line)
    } else {
      __builtin_prefetch(row);
      __builtin_prefetch(row + c.row_bytes[j] - 1);
    }
  }
}

// The entry holding `id`, or -1.
inline int64_t Find(const SoCache& c, int64_t id) {
  const int64_t base = SetOf(c, id) * c.ways;
  for (int64_t w = 0; w < c.ways; ++w) {
    if (c.tags[base + w] == id) return base + w;
  }
  return -1;
}

inline void Touch(SoCache& c, int64_t entry, int64_t tick) {
  c.last[entry] = tick;
  c.uses[entry] = c.uses[entry] + 1 < kMaxUses ? c.uses[entry] + 1 : kMaxUses;
}

// The entry of set `set` to evict: an empty one first, else the smallest key
// (LRU: last use; LFU: uses, then last use), the first of equals.
inline int64_t Victim(const SoCache& c, int64_t set) {
  const int64_t base = set * c.ways;
  int64_t best = base, best_key = 0;
  for (int64_t w = 0; w < c.ways; ++w) {
    const int64_t e = base + w;
    const int64_t key = c.tags[e] < 0 ? -1
                        : c.lfu ? (c.uses[e] << kTickBits) | c.last[e] : c.last[e];
    if (w == 0 || key < best_key) {
      best = e;
      best_key = key;
    }
  }
  return best;
}

// Writes row `id` (`rows[k]`: its values per column, at row `at`) into the
// files (its pages of disk reserved when the row was first made dirty: see
// RowFiles.reserve) and marks it written.
inline void ToFiles(const SoCache& c, int64_t id, uint8_t* const* rows, int64_t at) {
  for (int64_t k = 0; k < c.columns; ++k) {
    std::memcpy(c.files[k] + id * c.row_bytes[k], rows[k] + at * c.row_bytes[k],
                c.row_bytes[k]);
  }
  c.written[id >> 3] |= static_cast<uint8_t>(1u << (id & 7));
}

// The entries holding distinct `ids` [m], touched: each row copied from the
// cache into `rows` (per column, row k for ids[k]), or, `writing`, from `rows`
// into the cache, marked dirty; the indices of uncached ids into `missed`.
// Returns how many were uncached.
//
// Two passes: the first finds each id's entry (its set's lines asked for
// ahead), the second copies the rows, asking ahead for the lines of the
// entries it will copy next, which only the first pass knows: a row of the
// cache lies at random, and its load would otherwise wait, id after id.
int64_t Hits(SoCache& c, const int64_t* ids, int64_t m, uint8_t** rows, int64_t* missed,
             bool writing) {
  const int64_t tick = ++*c.tick;
  std::vector<int64_t> entry(m), at(m);  // the hits: their entries, and k
  int64_t count = 0, found = 0;
  for (int64_t k = 0; k < m; ++k) {
    if (k + kAhead < m) Prefetch(c, ids[k + kAhead]);
    const int64_t e = Find(c, ids[k]);
    if (e < 0) {
      missed[count++] = k;
      continue;
    }
    entry[found] = e;
    at[found++] = k;
  }
  for (int64_t h = 0; h < found; ++h) {
    if (h + kAhead < found) {
      PrefetchRow(c, c.data, entry[h + kAhead], writing);
      PrefetchRow(c, rows, at[h + kAhead], !writing);
    }
    const int64_t e = entry[h], k = at[h];
    for (int64_t j = 0; j < c.columns; ++j) {
      uint8_t* cached = c.data[j] + e * c.row_bytes[j];
      uint8_t* given = rows[j] + k * c.row_bytes[j];
      std::memcpy(writing ? cached : given, writing ? given : cached, c.row_bytes[j]);
    }
    if (writing) c.dirty[e] = 1;
    Touch(c, e, tick);
  }
  return count;
}

}  // namespace

// The cached rows of distinct `ids` [m] copied into `out` (per column, row k
// for ids[k]) and touched; the indices of the others into `missed`. Returns how
// many missed.
int64_t so_cache_read(SoCache* cache, const int64_t* ids, int64_t m, uint8_t** out,
                      int64_t* missed) {
  const int64_t count = Hits(*cache, ids, m, out, missed, false);
  cache->counts[0] += m - count;
  cache->counts[1] += count;
  return count;
}

// Writes `values` (per column, row k for ids[k]) of distinct cached `ids`
// [m], marking them dirty; the indices of uncached ones into `missed`.
// Returns how many are uncached.
int64_t so_cache_write(SoCache* cache, const int64_t* ids, int64_t m, uint8_t** values,
                       int64_t* missed) {
  return Hits(*cache, ids, m, values, missed, true);
}

// Caches distinct uncached rows `ids[at[k]]` (k < m) with values row `at[k]`
// of `values` (per column), dirty or not, evicting others (dirty ones staged).
// Rows of one set are placed in their order, each in a round of its own (round
// r ticks once after round r-1), as RowCache._insert. Returns 0, or -1,
// changing nothing, where the stage has no room for m more (its caller makes
// room: each row evicts at most one).
int64_t so_cache_insert(SoCache* cache, const int64_t* ids, const int64_t* at, int64_t m,
                        uint8_t** values, int64_t dirty) {
  SoCache& c = *cache;
  if (*c.staged + m > c.stage_capacity) return -1;
  const int64_t base = *c.tick;
  int64_t rounds = 0;
  // Two passes, as Hits: the first picks each row's entry and does the
  // bookkeeping (tags, flags, ticks; which evicted rows go where), the second
  // copies rows, asking ahead for the lines of the entries it copies next. In
  // order, so where a call's rows evict one another (more than a set's ways),
  // each evicted copy is the one before it.
  // Each row's entry, and where its evicted row goes in the stage (-1: nowhere).
  std::vector<int64_t> entry(m), out(m);
  for (int64_t k = 0; k < m; ++k) {
    if (k + kAhead < m) Prefetch(c, ids[at[k + kAhead]]);
    const int64_t row = at[k], set = SetOf(c, ids[row]);
    const int64_t round = c.rounds[set]++;
    rounds = round + 1 > rounds ? round + 1 : rounds;
    const int64_t e = Victim(c, set);
    out[k] = -1;
    if (c.tags[e] >= 0 && c.dirty[e]) {
      out[k] = (*c.staged)++;
      c.stage_ids[out[k]] = c.tags[e];
    }
    entry[k] = e;
    c.tags[e] = ids[row];
    c.dirty[e] = static_cast<uint8_t>(dirty != 0);
    c.uses[e] = 0;
    Touch(c, e, base + round + 1);
  }
  for (int64_t k = 0; k < m; ++k) c.rounds[SetOf(c, ids[at[k]])] = 0;
  *c.tick = base + rounds;
  for (int64_t k = 0; k < m; ++k) {
    if (k + kAhead < m) {
      PrefetchRow(c, c.data, entry[k + kAhead], true);
      PrefetchRow(c, values, at[k + kAhead], false);
    }
    const int64_t e = entry[k];
    if (out[k] >= 0) {
      for (int64_t j = 0; j < c.columns; ++j) {
        std::memcpy(c.stage[j] + out[k] * c.row_bytes[j], c.data[j] + e * c.row_bytes[j],
                    c.row_bytes[j]);
      }
    }
    for (int64_t j = 0; j < c.columns; ++j) {
      std::memcpy(c.data[j] + e * c.row_bytes[j], values[j] + at[k] * c.row_bytes[j],
                  c.row_bytes[j]);
    }
  }
  return 0;
}

// The rows `ids[at[k]]` (k < m, uncached: a read's misses) that the files hold
// (written before) copied from the files' maps into `out` (per column, at row
// at[k]), in one pass; the indices at[k] of the rows never written (the caller
// draws them: their files hold nothing) into `fresh`. Returns how many are fresh.
int64_t so_files_read(SoCache* cache, const int64_t* ids, const int64_t* at, int64_t m,
                      uint8_t** out, int64_t* fresh) {
  const SoCache& c = *cache;
  int64_t count = 0;
  for (int64_t k = 0; k < m; ++k) {
    if (k + kAhead < m) {
      const int64_t next = ids[at[k + kAhead]];
      __builtin_prefetch(c.written + (next >> 3));
      PrefetchRow(c, c.files, next, false);
    }
    const int64_t row = at[k], id = ids[row];
    if (!((c.written[id >> 3] >> (id & 7)) & 1)) {
      fresh[count++] = row;
      continue;
    }
    for (int64_t j = 0; j < c.columns; ++j) {
      std::memcpy(out[j] + row * c.row_bytes[j], c.files[j] + id * c.row_bytes[j],
                  c.row_bytes[j]);
    }
  }
  return count;
}

// Writes the staged rows into the files, in the order they were staged (where
// a row was staged twice, the files keep its later values). Returns how many.
int64_t so_stage_flush(SoCache* cache) {
  SoCache& c = *cache;
  const int64_t count = *c.staged;
  for (int64_t s = 0; s < count; ++s) {
    if (s + kAhead < count) {  // (the files' rows lie at random: asked for ahead)
      const int64_t next = c.stage_ids[s + kAhead];
      PrefetchRow(c, c.files, next, true);
      __builtin_prefetch(c.written + (next >> 3), 1);
    }
    ToFiles(c, c.stage_ids[s], c.stage, s);
  }
  *c.staged = 0;
  return count;
}

// Writes every dirty row back into the files. Returns how many.
int64_t so_cache_flush(SoCache* cache) {
  SoCache& c = *cache;
  int64_t written = 0;
  for (int64_t e = 0; e < c.sets * c.ways; ++e) {
    if (c.tags[e] >= 0 && c.dirty[e]) {
      ToFiles(c, c.tags[e], c.data, e);
      c.dirty[e] = 0;
      ++written;
    }
  }
  return written;
}

// The initial values of rows `ids` [m] of a RandomUniform table of `width`
// columns into `out` [m, width] (sparseopt.disk.initial_rows.InitialRows):
// value c of row i from the word Mix((i * width + c) ^ key) (`key`: the
// table's seed and the draw's stream, mixed as uniform01 mixes them), its top
// 53 bits a double u in [0, 1), then minval + span * u (`span`: maxval - minval
// as NumPy works it out from the initializer's bounds) rounded to float and kept
// below `high`. Each operation rounds as NumPy's does (no FMA contraction: the
// library is built with -ffp-contract=off), so the values are NumPy's, bit for bit.
void so_uniform(const int64_t* ids, int64_t m, int64_t width, uint64_t key, double minval,
                double span, float high, float* out) {
  const uint64_t cols = static_cast<uint64_t>(width);
  for (int64_t k = 0; k < m; ++k) {
    const uint64_t base = static_cast<uint64_t>(ids[k]) * cols;
    float* row = out + k * width;
    for (uint64_t c = 0; c < cols; ++c) {
      const uint64_t word = Mix((base + c) ^ key);
      const double u = static_cast<double>(word >> 11) * (1.0 / 9007199254740992.0);
      const float value = static_cast<float>(minval + span * u);
      row[c] = value < high ? value : high;
    }
  }
}

}  // extern "C"
