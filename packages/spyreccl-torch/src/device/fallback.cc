// Boxed fallback: every aten operator without an explicit spyre kernel runs
// its CPU kernel directly on the spyre memory (see host_alias.h).
//
// Unlike at::native::cpu_fallback, nothing is copied: view operators
// (view_as_real, unfold, diagonal, ...) return true views of the spyre
// storage, in-place and out= operators write the spyre memory itself, and
// results allocated by the CPU kernel become spyre tensors by relabelling.
//
// The same function also serves, as an explicit spyre kernel, the operators
// for which CPU has a kernel of its own but PrivateUse1 would get a composite
// one (see route_to_cpu_kernels), so that spyre runs what CPU runs.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "device_state.h"
#include "generator.h"
#include "host_alias.h"

namespace spyreccl::device {
namespace {

bool is_tensor_type(const c10::TypePtr& type) {
  return type->kind() == c10::TypeKind::TensorType ||
         (type->kind() == c10::TypeKind::OptionalType &&
          type->castRaw<c10::OptionalType>()->getElementType()->kind() ==
              c10::TypeKind::TensorType);
}

bool is_tensor_list(const c10::IValue& value) {
  return value.isList() && is_tensor_type(value.toList().elementType());
}

bool is_optional_generator(const c10::Argument& argument) {
  const c10::TypePtr& type = argument.type();
  return type->kind() == c10::TypeKind::OptionalType &&
         type->castRaw<c10::OptionalType>()->getElementType()->kind() ==
             c10::TypeKind::GeneratorType;
}

// Where an operator call runs and where its fresh results belong.
struct CallDevice {
  // That of the first spyre tensor, else the spyre device argument.
  c10::Device device;
  // False when the call names a non-spyre device for its results (say
  // device="cpu" next to spyre inputs): those results stay where they are.
  bool adopt_results;
};

std::optional<CallDevice> find_device(const c10::FunctionSchema& schema, const c10::IValue* args) {
  std::optional<c10::Device> from_tensor;
  std::optional<c10::Device> from_device_arg;
  bool names_other_device = false;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const c10::IValue& value = args[i];
    if (value.isDevice()) {
      if (value.toDevice().type() != kSpyreDeviceType) {
        names_other_device = true;
      } else if (!from_device_arg.has_value()) {
        from_device_arg = value.toDevice();
      }
    } else if (from_tensor.has_value()) {
      // Found already; keep scanning for device arguments only.
    } else if (value.isTensor()) {
      if (is_spyre(value.toTensor())) {
        from_tensor = value.toTensor().device();
      }
    } else if (is_tensor_list(value)) {
      for (const c10::IValue& element : value.toListRef()) {
        if (element.isTensor() && is_spyre(element.toTensor())) {
          from_tensor = element.toTensor().device();
          break;
        }
      }
    }
  }
  if (from_tensor.has_value()) {
    return CallDevice{*from_tensor, !names_other_device};
  }
  if (from_device_arg.has_value()) {
    return CallDevice{
        spyre_device(resolve_device_index(from_device_arg->index(), "spyre fallback")), true};
  }
  return std::nullopt;
}

c10::IValue lend_list(HostAliasScope& scope, const c10::IValue& value) {
  c10::List<c10::IValue> original = value.toList();
  // A fresh list of the same element type: the caller's list must not be
  // modified, and unboxing checks the element type.
  c10::impl::GenericList lent_list(original.elementType());
  lent_list.reserve(original.size());
  for (const c10::IValue& element : original) {
    lent_list.push_back(element.isTensor() ? scope.lend_argument(element.toTensor()) : element);
  }
  return c10::IValue(std::move(lent_list));
}

c10::IValue result_to_spyre(HostAliasScope& scope, const c10::IValue& value) {
  if (value.isTensor()) {
    return scope.to_spyre(value.toTensor());
  }
  if (is_tensor_list(value)) {
    c10::List<c10::IValue> original = value.toList();
    c10::impl::GenericList mapped(original.elementType());
    mapped.reserve(original.size());
    for (const c10::IValue& element : original) {
      mapped.push_back(element.isTensor() ? c10::IValue(scope.to_spyre(element.toTensor()))
                                          : element);
    }
    return c10::IValue(std::move(mapped));
  }
  return value;
}

void spyre_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet /*keys*/,
                    torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const char* name = schema.name().c_str();
  const size_t num_args = schema.arguments().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= num_args);
  c10::IValue* args = stack->data() + (stack->size() - num_args);

  const std::optional<CallDevice> call = find_device(schema, args);
  TORCH_CHECK(call.has_value(), schema.operator_name(),
              ": dispatched to the spyre device but has neither a spyre tensor nor a spyre "
              "device argument (a spyre generator can only drive ops on spyre tensors)");

  const c10::Device device = call->device;
  HostAliasScope scope(name, device, call->adopt_results);
  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& value = args[i];
    if (value.isTensor()) {
      // The scope remembers every spyre tensor it lends (and writes them back after the
      // kernel ran, write_back_lent), so no list of its own is kept here.
      value = scope.lend_argument(value.toTensor());
    } else if (is_tensor_list(value)) {
      value = lend_list(scope, value);
    } else if (value.isDevice()) {
      if (value.toDevice().type() == kSpyreDeviceType) {
        value = c10::IValue(c10::Device(c10::kCPU));
      }
    } else if (value.isGenerator()) {
      value = cpu_engine_for(value.toGenerator(), name);
    } else if (value.isNone() && is_optional_generator(schema.arguments()[i])) {
      // Draw from the spyre device's default generator rather than the CPU's
      // (random ops without a spyre kernel in random_kernels.cc).
      value = cpu_engine_for(default_generator(device.index()), name);
    }
  }

  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  scope.commit();
  scope.write_back_lent();
  const size_t num_returns = schema.returns().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= num_returns);
  for (auto it = stack->end() - static_cast<std::ptrdiff_t>(num_returns); it != stack->end();
       ++it) {
    *it = result_to_spyre(scope, *it);
  }
}

// Operators for which CPU has a kernel of its own while PrivateUse1 would get a
// composite one. Structured operators register their functional and in-place
// variants as CompositeExplicitAutogradNonFunctional for every backend: a
// spyre call would allocate the output on spyre and redispatch to the out=
// variant, whose CPU kernel then runs with an output that is already sized. A
// CPU call takes the functional kernel directly. The two differ where the
// out= kernel resizes that output (mse_loss with reduction: CPU's out= kernel
// first sizes it like the inputs, which warns "An output with one or more
// elements was resized", then shrinks it to 0-d), and some
// CompositeExplicitAutograd decompositions (native_layer_norm, native_group_norm)
// round differently from CPU's fused kernels. Routing them to the fallback
// runs exactly CPU's kernel on the spyre memory, in one dispatch.
bool runs_a_composite_where_cpu_has_a_kernel(const c10::OperatorHandle& op) {
  return op.hasKernelForDispatchKey(c10::DispatchKey::CPU) &&
         !op.hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) &&
         (op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) ||
          op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd));
}

int64_t route_to_cpu_kernels() {
  // Never destroyed: the registrations must live as long as the process, and
  // deregistering during static destruction (after the threads torch started are
  // gone) aborts the process. The static pointer keeps it reachable.
  static torch::Library* library = nullptr;
  static int64_t routed = 0;
  static std::once_flag once;
  std::call_once(once, [] {
    library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                 __FILE__, __LINE__);
    c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) {
        continue;
      }
      const std::optional<c10::OperatorHandle> op = dispatcher.findOp(name);
      if (!op.has_value() || !runs_a_composite_where_cpu_has_a_kernel(*op)) {
        continue;
      }
      const std::string qualified =
          name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
      library->impl(qualified.c_str(),
                    torch::CppFunction::makeFromBoxedFunction<&spyre_fallback>());
      ++routed;
    }
  });
  return routed;
}

}  // namespace

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&spyre_fallback>());
}

// Called once by the Python loader after the library is loaded, when every
// explicit spyre kernel of this library (kernels.cc) is registered: static
// initialisers of different files run in no fixed order, so the scan cannot
// run in one of them.
TORCH_LIBRARY_FRAGMENT(spyreccl_device, m) {
  m.def("route_to_cpu_kernels() -> int", &route_to_cpu_kernels);
}

}  // namespace spyreccl::device
