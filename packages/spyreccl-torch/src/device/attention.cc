// Fused scaled-dot-product attention for spyre.
//
// On a device without a fused SDPA, torch decomposes F.scaled_dot_product_attention
// into its math path, which builds plain mask tensors and so cannot run on DTensors
// ("got mixed torch.Tensor and DTensor"). Spyre instead registers a choice function
// for the PrivateUse1 SDPA stub that picks the "efficient attention" backend, and
// implements aten::_scaled_dot_product_efficient_attention (+ backward) for spyre:
// DTensor has sharding rules for that op pair (heads or batch sharded), so
// Megatron-style tensor parallel attention works unchanged. The kernels compute
// exactly (no tiling): scores, a log-sum-exp saved for the backward, and
// attention probabilities recomputed from it; half/bfloat16 are computed in
// float32, as the math path does. Dropout masks come from the spyre Philox
// stream, and the (seed, offset) returned by the forward rebuilds the same mask
// in the backward.
//
// Both kernels run their arithmetic on CPU tensors lent from the spyre ones, under one
// HostAliasScope for the whole call (host_alias.h), and hand their fresh results back as
// spyre tensors at the end. Calling ATen on the spyre tensors themselves computes the same
// numbers with the same CPU kernels, but each of the call's fifteen to thirty operators
// then reaches the boxed fallback (fallback.cc), which lends its operands and adopts its
// result once per operator: on a decode step's shapes that bookkeeping was a sixth of the
// call (docs/notes/device-op-overhead.md). The intermediates (scores, probabilities) are
// CPU memory that lives within the call; spyre's memory statistics count the results.
#include <ATen/Context.h>
#include <ATen/SDPBackend.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "device_state.h"
#include "host_alias.h"
#include "philox.h"

namespace spyreccl::device {
namespace {

using at::SDPBackend;

bool is_attention_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// Which SDPA backend spyre uses: efficient attention (this file) for 4-D dense
// inputs of one floating dtype with as many key/value heads as query heads; the
// math decomposition otherwise (grouped-query attention, other ranks), and
// whatever torch.nn.attention.sdpa_kernel() allows.
int64_t fused_sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask, double /*dropout_p*/,
                         bool /*is_causal*/, std::optional<double> /*scale*/, bool /*enable_gqa*/) {
  const auto& ctx = at::globalContext();
  const bool shapes_fit = query.dim() == 4 && key.dim() == 4 && value.dim() == 4 &&
                          key.size(1) == query.size(1) && value.size(1) == query.size(1) &&
                          key.size(0) == query.size(0) && value.size(0) == query.size(0);
  const bool dtypes_fit = is_attention_dtype(query.scalar_type()) &&
                          key.scalar_type() == query.scalar_type() &&
                          value.scalar_type() == query.scalar_type();
  const bool dense = !query.is_nested() && !key.is_nested() && !value.is_nested() &&
                     (!attn_mask.has_value() || !attn_mask->is_nested());
  if (ctx.userEnabledMemEfficientSDP() && shapes_fit && dtypes_fit && dense) {
    return static_cast<int64_t>(SDPBackend::efficient_attention);
  }
  if (ctx.userEnabledMathSDP()) {
    return static_cast<int64_t>(SDPBackend::math);
  }
  return static_cast<int64_t>(SDPBackend::error);
}

// The device of a call whose tensors must all be spyre tensors (SDPA's front end checks
// that query, key and value share a device; a direct call of the op gets the same answer
// here rather than a result on a device nobody asked for).
c10::Device spyre_device_of(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  const at::Tensor* first = nullptr;
  for (const at::Tensor* t : tensors) {
    if (!t->defined()) {
      continue;
    }
    TORCH_CHECK(is_spyre(*t), op, ": expected spyre tensors for query, key, value (and the ",
                "backward's gradient, output and log-sum-exp), got one on ", t->device());
    if (first == nullptr) {
      first = t;
    } else {
      TORCH_CHECK(t->device() == first->device(), op,
                  ": expected all tensors on one spyre device, got ", first->device(), " and ",
                  t->device());
    }
  }
  TORCH_INTERNAL_ASSERT(first != nullptr);
  return first->device();
}

// The CPU tensor a kernel below computes with: `t` lent from spyre (the caller's argument,
// alive for the whole call, so borrowed), or `t` itself on CPU (an attention bias may be
// a CPU tensor, which the fallback also accepted), or undefined.
at::Tensor host_operand(HostAliasScope& scope, const at::Tensor& t) {
  return scope.lend_argument(t, /*borrow=*/true);
}

std::optional<at::Tensor> host_operand(HostAliasScope& scope, const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) {
    return std::nullopt;
  }
  return host_operand(scope, *t);
}

at::ScalarType compute_dtype(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

double softmax_scale(const at::Tensor& query, std::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(query.size(-1)));
}

void check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
              ": expected 4-D query, key, value (batch, heads, length, dim), got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(0) == v.size(0) && q.size(1) == k.size(1) &&
                  q.size(1) == v.size(1) && k.size(2) == v.size(2) && q.size(3) == k.size(3),
              op, ": incompatible shapes query ", q.sizes(), ", key ", k.sizes(), ", value ",
              v.sizes());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
              ": query, key and value must have one dtype, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
}

// Attention scores (B, H, L, S) in `acc` precision: scaled q k^T, causal mask
// (top-left aligned, as the math path) and additive bias.
at::Tensor scores_of(const at::Tensor& q, const at::Tensor& k,
                     const std::optional<at::Tensor>& bias, bool is_causal, double scale,
                     at::ScalarType acc) {
  at::Tensor scores = at::matmul(q.to(acc), k.to(acc).transpose(-2, -1)).mul_(scale);
  if (is_causal) {
    const int64_t L = q.size(2);
    const int64_t S = k.size(2);
    at::Tensor keep = at::ones({L, S}, q.options().dtype(at::kBool)).tril();
    scores.masked_fill_(keep.logical_not(), -std::numeric_limits<double>::infinity());
  }
  if (bias.has_value() && bias->defined()) {
    scores.add_(
        bias->scalar_type() == at::kBool
            ? at::zeros_like(*bias, bias->options().dtype(acc))
                  .masked_fill_(bias->logical_not(), -std::numeric_limits<double>::infinity())
            : bias->to(acc));
  }
  return scores;
}

// exp(scores - lse), with rows that every position masked out (lse = -inf)
// giving zeros, as the math path's safe softmax does.
at::Tensor probabilities(const at::Tensor& scores, const at::Tensor& lse) {
  at::Tensor finite_lse = lse.masked_fill(lse.isneginf(), 0.0);
  return (scores - finite_lse.unsqueeze(-1)).exp_();
}

// An uninitialised (b, h, n, d) tensor over (b, n, h, d) memory.
at::Tensor transposed_heads_empty(int64_t b, int64_t h, int64_t n, int64_t d,
                                  const at::TensorOptions& options) {
  return at::empty({b, n, h, d}, options).transpose(1, 2);
}

at::Tensor transposed_heads_like(const at::Tensor& t) {
  return transposed_heads_empty(t.size(0), t.size(1), t.size(2), t.size(3), t.options());
}

at::Tensor philox_scalar(uint64_t value, c10::Device device) {
  return at::scalar_tensor(static_cast<int64_t>(value),
                           at::TensorOptions().dtype(at::kLong).device(device));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> efficient_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_bias, bool compute_log_sumexp, double dropout_p,
    bool is_causal, std::optional<double> scale) {
  constexpr const char* kOp = "_scaled_dot_product_efficient_attention";
  check_inputs(kOp, query, key, value);
  TORCH_CHECK(0.0 <= dropout_p && dropout_p <= 1.0, kOp, ": dropout_p must be in [0, 1], got ",
              dropout_p);
  const c10::Device device = spyre_device_of(kOp, {&query, &key, &value});
  HostAliasScope scope(kOp, device);
  const at::Tensor q = host_operand(scope, query);
  const at::Tensor k = host_operand(scope, key);
  const at::Tensor v = host_operand(scope, value);
  const std::optional<at::Tensor> bias = host_operand(scope, attn_bias);

  const at::ScalarType acc = compute_dtype(q.scalar_type());
  at::Tensor scores = scores_of(q, k, bias, is_causal, softmax_scale(q, scale), acc);
  at::Tensor lse = at::logsumexp(scores, -1);
  at::Tensor probs = probabilities(scores, lse);
  uint64_t seed = 0;
  uint64_t first = 0;
  if (dropout_p > 0.0) {
    // Drawn on the spyre device (its Philox stream), then lent like the inputs.
    const at::Tensor keep =
        scope.lend(reserve_keep_mask(probs.sizes(), 1.0 - dropout_p, device, seed, first));
    probs = probs.mul_(keep).div_(1.0 - dropout_p);
  }
  // The layout the op's meta function declares (and DTensor, fake tensors and
  // inductor plan with): output (B, H, L, Ev) over (B, L, H, Ev) memory, float32
  // log-sum-exp padded to a multiple of 32 queries, 0-dim int64 seed and offset.
  at::Tensor out = transposed_heads_empty(q.size(0), q.size(1), q.size(2), v.size(3), q.options());
  out.copy_(at::matmul(probs, v.to(acc)));
  at::Tensor saved_lse;
  if (compute_log_sumexp) {
    const int64_t padded = (q.size(2) + 31) / 32 * 32;
    saved_lse = at::full({q.size(0), q.size(1), padded}, std::numeric_limits<float>::infinity(),
                         lse.options().dtype(at::kFloat));
    saved_lse.narrow(-1, 0, q.size(2)).copy_(lse);
  } else {
    saved_lse = at::empty({q.size(0), q.size(1), 0}, lse.options().dtype(at::kFloat));
  }
  // Nothing above resized or re-pointed a lent tensor; commit() and write_back_lent() keep
  // the scope's contract all the same (they cost a comparison per lent tensor).
  scope.commit();
  scope.write_back_lent();
  return {scope.to_spyre(out), scope.to_spyre(saved_lse), philox_scalar(seed, device),
          philox_scalar(first, device)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> efficient_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& attn_bias_or_undefined, const at::Tensor& out,
    const at::Tensor& logsumexp, const at::Tensor& philox_seed, const at::Tensor& philox_offset,
    double dropout_p, std::array<bool, 4> grad_input_mask, bool is_causal,
    std::optional<double> scale) {
  constexpr const char* kOp = "_scaled_dot_product_efficient_attention_backward";
  check_inputs(kOp, query, key, value);
  if (!grad_out.defined()) {
    return {};  // no gradient flowed into the output: none flows out
  }
  const c10::Device device =
      spyre_device_of(kOp, {&grad_out, &query, &key, &value, &out, &logsumexp});
  HostAliasScope scope(kOp, device);
  const at::Tensor q = host_operand(scope, query);
  const at::Tensor k = host_operand(scope, key);
  const at::Tensor v = host_operand(scope, value);
  const at::Tensor given_out = host_operand(scope, out);
  const at::Tensor given_lse = host_operand(scope, logsumexp);
  const std::optional<at::Tensor> attn_bias = host_operand(
      scope, attn_bias_or_undefined.defined() ? std::optional<at::Tensor>(attn_bias_or_undefined)
                                              : std::nullopt);
  const at::ScalarType acc = compute_dtype(q.scalar_type());
  const double s = softmax_scale(q, scale);
  at::Tensor scores = scores_of(q, k, attn_bias, is_causal, s, acc);
  // The op differentiates through the `logsumexp` and `out` it is given, not
  // through this block of keys alone: ring attention (context parallelism) runs
  // the backward once per block of keys and values, with the log-sum-exp and
  // output merged over every block, so each call must give that block's share of
  // the gradient (as CUDA's kernels do). When they are this call's own forward
  // results (the given float32 log-sum-exp equals the recomputed one, rounded),
  // the recomputed values serve instead: they keep float64 inputs' precision.
  const at::Tensor own_lse = at::logsumexp(scores, -1);
  at::Tensor lse = own_lse;
  bool own = true;
  if (given_lse.defined() && given_lse.dim() == 3 && given_lse.size(-1) >= q.size(2)) {
    const at::Tensor given = given_lse.narrow(-1, 0, q.size(2));
    own = at::equal(given, own_lse.to(given.scalar_type()));
    if (!own) {
      TORCH_CHECK(given_out.defined() && given_out.sizes() == grad_out.sizes(), kOp,
                  ": a log-sum-exp other than the forward's own needs the matching output, of "
                  "the shape of grad_out");
      lse = given.to(acc);
    }
  }
  at::Tensor probs = probabilities(scores, lse);
  at::Tensor dropped = probs;
  std::optional<at::Tensor> keep;
  if (dropout_p > 0.0) {
    // The forward's mask, rebuilt on the spyre device from its (seed, offset), then lent.
    keep = scope.lend(keep_mask(probs.sizes(), 1.0 - dropout_p, device,
                                static_cast<uint64_t>(philox_seed.item<int64_t>()),
                                static_cast<uint64_t>(philox_offset.item<int64_t>())));
    dropped = probs * *keep / (1.0 - dropout_p);
  }
  const at::Tensor dout = host_operand(scope, grad_out).to(acc);
  // Gradients in the layout of the op's meta function: q, k, v gradients over
  // (B, L, H, E) memory, the bias gradient with its last dimension padded to 16.
  at::Tensor grad_v = transposed_heads_like(v);
  grad_v.copy_(at::matmul(dropped.transpose(-2, -1), dout));
  // d(softmax): dS = P * (dP - rowsum(dP * P)), dP = dO V^T (through the dropout).
  at::Tensor dprobs = at::matmul(dout, v.to(acc).transpose(-2, -1));
  if (keep.has_value()) {
    dprobs.mul_(*keep).div_(1.0 - dropout_p);
  }
  // rowsum(dO * O). For the forward's own results in `acc` precision, from the
  // probabilities rather than from `out`, which half/bfloat16 inputs have rounded;
  // otherwise from the given output (the one merged over every block of keys).
  const at::Tensor row = own ? (dprobs * probs).sum(-1, /*keepdim=*/true)
                             : (dout * given_out.to(acc)).sum(-1, /*keepdim=*/true);
  const at::Tensor dscores = probs * (dprobs - row);
  at::Tensor grad_q = transposed_heads_like(q);
  grad_q.copy_(at::matmul(dscores, k.to(acc)).mul_(s));
  at::Tensor grad_k = transposed_heads_like(k);
  grad_k.copy_(at::matmul(dscores.transpose(-2, -1), q.to(acc)).mul_(s));
  at::Tensor grad_bias;
  if (grad_input_mask[3] && attn_bias.has_value()) {
    const int64_t S = k.size(2);
    grad_bias =
        at::empty({q.size(0), q.size(1), q.size(2), (S + 15) / 16 * 16}, attn_bias->options())
            .narrow(-1, 0, S);
    grad_bias.copy_(dscores);
  }
  scope.commit();
  scope.write_back_lent();
  // The bias gradient lives where the bias does (a CPU bias keeps a CPU gradient).
  return {scope.to_spyre(grad_q), scope.to_spyre(grad_k), scope.to_spyre(grad_v),
          is_spyre(attn_bias_or_undefined) ? scope.to_spyre(grad_bias) : grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_scaled_dot_product_efficient_attention", TORCH_FN(efficient_attention));
  m.impl("_scaled_dot_product_efficient_attention_backward",
         TORCH_FN(efficient_attention_backward));
}

}  // namespace spyreccl::device

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &spyreccl::device::fused_sdp_choice)
}  // namespace at::native
