#include "generator.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Utils.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <mutex>
#include <vector>

#include "device_state.h"

namespace spyreccl::device {

SpyreGeneratorImpl::SpyreGeneratorImpl(c10::DeviceIndex device, uint64_t seed)
    : SpyreGeneratorImpl(device, c10::make_intrusive<SpyreRngState>()) {
  state_->seed = seed;
}

SpyreGeneratorImpl::SpyreGeneratorImpl(c10::DeviceIndex device,
                                       c10::intrusive_ptr<SpyreRngState> state)
    : c10::GeneratorImpl(spyre_device(device), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
      state_(std::move(state)) {}

// Callers of these methods hold mutex_ (torch's convention for generators).

void SpyreGeneratorImpl::set_current_seed(uint64_t seed) {
  state_->seed = seed;
  state_->offset = 0;
}

void SpyreGeneratorImpl::set_offset(uint64_t offset) { state_->offset = offset; }

uint64_t SpyreGeneratorImpl::get_offset() const { return state_->offset; }

uint64_t SpyreGeneratorImpl::current_seed() const { return state_->seed; }

uint64_t SpyreGeneratorImpl::seed() {
  const uint64_t fresh = c10::detail::getNonDeterministicRandom();
  set_current_seed(fresh);
  return fresh;
}

// get_state and set_state run no torch operator on the state tensor (as CUDA's
// generator): torch.spyre.get_rng_state / set_rng_state, which call them, must
// work under any active dispatch mode (FakeTensorMode, LocalTensorMode), where a
// dispatched op would be intercepted and a dispatched empty() would come back fake.
void SpyreGeneratorImpl::set_state(const c10::TensorImpl& new_state) {
  // A fake (or other Python subclass) tensor reports a CPU device but has no
  // host data to read.
  TORCH_CHECK(!new_state.key_set().has(c10::DispatchKey::Python),
              "spyre set_rng_state: expected a real CPU torch.uint8 tensor, got a tensor "
              "subclass (a FakeTensor or another Python tensor), which holds no host data");
  TORCH_CHECK(new_state.layout() == c10::kStrided && new_state.device().type() == c10::kCPU &&
                  new_state.dtype() == caffe2::TypeMeta::Make<uint8_t>() &&
                  new_state.is_contiguous(),
              "spyre set_rng_state: expected a contiguous CPU torch.uint8 tensor, got ",
              new_state.dtype(), " on ", new_state.device());
  TORCH_CHECK(new_state.numel() == kRngStateBytes, "spyre set_rng_state: expected a state of ",
              kRngStateBytes,
              " bytes (uint64 seed, uint64 offset: a Philox state from get_rng_state), got ",
              new_state.numel(), " bytes");
  const auto* bytes = static_cast<const uint8_t*>(new_state.data());
  std::memcpy(&state_->seed, bytes, sizeof(uint64_t));
  std::memcpy(&state_->offset, bytes + sizeof(uint64_t), sizeof(uint64_t));
}

c10::intrusive_ptr<c10::TensorImpl> SpyreGeneratorImpl::get_state() const {
  // The CPU allocator directly, not the dispatched at::empty.
  at::TensorBase state = at::detail::empty_cpu({kRngStateBytes}, at::kByte);
  auto* bytes = state.data_ptr<uint8_t>();
  std::memcpy(bytes, &state_->seed, sizeof(uint64_t));
  std::memcpy(bytes + sizeof(uint64_t), &state_->offset, sizeof(uint64_t));
  return state.getIntrusivePtr();
}

void SpyreGeneratorImpl::graphsafe_set_state(const c10::intrusive_ptr<c10::GeneratorImpl>& state) {
  auto* other = dynamic_cast<SpyreGeneratorImpl*>(state.get());
  TORCH_CHECK(other != nullptr,
              "spyre graphsafe_set_state: expected the state of a spyre generator");
  state_ = other->state_;
}

c10::intrusive_ptr<c10::GeneratorImpl> SpyreGeneratorImpl::graphsafe_get_state() const {
  return c10::make_intrusive<SpyreGeneratorImpl>(device_.index(), state_);
}

uint64_t SpyreGeneratorImpl::reserve(uint64_t count) {
  const uint64_t first = state_->offset;
  state_->offset += (count + 3) / 4 * 4;
  return first;
}

SpyreGeneratorImpl::Stream SpyreGeneratorImpl::reserve_stream(uint64_t count) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t seed = current_seed();
  return Stream{seed, reserve(count)};
}

SpyreGeneratorImpl* SpyreGeneratorImpl::clone_impl() const {
  auto copy = c10::make_intrusive<SpyreRngState>();
  copy->seed = state_->seed;
  copy->offset = state_->offset;
  return new SpyreGeneratorImpl(device_.index(), std::move(copy));
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

at::Generator spyre_generator_or_default(const std::optional<at::Generator>& generator,
                                         c10::DeviceIndex device, const char* op) {
  if (!generator.has_value() || !generator->defined()) {
    return default_generator(device);
  }
  TORCH_CHECK(generator->device().type() == kSpyreDeviceType, op,
              ": expected a spyre generator for spyre tensors, got a generator on ",
              generator->device());
  return *generator;
}

at::Generator cpu_engine_for(const at::Generator& generator, const char* op) {
  TORCH_CHECK(generator.device().type() == kSpyreDeviceType, op,
              ": expected a spyre generator for spyre tensors, got a generator on ",
              generator.device());
  const SpyreGeneratorImpl::Stream stream = generator.get<SpyreGeneratorImpl>()->reserve_stream(4);
  const uint64_t seed = stream.seed;
  const uint64_t offset = stream.first;
  // splitmix64-style mixing: nearby (seed, offset) pairs give unrelated mt19937 seeds.
  uint64_t z = seed ^ (offset * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return at::detail::createCPUGenerator(z ^ (z >> 31));
}

}  // namespace spyreccl::device
