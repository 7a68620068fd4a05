// In-place row writes of a bfloat16 array (sparseopt/native).
//
// XLA:CPU has no bfloat16 scatter: it converts the whole array to float32 and
// back around one, and the pure path's uint16 bitcast around the scatter is a
// copy of the array too (sparseopt/backend/jax_rows.py), so each step of a
// bfloat16 table copies it. This call writes the given rows into the array,
// which XLA aliases to its output (donated: in place), and nothing else.
// Ids outside [0, rows) are dropped, as the pure path's `mode="drop"` does;
// where ids repeat, the last row written wins.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error SetRowsBf16Impl(ffi::Buffer<ffi::BF16> table_in, ffi::Buffer<ffi::S32> ids,
                           ffi::Buffer<ffi::BF16> rows, ffi::ResultBuffer<ffi::BF16> table) {
  const auto dims = table->dimensions();
  const int64_t num_rows = dims.size() ? dims[0] : 0;
  const int64_t width = num_rows ? table->element_count() / num_rows : 0;
  const int64_t n = ids.element_count();
  auto* out = reinterpret_cast<uint16_t*>(table->untyped_data());
  const auto* in = reinterpret_cast<const uint16_t*>(rows.untyped_data());
  const int32_t* id = ids.typed_data();
  for (int64_t k = 0; k < n; ++k) {
    if (id[k] < 0 || id[k] >= num_rows) continue;
    std::memcpy(out + static_cast<int64_t>(id[k]) * width, in + k * width,
                sizeof(uint16_t) * width);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseoptSetRowsBf16, SetRowsBf16Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
