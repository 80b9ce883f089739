// Random number generators of the emulated spyre device.
//
// A counter-based (Philox4x32-10) generator, as CUDA's: its whole state is a
// seed and an offset (get_state() is 16 bytes, seed then offset, as on CUDA),
// and a random op on N elements reads counters offset .. offset+N-1 and then
// advances the offset by N rounded up to a multiple of 4. Element i of an op
// draws only from counter offset+i (see random_kernels.cc), so its value does
// not depend on how the work is split — which is what DTensor's offset-based
// RNG tracker relies on to give each shard the part of the global stream that
// an unsharded op would use.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

#include <cstdint>

namespace spyreccl::device {

// Size of get_state(): uint64 seed, then uint64 offset (CUDA's layout).
inline constexpr int64_t kRngStateBytes = 16;

// (seed, offset): the whole state of a spyre generator. Held through a shared
// pointer so that graph-safe RNG (torch.compile's activation checkpointing) can
// point a generator at another one's state, as CUDA's generator does.
struct SpyreRngState final : c10::intrusive_ptr_target {
  uint64_t seed = 0;
  uint64_t offset = 0;
};

class SpyreGeneratorImpl final : public c10::GeneratorImpl {
 public:
  SpyreGeneratorImpl(c10::DeviceIndex device, uint64_t seed);
  SpyreGeneratorImpl(c10::DeviceIndex device, c10::intrusive_ptr<SpyreRngState> state);

  // Seeding resets the offset to 0 (as CUDA's generator does).
  void set_current_seed(uint64_t seed) override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  // Graph-safe state handling: get returns a generator sharing this one's state
  // object; set makes this generator use `state`'s state object (no copy).
  void graphsafe_set_state(const c10::intrusive_ptr<c10::GeneratorImpl>& state) override;
  c10::intrusive_ptr<c10::GeneratorImpl> graphsafe_get_state() const override;

  // Reserves `count` counters for one random op: returns the first, advances the
  // offset past them (rounded up to a multiple of 4). Caller holds mutex_.
  uint64_t reserve(uint64_t count);

  // The counters of one random op: element i of the op draws philox(seed, first + i).
  struct Stream {
    uint64_t seed;
    uint64_t first;
  };
  // reserve() under mutex_, with the seed the counters belong to.
  Stream reserve_stream(uint64_t count);

 private:
  SpyreGeneratorImpl* clone_impl() const override;

  c10::intrusive_ptr<SpyreRngState> state_;
};

// Default generator of device `index` (-1: current device). Lives forever.
const at::Generator& default_generator(c10::DeviceIndex index);

// A fresh generator for device `index` (-1: current device).
at::Generator make_generator(c10::DeviceIndex index);

// The spyre generator a random op on `device` uses: `generator` if given (it
// must be a spyre generator; `op` names the operator in the error), else the
// device's default generator.
at::Generator spyre_generator_or_default(const std::optional<at::Generator>& generator,
                                         c10::DeviceIndex device, const char* op);

// A CPU generator for a random op that has no spyre kernel and runs its CPU
// kernel (the fallback): seeded from the spyre generator's (seed, offset), whose
// offset then advances by 4, so such ops are reproducible under manual_seed and
// differ from call to call, but are not tied to element indices.
at::Generator cpu_engine_for(const at::Generator& generator, const char* op);

}  // namespace spyreccl::device
