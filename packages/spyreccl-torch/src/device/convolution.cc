// Convolution on spyre tensors.
//
// ATen routes convolutions on backends it does not know to
// convolution_overrideable / convolution_backward_overrideable, whose default
// kernels throw, so they never reach the boxed fallback. These kernels lend
// the operands to the CPU convolution (and its backward), which picks the
// best CPU algorithm, and adopt the results without copying.
//
// Results are returned in the contiguous memory format: that is what torch's
// shape functions promise for the Overrideable convolution backend that
// PrivateUse1 devices get (FakeTensor asks _conv_determine_backend_memory_format),
// and what torch.compile's generated code checks (assert_size_stride). CPU
// kernels keep channels-last inputs channels-last, so such results are made
// contiguous (one copy; inductor feeds channels-last inputs when it optimises
// the layout of convolution graphs).
#include <ATen/core/Tensor.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "host_alias.h"

namespace spyreccl::device {
namespace {

at::Tensor lend_optional(HostAliasScope& scope, const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? scope.lend(*t) : at::Tensor();
}

// The spyre result for a CPU kernel's `host` result, in the contiguous format
// (see the file comment).
at::Tensor contiguous_result(HostAliasScope& scope, const at::Tensor& host) {
  return scope.to_spyre(host.defined() ? host.contiguous() : host);
}

at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                       c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
                       c10::IntArrayRef output_padding, int64_t groups) {
  HostAliasScope scope("convolution", input.device());
  const at::Tensor bias_host = lend_optional(scope, bias);
  at::Tensor output =
      at::convolution(scope.lend(input), scope.lend(weight),
                      bias_host.defined() ? std::optional<at::Tensor>(bias_host) : std::nullopt,
                      stride, padding, dilation, transposed, output_padding, groups);
  return contiguous_result(scope, output);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
    c10::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> output_mask) {
  HostAliasScope scope("convolution_backward", input.device());
  // The bias gradient has one entry per output channel.
  const int64_t out_channels = transposed ? weight.size(1) * groups : weight.size(0);
  const std::array<int64_t, 1> bias_sizes{out_channels};
  auto [grad_input, grad_weight, grad_bias] = at::convolution_backward(
      scope.lend(grad_output), scope.lend(input), scope.lend(weight),
      output_mask[2] ? std::optional<c10::IntArrayRef>(bias_sizes) : std::nullopt, stride, padding,
      dilation, transposed, output_padding, groups, output_mask);
  return {contiguous_result(scope, grad_input), contiguous_result(scope, grad_weight),
          contiguous_result(scope, grad_bias)};
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("convolution_overrideable", TORCH_FN(convolution));
  m.impl("convolution_backward_overrideable", TORCH_FN(convolution_backward));
}

}  // namespace spyreccl::device
