// Unboxed spyre kernels for the binary elementwise operators eager code calls most
// (add, sub, mul and div of two tensors).
//
// They do exactly what the boxed fallback (fallback.cc) does for these operators — lend
// the spyre operands to CPU's kernel through a HostAliasScope and adopt its result — but
// without boxing: the dispatcher boxes a fallback's arguments into a stack, which copies
// each input tensor, and for a tensor held only by Python that copy takes the C++ reference
// count from 1 to 2, which increfs its Python object under the GIL (released for the call).
// That round trip and the stack were about a tenth of a microsecond per call, a fifth of
// what such an operator costs on spyre beyond CPU (docs/notes/device-op-overhead.md).
#include <ATen/core/Tensor.h>
#include <ATen/ops/add_ops.h>
#include <ATen/ops/div_ops.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/sub_ops.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

#include "device_state.h"
#include "host_alias.h"

namespace spyreccl::device {
namespace {

constexpr c10::DispatchKeySet kCpuKernel{c10::DispatchKey::CPU};

// The fallback's choice: the device of the first spyre tensor (one of the two is, or the
// dispatcher would not have come here).
c10::Device call_device(const at::Tensor& self, const at::Tensor& other) {
  return is_spyre(self) ? self.device() : other.device();
}

// Calls CPU's kernel of `Op` on the lent operands (lent in argument order, as the fallback
// does) and maps its result back to spyre.
template <class Op, class... Extra>
at::Tensor run_on_cpu_kernel(const char* name, const at::Tensor& self, const at::Tensor& other,
                             const Extra&... extra) {
  HostAliasScope scope(name, call_device(self, other));
  // The caller's arguments outlive the scope: borrowed, not referenced (see the top).
  const at::Tensor host_self = scope.lend_argument(self, /*borrow=*/true);
  const at::Tensor host_other = scope.lend_argument(other, /*borrow=*/true);
  const at::Tensor result = Op::redispatch(kCpuKernel, host_self, host_other, extra...);
  scope.commit();
  scope.write_back_lent();
  return scope.to_spyre(result);
}

at::Tensor add_tensor(const at::Tensor& self, const at::Tensor& other, const c10::Scalar& alpha) {
  return run_on_cpu_kernel<at::_ops::add_Tensor>("aten::add", self, other, alpha);
}

at::Tensor sub_tensor(const at::Tensor& self, const at::Tensor& other, const c10::Scalar& alpha) {
  return run_on_cpu_kernel<at::_ops::sub_Tensor>("aten::sub", self, other, alpha);
}

at::Tensor mul_tensor(const at::Tensor& self, const at::Tensor& other) {
  return run_on_cpu_kernel<at::_ops::mul_Tensor>("aten::mul", self, other);
}

at::Tensor div_tensor(const at::Tensor& self, const at::Tensor& other) {
  return run_on_cpu_kernel<at::_ops::div_Tensor>("aten::div", self, other);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("add.Tensor", TORCH_FN(add_tensor));
  m.impl("sub.Tensor", TORCH_FN(sub_tensor));
  m.impl("mul.Tensor", TORCH_FN(mul_tensor));
  m.impl("div.Tensor", TORCH_FN(div_tensor));
}

}  // namespace spyreccl::device
