// Fused RNN cells for spyre.
//
// ATen's LSTM and GRU layers (nn.LSTM, nn.GRU, and the cell modules through _VF) call the
// fused cell ops aten::_thnn_fused_{lstm,gru}_cell for every device that is not the CPU
// (RNN.cpp: cuda, xpu and privateuseone), and those ops only have CUDA and XPU kernels: on
// spyre the zero-copy CPU fallback found no kernel and nn.LSTM failed outright. These are the
// spyre kernels, written with ATen operators on the gates (the same arithmetic as CPU's
// unfused cell, which adds the biases to each product before the sum instead of after).
//
// The autograd formulas are torch's: under grad mode (create_graph) torch differentiates its
// composite _thnn_differentiable_*_cell_backward; otherwise it calls the backward ops below,
// which read what the forward kept in `workspace`:
//   LSTM: the activated gates [i, f, g, o] (batch, 4 hidden);
//   GRU:  [r, z, n, hx, hn] (batch, 5 hidden), hn being the hidden part of the new gate.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace spyreccl::device {
namespace {

void check_cell(const char* op, const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                const at::Tensor& state, int64_t gates) {
  TORCH_CHECK(input_gates.dim() == 2 && hidden_gates.sizes() == input_gates.sizes(), op,
              ": input_gates and hidden_gates must be (batch, ", gates,
              " * hidden) matrices of one shape, got ", input_gates.sizes(), " and ",
              hidden_gates.sizes());
  TORCH_CHECK(state.dim() == 2 && state.size(0) == input_gates.size(0) &&
                  state.size(1) * gates == input_gates.size(1),
              op, ": the state must be (batch, hidden) = (", input_gates.size(0), ", ",
              input_gates.size(1) / gates, "), got ", state.sizes());
}

at::Tensor with_bias(const at::Tensor& gates, const std::optional<at::Tensor>& bias) {
  return bias.has_value() && bias->defined() ? gates + *bias : gates;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  check_cell("_thnn_fused_lstm_cell", input_gates, hidden_gates, cx, 4);
  const auto parts =
      (with_bias(input_gates, input_bias) + with_bias(hidden_gates, hidden_bias)).chunk(4, 1);
  at::Tensor i = parts[0].sigmoid();
  at::Tensor f = parts[1].sigmoid();
  at::Tensor g = parts[2].tanh();
  at::Tensor o = parts[3].sigmoid();
  at::Tensor cy = f * cx + i * g;
  at::Tensor hy = o * cy.tanh();
  return {hy, cy, at::cat({i, f, g, o}, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell_backward_impl(
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy,
    const at::Tensor& cx, const at::Tensor& cy, const at::Tensor& workspace, bool has_bias) {
  const bool have_hy = grad_hy.has_value() && grad_hy->defined();
  const bool have_cy = grad_cy.has_value() && grad_cy->defined();
  if (!have_hy && !have_cy) return {};  // nothing flows back (as torch's kernels)
  const auto gates = workspace.chunk(4, 1);
  const at::Tensor &i = gates[0], &f = gates[1], &g = gates[2], &o = gates[3];
  const at::Tensor tanh_cy = cy.tanh();
  // The gradient reaching the cell state: from cy directly and through hy = o * tanh(cy).
  at::Tensor d_cy = have_cy ? *grad_cy : at::zeros_like(cy);
  at::Tensor d_o;
  if (have_hy) {
    d_cy = d_cy + *grad_hy * o * (1 - tanh_cy * tanh_cy);
    d_o = *grad_hy * tanh_cy * o * (1 - o);
  } else {
    d_o = at::zeros_like(o);
  }
  at::Tensor d_i = d_cy * g * i * (1 - i);
  at::Tensor d_f = d_cy * cx * f * (1 - f);
  at::Tensor d_g = d_cy * i * (1 - g * g);
  at::Tensor grad_gates = at::cat({d_i, d_f, d_g, d_o}, 1);
  at::Tensor grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  return {grad_gates, d_cy * f, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> fused_gru_cell(const at::Tensor& input_gates,
                                                  const at::Tensor& hidden_gates,
                                                  const at::Tensor& hx,
                                                  const std::optional<at::Tensor>& input_bias,
                                                  const std::optional<at::Tensor>& hidden_bias) {
  check_cell("_thnn_fused_gru_cell", input_gates, hidden_gates, hx, 3);
  const auto in = with_bias(input_gates, input_bias).chunk(3, 1);
  const auto hid = with_bias(hidden_gates, hidden_bias).chunk(3, 1);
  at::Tensor r = (in[0] + hid[0]).sigmoid();
  at::Tensor z = (in[1] + hid[1]).sigmoid();
  const at::Tensor& hn = hid[2];
  at::Tensor n = (in[2] + r * hn).tanh();
  at::Tensor hy = n + z * (hx - n);  // (1 - z) * n + z * hx
  return {hy, at::cat({r, z, n, hx, hn}, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  const auto saved = workspace.chunk(5, 1);
  const at::Tensor &r = saved[0], &z = saved[1], &n = saved[2], &hx = saved[3], &hn = saved[4];
  at::Tensor d_n = grad_hy * (1 - z) * (1 - n * n);  // through the new gate's tanh
  at::Tensor d_z = grad_hy * (hx - n) * z * (1 - z);
  at::Tensor d_r = d_n * hn * r * (1 - r);
  at::Tensor grad_input_gates = at::cat({d_r, d_z, d_n}, 1);
  at::Tensor grad_hidden_gates = at::cat({d_r, d_z, d_n * r}, 1);
  at::Tensor grad_hx = grad_hy * z;
  at::Tensor grad_input_bias = has_bias ? grad_input_gates.sum(0) : at::Tensor();
  at::Tensor grad_hidden_bias = has_bias ? grad_hidden_gates.sum(0) : at::Tensor();
  return {grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias};
}

}  // namespace
}  // namespace spyreccl::device

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace spyreccl::device;
  m.impl("_thnn_fused_lstm_cell", TORCH_FN(fused_lstm_cell));
  m.impl("_thnn_fused_lstm_cell_backward_impl", TORCH_FN(fused_lstm_cell_backward_impl));
  m.impl("_thnn_fused_gru_cell", TORCH_FN(fused_gru_cell));
  m.impl("_thnn_fused_gru_cell_backward", TORCH_FN(fused_gru_cell_backward));
}
