// FP4 quantization at load, on CPU (torch.ops.pagedserve.quantize_mxfp4 / quantize_nvfp4):
// float32 weights -> MXFP4 blocks or NVFP4 codes and scales, the formats and rules of
// pagedserve/quantization/fp4_formats.py (its docstring cites the specs):
//   elements: E2M1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), nearest, ties to even, clamped;
//   MXFP4 (OCP MX v1.0, section 6.3): per 32, E8M0 e = floor(log2(max|v|)) - 2 + 127;
//   NVFP4 (NVIDIA): per 16, E4M3 s = E4M3(max|v| / (6 g)), g the tensor's scale (given).
// With search, each block's scale is then the one of least squared error among the rule's
// and its neighbours (MXFP4: e - 1, e + 1; NVFP4: the 4 E4M3 codes either side), the
// elements still rounded to nearest for the scale chosen: the format is unchanged, the
// error lower (as ggml's k-quant quantizers search their scales, make_qkx2_quants). The
// rule's scale stays unless another is strictly better.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int kMXBlock = 32, kNVBlock = 16;
constexpr int kE4M3MaxCode = 0x7E;  // 448; 0x7F is NaN

#define PRECISE __attribute__((optimize("no-fast-math", "fp-contract=off")))

// 1.5 * 2^23: for 0 <= v <= 2^22, (v + kRoundMagic) - kRoundMagic is v rounded to the
// nearest integer, ties to even (the FPU's default mode); unlike std::nearbyint (a libm
// call) it vectorizes. Fast-math is off (PRECISE) so that the compiler keeps it.
constexpr float kRoundMagic = 12582912.f;

// The E2M1 value nearest x, ties to the even code, |x| clamped to 6, and its code (bit 3
// the sign, x < 0). The three spans have steps 0.5, 1 and 2, so rounding x / step to the
// nearest integer gives the code's offset; a tie between spans (1.75, 3.5) rounds up to
// the even code, as the span above would. Branch-free so that loops of it vectorize, and
// built-ins only: a PRECISE function does not inline std::min or std::fabs (compiled with
// other options), which left the loops scalar and 8x slower.
PRECISE inline float e2m1_round(float x, uint8_t* code) {
  const float a = __builtin_fabsf(x), m = a < 6.f ? a : 6.f;
  const float per_step = m < 2.f ? 2.f : m < 4.f ? 1.f : 0.5f;
  const float base = m < 2.f ? 0.f : m < 4.f ? 2.f : 4.f;
  const float q = (m * per_step + kRoundMagic) - kRoundMagic;
  *code = static_cast<uint8_t>(static_cast<int>(base + q) | (x < 0.f ? 8 : 0));
  const float value = q / per_step;  // exact: per_step is a power of two
  return x < 0.f ? -value : value;
}

// Codes of the N values v / step (all 0 where step is 0), and their squared error summed
// in index order.
template <int N>
PRECISE float quantize_block(const float* v, float step, uint8_t* codes) {
  float sq[N];
  const float safe = step > 0.f ? step : 1.f;
  for (int j = 0; j < N; ++j) {
    const float value = e2m1_round(v[j] / safe, &codes[j]) * step;
    sq[j] = (value - v[j]) * (value - v[j]);
    if (!(step > 0.f)) codes[j] = 0;
  }
  float err = 0.f;
  for (int j = 0; j < N; ++j) err += sq[j];
  return err;
}

float abs_max(const float* v, int n) {
  float m = 0.f;
  for (int j = 0; j < n; ++j) m = std::max(m, std::fabs(v[j]));
  return m;
}

// Codes of an MXFP4 block at the scale 2^(e - 127) (exact in float32, subnormal below
// e = 1), and their squared error.
float mxfp4_codes(const float* v, int e, uint8_t* codes) {
  return quantize_block<kMXBlock>(v, std::ldexp(1.f, e - 127), codes);
}

// One MXFP4 block: e, then 16 bytes, element j in the low nibble of byte j, 16 + j high.
void mxfp4_block(const float* v, bool search, uint8_t* out) {
  const float amax = abs_max(v, kMXBlock);
  int e = 0;
  if (amax > 0.f) {
    int exp;
    std::frexp(amax, &exp);  // amax = f 2^exp, 0.5 <= f < 1: floor(log2(amax)) = exp - 1
    e = std::clamp(exp - 1 - 2 + 127, 0, 254);
  }
  uint8_t codes[kMXBlock], trial[kMXBlock];
  float best = mxfp4_codes(v, e, codes);
  if (search && amax > 0.f)
    for (int ex : {e + 1, e - 1}) {
      if (ex < 0 || ex > 254) continue;
      const float err = mxfp4_codes(v, ex, trial);
      if (err < best) {
        best = err;
        e = ex;
        std::copy(trial, trial + kMXBlock, codes);
      }
    }
  out[0] = static_cast<uint8_t>(e);
  for (int j = 0; j < kMXBlock / 2; ++j)
    out[1 + j] = static_cast<uint8_t>(codes[j] | (codes[j + kMXBlock / 2] << 4));
}

// One NVFP4 block: its E4M3 scale's bits, its codes.
uint8_t nvfp4_block(const float* v, float global_scale, bool search, uint8_t* codes) {
  const float wanted = abs_max(v, kNVBlock) / (6.f * global_scale);
  const c10::Float8_e4m3fn rule(std::min(wanted, 448.f));  // nearest, ties to even
  const int rule_code = rule.x;
  int code = rule_code;
  float best = quantize_block<kNVBlock>(v, static_cast<float>(rule) * global_scale, codes);
  if (search && rule_code > 0) {
    uint8_t trial[kNVBlock];
    const int last = std::min(kE4M3MaxCode, rule_code + 4);
    for (int c = std::max(1, rule_code - 4); c <= last; ++c) {
      if (c == rule_code) continue;
      const float scale = static_cast<float>(
          c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
      const float err = quantize_block<kNVBlock>(v, scale * global_scale, trial);
      if (err < best) {
        best = err;
        code = c;
        std::copy(trial, trial + kNVBlock, codes);
      }
    }
  }
  return static_cast<uint8_t>(code);
}

void check_weight(const torch::Tensor& w, int block, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_cpu(), op,
              ": expected a float32 [N, K] CPU tensor");
  TORCH_CHECK(w.size(1) % block == 0, op, ": K = ", w.size(1), " is not a multiple of ", block);
}

}  // namespace

// w float32 [N, K] (K a multiple of 32) -> MXFP4 blocks uint8 [N, K / 32 * 17], ggml's
// block_mxfp4 bytes. Raises (RuntimeError) on another dtype or shape.
torch::Tensor quantize_mxfp4(torch::Tensor w, bool search) {
  check_weight(w, kMXBlock, "quantize_mxfp4");
  w = w.contiguous();
  const int64_t blocks = w.numel() / kMXBlock;
  auto out = torch::empty({w.size(0), w.size(1) / kMXBlock * 17}, torch::kByte);
  const float* v = w.data_ptr<float>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) mxfp4_block(v + b * kMXBlock, search, o + b * 17);
  });
  return out;
}

// w float32 [N, K] (K a multiple of 16), global_scale g > 0 -> (codes uint8 [N, K], E4M3
// scale bits uint8 [N, K / 16]). Raises (RuntimeError) on another dtype or shape.
std::tuple<torch::Tensor, torch::Tensor> quantize_nvfp4(torch::Tensor w, double global_scale,
                                                        bool search) {
  check_weight(w, kNVBlock, "quantize_nvfp4");
  TORCH_CHECK(global_scale > 0, "quantize_nvfp4: global_scale must be > 0");
  w = w.contiguous();
  const int64_t blocks = w.numel() / kNVBlock;
  auto codes = torch::empty({w.size(0), w.size(1)}, torch::kByte);
  auto scales = torch::empty({w.size(0), w.size(1) / kNVBlock}, torch::kByte);
  const float* v = w.data_ptr<float>();
  const float g = static_cast<float>(global_scale);
  uint8_t* c = codes.data_ptr<uint8_t>();
  uint8_t* s = scales.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      s[b] = nvfp4_block(v + b * kNVBlock, g, search, c + b * kNVBlock);
  });
  return {codes, scales};
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("quantize_mxfp4", &quantize_mxfp4);
  m.def("quantize_nvfp4", &quantize_nvfp4);
}
