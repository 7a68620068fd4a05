// A hash index of ids, and a step's ids numbered with it: shared by the host
// library (disk_host.cc, called through ctypes) and the JAX kernels
// (number_ffi.cc, called from the compiled step as an XLA FFI call), so the
// two number a step's ids alike, by the same code.

#ifndef SPARSEOPT_NATIVE_ID_INDEX_H_
#define SPARSEOPT_NATIVE_ID_INDEX_H_

#include <cstdint>
#include <cstring>
#include <vector>

namespace sparseopt {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kM1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kM2 = 0x94D049BB133111EBull;

// splitmix64's gamma product and finalizer (sparseopt.disk.initial_rows.mix).
inline uint64_t Mix(uint64_t z) {
  z *= kGolden;
  z = (z ^ (z >> 30)) * kM1;
  z = (z ^ (z >> 27)) * kM2;
  return z ^ (z >> 31);
}

// An open-addressing index of int64 keys (-1: empty) to int64 values, of a
// power-of-two capacity the caller allocates (at least twice the keys).
struct Index {
  int64_t* keys;
  int64_t* values;
  uint64_t mask;

  // The slot holding `key`, or the empty slot where it would go.
  inline uint64_t Slot(int64_t key) const {
    uint64_t at = Mix(static_cast<uint64_t>(key)) & mask;
    while (keys[at] != -1 && keys[at] != key) at = (at + 1) & mask;
    return at;
  }

  // Asks for the lines where `key`'s search starts: a loop over keys asks some
  // keys ahead, so that loads of slots at random overlap the work before.
  inline void Prefetch(int64_t key) const {
    const uint64_t at = Mix(static_cast<uint64_t>(key)) & mask;
    __builtin_prefetch(keys + at);
    __builtin_prefetch(values + at);
  }
};

// The valid ids of `ids` [n] (inside [0, num_rows)) numbered 0..count-1 in the
// order of their last occurrence: `number[i]` each entry's id's number (n
// where invalid), `ids_of[k]` / `positions[k]` the id and last position of
// number k (0 from count on). Returns count.
inline int64_t NumberIds(const int32_t* ids, int64_t n, int64_t num_rows, int32_t* number,
                         int32_t* ids_of, int32_t* positions) {
  uint64_t capacity = 2;
  while (capacity < 2 * static_cast<uint64_t>(n)) capacity <<= 1;
  std::vector<int64_t> keys(capacity, -1), values(capacity, 0);
  Index index{keys.data(), values.data(), capacity - 1};
  std::vector<uint64_t> where(n);
  for (int64_t i = 0; i < n; ++i) {  // each id's last position
    if (ids[i] < 0 || ids[i] >= num_rows) continue;
    where[i] = index.Slot(ids[i]);
    keys[where[i]] = ids[i];
    values[where[i]] = i;
  }
  std::memset(ids_of, 0, sizeof(int32_t) * n);
  std::memset(positions, 0, sizeof(int32_t) * n);
  int32_t count = 0;
  for (int64_t i = 0; i < n; ++i) {  // numbered at their last position, in order
    if (ids[i] < 0 || ids[i] >= num_rows) continue;
    if (values[where[i]] == i) {
      ids_of[count] = ids[i];
      positions[count] = static_cast<int32_t>(i);
      values[where[i]] = -1 - int64_t{count};  // (now: the number, as -1 - k)
      ++count;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const bool valid = ids[i] >= 0 && ids[i] < num_rows;
    number[i] = valid ? static_cast<int32_t>(-1 - values[where[i]]) : static_cast<int32_t>(n);
  }
  return count;
}

}  // namespace sparseopt

#endif  // SPARSEOPT_NATIVE_ID_INDEX_H_
