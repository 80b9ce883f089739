#include "generator.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <vector>

#include "device_state.h"

namespace spyreccl::device {

SpyreGeneratorImpl::SpyreGeneratorImpl(c10::DeviceIndex device, uint64_t seed)
    : SpyreGeneratorImpl(device, at::detail::createCPUGenerator(seed)) {}

SpyreGeneratorImpl::SpyreGeneratorImpl(c10::DeviceIndex device, at::Generator engine)
    : c10::GeneratorImpl(spyre_device(device), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
      engine_(std::move(engine)) {}

std::mutex& SpyreGeneratorImpl::engine_mutex() const {
  return engine_.unsafeGetGeneratorImpl()->mutex_;
}

// The engine has its own mutex, which CPU kernels take while drawing numbers.
// Callers of these methods hold this generator's mutex_, so taking the
// engine's as well keeps state updates atomic with respect to running kernels.

void SpyreGeneratorImpl::set_current_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(engine_mutex());
  engine_.set_current_seed(seed);
}

void SpyreGeneratorImpl::set_offset(uint64_t offset) {
  std::lock_guard<std::mutex> lock(engine_mutex());
  engine_.set_offset(offset);
}

uint64_t SpyreGeneratorImpl::get_offset() const {
  std::lock_guard<std::mutex> lock(engine_mutex());
  return engine_.get_offset();
}

uint64_t SpyreGeneratorImpl::current_seed() const {
  std::lock_guard<std::mutex> lock(engine_mutex());
  return engine_.current_seed();
}

uint64_t SpyreGeneratorImpl::seed() {
  std::lock_guard<std::mutex> lock(engine_mutex());
  return engine_.seed();
}

void SpyreGeneratorImpl::set_state(const c10::TensorImpl& new_state) {
  std::lock_guard<std::mutex> lock(engine_mutex());
  engine_.unsafeGetGeneratorImpl()->set_state(new_state);
}

c10::intrusive_ptr<c10::TensorImpl> SpyreGeneratorImpl::get_state() const {
  std::lock_guard<std::mutex> lock(engine_mutex());
  return engine_.unsafeGetGeneratorImpl()->get_state();
}

SpyreGeneratorImpl* SpyreGeneratorImpl::clone_impl() const {
  std::lock_guard<std::mutex> lock(engine_mutex());
  return new SpyreGeneratorImpl(device_.index(), engine_.clone());
}

const at::Generator& default_generator(c10::DeviceIndex index) {
  // Created together on first use; torch hands out references to these, so
  // they must never move or die.
  static const auto* generators = [] {
    auto* all = new std::vector<at::Generator>();
    all->reserve(device_count());
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
      all->push_back(at::make_generator<SpyreGeneratorImpl>(i, c10::default_rng_seed_val));
    }
    return all;
  }();
  return (*generators)[resolve_device_index(index, "spyre default generator")];
}

at::Generator make_generator(c10::DeviceIndex index) {
  return at::make_generator<SpyreGeneratorImpl>(resolve_device_index(index, "spyre generator"),
                                                c10::default_rng_seed_val);
}

at::Generator engine_of(const at::Generator& generator, const char* op) {
  TORCH_CHECK(generator.device().type() == kSpyreDeviceType, op,
              ": expected a spyre generator for spyre tensors, got a generator on ",
              generator.device());
  return generator.get<SpyreGeneratorImpl>()->engine();
}

}  // namespace spyreccl::device
