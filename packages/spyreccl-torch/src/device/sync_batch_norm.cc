// The per-channel statistics kernels behind nn.SyncBatchNorm, for spyre.
//
// SyncBatchNorm (torch/nn/modules/_functions.py) accepts CUDA, XPU and PrivateUse1
// inputs and computes with five ATen operators that only CUDA implements:
// batch_norm_stats, batch_norm_gather_stats(_with_counts), batch_norm_elemt,
// batch_norm_backward_reduce and batch_norm_backward_elemt. The CPU fallback that
// serves spyre's other operators has no kernel for them ("Could not run
// 'aten::batch_norm_stats' with arguments from the 'CPU' backend"), so a DDP model
// converted with convert_sync_batchnorm failed in its first forward. These kernels
// follow CUDA's definitions (channel dimension 1; statistics in float32 for
// half/bfloat16 inputs, in the input's dtype otherwise; running variance
// unbiased over the global count) and compute exactly with ATen operators on the
// spyre tensors. The collectives between them stay SyncBatchNorm's own.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/var_mean.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace spyreccl::device {
namespace {

// CUDA's accumulate type for these kernels: double stays double, every other
// floating type is computed in float32.
at::ScalarType accumulate_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_input(const char* op, const at::Tensor& input) {
  TORCH_CHECK(input.dim() >= 2, op,
              ": expected an input of at least 2 dimensions (N, C, ...), got ", input.dim());
  TORCH_CHECK(at::isFloatingType(input.scalar_type()), op,
              ": expected a floating-point input, got ", input.scalar_type());
}

// Every dimension but the channels (1).
std::vector<int64_t> reduced_dims(const at::Tensor& input) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) {
    dims.push_back(d);
  }
  return dims;
}

// A per-channel vector `v` shaped to broadcast against `input` (1, C, 1, ...).
at::Tensor per_channel(const at::Tensor& v, const at::Tensor& input) {
  std::vector<int64_t> shape(static_cast<size_t>(input.dim()), 1);
  shape[1] = v.numel();
  return v.reshape(shape);
}

// `value` written into a tensor like `input` (its dtype and memory format:
// channels_last inputs keep it).
at::Tensor like_input(const at::Tensor& value, const at::Tensor& input) {
  at::Tensor out = at::empty_like(input);
  out.copy_(value);
  return out;
}

// input - mean, per channel, in `acc`.
at::Tensor centered(const at::Tensor& input, const at::Tensor& mean, at::ScalarType acc) {
  return input.to(acc) - per_channel(mean.to(acc), input);
}

bool defined(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// (mean, 1 / sqrt(biased variance + eps)) per channel.
std::tuple<at::Tensor, at::Tensor> batch_norm_stats(const at::Tensor& input, double eps) {
  check_input("batch_norm_stats", input);
  const at::Tensor x = input.to(accumulate_type(input));
  auto [var, mean] = at::var_mean(x, reduced_dims(input), /*correction=*/0, /*keepdim=*/false);
  return {mean, var.add_(eps).rsqrt_()};
}

// The global (mean, invstd) from every rank's (mean, invstd) and element count
// (rows of `mean`, `invstd`, entries of `counts`), and the running statistics
// updated with them in place, the variance unbiased over the global count.
std::tuple<at::Tensor, at::Tensor> gather_stats_with_counts(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    double momentum, double eps, const at::Tensor& counts) {
  TORCH_CHECK(mean.dim() == 2 && invstd.sizes() == mean.sizes() && counts.numel() == mean.size(0),
              "batch_norm_gather_stats_with_counts: expected mean and invstd of shape (ranks, C) "
              "and one count per rank, got ",
              mean.sizes(), ", ", invstd.sizes(), " and ", counts.numel(), " counts");
  const at::ScalarType acc = mean.scalar_type();
  const at::Tensor n = counts.to(acc).reshape({-1, 1});
  const at::Tensor total = n.sum();
  const at::Tensor global_mean = (mean * n).sum(0).div_(total);
  const at::Tensor variances = invstd.reciprocal().pow_(2).sub_(eps);
  // Sum of squared deviations over every element: each rank's, plus its mean's
  // distance to the global mean.
  const at::Tensor m2 =
      (variances * n).sum(0).add_((mean - global_mean.unsqueeze(0)).pow_(2).mul_(n).sum(0));
  const at::Tensor global_invstd = (m2 / total).add_(eps).rsqrt_();
  if (defined(running_mean)) {
    at::Tensor rm = *running_mean;
    rm.mul_(1.0 - momentum).add_(global_mean.to(rm.scalar_type()), momentum);
  }
  if (defined(running_var)) {
    at::Tensor rv = *running_var;
    rv.mul_(1.0 - momentum).add_((m2 / (total - 1)).to(rv.scalar_type()), momentum);
  }
  return {global_mean, global_invstd};
}

std::tuple<at::Tensor, at::Tensor> gather_stats(const at::Tensor& input, const at::Tensor& mean,
                                                const at::Tensor& invstd,
                                                const std::optional<at::Tensor>& running_mean,
                                                const std::optional<at::Tensor>& running_var,
                                                double momentum, double eps, int64_t count) {
  const at::Tensor counts = at::full({mean.size(0)}, count, mean.options());
  return gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps,
                                  counts);
}

// (input - mean) * invstd * weight + bias, in the input's dtype and layout.
at::Tensor batch_norm_elemt(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& mean,
                            const at::Tensor& invstd, double /*eps*/) {
  check_input("batch_norm_elemt", input);
  const at::ScalarType acc = accumulate_type(input);
  at::Tensor y = centered(input, mean, acc).mul_(per_channel(invstd.to(acc), input));
  if (defined(weight)) {
    y.mul_(per_channel(weight->to(acc), input));
  }
  if (defined(bias)) {
    y.add_(per_channel(bias->to(acc), input));
  }
  return like_input(y, input);
}

// Per channel: sum(dy), sum(dy * (x - mean)), and from them the weight's and the
// bias's gradients; each only where asked for (undefined otherwise, as CUDA's).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_reduce(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const std::optional<at::Tensor>& weight, bool input_g, bool weight_g,
    bool bias_g) {
  check_input("batch_norm_backward_reduce", input);
  const at::ScalarType acc = accumulate_type(input);
  const std::vector<int64_t> dims = reduced_dims(input);
  const at::Tensor dy = grad_out.to(acc);
  const at::Tensor sum_dy = dy.sum(dims);
  const at::Tensor sum_dy_xmu = (dy * centered(input, mean, acc)).sum(dims);
  const at::TensorOptions grad_options = defined(weight) ? weight->options() : mean.options();
  at::Tensor grad_weight;
  at::Tensor grad_bias;
  if (weight_g) {
    grad_weight = (sum_dy_xmu * invstd.to(acc)).to(grad_options.dtype());
  }
  if (bias_g) {
    grad_bias = sum_dy.to(grad_options.dtype());
  }
  return {input_g ? sum_dy.to(mean.scalar_type()) : at::Tensor(),
          input_g ? sum_dy_xmu.to(mean.scalar_type()) : at::Tensor(), grad_weight, grad_bias};
}

// The input's gradient from the global sums of dy and dy * (x - mean) over
// sum(count) elements per channel.
at::Tensor backward_elemt(const at::Tensor& grad_out, const at::Tensor& input,
                          const at::Tensor& mean, const at::Tensor& invstd,
                          const std::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
                          const at::Tensor& sum_dy_xmu, const at::Tensor& count) {
  check_input("batch_norm_backward_elemt", input);
  const at::ScalarType acc = accumulate_type(input);
  const at::Tensor total = count.to(acc).sum();
  const at::Tensor inv = invstd.to(acc);
  const at::Tensor mean_dy = sum_dy.to(acc) / total;
  const at::Tensor mean_dy_xmu = sum_dy_xmu.to(acc) / total;
  const at::Tensor xmu = centered(input, mean, acc);
  at::Tensor scale = inv;
  if (defined(weight)) {
    scale = inv * weight->to(acc);
  }
  const at::Tensor grad = (grad_out.to(acc) - per_channel(mean_dy, input))
                              .sub_(xmu * per_channel(inv * inv * mean_dy_xmu, input))
                              .mul_(per_channel(scale, input));
  return like_input(grad, input);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("batch_norm_stats", TORCH_FN(batch_norm_stats));
  m.impl("batch_norm_gather_stats", TORCH_FN(gather_stats));
  m.impl("batch_norm_gather_stats_with_counts", TORCH_FN(gather_stats_with_counts));
  m.impl("batch_norm_elemt", TORCH_FN(batch_norm_elemt));
  m.impl("batch_norm_backward_reduce", TORCH_FN(backward_reduce));
  m.impl("batch_norm_backward_elemt", TORCH_FN(backward_elemt));
}

}  // namespace spyreccl::device
