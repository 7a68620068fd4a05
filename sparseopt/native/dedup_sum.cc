// Dedup and sum of one step's row gradients, in one call (sparseopt/native):
// `dedup_core.h`'s algorithm as XLA FFI custom calls (CPU), for JAX.
//
// XLA's shapes are static: the results have `min(ids, rows)` entries, the
// distinct ids first, then padding (ids num_rows + j, zero gradients), as the
// pure path (sparseopt/backend/jax.py `dedup`) gives them. Invalid ids are
// dropped. The workspace is aliased to its output: written in place.
//
// Built by `sparseopt.native.build()` with the system compiler against the
// XLA FFI headers that jaxlib ships.

#include <cstdint>
#include <cstring>

#include "dedup_core.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using sparseopt_native::AddBagRow;
using sparseopt_native::AddRow;

namespace {

// Padding after the `count` distinct entries: ids past the table (distinct
// where they fit in int32, as `jax_rows.padding_ids`), zero gradients.
void Pad(int64_t count, int64_t size, int64_t num_rows, int64_t width, int32_t* uniq,
         float* summed) {
  const bool distinct = num_rows + size <= INT32_MAX;
  for (int64_t j = count; j < size; ++j) {
    uniq[j] = static_cast<int32_t>(distinct ? num_rows + j : num_rows);
  }
  std::memset(summed + count * width, 0, sizeof(float) * (size - count) * width);
}

// The whole call: numbering, sums, padding, count.
template <typename Add>
void DedupSum(const int32_t* ids, int64_t n, int64_t num_rows, int64_t width,
              ffi::ResultBuffer<ffi::S32>& uniq, ffi::ResultBuffer<ffi::F32>& summed,
              ffi::ResultBuffer<ffi::S32>& count_out,
              ffi::ResultBuffer<ffi::S32>& workspace, Add add) {
  const int64_t size = uniq->element_count();
  int32_t* u = uniq->typed_data();
  float* s = summed->typed_data();
  const int64_t count = sparseopt_native::Number(
      ids, n, num_rows, /*sink=*/-1, workspace->typed_data(),
      [u](int64_t k, int32_t id) { u[k] = id; });
  sparseopt_native::SumRows(n, count, width, s, add);
  Pad(count, size, num_rows, width, u, s);
  *count_out->typed_data() = static_cast<int32_t>(count);
}

ffi::Error DedupSumImpl(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> rows,
                        ffi::Buffer<ffi::S32> workspace_in, int64_t num_rows,
                        ffi::ResultBuffer<ffi::S32> uniq, ffi::ResultBuffer<ffi::F32> summed,
                        ffi::ResultBuffer<ffi::S32> count_out,
                        ffi::ResultBuffer<ffi::S32> workspace) {
  const int64_t n = ids.element_count();
  const int64_t width = n ? rows.element_count() / n : 0;
  DedupSum(ids.typed_data(), n, num_rows, width, uniq, summed, count_out, workspace,
           AddRow{rows.typed_data(), width});
  return ffi::Error::Success();
}

// Pooled bags: id i's gradient is values[bag[i]] * weight[i] (`BagGrads`).
ffi::Error DedupSumBagsImpl(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> values,
                            ffi::Buffer<ffi::S32> bag, ffi::Buffer<ffi::F32> weight,
                            ffi::Buffer<ffi::S32> workspace_in, int64_t num_rows,
                            ffi::ResultBuffer<ffi::S32> uniq, ffi::ResultBuffer<ffi::F32> summed,
                            ffi::ResultBuffer<ffi::S32> count_out,
                            ffi::ResultBuffer<ffi::S32> workspace) {
  const int64_t n = ids.element_count();
  const int64_t bags = values.dimensions().size() ? values.dimensions()[0] : 0;
  const int64_t width = bags ? values.element_count() / bags : 0;
  DedupSum(ids.typed_data(), n, num_rows, width, uniq, summed, count_out, workspace,
           AddBagRow{values.typed_data(), bag.typed_data(), weight.typed_data(), bags, width});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseoptDedupSum, DedupSumImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_rows")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseoptDedupSumBags, DedupSumBagsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_rows")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
