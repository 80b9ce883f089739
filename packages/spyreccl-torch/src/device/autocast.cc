// Automatic mixed precision (torch.autocast("spyre")) for the emulated device.
//
// Entering autocast for a device un-excludes its Autocast dispatch key; from
// then on every operator on spyre tensors passes through AutocastPrivateUse1.
// Operators without a kernel there fall through to the next key unchanged; the
// kernels below cast their floating-point tensor arguments first, as the
// policy says.
//
// Spyre operators run CPU kernels on host memory (fallback.cc), so the policy
// is CPU's: the operator lists mirror torch's AutocastCPU registrations for
// the torch version this library is built against (the parity test in
// tests/test_device_autocast.py compares the two sets, so a torch upgrade that
// changes CPU's lists fails loudly). Which ops run in lower precision, which
// are kept in float32 and which promote to the widest input type then match a
// CPU autocast run, value for value.
#include <ATen/autocast_mode.h>
#include <torch/library.h>
#include <torch/version.h>

namespace spyreccl::device {
namespace {

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  // Matrix products, convolutions and attention: in the autocast dtype
  // (lower_precision_fp), where CPU kernels have fast bfloat16/float16 paths.
  KERNEL_PRIVATEUSEONE(conv1d, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(conv1d, padding, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(conv2d, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(conv2d, padding, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(conv3d, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(conv3d, padding, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(conv_tbc, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(conv_transpose1d, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(conv_transpose2d, input, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(conv_transpose3d, input, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(_convolution, deprecated, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(mm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(bmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(matmul, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(linear, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(addmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(_addmm_activation, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(addbmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(baddbmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(linalg_vecdot, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(prelu, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(mkldnn_rnn_layer, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(scaled_dot_product_attention, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(_native_multi_head_attention, lower_precision_fp)

  // Numerically sensitive ops run in float32 whatever their inputs: losses,
  // reductions whose error grows with the extent, linear algebra, FFTs, some
  // pooling/padding and sampling ops.
  KERNEL_PRIVATEUSEONE(binary_cross_entropy, fp32)
  KERNEL_PRIVATEUSEONE(binary_cross_entropy_with_logits, fp32)
  KERNEL_PRIVATEUSEONE(cross_entropy_loss, fp32)
  KERNEL_PRIVATEUSEONE(nll_loss, fp32)
  KERNEL_PRIVATEUSEONE(nll_loss2d, fp32)
  KERNEL_PRIVATEUSEONE(mse_loss, fp32)
  KERNEL_PRIVATEUSEONE(l1_loss, fp32)
  KERNEL_PRIVATEUSEONE(smooth_l1_loss, fp32)
  KERNEL_PRIVATEUSEONE(huber_loss, fp32)
  KERNEL_PRIVATEUSEONE(kl_div, fp32)
  KERNEL_PRIVATEUSEONE(poisson_nll_loss, fp32)
  KERNEL_PRIVATEUSEONE(cosine_embedding_loss, fp32)
  KERNEL_PRIVATEUSEONE(hinge_embedding_loss, fp32)
  KERNEL_PRIVATEUSEONE(margin_ranking_loss, fp32)
  KERNEL_PRIVATEUSEONE(soft_margin_loss, fp32)
  KERNEL_PRIVATEUSEONE(triplet_margin_loss, fp32)
  KERNEL_PRIVATEUSEONE(multi_margin_loss, fp32)
  KERNEL_PRIVATEUSEONE(multilabel_margin_loss, fp32)
  KERNEL_PRIVATEUSEONE(multilabel_margin_loss_forward, fp32)
  KERNEL_PRIVATEUSEONE(ctc_loss, IntList, fp32)
  KERNEL_PRIVATEUSEONE(ctc_loss, Tensor, fp32)
  KERNEL_PRIVATEUSEONE(prod, fp32)
  KERNEL_PRIVATEUSEONE(prod, dim_int, fp32)
  KERNEL_PRIVATEUSEONE(trace, fp32)
  KERNEL_PRIVATEUSEONE(cdist, fp32)
  KERNEL_PRIVATEUSEONE(quantile, fp32)
  KERNEL_PRIVATEUSEONE(quantile, scalar, fp32)
  KERNEL_PRIVATEUSEONE(nanquantile, fp32)
  KERNEL_PRIVATEUSEONE(nanquantile, scalar, fp32)
  KERNEL_PRIVATEUSEONE(polar, fp32)
  KERNEL_PRIVATEUSEONE(view_as_complex, fp32)
  KERNEL_PRIVATEUSEONE(stft, fp32)
  KERNEL_PRIVATEUSEONE(stft, center, fp32)
  KERNEL_PRIVATEUSEONE(fft_fft, fp32)
  KERNEL_PRIVATEUSEONE(fft_ifft, fp32)
  KERNEL_PRIVATEUSEONE(fft_fft2, fp32)
  KERNEL_PRIVATEUSEONE(fft_ifft2, fp32)
  KERNEL_PRIVATEUSEONE(fft_fftn, fp32)
  KERNEL_PRIVATEUSEONE(fft_ifftn, fp32)
  KERNEL_PRIVATEUSEONE(fft_rfft, fp32)
  KERNEL_PRIVATEUSEONE(fft_irfft, fp32)
  KERNEL_PRIVATEUSEONE(fft_rfft2, fp32)
  KERNEL_PRIVATEUSEONE(fft_irfft2, fp32)
  KERNEL_PRIVATEUSEONE(fft_rfftn, fp32)
  KERNEL_PRIVATEUSEONE(fft_irfftn, fp32)
  KERNEL_PRIVATEUSEONE(fft_hfft, fp32)
  KERNEL_PRIVATEUSEONE(fft_ihfft, fp32)
  KERNEL_PRIVATEUSEONE(cholesky_inverse, fp32)
  KERNEL_PRIVATEUSEONE(cholesky_solve, fp32)
  KERNEL_PRIVATEUSEONE(inverse, fp32)
  KERNEL_PRIVATEUSEONE(pinverse, fp32)
  KERNEL_PRIVATEUSEONE(lu_solve, fp32)
  KERNEL_PRIVATEUSEONE(_lu_with_info, fp32)
  KERNEL_PRIVATEUSEONE(orgqr, fp32)
  KERNEL_PRIVATEUSEONE(ormqr, fp32)
  KERNEL_PRIVATEUSEONE(geqrf, fp32)
  KERNEL_PRIVATEUSEONE(svd, fp32)
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 14
  // Deprecated for torch.linalg's and removed from ATen in torch 2.14 (so from CPU's list).
  KERNEL_PRIVATEUSEONE(cholesky, fp32)
  KERNEL_PRIVATEUSEONE(qr, fp32)
#endif
  KERNEL_PRIVATEUSEONE(triangular_solve, fp32)
  KERNEL_PRIVATEUSEONE(linalg_cond, fp32)
  KERNEL_PRIVATEUSEONE(linalg_cond, p_str, fp32)
  KERNEL_PRIVATEUSEONE(linalg_matrix_rank, fp32)
  KERNEL_PRIVATEUSEONE(linalg_matrix_rank, tol_tensor, fp32)
  KERNEL_PRIVATEUSEONE(linalg_matrix_rank, atol_rtol_tensor, fp32)
  KERNEL_PRIVATEUSEONE(linalg_matrix_rank, atol_rtol_float, fp32)
  KERNEL_PRIVATEUSEONE(linalg_solve, fp32)
  KERNEL_PRIVATEUSEONE(linalg_cholesky, fp32)
  KERNEL_PRIVATEUSEONE(linalg_cholesky_ex, fp32)
  KERNEL_PRIVATEUSEONE(linalg_svd, fp32)
  KERNEL_PRIVATEUSEONE(linalg_svdvals, fp32)
  KERNEL_PRIVATEUSEONE(linalg_eig, fp32)
  KERNEL_PRIVATEUSEONE(linalg_eigh, fp32)
  KERNEL_PRIVATEUSEONE(linalg_eigvals, fp32)
  KERNEL_PRIVATEUSEONE(linalg_eigvalsh, fp32)
  KERNEL_PRIVATEUSEONE(linalg_inv, fp32)
  KERNEL_PRIVATEUSEONE(linalg_inv_ex, fp32)
  KERNEL_PRIVATEUSEONE(linalg_householder_product, fp32)
  KERNEL_PRIVATEUSEONE(linalg_qr, fp32)
  KERNEL_PRIVATEUSEONE(linalg_lstsq, fp32)
  KERNEL_PRIVATEUSEONE(linalg_tensorinv, fp32)
  KERNEL_PRIVATEUSEONE(linalg_tensorsolve, fp32)
  KERNEL_PRIVATEUSEONE(fake_quantize_per_tensor_affine, fp32)
  KERNEL_PRIVATEUSEONE(avg_pool3d, fp32)
  KERNEL_PRIVATEUSEONE(max_pool3d, fp32)
  KERNEL_PRIVATEUSEONE(adaptive_avg_pool3d, fp32)
  KERNEL_PRIVATEUSEONE(adaptive_max_pool3d, fp32)
  KERNEL_PRIVATEUSEONE(fractional_max_pool2d, fp32)
  KERNEL_PRIVATEUSEONE(fractional_max_pool3d, fp32)
  KERNEL_PRIVATEUSEONE(max_unpool2d, fp32)
  KERNEL_PRIVATEUSEONE(max_unpool3d, fp32)
  KERNEL_PRIVATEUSEONE(reflection_pad1d, fp32)
  KERNEL_PRIVATEUSEONE(reflection_pad2d, fp32)
  KERNEL_PRIVATEUSEONE(replication_pad1d, fp32)
  KERNEL_PRIVATEUSEONE(replication_pad2d, fp32)
  KERNEL_PRIVATEUSEONE(replication_pad3d, fp32)
  KERNEL_PRIVATEUSEONE(grid_sampler, fp32)
  KERNEL_PRIVATEUSEONE(grid_sampler_2d, fp32)
  KERNEL_PRIVATEUSEONE(_grid_sampler_2d_cpu_fallback, fp32)
  KERNEL_PRIVATEUSEONE(grid_sampler_3d, fp32)

  // Ops combining several tensors: promoted to the widest floating type among
  // their inputs, so that mixing autocast outputs with float32 tensors works.
  KERNEL_PRIVATEUSEONE(cat, promote)
  KERNEL_PRIVATEUSEONE(stack, promote)
  KERNEL_PRIVATEUSEONE(index_copy, promote)
}

}  // namespace
}  // namespace spyreccl::device
