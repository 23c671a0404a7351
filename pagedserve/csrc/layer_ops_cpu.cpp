// Per-token layer ops for CPU, each one pass over its rows instead of the 5-10 small
// PyTorch ops (and temporaries) of the Python versions in pagedserve/models/layers.py and
// pagedserve/attention/torch_attn.py, which they must match: at a decode step those ops
// cost more in dispatch than in arithmetic. Names follow vLLM's custom ops.
//
//   rms_norm(out, x, weight, eps)            out = weight * (x / sqrt(mean(x^2) + eps))
//   fused_add_rms_norm(out, x, delta, weight, eps)     x += delta, then rms_norm(out, x)
//   rotary_embedding(positions, q, k, cos, sin, rotary_dim, interleaved)   in place
//   reshape_and_cache(key, value, kv_cache, slot_mapping)                  K/V -> slots
//   silu_and_mul(out, gate_up)               out = silu(gate) * up
//
// Rounding follows the PyTorch code op by op (float32 statistics, a cast to the model
// dtype after each elementwise op), so bfloat16/float16 results equal it too.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"

namespace {

// Rows per parallel task: a decode step's few rows stay on one thread.
constexpr int64_t kGrain = 16;

// x as T. A float32 passes a barrier, so that fast-math cannot fuse a product and a sum
// into one FMA: PyTorch rounds after each op.
template <typename T>
inline T round_to(float x) {
  if constexpr (std::is_same_v<T, float>) asm("" : "+x"(x));
  return static_cast<T>(x);
}

template <typename scalar_t>
void rms_norm_row(scalar_t* out, const scalar_t* x, const scalar_t* w, int64_t H, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < H; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float r = 1.f / std::sqrt(sum / H + eps);
  for (int64_t i = 0; i < H; ++i) {
    const float normed = static_cast<float>(round_to<scalar_t>(static_cast<float>(x[i]) * r));
    out[i] = round_to<scalar_t>(static_cast<float>(w[i]) * normed);
  }
}

}  // namespace

// x, out [T, H] (rows may be strided, each row contiguous); weight [H].
// HF LlamaRMSNorm: variance in float32, x * rsqrt(variance + eps) cast to the dtype,
// then times the weight.
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "rms_norm: x and out [T, H] with contiguous rows, all of one dtype");
  const int64_t T = x.size(0), H = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        rms_norm_row(out.data_ptr<scalar_t>() + t * out.stride(0),
                     x.data_ptr<scalar_t>() + t * x.stride(0), w, H, static_cast<float>(eps));
    });
  });
}

// x [T, H] += delta [T, H] (contiguous, one dtype: PyTorch's add_, rounded to the dtype),
// then rms_norm(out, x, weight, eps), a row at a time: the residual add of a decoder layer
// and the next norm in one pass, bit-equal to the two ops. In a decode step the add alone
// ran on one thread (PyTorch keeps tensors under 32,768 elements on one) while the other
// waited. Raises (RuntimeError) on other shapes or dtypes.
void fused_add_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor delta,
                        torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && delta.is_contiguous() &&
                  delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: x and delta contiguous [T, H] of one dtype");
  TORCH_CHECK(out.stride(1) == 1 && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: out [T, H] with contiguous rows, weight [H], x's dtype");
  const int64_t T = x.size(0), H = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm",
                                  [&] {
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* row = x.data_ptr<scalar_t>() + t * H;
        const scalar_t* d = delta.data_ptr<scalar_t>() + t * H;
        for (int64_t i = 0; i < H; ++i)
          row[i] = round_to<scalar_t>(static_cast<float>(row[i]) + static_cast<float>(d[i]));
        rms_norm_row(out.data_ptr<scalar_t>() + t * out.stride(0), row, w, H,
                     static_cast<float>(eps));
      }
    });
  });
}

namespace {

// Rotates one head of `rotary_dim` leading channels in place by (cos, sin) rows.
// Neox ("rotate half") pairs i with i + rotary_dim/2; interleaved pairs 2i with 2i+1.
template <typename scalar_t, typename cos_t>
void rotate_head(scalar_t* x, const cos_t* cos, const cos_t* sin, int64_t rotary_dim,
                 bool interleaved) {
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    // cos/sin are cast to the dtype first, as the PyTorch code does
    const float ca = static_cast<float>(round_to<scalar_t>(static_cast<float>(cos[a])));
    const float cb = static_cast<float>(round_to<scalar_t>(static_cast<float>(cos[b])));
    const float sa = static_cast<float>(round_to<scalar_t>(static_cast<float>(sin[a])));
    const float sb = static_cast<float>(round_to<scalar_t>(static_cast<float>(sin[b])));
    const float xa = static_cast<float>(x[a]), xb = static_cast<float>(x[b]);
    // out_a = x_a cos_a + (-x_b) sin_a;  out_b = x_b cos_b + x_a sin_b
    const float ya = static_cast<float>(round_to<scalar_t>(xa * ca)) +
                     static_cast<float>(round_to<scalar_t>(-xb * sa));
    const float yb = static_cast<float>(round_to<scalar_t>(xb * cb)) +
                     static_cast<float>(round_to<scalar_t>(xa * sb));
    x[a] = round_to<scalar_t>(ya);
    x[b] = round_to<scalar_t>(yb);
  }
}

using pagedserve_vec::kLanes, pagedserve_vec::vf, pagedserve_vec::vu16, pagedserve_vec::loadv;
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));  // vf's bits

// x rounded to T (round_to's value, as float32): bfloat16 to nearest even, NaN to
// c10's 0x7FC0; float32 as is, behind a barrier so that fast-math cannot fuse a product
// and a sum into one FMA (PyTorch rounds each op).
template <typename T>
inline vf roundv(vf x) {
  if constexpr (std::is_same_v<T, float>) {
#ifdef __FMA__
    asm("" : "+v"(x));
#endif
    return x;
  } else {
    const vu bits = reinterpret_cast<const vu&>(x);
    const vu top = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    const vu out = x == x ? top : vu{} + 0x7FC00000u;
    return reinterpret_cast<const vf&>(out);
  }
}

// kLanes floats already rounded to T (roundv) stored as T.
template <typename T>
inline void store_rounded(T* p, vf x) {
  if constexpr (std::is_same_v<T, float>) {
    pagedserve_vec::storev(p, x);
  } else {
    const vu16 h = __builtin_convertvector(reinterpret_cast<const vu&>(x) >> 16, vu16);
    std::memcpy(p, &h, sizeof(h));
  }
}

// rotate_head for "rotate half" with rotary_dim / 2 a multiple of kLanes, for float32
// and bfloat16: the same roundings, a register of pairs at a time.
template <typename scalar_t, typename cos_t>
void rotate_half_vec(scalar_t* x, const cos_t* cos, const cos_t* sin, int64_t half) {
  auto r = [](vf v) { return roundv<scalar_t>(v); };
  for (int64_t i = 0; i < half; i += kLanes) {
    const vf ca = r(loadv(cos + i)), cb = r(loadv(cos + i + half));
    const vf sa = r(loadv(sin + i)), sb = r(loadv(sin + i + half));
    const vf xa = loadv(x + i), xb = loadv(x + i + half);
    store_rounded(x + i, r(r(xa * ca) + r(-xb * sa)));
    store_rounded(x + i + half, r(r(xb * cb) + r(xa * sb)));
  }
}

template <typename T>
constexpr bool kVectorRotary = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// rotate_head, a register of pairs at a time where the layout and dtypes allow it.
template <typename scalar_t, typename cos_t>
void rotate(scalar_t* x, const cos_t* cos, const cos_t* sin, int64_t rotary_dim,
            bool interleaved) {
  if constexpr (kVectorRotary<scalar_t> && kVectorRotary<cos_t>) {
    if (!interleaved && rotary_dim % (2 * kLanes) == 0)
      return rotate_half_vec(x, cos, sin, rotary_dim / 2);
  }
  rotate_head(x, cos, sin, rotary_dim, interleaved);
}

}  // namespace

namespace {

template <typename scalar_t, typename cos_t>
void rotate_rows(const int64_t* pos, torch::Tensor& q, torch::Tensor& k, const cos_t* cos,
                 const cos_t* sin, int64_t rotary_dim, bool interleaved) {
  const int64_t T = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2);
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const cos_t* c = cos + pos[t] * rotary_dim;
      const cos_t* s = sin + pos[t] * rotary_dim;
      scalar_t* qr = q.data_ptr<scalar_t>() + t * q.stride(0);
      scalar_t* kr = k.data_ptr<scalar_t>() + t * k.stride(0);
      for (int64_t h = 0; h < H; ++h) rotate(qr + h * D, c, s, rotary_dim, interleaved);
      for (int64_t h = 0; h < KVH; ++h) rotate(kr + h * D, c, s, rotary_dim, interleaved);
    }
  });
}

}  // namespace

// q [T, H, D], k [T, KVH, D] (rows may be strided, heads contiguous), rotated in place
// at positions [T] (int64) with cos/sin caches [max_positions, rotary_dim], float32 or
// the dtype of q (a model cast to bfloat16 casts its caches too).
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k,
                      torch::Tensor cos, torch::Tensor sin, int64_t rotary_dim,
                      bool interleaved) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) &&
                  k.stride(1) == k.size(2) && k.scalar_type() == q.scalar_type(),
              "rotary_embedding: q and k of one dtype with contiguous heads");
  TORCH_CHECK((cos.scalar_type() == at::kFloat || cos.scalar_type() == q.scalar_type()) &&
                  sin.scalar_type() == cos.scalar_type() && cos.is_contiguous() &&
                  sin.is_contiguous() && positions.scalar_type() == at::kLong,
              "rotary_embedding: contiguous cos/sin (float32 or q's dtype), int64 positions");
  const int64_t* pos = positions.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    if (cos.scalar_type() == at::kFloat)
      rotate_rows<scalar_t, float>(pos, q, k, cos.data_ptr<float>(), sin.data_ptr<float>(),
                                   rotary_dim, interleaved);
    else
      rotate_rows<scalar_t, scalar_t>(pos, q, k, cos.data_ptr<scalar_t>(),
                                      sin.data_ptr<scalar_t>(), rotary_dim, interleaved);
  });
}

// key/value [T, KVH, D] (rows may be strided) -> kv_cache [2, num_blocks, block_size,
// KVH, D] at slot_mapping [T] (block * block_size + offset; negative slots are skipped).
// The cache has the rows' dtype (copied) or bfloat16 (rounded to nearest even, as
// Tensor.to does).
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
                       torch::Tensor slot_mapping) {
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && kv_cache.is_contiguous() &&
                  (kv_cache.scalar_type() == key.scalar_type() ||
                   kv_cache.scalar_type() == at::kBFloat16),
              "reshape_and_cache: key and value of one dtype, a contiguous cache of that "
              "dtype or bfloat16");
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  TORCH_CHECK(key.stride(1) == key.size(2) && key.stride(2) == 1 &&
                  value.stride(1) == value.size(2) && value.stride(2) == 1 &&
                  kv_cache.size(3) * kv_cache.size(4) == row,
              "reshape_and_cache: contiguous heads matching the cache's [KVH, D]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "reshape_and_cache", [&] {
    auto write = [&](auto* k_dst) {  // k_dst: the cache's K half, typed
      auto* v_dst = k_dst + kv_cache.stride(0);
      const scalar_t* k_src = key.data_ptr<scalar_t>();
      const scalar_t* v_src = value.data_ptr<scalar_t>();
      auto rows = [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          if (slots[t] < 0) continue;
          const scalar_t* k = k_src + t * key.stride(0);
          const scalar_t* v = v_src + t * value.stride(0);
          auto* kd = k_dst + slots[t] * row;
          auto* vd = v_dst + slots[t] * row;
          using cache_t = std::remove_pointer_t<decltype(kd)>;
          if constexpr (std::is_same_v<cache_t, scalar_t>) {
            std::memcpy(kd, k, row * sizeof(scalar_t));
            std::memcpy(vd, v, row * sizeof(scalar_t));
          } else {
            for (int64_t i = 0; i < row; ++i) {
              kd[i] = static_cast<cache_t>(static_cast<float>(k[i]));
              vd[i] = static_cast<cache_t>(static_cast<float>(v[i]));
            }
          }
        }
      };
      // On threads: a first write into a page of the pool faults (the kernel zeroes it),
      // and two threads fault in parallel (2,048 rows into new pages: 0.38 against 0.59 ms).
      at::parallel_for(0, T, 8, rows);
    };
    if (kv_cache.scalar_type() == key.scalar_type())
      write(kv_cache.data_ptr<scalar_t>());
    else
      write(kv_cache.data_ptr<c10::BFloat16>());
  });
}

namespace {

#if defined(__AVX512F__) || defined(__AVX2__)
// The exponential PyTorch's vectorized CPU kernels use (Vectorized<float>::exp: SLEEF's
// 1-ulp expf, exported by libtorch_cpu), so that silu's bits are PyTorch's.
extern "C" {
#ifdef __AVX512F__
__m512 Sleef_expf16_u10(__m512);
#else
__m256 Sleef_expf8_u10(__m256);
#endif
}

inline vf exp_like_torch(vf x) {
#ifdef __AVX512F__
  return (vf)Sleef_expf16_u10((__m512)x);
#else
  return (vf)Sleef_expf8_u10((__m256)x);
#endif
}

// a / b as vdivps: fast-math would make it a reciprocal estimate and a Newton step (other
// bits), even where a function asks for no reciprocal math once inlined.
inline vf divide(vf a, vf b) {
  asm("vdivps %2, %1, %0" : "=v"(a) : "v"(a), "v"(b));
  return a;
}
#endif

// PyTorch's scalar silu (std::exp), for the elements its vectorized loop leaves to the
// scalar one; not vectorized, where GCC would call libmvec's expf instead.
__attribute__((noinline, optimize("no-tree-vectorize"))) float silu_scalar(float x) {
  return x / (1.f + std::exp(-x));
}

// out[0:I] = silu(gate[0:I]) * up[0:I] for one row, each op rounded to T as F.silu and
// the product round (silu: x / (1 + exp(-x)) in float32). PyTorch's elementwise loop
// takes two registers of T (2 * 16 floats, 2 * 32 bfloat16 with AVX-512) at a time and
// the rest one by one with std::exp: so does this.
template <typename T>
void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t I) {
  int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  constexpr int64_t kStep = 2 * (sizeof(T) == 2 ? 2 * kLanes : kLanes);
  const int64_t vectorized = I - I % kStep;
  for (; i < vectorized; i += kLanes) {
    const vf x = loadv(gate + i);
    const vf silu = roundv<T>(divide(x, 1.f + exp_like_torch(-x)));
    store_rounded(out + i, roundv<T>(silu * loadv(up + i)));
  }
#endif
  for (; i < I; ++i)
    out[i] = static_cast<T>(static_cast<float>(static_cast<T>(silu_scalar(gate[i]))) *
                            static_cast<float>(up[i]));
}

}  // namespace

// out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:] for gate_up [T, 2 * I] (rows may be
// strided), float32 or bfloat16: the bits of F.silu(gate) * up in one pass (vLLM's
// SiluAndMul) instead of two ops and a temporary. Raises (RuntimeError) on other dtypes
// or shapes.
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && out.dim() == 2 && gate_up.stride(1) == 1 &&
                  out.stride(1) == 1 && gate_up.size(0) == out.size(0) &&
                  gate_up.size(1) == 2 * out.size(1) &&
                  out.scalar_type() == gate_up.scalar_type() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "silu_and_mul: out [T, I] and gate_up [T, 2 * I] with contiguous rows, both "
              "float32 or both bfloat16");
  const int64_t T = out.size(0), I = out.size(1);
  // PyTorch's grain for elementwise ops (32,768 elements), in rows
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(I, 1));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out.scalar_type(), "silu_and_mul", [&] {
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gate = gate_up.data_ptr<scalar_t>() + t * gate_up.stride(0);
        silu_and_mul_row(out.data_ptr<scalar_t>() + t * out.stride(0), gate, gate + I, I);
      }
    });
  });
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("rms_norm", &rms_norm);
  m.def("fused_add_rms_norm", &fused_add_rms_norm);
  m.def("rotary_embedding", &rotary_embedding);
  m.def("reshape_and_cache", &reshape_and_cache);
  m.def("silu_and_mul", &silu_and_mul);
}
