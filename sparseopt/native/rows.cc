// Rows of an array read and written by id, any dtype (sparseopt/native).
//
// A step reads the distinct rows of a table and of its per-row state, and
// writes them back. XLA compiles each of those gathers and scatters into a
// kernel of its own, for every table and state variable of a model, which is
// most of what the sparse step adds to XLA's compile time. These calls do the
// same byte for byte, once compiled for every array: a row is `width`
// consecutive elements, copied whole.
//
// take_rows: out[k] = table[clamp(ids[k], 0, rows - 1)] (`jnp.take(mode="clip")`).
// put_rows: table[ids[k]] = rows[k], in order (later ids win), as
//   `.at[].set(mode="drop")` does: an id in [-rows, 0) counts from the end,
//   others outside [0, rows) are dropped. Written into the array XLA aliases to
//   the output (donated: in place).

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Bytes per row of an array whose first dimension is its rows.
int64_t RowBytes(const ffi::AnyBuffer& array) {
  const auto dims = array.dimensions();
  const int64_t rows = dims.size() ? dims[0] : 0;
  return rows ? static_cast<int64_t>(array.size_bytes()) / rows : 0;
}

ffi::Error TakeRowsImpl(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids,
                        ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = table.dimensions();
  const int64_t num_rows = dims.size() ? dims[0] : 0;
  const int64_t bytes = RowBytes(table);
  const int64_t n = ids.element_count();
  if (num_rows == 0) {
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  const auto* in = static_cast<const char*>(table.untyped_data());
  auto* dst = static_cast<char*>(out->untyped_data());
  const int32_t* id = ids.typed_data();
  for (int64_t k = 0; k < n; ++k) {
    int64_t row = id[k] < 0 ? 0 : (id[k] >= num_rows ? num_rows - 1 : id[k]);
    std::memcpy(dst + k * bytes, in + row * bytes, bytes);
  }
  return ffi::Error::Success();
}

ffi::Error PutRowsImpl(ffi::AnyBuffer table_in, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer rows,
                       ffi::Result<ffi::AnyBuffer> table) {
  const auto dims = table->dimensions();
  const int64_t num_rows = dims.size() ? dims[0] : 0;
  const int64_t bytes = num_rows ? static_cast<int64_t>(table->size_bytes()) / num_rows : 0;
  const int64_t n = ids.element_count();
  auto* out = static_cast<char*>(table->untyped_data());
  const auto* in = static_cast<const char*>(rows.untyped_data());
  const int32_t* id = ids.typed_data();
  for (int64_t k = 0; k < n; ++k) {
    const int64_t row = id[k] < 0 ? id[k] + num_rows : id[k];
    if (row < 0 || row >= num_rows) continue;
    std::memcpy(out + row * bytes, in + k * bytes, bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseoptTakeRows, TakeRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseoptPutRows, PutRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
