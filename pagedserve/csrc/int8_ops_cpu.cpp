// The element-wise halves of the int8 W8A8 linear (pagedserve/quantization/int8.py), each one
// pass over its rows instead of the 4-5 PyTorch ops (and temporaries) of the Python code,
// which they must equal bit for bit: at a decode step those ops cost more in dispatch
// than in arithmetic.
//
//   quantize_rows_int8(x [R, K]) -> (q int8 [R, K], scale float32 [R, 1])
//       scale = max|x| / 127, q = round_half_even(x * (1 / max(max|x|, FLT_MIN) * 127))
//   int8_scaled_mm_epilogue(acc int32 [M, N], x_scale [M, 1], w_scale [N], bias?, dtype)
//       out = ((float(acc) * x_scale[m]) * w_scale[n] + bias[n]) cast to dtype
//
// The operations and their order are the Python code's, in float32; fast-math is off for
// this file's functions (and no fused multiply-add) so the compiler keeps that order.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <tuple>

#define PRECISE __attribute__((optimize("no-fast-math", "fp-contract=off")))

namespace {

constexpr int64_t kGrain = 16;  // rows per parallel task: a decode step stays on one thread

// 1.5 * 2^23: for |v| <= 2^22, (v + kRoundMagic) - kRoundMagic is v rounded half to even
// (the FPU's default mode rounds the sum to the unit of its last place), as torch.round.
// Here |v| <= 127. Unlike std::nearbyint, a libm call per element here, it vectorizes.
constexpr float kRoundMagic = 12582912.f;

// Not inlined, so that no re-association (fast-math) can fold `inv` back into a division.
template <typename scalar_t>
PRECISE __attribute__((noinline)) void round_scaled(const scalar_t* x, int64_t K, float inv,
                                                    int8_t* q) {
  for (int64_t k = 0; k < K; ++k) {
    const float v = static_cast<float>(x[k]) * inv;
    q[k] = static_cast<int8_t>(static_cast<int32_t>((v + kRoundMagic) - kRoundMagic));
  }
}

// 1 / a rounded once to float32 (via double: exact for one division); not inlined, so that
// fast-math cannot fold `reciprocal(a) * 127` back into `127 / a`.
PRECISE __attribute__((noinline)) float reciprocal(float a) {
  return static_cast<float>(1.0 / static_cast<double>(a));
}

template <typename scalar_t>
PRECISE void quantize_row(const scalar_t* x, int64_t K, int8_t* q, float* scale) {
  // max |x| over 8 lanes, then across them (max is exact in any order): std::max and
  // std::fabs spelled out, which the compiler inlines and vectorizes here.
  float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    for (int i = 0; i < 8; ++i) {
      const float v = static_cast<float>(x[k + i]);
      const float a = v < 0.f ? -v : v;
      lane[i] = lane[i] < a ? a : lane[i];
    }
  for (; k < K; ++k) {
    const float v = static_cast<float>(x[k]);
    const float a = v < 0.f ? -v : v;
    lane[0] = lane[0] < a ? a : lane[0];
  }
  float absmax = 0.f;
  for (int i = 0; i < 8; ++i) absmax = absmax < lane[i] ? lane[i] : absmax;
  *scale = static_cast<float>(static_cast<double>(absmax) / 127.0);  // one rounding, as torch
  // PyTorch evaluates `127 / absmax` as `absmax.reciprocal() * 127` (Tensor.__rtruediv__):
  // two float32 roundings, not one, so the same here.
  const float inv = reciprocal(std::max(absmax, FLT_MIN)) * 127.f;
  round_scaled(x, K, inv, q);
}

template <typename out_t, typename bias_t>
PRECISE void epilogue_row(const int32_t* acc, float xs, const float* ws, const bias_t* bias,
                          int64_t N, out_t* out) {
  for (int64_t n = 0; n < N; ++n) {
    float v = static_cast<float>(acc[n]) * xs;
    v = v * ws[n];
    if (bias != nullptr) v = v + static_cast<float>(bias[n]);
    out[n] = static_cast<out_t>(v);
  }
}

}  // namespace

// x: float32 / bfloat16 / float16 [R, K], rows contiguous. Raises on another dtype or shape.
std::tuple<torch::Tensor, torch::Tensor> quantize_rows_int8(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2, "quantize_rows_int8: x must be [R, K]");
  x = x.contiguous();
  const int64_t R = x.size(0), K = x.size(1);
  auto q = torch::empty({R, K}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({R, 1}, x.options().dtype(torch::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    at::parallel_for(0, R, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * K, K, qp + r * K, sp + r);
    });
  });
  return {q, scale};
}

// acc: int32 [M, N] (torch._int_mm's result); x_scale: float32 [M, 1]; w_scale: float32
// [N]; bias: [N] in any float dtype, or None. Returns [M, N] in `dtype`.
torch::Tensor int8_scaled_mm_epilogue(torch::Tensor acc, torch::Tensor x_scale,
                                      torch::Tensor w_scale, std::optional<torch::Tensor> bias,
                                      at::ScalarType dtype) {
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.dim() == 2 && acc.is_contiguous(),
              "int8_scaled_mm_epilogue: acc must be a contiguous int32 [M, N] tensor");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(x_scale.scalar_type() == at::kFloat && x_scale.numel() == M &&
                  w_scale.scalar_type() == at::kFloat && w_scale.numel() == N,
              "int8_scaled_mm_epilogue: float32 scales of M and N elements");
  x_scale = x_scale.contiguous();
  w_scale = w_scale.contiguous();
  auto out = torch::empty({M, N}, acc.options().dtype(dtype));
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "int8_scaled_mm_epilogue: bias of N elements");
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xs = x_scale.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "epilogue", [&] {
    using out_t = scalar_t;
    out_t* op = out.data_ptr<out_t>();
    const at::ScalarType bias_type = b.defined() ? b.scalar_type() : dtype;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bias_type, "bias", [&] {
      const scalar_t* bp = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
      at::parallel_for(0, M, kGrain, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m)
          epilogue_row(ap + m * N, xs[m], ws, bp, N, op + m * N);
      });
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("quantize_rows_int8", &quantize_rows_int8);
  m.def("int8_scaled_mm_epilogue", &int8_scaled_mm_epilogue);
}
