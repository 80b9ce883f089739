// input_checks.cpp — see input_checks.h.
#include "backend/input_checks.h"

#include <c10/util/Exception.h>

#include "backend/tensor_translation.h"

namespace spyreccl_torch {

std::string indexedName(const char* argName, size_t index) {
  return std::string(argName) + "[" + std::to_string(index) + "]";
}

std::string indexedName(const char* argName, size_t outer, size_t inner) {
  return std::string(argName) + "[" + std::to_string(outer) + "][" + std::to_string(inner) + "]";
}

void DeviceChecker::add(const at::Tensor& tensor, const std::string& argName) {
  TORCH_CHECK(tensor.defined(), "spyreccl ", opName_, ": argument '", argName,
              "' is an undefined tensor");
  const c10::Device device = tensor.device();
  TORCH_CHECK(device.type() == c10::DeviceType::PrivateUse1, "spyreccl ", opName_, ": argument '",
              argName, "' is on device ", device.str(),
              "; spyreccl handles spyre tensors only; for CPU tensors use "
              "init_process_group('cpu:gloo,spyre:spyreccl')");
  TORCH_CHECK(tensor.layout() == c10::kStrided, "spyreccl ", opName_, ": argument '", argName,
              "' has layout ", tensor.layout(), "; spyreccl supports dense (strided) tensors only");
  if (!device_) {
    device_ = device;
    firstArg_ = argName;
    return;
  }
  TORCH_CHECK(*device_ == device, "spyreccl ", opName_, ": argument '", argName, "' is on ",
              device.str(), " but '", firstArg_, "' is on ", device_->str(),
              "; all tensors of one call must be on the same spyre device");
}

std::vector<c10::Device> DeviceChecker::devices() const {
  if (!device_) {
    return {};
  }
  return {*device_};
}

void checkListSize(size_t actual, size_t expected, const char* opName, const char* argName,
                   const char* what) {
  TORCH_CHECK(actual == expected, "spyreccl ", opName, ": argument '", argName, "' must hold ",
              expected, " ", what, ", got ", actual);
}

void checkNonEmpty(size_t actual, const char* opName, const char* argName) {
  TORCH_CHECK(actual > 0, "spyreccl ", opName, ": argument '", argName,
              "' is an empty tensor list; expected at least one tensor");
}

void checkSingleTensor(size_t actual, const char* opName, const char* argName) {
  checkNonEmpty(actual, opName, argName);
  TORCH_CHECK(actual == 1, "spyreccl ", opName, ": argument '", argName,
              "' must hold exactly one tensor, got ", actual,
              " (lists of several per-device tensors are not supported)");
}

void checkSameDtype(const at::Tensor& tensor, at::ScalarType expected, const char* opName,
                    const std::string& argName, const std::string& referenceName) {
  TORCH_CHECK(tensor.scalar_type() == expected, "spyreccl ", opName, ": argument '", argName,
              "' has dtype ", dtypeName(tensor.scalar_type()), " but '", referenceName,
              "' has dtype ", dtypeName(expected), "; all tensors of one call must share a dtype");
}

void checkNumel(const at::Tensor& tensor, int64_t expected, const char* opName,
                const std::string& argName, const std::string& why) {
  TORCH_CHECK(tensor.numel() == expected, "spyreccl ", opName, ": argument '", argName, "' has ",
              tensor.numel(), " elements (shape ", tensor.sizes(), "), expected ", expected, " ",
              why);
}

void checkRank(int64_t rank, int size, const char* opName, const char* argName) {
  TORCH_CHECK(rank >= 0 && rank < size, "spyreccl ", opName, ": argument '", argName, "' is ", rank,
              ", expected a rank of the group in [0, ", size, ")");
}

}  // namespace spyreccl_torch
