// input_checks.h — argument validation shared by all spyreccl operations.
//
// Every check runs on the calling rank before anything is enqueued, so a bad call fails
// right there with one message that names the operation, the argument and what was
// expected, and never reaches the peers (where it would surface as a mismatch or a hang).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace spyreccl_torch {

// "tensors[3]" style argument names.
std::string indexedName(const char* argName, size_t index);
std::string indexedName(const char* argName, size_t outer, size_t inner);

// Collects the tensors of one call and checks that each is a defined, dense spyre tensor on
// the same spyre device as the first one seen.
class DeviceChecker {
 public:
  explicit DeviceChecker(const char* opName) : opName_(opName) {}
  void add(const at::Tensor& tensor, const std::string& argName);
  // The common device; empty when the call carried no tensor (barrier).
  std::vector<c10::Device> devices() const;

 private:
  const char* opName_;
  std::optional<c10::Device> device_;
  std::string firstArg_;
};

void checkListSize(size_t actual, size_t expected, const char* opName, const char* argName,
                   const char* what);
void checkNonEmpty(size_t actual, const char* opName, const char* argName);
void checkSingleTensor(size_t actual, const char* opName, const char* argName);
void checkSameDtype(const at::Tensor& tensor, at::ScalarType expected, const char* opName,
                    const std::string& argName, const std::string& referenceName);
void checkNumel(const at::Tensor& tensor, int64_t expected, const char* opName,
                const std::string& argName, const std::string& why);
// Group rank argument (root, peer) in [0, size).
void checkRank(int64_t rank, int size, const char* opName, const char* argName);

}  // namespace spyreccl_torch
