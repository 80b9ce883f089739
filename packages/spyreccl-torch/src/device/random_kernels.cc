// Random kernels of the spyre device: every value comes from the spyre
// generator's Philox4x32-10 stream (see generator.h).
//
// An op on N elements reserves counters [offset, offset + N) and element i (in
// row-major order of the logical shape) is a function of (seed, offset + i)
// alone: one Philox block of four 32-bit words per element. So the values of
// a tensor do not depend on how many threads fill it, and a shard that starts
// at the offset of its first element in the whole tensor (what DTensor's
// OffsetBasedRNGTracker arranges) holds exactly the values that an unsharded
// op would have put there.
#include <ATen/Dispatch.h>
#include <ATen/ExpandUtils.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/result_type.h>
#include <ATen/ops/view_as_real.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>

#include "device_memory.h"
#include "device_state.h"
#include "generator.h"
#include "philox.h"

namespace spyreccl::device {
namespace {

uint64_t word64(const PhiloxBlock& w, int first) {
  return (static_cast<uint64_t>(w[first]) << 32) | w[first + 1];
}

// Uniform in [0, 1) with 53 random bits, and in (0, 1] (safe for log).
double unit_closed_open(const PhiloxBlock& w, int first = 0) {
  return static_cast<double>(word64(w, first) >> 11) * 0x1p-53;
}
double unit_open_closed(const PhiloxBlock& w, int first = 0) {
  return static_cast<double>((word64(w, first) >> 11) + 1) * 0x1p-53;
}
// The same with 24 bits, for float and narrower types.
float unit_closed_open_f(uint32_t x) { return static_cast<float>(x >> 8) * 0x1p-24f; }
float unit_open_closed_f(uint32_t x) { return static_cast<float>((x >> 8) + 1) * 0x1p-24f; }

// A standard normal value by Box-Muller, in the precision of `opmath_t`.
template <typename opmath_t>
opmath_t standard_normal(const PhiloxBlock& w) {
  if constexpr (std::is_same_v<opmath_t, double>) {
    const double radius = std::sqrt(-2.0 * std::log(unit_open_closed(w, 0)));
    return radius * std::cos(2.0 * M_PI * unit_closed_open(w, 2));
  } else {
    const float radius = std::sqrt(-2.0f * std::log(unit_open_closed_f(w[0])));
    return radius * std::cos(2.0f * static_cast<float>(M_PI) * unit_closed_open_f(w[1]));
  }
}

template <typename opmath_t>
opmath_t uniform01(const PhiloxBlock& w) {
  if constexpr (std::is_same_v<opmath_t, double>) {
    return unit_closed_open(w);
  } else {
    return unit_closed_open_f(w[0]);
  }
}

template <typename opmath_t>
opmath_t uniform01_open_closed(const PhiloxBlock& w) {
  if constexpr (std::is_same_v<opmath_t, double>) {
    return unit_open_closed(w);
  } else {
    return unit_open_closed_f(w[0]);
  }
}

// Fills `self` with draw(block of element i), i in row-major order (or
// draw(block, i) when the value also depends on the element). `draw` returns scalar_t.
template <typename scalar_t, typename Draw>
void fill_elements(at::Tensor& self, const std::optional<at::Generator>& generator, const char* op,
                   Draw draw) {
  const int64_t n = self.numel();
  if (n == 0) {
    return;
  }
  at::Generator gen = spyre_generator_or_default(generator, self.device().index(), op);
  const SpyreGeneratorImpl::Stream stream =
      gen.get<SpyreGeneratorImpl>()->reserve_stream(static_cast<uint64_t>(n));
  const uint64_t seed = stream.seed;
  const uint64_t first = stream.first;
  // The device's own kernel: a contiguous tensor is written in place (through
  // its host address), any other layout through a contiguous staging buffer.
  const bool direct = self.is_contiguous();
  at::Tensor out = direct ? self : at::empty(self.sizes(), self.options().device(c10::kCPU));
  scalar_t* data = static_cast<scalar_t*>(host_address(out.mutable_data_ptr()));
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const PhiloxBlock w = philox(seed, first + static_cast<uint64_t>(i));
      if constexpr (std::is_invocable_v<Draw, const PhiloxBlock&, int64_t>) {
        data[i] = draw(w, i);  // the value also depends on the element (bernoulli_ with p)
      } else {
        data[i] = draw(w);
      }
    }
  });
  if (!direct) {
    self.copy_(out);
  }
}

void check_floating(const at::Tensor& self, const char* op) {
  TORCH_CHECK(at::isFloatingType(self.scalar_type()), op, " expects a floating point tensor, got ",
              self.scalar_type());
}

at::Tensor& normal_(at::Tensor& self, double mean, double std,
                    std::optional<at::Generator> generator) {
  TORCH_CHECK(std >= 0.0, "normal expects std >= 0.0, but found std ", std);
  if (self.is_complex()) {
    // As on CPU (torch.randn(..., dtype=torch.complex64) and the complex initialisers): the
    // real and imaginary parts are independent normals of std / sqrt(2), so that the complex
    // value has variance std^2. The parts are consecutive elements of the real view.
    at::Tensor parts = at::view_as_real(self);
    normal_(parts, mean, std / std::sqrt(2.0), generator);
    return self;
  }
  check_floating(self, "normal_");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "normal_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto m = static_cast<opmath_t>(mean);
    const auto s = static_cast<opmath_t>(std);
    fill_elements<scalar_t>(self, generator, "normal_", [=](const PhiloxBlock& w) {
      return static_cast<scalar_t>(m + s * standard_normal<opmath_t>(w));
    });
  });
  return self;
}

at::Tensor& uniform_(at::Tensor& self, double from, double to,
                     std::optional<at::Generator> generator) {
  if (self.is_complex()) {
    // As on CPU: both parts uniform in [from, to).
    at::Tensor parts = at::view_as_real(self);
    uniform_(parts, from, to, generator);
    return self;
  }
  check_floating(self, "uniform_");
  TORCH_CHECK(from <= to, "uniform_ expects to return a [from, to) range, but found from=", from,
              " > to=", to);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "uniform_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto lo = static_cast<opmath_t>(from);
    const auto range = static_cast<opmath_t>(to - from);
    const auto lo_s = static_cast<scalar_t>(from);
    const auto hi_s = static_cast<scalar_t>(to);
    fill_elements<scalar_t>(self, generator, "uniform_", [=](const PhiloxBlock& w) {
      const auto value = static_cast<scalar_t>(lo + range * uniform01<opmath_t>(w));
      // Rounding to a narrow type can reach `to`; keep the range half-open.
      return (value == hi_s && lo_s != hi_s) ? lo_s : value;
    });
  });
  return self;
}

at::Tensor& exponential_(at::Tensor& self, double lambd, std::optional<at::Generator> generator) {
  check_floating(self, "exponential_");
  TORCH_CHECK(lambd > 0.0, "exponential_ expects lambda > 0.0, but found lambda=", lambd);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, self.scalar_type(), "exponential_", [&] {
        using opmath_t = at::opmath_type<scalar_t>;
        const auto inv = static_cast<opmath_t>(1.0 / lambd);
        fill_elements<scalar_t>(self, generator, "exponential_", [=](const PhiloxBlock& w) {
          return static_cast<scalar_t>(-inv * std::log(uniform01_open_closed<opmath_t>(w)));
        });
      });
  return self;
}

at::Tensor& log_normal_(at::Tensor& self, double mean, double std,
                        std::optional<at::Generator> generator) {
  check_floating(self, "log_normal_");
  TORCH_CHECK(std > 0.0, "log_normal_ expects std > 0.0, but found std=", std);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "log_normal_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto m = static_cast<opmath_t>(mean);
    const auto s = static_cast<opmath_t>(std);
    fill_elements<scalar_t>(self, generator, "log_normal_", [=](const PhiloxBlock& w) {
      return static_cast<scalar_t>(std::exp(m + s * standard_normal<opmath_t>(w)));
    });
  });
  return self;
}

at::Tensor& bernoulli_float_(at::Tensor& self, double p, std::optional<at::Generator> generator) {
  TORCH_CHECK(0.0 <= p && p <= 1.0, "bernoulli_ expects p to be in [0, 1], but got p=", p);
  AT_DISPATCH_ALL_TYPES_AND3(
      at::kBool, at::kHalf, at::kBFloat16, self.scalar_type(), "bernoulli_", [&] {
        fill_elements<scalar_t>(self, generator, "bernoulli_", [=](const PhiloxBlock& w) {
          return static_cast<scalar_t>(unit_closed_open(w) < p ? 1 : 0);
        });
      });
  return self;
}

at::Tensor& bernoulli_tensor_(at::Tensor& self, const at::Tensor& p_,
                              std::optional<at::Generator> generator) {
  // Probabilities in element order of `self`, as doubles (read through the host
  // address when `p` is a spyre tensor).
  const at::Tensor p = p_.expand(self.sizes()).to(at::kDouble).contiguous();
  const auto* prob = static_cast<const double*>(host_address(p.const_data_ptr<double>()));
  for (int64_t i = 0; i < p.numel(); ++i) {
    TORCH_CHECK(0.0 <= prob[i] && prob[i] <= 1.0,
                "bernoulli_ expects all elements of p to be in [0, 1], found ", prob[i]);
  }
  // Each element compares its draw with its own probability.
  AT_DISPATCH_ALL_TYPES_AND3(
      at::kBool, at::kHalf, at::kBFloat16, self.scalar_type(), "bernoulli_", [&] {
        fill_elements<scalar_t>(
            self, generator, "bernoulli_", [=](const PhiloxBlock& w, int64_t i) {
              return static_cast<scalar_t>(unit_closed_open(w) < prob[i] ? 1 : 0);
            });
      });
  return self;
}

// Largest value random_() without bounds produces: the dtype's maximum for
// integers, 2**digits for floating types (every integer up to it is exact).
template <typename scalar_t>
int64_t random_upper_inclusive() {
  if constexpr (std::is_same_v<scalar_t, bool>) {
    return 1;
  } else if constexpr (std::is_floating_point_v<scalar_t> || std::is_same_v<scalar_t, at::Half> ||
                       std::is_same_v<scalar_t, at::BFloat16>) {
    return int64_t{1} << std::numeric_limits<scalar_t>::digits;
  } else {
    return static_cast<int64_t>(std::numeric_limits<scalar_t>::max());
  }
}

// Integers uniform in [from, from + range) (range 0 means 2**64).
at::Tensor& random_range_(at::Tensor& self, int64_t from, uint64_t range,
                          std::optional<at::Generator> generator) {
  AT_DISPATCH_ALL_TYPES_AND3(
      at::kBool, at::kHalf, at::kBFloat16, self.scalar_type(), "random_", [&] {
        fill_elements<scalar_t>(self, generator, "random_", [=](const PhiloxBlock& w) {
          const uint64_t draw = word64(w, 0);
          const uint64_t offset = range == 0 ? draw : draw % range;
          return static_cast<scalar_t>(static_cast<int64_t>(static_cast<uint64_t>(from) + offset));
        });
      });
  return self;
}

int64_t upper_inclusive_of(const at::Tensor& self) {
  int64_t upper = 0;
  AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, self.scalar_type(), "random_",
                             [&] { upper = random_upper_inclusive<scalar_t>(); });
  return upper;
}

at::Tensor& random_from_(at::Tensor& self, int64_t from, std::optional<int64_t> to,
                         std::optional<at::Generator> generator) {
  if (to.has_value()) {
    TORCH_CHECK(from < *to, "random_ expects 'from' to be less than 'to', but got from=", from,
                " >= to=", *to);
    return random_range_(self, from, static_cast<uint64_t>(*to) - static_cast<uint64_t>(from),
                         generator);
  }
  const int64_t upper = upper_inclusive_of(self);
  TORCH_CHECK(from <= upper, "random_ expects 'from' to be at most ", upper, " for ",
              self.scalar_type(), ", but got from=", from);
  // [from, upper]: the count wraps to 0 (meaning 2**64) only for the full int64 range.
  return random_range_(self, from, static_cast<uint64_t>(upper) - static_cast<uint64_t>(from) + 1,
                       generator);
}

at::Tensor& random_to_(at::Tensor& self, int64_t to, std::optional<at::Generator> generator) {
  return random_from_(self, 0, to, generator);
}

at::Tensor& random_(at::Tensor& self, std::optional<at::Generator> generator) {
  return random_from_(self, 0, std::nullopt, generator);
}

// Fused dropout, as CUDA's: a Bernoulli(1 - p) keep-mask from the spyre stream,
// output = input * mask / (1 - p).
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p,
                                                  std::optional<bool> train) {
  TORCH_CHECK(0.0 <= p && p <= 1.0, "dropout probability has to be between 0 and 1, but got ", p);
  if (train.has_value() && !*train) {
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  }
  at::Tensor mask = at::empty_like(input, input.options().dtype(at::kBool));
  bernoulli_float_(mask, 1.0 - p, std::nullopt);
  const double scale = p == 1.0 ? 0.0 : 1.0 / (1.0 - p);
  at::Tensor output = input.mul(mask).mul_(scale);
  return {output, mask};
}

at::Tensor normal_tensor_float(const at::Tensor& mean, double std,
                               std::optional<at::Generator> generator) {
  at::Tensor out = at::empty_like(mean, at::MemoryFormat::Contiguous);
  normal_(out, 0.0, std, generator);
  return out.add_(mean);
}

at::Tensor normal_float_tensor(double mean, const at::Tensor& std,
                               std::optional<at::Generator> generator) {
  at::Tensor out = at::empty_like(std, at::MemoryFormat::Contiguous);
  normal_(out, 0.0, 1.0, generator);
  return out.mul_(std).add_(mean);
}

at::Tensor normal_tensor_tensor(const at::Tensor& mean, const at::Tensor& std,
                                std::optional<at::Generator> generator) {
  const at::Tensor& like = mean.device().type() == kSpyreDeviceType ? mean : std;
  at::Tensor out = at::empty(at::infer_size(mean.sizes(), std.sizes()),
                             like.options().dtype(at::result_type(mean, std)));
  normal_(out, 0.0, 1.0, generator);
  return out.mul_(std).add_(mean);
}

}  // namespace

at::Tensor reserve_keep_mask(c10::IntArrayRef sizes, double keep_prob, c10::Device device,
                             uint64_t& seed, uint64_t& first) {
  const int64_t n = c10::multiply_integers(sizes);
  const auto stream = default_generator(device.index())
                          .get<SpyreGeneratorImpl>()
                          ->reserve_stream(static_cast<uint64_t>(n));
  seed = stream.seed;
  first = stream.first;
  return keep_mask(sizes, keep_prob, device, seed, first);
}

at::Tensor keep_mask(c10::IntArrayRef sizes, double keep_prob, c10::Device device, uint64_t seed,
                     uint64_t first) {
  at::Tensor mask = at::empty(sizes, at::TensorOptions().dtype(at::kBool).device(device));
  bool* data = static_cast<bool*>(host_address(mask.mutable_data_ptr<bool>()));
  at::parallel_for(0, mask.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      data[i] = unit_closed_open(philox(seed, first + static_cast<uint64_t>(i))) < keep_prob;
    }
  });
  return mask;
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("normal_", TORCH_FN(normal_));
  m.impl("uniform_", TORCH_FN(uniform_));
  m.impl("exponential_", TORCH_FN(exponential_));
  m.impl("log_normal_", TORCH_FN(log_normal_));
  m.impl("bernoulli_.float", TORCH_FN(bernoulli_float_));
  m.impl("bernoulli_.Tensor", TORCH_FN(bernoulli_tensor_));
  m.impl("random_", TORCH_FN(random_));
  m.impl("random_.from", TORCH_FN(random_from_));
  m.impl("random_.to", TORCH_FN(random_to_));
  m.impl("native_dropout", TORCH_FN(native_dropout));
  m.impl("normal.Tensor_float", TORCH_FN(normal_tensor_float));
  m.impl("normal.float_Tensor", TORCH_FN(normal_float_tensor));
  m.impl("normal.Tensor_Tensor", TORCH_FN(normal_tensor_tensor));
}

}  // namespace spyreccl::device
