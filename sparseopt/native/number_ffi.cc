// A step's ids numbered inside the compiled step (sparseopt/native): the host
// library's so_number (both are id_index.h's NumberIds) as an XLA FFI call,
// for tables on disk on JAX. The host library numbers a step's ids in one pass
// (sparseopt.engine.stages._Numbering); called through a Python host call,
// each step paid the crossing into Python and back for it. As an FFI call it
// is a call from the compiled program into C++, with no Python and no order
// to keep with the table's other host calls (it depends on the ids only).

#include <cstdint>

#include "id_index.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error NumberIdsImpl(ffi::Buffer<ffi::S32> ids, int64_t num_rows,
                         ffi::Result<ffi::Buffer<ffi::S32>> number,
                         ffi::Result<ffi::Buffer<ffi::S32>> ids_of,
                         ffi::Result<ffi::Buffer<ffi::S32>> positions,
                         ffi::Result<ffi::BufferR0<ffi::S32>> count) {
  const int64_t n = static_cast<int64_t>(ids.element_count());
  count->typed_data()[0] = static_cast<int32_t>(sparseopt::NumberIds(
      ids.typed_data(), n, num_rows, number->typed_data(), ids_of->typed_data(),
      positions->typed_data()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseoptNumberIds, NumberIdsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_rows")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>());
