// Dedup and sum of one step's row gradients as one TensorFlow op on the
// dedup workspace, a resource variable (sparseopt/native): `dedup_core.h`'s
// algorithm, for sparseopt/backend/tensorflow.py.
//
// The pure path runs a `ResourceScatterUpdate` and a `ResourceGather` on the
// workspace, then an XLA-compiled count and segment sum into `[ids, width]`
// buffers, then slices them: four to six ops, and buffers sized by the ids.
// This op writes the workspace in place and outputs exactly the `count`
// distinct ids and their summed rows. Invalid ids write to the workspace's
// sink entry `num_rows`, as the pure path's scatter does.
//
// A second op, SparseoptNumberIds, numbers a table on disk's step ids inside
// the step (id_index.h's NumberIds, the host library's code) where a Python
// host call (`tf.numpy_function`) did.
//
// Built by `sparseopt.native.build_tf()` with the system compiler against the
// headers and library TensorFlow ships (`tf.sysconfig`); loaded with
// `tf.load_op_library`.

#include <cstdint>
#include <cstring>
#include <vector>

#include "dedup_core.h"
#include "id_index.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

// The variable's tensor, ready to be written in place: TensorFlow's rule for
// resource variables (copy first while a read of the buffer is alive; then
// "copy on read" mode, so that later reads copy instead), as its sparse
// updates (`ResourceScatterUpdate`, the pure path's) apply it. REQUIRES: the
// variable's lock held.
absl::Status ForSparseWrite(OpKernelContext* ctx, Var* var) {
  Tensor* tensor = var->tensor();
  if (!var->copy_on_read_mode.load() && !tensor->RefCountIsOne()) {
    Tensor copy;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(tensor->dtype(), tensor->shape(), &copy));
    std::memcpy(copy.data(), tensor->data(), tensor->TotalBytes());
    *tensor = copy;
  }
  var->copy_on_read_mode.store(true);
  return absl::OkStatus();
}

REGISTER_OP("SparseoptDedupSum")
    .Input("workspace: resource")
    .Input("ids: Tids")
    .Input("rows: float")
    .Input("bag: int32")
    .Input("weight: float")
    .Attr("num_rows: int")
    .Attr("bags: bool")
    .Attr("Tids: {int32, int64}")
    .Output("uniq: Tids")
    .Output("summed: float")
    .Output("count: int32")
    // It writes the workspace: never merged with another call or folded.
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle rows;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &rows));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Matrix(c->UnknownDim(), c->Dim(rows, 1)));
      c->set_output(2, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
The distinct valid ids of `ids` (in order of their last occurrence) and their
gradients summed in occurrence order; `rows` holds one gradient row per id, or
(`bags`) one per bag, id i's gradient then being `rows[bag[i]] * weight[i]`.
Writes each occurrence's position into `workspace[id]` (invalid ids: entry
`num_rows`), in place.
)doc");

template <typename Id>
class DedupSumOp : public OpKernel {
 public:
  explicit DedupSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_rows", &num_rows_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bags", &bags_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(1);
    const Tensor& rows = ctx->input(2);
    const Tensor& bag = ctx->input(3);
    const Tensor& weight = ctx->input(4);
    const int64_t n = ids.NumElements();
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(rows.shape()),
                errors::InvalidArgument("rows must be a matrix"));
    const int64_t width = rows.dim_size(1);
    if (bags_) {
      OP_REQUIRES(ctx, bag.NumElements() == n && weight.NumElements() == n,
                  errors::InvalidArgument("bag and weight need one entry per id"));
    } else {
      OP_REQUIRES(ctx, rows.dim_size(0) == n,
                  errors::InvalidArgument("rows need one row per id"));
    }
    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &var));
    mutex_lock lock(*var->mu());
    Tensor* space = var->tensor();
    OP_REQUIRES(ctx, space->dtype() == DT_INT32 && space->NumElements() > num_rows_,
                errors::InvalidArgument("the workspace needs int32 entries for num_rows + 1"));
    // In place, as the pure path's scatter (`ForSparseWrite` may swap the
    // buffer behind `space`, the same Tensor object).
    OP_REQUIRES_OK(ctx, ForSparseWrite(ctx, var.get()));
    int32_t* workspace = space->flat<int32_t>().data();
    const Id* id = ids.flat<Id>().data();
    // The numbering first: the outputs are sized by its count.
    std::vector<Id>& firsts = Firsts();
    if (static_cast<int64_t>(firsts.size()) < n) firsts.resize(n);
    Id* first = firsts.data();
    const int64_t count = sparseopt_native::Number(
        id, n, num_rows_, num_rows_, workspace, [first](int64_t k, Id v) { first[k] = v; });
    Tensor* uniq = nullptr;
    Tensor* summed = nullptr;
    Tensor* count_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({count}), &uniq));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({count, width}), &summed));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &count_out));
    if (count) std::memcpy(uniq->flat<Id>().data(), first, sizeof(Id) * count);
    count_out->scalar<int32_t>()() = static_cast<int32_t>(count);
    float* out = summed->flat<float>().data();
    if (bags_) {
      sparseopt_native::SumRows(
          n, count, width, out,
          sparseopt_native::AddBagRow{rows.flat<float>().data(), bag.flat<int32_t>().data(),
                                      weight.flat<float>().data(), rows.dim_size(0), width});
    } else {
      sparseopt_native::SumRows(n, count, width, out,
                                sparseopt_native::AddRow{rows.flat<float>().data(), width});
    }
  }

 private:
  static std::vector<Id>& Firsts() {
    thread_local std::vector<Id> firsts;
    return firsts;
  }

  int64_t num_rows_;
  bool bags_;
};

REGISTER_KERNEL_BUILDER(
    Name("SparseoptDedupSum").Device(DEVICE_CPU).TypeConstraint<int32_t>("Tids"),
    DedupSumOp<int32_t>);
REGISTER_KERNEL_BUILDER(
    Name("SparseoptDedupSum").Device(DEVICE_CPU).TypeConstraint<int64_t>("Tids"),
    DedupSumOp<int64_t>);

REGISTER_OP("SparseoptNumberIds")
    .Input("ids: int32")
    .Attr("num_rows: int")
    .Output("number: int32")
    .Output("ids_of: int32")
    .Output("positions: int32")
    .Output("count: int32")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &ids));
      for (int k = 0; k < 3; ++k) c->set_output(k, ids);
      c->set_output(3, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
A table on disk's step ids numbered in the order of their last occurrence (the
host library's numbering, id_index.h): each id's number (the size of `ids`
where it is outside [0, num_rows)), each number's id and last position (0 from
`count` on), and `count`. Depends on `ids` only: no host call, no state.
)doc");

class NumberIdsOp : public OpKernel {
 public:
  explicit NumberIdsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_rows", &num_rows_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    const int64_t n = ids.NumElements();
    Tensor* out[4];
    for (int k = 0; k < 3; ++k) {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(k, ids.shape(), &out[k]));
    }
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({}), &out[3]));
    out[3]->scalar<int32_t>()() = static_cast<int32_t>(sparseopt::NumberIds(
        ids.flat<int32_t>().data(), n, num_rows_, out[0]->flat<int32_t>().data(),
        out[1]->flat<int32_t>().data(), out[2]->flat<int32_t>().data()));
  }

 private:
  int64_t num_rows_;
};

REGISTER_KERNEL_BUILDER(Name("SparseoptNumberIds").Device(DEVICE_CPU), NumberIdsOp);

}  // namespace
}  // namespace tensorflow
