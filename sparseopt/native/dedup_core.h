// The dedup and sum of one step's row gradients: the algorithm, shared by the
// XLA FFI calls (dedup_sum.cc, JAX) and the TensorFlow op (tf_ops.cc).
//
// The pure paths (sparseopt/backend/jax.py and tensorflow.py, `dedup`)
// scatter every occurrence's position into a persistent per-row workspace,
// read it back, number the distinct ids with a running count and sum the
// gradients with a segment sum. This does the same in one call, with no
// `[ids, width]` buffer for the sum: it numbers the ids through the same
// workspace (written once and read once; no per-step table to build or
// clear) and adds each row into its distinct entry in occurrence order.
// Results equal the pure path's bit for bit: the same order of distinct ids
// (where the pure path's scatter lands the last write of an id, as XLA's
// does), the same order of additions (occurrence order, from 0.0f), and the
// same workspace entries for the ids seen.

#ifndef SPARSEOPT_NATIVE_DEDUP_CORE_H_
#define SPARSEOPT_NATIVE_DEDUP_CORE_H_

#include <cstdint>
#include <cstring>
#include <vector>

namespace sparseopt_native {

// Batch-sized scratch, kept from call to call on each thread: fresh buffers
// would page-fault every step.
struct Scratch {
  std::vector<int32_t> slot_of, last;
};

inline Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

inline int32_t* Room(std::vector<int32_t>* v, int64_t n) {
  if (static_cast<int64_t>(v->size()) < n) v->resize(n);
  return v->data();
}

// The distinct valid ids of `ids[0..n)`, numbered in the order of their last
// occurrence. Every occurrence writes its position into `workspace[id]`
// (an invalid id into `workspace[sink]` where `sink >= 0`: TensorFlow's
// scatter has no "drop" mode, so its pure path keeps a sink entry), so the
// workspace ends holding what the pure path leaves. `slot_of[i]` (in the
// thread's scratch) is occurrence i's distinct entry, -1 for an invalid id;
// `first_id(k, id)` is told each distinct id in order. Returns their count.
template <typename Id, typename FirstId>
int64_t Number(const Id* ids, int64_t n, int64_t num_rows, int64_t sink, int32_t* workspace,
               FirstId first_id) {
  Scratch& scratch = ThreadScratch();
  int32_t* slot = Room(&scratch.slot_of, n);
  int32_t* last = Room(&scratch.last, n);
  for (int64_t i = 0; i < n; ++i) {
    const Id id = ids[i];
    if (id >= 0 && id < num_rows) {
      workspace[id] = static_cast<int32_t>(i);
    } else if (sink >= 0) {
      workspace[sink] = static_cast<int32_t>(i);
    }
  }
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {  // numbered at their last occurrence, in order
    const Id id = ids[i];
    slot[i] = -1;
    last[i] = -1;
    if (id < 0 || id >= num_rows) continue;
    last[i] = workspace[id];
    if (last[i] == i) {
      slot[i] = static_cast<int32_t>(count);
      first_id(count, id);
      ++count;
    }
  }
  for (int64_t i = 0; i < n; ++i) {  // every other occurrence takes its last one's entry
    if (last[i] >= 0) slot[i] = slot[last[i]];
  }
  return count;
}

// `add(i, out)` for every occurrence i of a valid id, `out` its distinct
// entry's row of `summed` (zeroed here first: sums start from 0.0f, so a
// lone -0.0 becomes +0.0), in occurrence order. (Two threads, each owning
// the entries of one parity, were slower: 55 vs 46 ms for 1.3M ids on 2
// cores; the pass is bound by random row accesses, which both threads then
// make.)
template <typename Add>
void SumRows(int64_t n, int64_t count, int64_t width, float* summed, Add add) {
  const int32_t* slot = ThreadScratch().slot_of.data();
  std::memset(summed, 0, sizeof(float) * count * width);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t k = slot[i];
    if (k >= 0) add(i, summed + k * width);
  }
}

// Occurrence i's gradient row added into `out`: `rows[i]` (one row per id).
struct AddRow {
  const float* rows;
  int64_t width;
  void operator()(int64_t i, float* out) const {
    const float* in = rows + i * width;
    for (int64_t d = 0; d < width; ++d) out[d] += in[d];
  }
};

// Pooled bags: `values[bag[i]] * weight[i]` (the product rounded first, as
// the pure path's multiply before its sum; bags outside `[0, bags)` add
// nothing).
struct AddBagRow {
  const float* values;
  const int32_t* bag;
  const float* weight;
  int64_t bags, width;
  void operator()(int64_t i, float* out) const {
    if (bag[i] < 0 || bag[i] >= bags) return;
    const float* in = values + static_cast<int64_t>(bag[i]) * width;
    const float scale = weight[i];
    for (int64_t d = 0; d < width; ++d) out[d] += in[d] * scale;
  }
};

}  // namespace sparseopt_native

#endif  // SPARSEOPT_NATIVE_DEDUP_CORE_H_
