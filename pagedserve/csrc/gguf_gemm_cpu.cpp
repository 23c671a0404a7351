// GGUF-quantized matrix multiply with 8-bit activations, for CPU
// (torch.ops.pagedserve.ggml_mul_mat_a8):  out[M, N] = x[M, K] @ W^T,
// W [N, K] kept as GGUF blocks (Q4_1, Q8_0, or FP4: MXFP4 and NVFP4) repacked at load,
// x float32 or bfloat16 (out in x's dtype).
// For decode steps (1 to some tens of rows of x) the step is bound by reading W, whose
// blocks are 3.2x (Q8_0) to 6.4x (Q4_1) smaller than float32, and by the products, which
// run as 8-bit integer dot products (4x the multiply-adds of a float32 FMA per instruction).
//
// Block formats (ggml's ggml-common.h block_q4_1 / block_q8_0; gguf-py's quants.py):
//   Q4_1 (ggml_type 3), 32 weights: fp16 d, fp16 m, 16 bytes qs; weight j < 16 is the low
//        nibble of qs[j], weight j >= 16 the high nibble of qs[j - 16]; w = d * q + m.
//   Q8_0 (ggml_type 8), 32 weights: fp16 d, int8 qs[32]; w = d * q.
//   MXFP4 (ggml_type 39, block_mxfp4; OCP MX v1.0), 32 weights: E8M0 e, 16 bytes qs (nibbles
//        as Q4_1's), each an E2M1 code c; w = 2^(e - 128) * kv[c], kv = the E2M1 values
//        doubled (0, 1, 2, 3, 4, 6, 8, 12, then negated; ggml's kvalues_mxfp4).
//   NVFP4 (type 40 here: the kernel's own rows, quantization/fp4_formats.py), 32 weights:
//        fp16 s0, fp16 s1, 16 bytes qs as MXFP4's; w = r * s * kv[c] with s = s0 for
//        weights 0..15, s1 for 16..31 (an E4M3 block scale halved) and r the row's
//        float32 scale (NVFP4's tensor scale), one per row after the tile's blocks.
//
// As llama.cpp's CPU backend and vLLM's GGUF kernels (ggml_mul_mat_vec_a8) do, each row of
// x is first quantized per block of 32 (block_q8_1's idea, with float32 scales; 16 or 8
// values a register at a time):
//   da = max|x| / 127,  a = round_half_even(x * (1 / da)),  sa = da * sum(a),
// and a weight block meets its activation block as one integer dot product:
//   Q4_1: sum_j (d q_j + m)(da a_j) = d da sum_j q_j a_j + m sa;   Q8_0: d da sum_j q_j a_j;
//   FP4: the code's value by a 16-entry table lookup (vpshufb) as kv[c] + 12 (unsigned, for
//   vpdpbusd), sum_j (kv_j + 12) a_j - 12 sum_j a_j, times s da per half block (NVFP4) or
//   block (MXFP4), and NVFP4's r at the end.
// Integer sums are exact; the error is x's rounding to 8 bits per block.
//
// Repacked layout (repack_blocks in quantization/gguf.py; the same bytes as GGUF's, moved):
// the rows in tiles of kTileRows = 16, and per tile, block after block: the 16 rows' scales
// d (fp16), for Q4_1 their 16 mins m, then their quants in chunks of 4 bytes, chunk-major:
// [chunk c][row r][qs bytes 4c..4c+3] (4 chunks for Q4_1 and FP4, 8 for Q8_0). NVFP4's
// scales are the 16 rows' s0 then their s1 (Q4_1's d and m places), and its tile ends with
// the 16 rows' r (float32). An MXFP4 tile holds every block's 16 bytes e first (padded to
// 64 bytes), then every block's quants (MXFP4Layout says why). One 64-byte load
// then holds 4 quant bytes of each of the 16 rows, i.e. one 32-bit lane per output row:
// a VNNI dot product (vpdpbusd) against 4 activation bytes broadcast to every lane adds
// 4 products to each of the 16 rows' sums, and a block's 8 such steps leave its 16 integer
// dot products in one register, in output order: no horizontal sums (the layout of
// llama.cpp's repacked "q4_0_8x8" GEMM kernels, here with 16 rows per 512-bit register).
// For 4-bit types the chunk's low nibbles are quants 4c..4c+3, its high ones 16+4c..19+4c.
//
// At load (one pass over the bytes each, where PyTorch code made 4-6 with temporaries):
//   dequantize_gguf_blocks(blocks uint8 [R, K / 32 * type_size], type) -> float32 [R, K]
//       w = d * q + m (Q4_1), w = d * q (Q8_0), a product then a sum in float32 as
//       gguf-py's quants.py computes them, so bit-equal to it;
//   repack_gguf_blocks(rows uint8 [N, K / 32 * type_size], type) -> uint8 [N / 16, ...]
//       the rows in the repacked layout above.
// And per step, for an embedding kept as blocks (quantization/gguf.py, GGUFEmbedding):
//   ggml_get_rows(qweight, ids int64 [T], type) -> float32 [T, K], rows ids of W

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "work_sharing.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PAGEDSERVE_A8_AVX512 1
#include "amx_tiles.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDSERVE_A8_AVX2 1
#endif

#define PRECISE __attribute__((optimize("no-fast-math", "fp-contract=off")))

namespace {

constexpr int64_t kBlock = 32;         // weights per block (QK4_1 == QK8_0 == 32)
constexpr int64_t kTileRows = 16;      // output rows per tile
constexpr int64_t kMaxRowsPerPass = 8;  // rows of x sharing one pass over a tile
constexpr int64_t kPrefetchBytes = 1536;  // how far ahead in W to prefetch
constexpr int64_t kDequantGrain = 256;    // blocks per parallel task of dequantize_gguf_blocks

enum GGMLType : int64_t { kQ4_1 = 3, kQ8_0 = 8, kMXFP4 = 39, kNVFP4 = 40 };

// The next tile's bytes, asked for into L2 a share per block step of the passes after a
// tile's first. A pass's own prefetch (kPrefetchBytes ahead) streams W for one pass; with
// more passes (over kMaxRowsPerPass rows of x) the first pass over each tile waited for
// memory while the others ran from cache (SmolLM2's block weights, cold, 1.07-1.27x at
// 16-64 rows, Zen 5).
struct NextTile {
  const uint8_t* bytes = nullptr;  // none: the last tile of the thread, or a single pass
  int64_t lines_per_step = 0, first_step = 0, lines = 0;
  inline void prefetch(int64_t b) const {
    if (bytes == nullptr) return;
    const int64_t from = (first_step + b) * lines_per_step;
    for (int64_t i = from; i < std::min(lines, from + lines_per_step); ++i)
      __builtin_prefetch(bytes + 64 * i, 0, 2);
  }
};

// E2M1 codes -> their values doubled (ggml's kvalues_mxfp4), and those plus kFP4Bias, so
// that vpdpbusd takes them unsigned.
constexpr int32_t kFP4Bias = 12;
struct FP4Table { alignas(16) int8_t v[16]; };
constexpr FP4Table kFP4Values = {{0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}};
constexpr FP4Table kFP4Biased = [] {
  FP4Table t{};
  for (int c = 0; c < 16; ++c) t.v[c] = static_cast<int8_t>(kFP4Values.v[c] + kFP4Bias);
  return t;
}();

// 4 activation quants read as one int32 (to broadcast them to every lane): allowed to
// alias the int8 array, and the compiler folds the read into the dot product's operand.
typedef int32_t int32_as_bytes __attribute__((may_alias, aligned(1)));

// A tile's bytes per block: its 16 rows' scale fields (d, and m for Q4_1), then quants;
// and after its blocks (kTailBytes): NVFP4's row scales. MXFP4's blocks of 16 + 256 bytes
// would put every other 64-byte quant load across two cache lines (1.5x slower decodes),
// so its tile holds all its blocks' scales first (padded to 64 bytes), then their quants.
struct Q4_1Layout {
  static constexpr int64_t kScaleBytes = 2 * 2 * kTileRows, kQuantBytes = 16 * kTileRows;
  static constexpr int64_t kScaleField = 2, kTailBytes = 0;
  static constexpr bool kScalesFirst = false;
};
struct Q8_0Layout {
  static constexpr int64_t kScaleBytes = 2 * kTileRows, kQuantBytes = 32 * kTileRows;
  static constexpr int64_t kScaleField = 2, kTailBytes = 0;
  static constexpr bool kScalesFirst = false;
};
struct MXFP4Layout {
  static constexpr int64_t kScaleBytes = kTileRows, kQuantBytes = 16 * kTileRows;
  static constexpr int64_t kScaleField = 1, kTailBytes = 0;
  static constexpr bool kScalesFirst = true;
};
struct NVFP4Layout : Q4_1Layout {
  static constexpr int64_t kTailBytes = 4 * kTileRows;
};

template <typename Layout>
constexpr int64_t tile_block_bytes() { return Layout::kScaleBytes + Layout::kQuantBytes; }

constexpr int64_t pad64(int64_t n) { return (n + 63) / 64 * 64; }

// Offsets in a tile of nb blocks: block b's scales, its quants; the tail; the tile's size.
template <typename L>
constexpr int64_t scale_offset(int64_t nb, int64_t b) {
  return L::kScalesFirst ? b * L::kScaleBytes : b * tile_block_bytes<L>();
}
template <typename L>
constexpr int64_t quant_offset(int64_t nb, int64_t b) {
  return L::kScalesFirst ? pad64(nb * L::kScaleBytes) + b * L::kQuantBytes
                         : b * tile_block_bytes<L>() + L::kScaleBytes;
}
template <typename L>
constexpr int64_t tail_offset(int64_t nb) {
  return L::kScalesFirst ? pad64(nb * L::kScaleBytes) + nb * L::kQuantBytes
                         : nb * tile_block_bytes<L>();
}
template <typename L>
constexpr int64_t tile_bytes_of(int64_t nb) { return tail_offset<L>(nb) + L::kTailBytes; }

// f(T{}) for the one of the four given types that stands for `type` (one of GGMLType, in
// its order): its block layout (with_layout), or, below, its kernel format.
template <typename Q4_1T, typename Q8_0T, typename MXFP4T, typename NVFP4T, typename F>
auto with_type(int64_t type, F f) {
  switch (type) {
    case kQ4_1: return f(Q4_1T{});
    case kQ8_0: return f(Q8_0T{});
    case kMXFP4: return f(MXFP4T{});
    default: return f(NVFP4T{});
  }
}

template <typename F>
auto with_layout(int64_t type, F f) {
  return with_type<Q4_1Layout, Q8_0Layout, MXFP4Layout, NVFP4Layout>(type, f);
}

inline bool is_kernel_type(int64_t type) {
  return type == kQ4_1 || type == kQ8_0 || type == kMXFP4 || type == kNVFP4;
}

// A tile's bytes for rows of K weights.
inline int64_t tile_bytes(int64_t type, int64_t K) {
  return with_layout(type, [K](auto l) { return tile_bytes_of<decltype(l)>(K / kBlock); });
}

inline float fp16_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Bytes of one row's block, of its scale fields, and of one such field.
inline int64_t block_bytes(int64_t type) {
  return with_layout(type, [](auto l) { return tile_block_bytes<decltype(l)>() / kTileRows; });
}
inline int64_t scale_bytes(int64_t type) {
  return with_layout(type, [](auto l) { return decltype(l)::kScaleBytes / kTileRows; });
}
inline int64_t scale_field_bytes(int64_t type) {
  return with_layout(type, [](auto l) { return decltype(l)::kScaleField; });
}

inline float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return fp16_to_float(bits);
}

PRECISE void dequantize_q4_1(const uint8_t* block, float* w) {
  const float d = fp16_at(block), m = fp16_at(block + 2);
  const uint8_t* qs = block + 4;
  for (int j = 0; j < 16; ++j) {
    w[j] = d * static_cast<float>(qs[j] & 0x0F) + m;
    w[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
  }
}

PRECISE void dequantize_q8_0(const uint8_t* block, float* w) {
  const float d = fp16_at(block);
  const int8_t* qs = reinterpret_cast<const int8_t*>(block + 2);
  for (int j = 0; j < kBlock; ++j) w[j] = d * static_cast<float>(qs[j]);
}

// GGUF rows of `type` (dequantize_gguf_blocks: Q4_1 or Q8_0; repack_gguf_blocks: MXFP4 too).
void check_blocks(const torch::Tensor& t, int64_t type, bool mxfp4, const char* op) {
  TORCH_CHECK(type == kQ4_1 || type == kQ8_0 || (mxfp4 && type == kMXFP4), op,
              ": type must be 3 (Q4_1), 8 (Q8_0)", mxfp4 ? " or 39 (MXFP4)" : "", ", got ", type);
  TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 2 && t.is_cpu(), op,
              ": expected a uint8 [rows, blocks * type_size] CPU tensor");
  TORCH_CHECK(t.size(1) % block_bytes(type) == 0, op, ": rows of ", t.size(1),
              " bytes are not whole blocks of ", block_bytes(type));
}

// x's rows quantized per block of 32. The quants in groups of group_rows rows, and per
// group block after block, its rows' 32 quants each: [M / group_rows][blocks][group_rows]
// [32] (x's order for one row a group; 16 for AMX tiles, an A tile's bytes together).
struct ActivationBlocks {
  int64_t blocks_per_row, group_rows;
  std::vector<int8_t> q;
  std::vector<float> d;      // [M, blocks]
  std::vector<float> s;      // [M, blocks]: d * sum(q)
  std::vector<int32_t> sum;  // [M, blocks]: sum(q)
  std::vector<int32_t> sum_low;  // [M, blocks]: the sum of the block's first 16 q

  // Row m's quants of block b.
  int8_t* quants(int64_t m, int64_t b) {
    return q.data() + ((m / group_rows * blocks_per_row + b) * group_rows + m % group_rows) *
                          kBlock;
  }
  const int8_t* quants(int64_t m, int64_t b) const {
    return const_cast<ActivationBlocks*>(this)->quants(m, b);
  }
};

// 1.5 * 2^23: for |v| <= 2^22, (v + kRoundMagic) - kRoundMagic is v rounded half to even
// (the FPU's default mode). Unlike std::nearbyint (a libm call per element) it
// vectorizes; fast-math is off here so that the compiler keeps it.
constexpr float kRoundMagic = 12582912.f;

// A block's scale d = amax / 127 and 1 / d (0 for a block of zeros). Its own function:
// fast-math would multiply by 1 / 127 instead, and the vector quantize_x_block cannot be
// PRECISE (the attribute stops its intrinsics from inlining).
PRECISE void block_scale(float amax, float* d, float* id) {
  *d = amax / 127.f;
  *id = *d > 0.f ? 1.f / *d : 0.f;
}

// One block of 32 values of x: its quants q, d, s, sum and sum_low.
PRECISE void quantize_block(const float* x, int8_t* q, float* d, float* s, int32_t* sum,
                            int32_t* sum_low) {
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) {
    const float a = x[j] < 0.f ? -x[j] : x[j];
    amax = amax < a ? a : amax;
  }
  float id;
  block_scale(amax, d, &id);
  int32_t total = 0, low = 0;
  for (int j = 0; j < kBlock; ++j) {
    const int32_t v = static_cast<int32_t>((x[j] * id + kRoundMagic) - kRoundMagic);
    q[j] = static_cast<int8_t>(v);
    total += v;
    if (j == kBlock / 2 - 1) low = total;
  }
  *s = *d * static_cast<float>(total);
  *sum = total;
  *sum_low = low;
}

#if defined(PAGEDSERVE_A8_AVX512)

// 16 output rows of a tile in one register: lane r is row r.
struct Lanes {
  using I = __m512i;
  using F = __m512;
  static constexpr int64_t kRows = 16;
  static inline I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static inline F scales(const uint8_t* p) {  // 16 fp16
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline I low_nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static inline I high_nibbles(I v) {
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
  }
  static inline I flip_sign_bits(I v) { return _mm512_xor_si512(v, _mm512_set1_epi8(-128)); }
  // acc + per lane: the sum of 4 products of unsigned w bytes and the 4 signed bytes a4.
  static inline I dot_u8(I acc, I w, int32_t a4) {
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(a4));
  }
  // A 16-byte table in every 128-bit lane, and each byte of idx (< 16) looked up in it.
  static inline I table(const int8_t* t) {
    return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
  }
  static inline I lookup(I table, I idx) { return _mm512_shuffle_epi8(table, idx); }
  // 16 E8M0 bytes e -> 2^(e - 128) exactly (ggml_e8m0_to_fp32_half): the float32 bits
  // (e - 1) << 23, or for e < 2 the subnormal 0x00200000 << e.
  static inline F e8m0_half(const uint8_t* p) {
    const I e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const I normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const I subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, subnormal));
  }
  static inline F loadf(const uint8_t* p) { return _mm512_loadu_ps(p); }
  static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static inline I zero() { return _mm512_setzero_si512(); }
  static inline I add(I a, int32_t b) { return _mm512_add_epi32(a, _mm512_set1_epi32(b)); }
  static inline I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static inline F fzero() { return _mm512_setzero_ps(); }
  static inline F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static inline F mul(F a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); }
  static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static inline F fma(F a, float b, F c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), c); }
  static inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  // bfloat16: rounded to nearest even, NaN as 0x7FC0 (c10::BFloat16's conversion).
  static inline void store(at::BFloat16* p, F v) {
    const I bits = _mm512_castps_si512(v);
    const I odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    I top = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd,
                                                   _mm512_set1_epi32(0x7FFF))), 16);
    top = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), top,
                                  _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
  }
  // For quantize_block: rows of x as float32 (a bfloat16 is float32's upper half), |v|,
  // max(a, b) (b where a is NaN, as `b < a ? a : b`), the largest lane, rounding half to
  // even, the lanes' sum, and int32 lanes (within int8) stored as bytes.
  static inline F load_x(const float* p) { return _mm512_loadu_ps(p); }
  static inline F load_x(const at::BFloat16* p) {
    const I wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static inline F abs(F v) { return _mm512_abs_ps(v); }
  static inline F max(F a, F b) { return _mm512_max_ps(a, b); }
  static inline float hmax(F v) { return _mm512_reduce_max_ps(v); }
  static inline I round(F v) {
    return _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static inline int32_t hsum(I v) { return _mm512_reduce_add_epi32(v); }
  static inline void store_i8(int8_t* p, I v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
  }
};

#elif defined(PAGEDSERVE_A8_AVX2)

// 8 output rows of a tile in one register (a tile is two halves).
struct Lanes {
  using I = __m256i;
  using F = __m256;
  static constexpr int64_t kRows = 8;
  static inline I load(const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static inline F scales(const uint8_t* p) {  // 8 fp16
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline I low_nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static inline I high_nibbles(I v) {
    return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
  }
  // The products of unsigned w and the 4 signed bytes a4 added in pairs, as int16 (no
  // saturation for Q4_1's quants, w <= 15, nor FP4's, w <= 24: pairs of at most
  // 2 * 24 * 127); Q8_0 multiplies its own way (see there).
  static inline I pairs(I w, int32_t a4) {
    return _mm256_maddubs_epi16(w, _mm256_set1_epi32(a4));
  }
  // acc + the int16 lanes of p added in pairs, as int32.
  static inline I widen_add(I acc, I p) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
  static inline I table(const int8_t* t) {
    return _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
  }
  static inline I lookup(I table, I idx) { return _mm256_shuffle_epi8(table, idx); }
  static inline F e8m0_half(const uint8_t* p) {  // 8 E8M0 bytes, as the AVX-512 one
    const I e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const I normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const I subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const I small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small));
  }
  static inline F loadf(const uint8_t* p) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
  static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static inline I zero() { return _mm256_setzero_si256(); }
  static inline I add(I a, int32_t b) { return _mm256_add_epi32(a, _mm256_set1_epi32(b)); }
  static inline I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static inline F fzero() { return _mm256_setzero_ps(); }
  static inline F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static inline F mul(F a, float b) { return _mm256_mul_ps(a, _mm256_set1_ps(b)); }
  static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static inline F fma(F a, float b, F c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(b), c); }
  static inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static inline void store(at::BFloat16* p, F v) {  // as the AVX-512 one
    const I bits = _mm256_castps_si256(v);
    const I odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    I top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd,
                                                   _mm256_set1_epi32(0x7FFF))), 16);
    top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7FC0),
                             _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),  // lanes <= 0xFFFF: no saturation
                     _mm_packus_epi32(_mm256_castsi256_si128(top),
                                      _mm256_extracti128_si256(top, 1)));
  }
  static inline F load_x(const float* p) { return _mm256_loadu_ps(p); }
  static inline F load_x(const at::BFloat16* p) {
    const I wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static inline F abs(F v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
  static inline F max(F a, F b) { return _mm256_max_ps(a, b); }
  static inline float hmax(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static inline I round(F v) { return _mm256_cvtps_epi32(v); }  // MXCSR's default: even
  static inline int32_t hsum(I v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
  }
  static inline void store_i8(int8_t* p, I v) {  // within int8: no saturation
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
};

#endif

#if defined(PAGEDSERVE_A8_AVX512) || defined(PAGEDSERVE_A8_AVX2)

// quantize_block, kBlock / Lanes::kRows registers at a time, and bit-equal to it: the same
// largest |x|, division and product, rounded half to even; exact integer sums.
template <typename In>
void quantize_x_block(const In* x, int8_t* q, float* d, float* s, int32_t* sum,
                              int32_t* sum_low) {
  constexpr int kRegs = kBlock / Lanes::kRows;
  Lanes::F v[kRegs], amax = Lanes::fzero();
  for (int i = 0; i < kRegs; ++i) {
    v[i] = Lanes::load_x(x + i * Lanes::kRows);
    amax = Lanes::max(Lanes::abs(v[i]), amax);
  }
  float id;
  block_scale(Lanes::hmax(amax), d, &id);
  int32_t total = 0, low = 0;
  for (int i = 0; i < kRegs; ++i) {
    const Lanes::I qi = Lanes::round(Lanes::mul(v[i], id));
    Lanes::store_i8(q + i * Lanes::kRows, qi);
    total += Lanes::hsum(qi);
    if ((i + 1) * Lanes::kRows == kBlock / 2) low = total;
  }
  *s = *d * static_cast<float>(total);
  *sum = total;
  *sum_low = low;
}

// Per lane, the sum over k of register w[k]'s 4 unsigned bytes times activation quants
// 4k..4k+3 (k from k0 to k1 - 1): a block's integer dot products for the tile's rows.
// Integer sums, so the same result in any order:
// - vpdpbusd in two chains, even and odd k, added at the end: half the latency of one
//   chain (Q4_1 GEMMs on SmolLM2's shapes 1.05-1.14x, Zen 5);
// - AVX2: the int16 pairs of up to 4 steps added before vpmaddwd widens them (at most
//   4 * 2 * 24 * 127 = 24,384, within int16): a quarter of the vpmaddwd, which share the
//   multiply pipes with vpmaddubsw (Q4_1 1.06-1.08x, an AVX2 build on Zen 5).
inline Lanes::I dot_u8_block(const Lanes::I w[8], const int32_as_bytes* a4, int k0 = 0,
                             int k1 = 8) {
#if defined(PAGEDSERVE_A8_AVX512)
  Lanes::I even = Lanes::zero(), odd = Lanes::zero();
  int k = k0;
  for (; k + 2 <= k1; k += 2) {
    even = Lanes::dot_u8(even, w[k], a4[k]);
    odd = Lanes::dot_u8(odd, w[k + 1], a4[k + 1]);
  }
  if (k < k1) even = Lanes::dot_u8(even, w[k], a4[k]);
  return Lanes::add(even, odd);
#else
  constexpr int kStepsPerWiden = 4;
  Lanes::I sum = Lanes::zero();
  for (int k = k0; k < k1; k += kStepsPerWiden) {
    Lanes::I p = Lanes::pairs(w[k], a4[k]);
    for (int j = k + 1; j < std::min(k + kStepsPerWiden, k1); ++j)
      p = _mm256_add_epi16(p, Lanes::pairs(w[j], a4[j]));
    sum = Lanes::widen_add(sum, p);
  }
  return sum;
#endif
}

// A format says, for kRows rows of a tile: how to load a block's scales (once per block,
// shared by every row of x), its quants as 8 registers (register k pairing with
// activation quants 4k..4k+3), the block's exact integer dot products with one row of x
// (dots: kDots of them, NVFP4's two halves apart), how those add to the row's float32
// sums (add: the one place the sums' bits are made, shared with the AMX tiles below), and
// what applies to the sums after the last block (finish; the tile's tail holds what it
// needs). For AMX tiles also the quants' values as they are (values: the B tile's 8 rows,
// unsigned where kUnsignedValues, else signed).
struct NoTail {
  static inline Lanes::F finish(Lanes::F acc, const uint8_t*, int64_t) { return acc; }
};

// The 4-bit quants of a block, low nibbles then high ones (both Q4_1 and FP4).
inline void nibbles(const uint8_t* qs, int64_t lane_offset, Lanes::I w[8]) {
  for (int c = 0; c < 4; ++c) {
    const Lanes::I v = Lanes::load(qs + c * 4 * kTileRows + lane_offset);
    w[c] = Lanes::low_nibbles(v);
    w[4 + c] = Lanes::high_nibbles(v);
  }
}

// The two fp16 scale fields of a Q4_1-shaped block: Q4_1's d and m, NVFP4's two halves'.
struct TwoScales {
  Lanes::F first, second;
  static inline TwoScales load(const uint8_t* blk, int64_t lane_offset) {
    return {Lanes::scales(blk + lane_offset / 2),
            Lanes::scales(blk + 2 * kTileRows + lane_offset / 2)};
  }
};

// A block whose dot products take one scale: sum += dots * (s da).
struct OneScale {
  struct Scales { Lanes::F d; };
  static constexpr int kDots = 1;
  static inline Lanes::F add(Lanes::F acc, const Scales& s, const Lanes::I* dots,
                             const ActivationBlocks& a, int64_t i) {
    return Lanes::fma(Lanes::cvt(dots[0]), Lanes::mul(s.d, a.d[i]), acc);
  }
};

struct Q4_1 : Q4_1Layout, NoTail {
  using Scales = TwoScales;  // d, m
  static constexpr int kDots = 1;
  static constexpr bool kUnsignedValues = true;
  static inline Scales scales(const uint8_t* blk, int64_t lane_offset) {
    return TwoScales::load(blk, lane_offset);
  }
  static inline void quants(const uint8_t* qs, int64_t lane_offset, Lanes::I w[8]) {
    nibbles(qs, lane_offset, w);
  }
  static inline void values(const uint8_t* qs, int64_t lane_offset, Lanes::I w[8]) {
    nibbles(qs, lane_offset, w);
  }
  static inline void dots(const Lanes::I w[8], const int32_as_bytes* a4,
                          const ActivationBlocks&, int64_t, Lanes::I out[1]) {
    out[0] = dot_u8_block(w, a4);
  }
  static inline Lanes::F add(Lanes::F acc, const Scales& s, const Lanes::I* dots,
                             const ActivationBlocks& a, int64_t i) {
    acc = Lanes::fma(Lanes::cvt(dots[0]), Lanes::mul(s.first, a.d[i]), acc);
    return Lanes::fma(s.second, a.s[i], acc);
  }
};

// Q8_0's integer dot products (two ways, below), then d da.
struct Q8_0Scales : Q8_0Layout, NoTail, OneScale {
  static constexpr bool kUnsignedValues = false;
  static inline Scales scales(const uint8_t* blk, int64_t lane_offset) {
    return {Lanes::scales(blk + lane_offset / 2)};
  }
  static inline void values(const uint8_t* qs, int64_t lane_offset, Lanes::I w[8]) {
    for (int c = 0; c < 8; ++c) w[c] = Lanes::load(qs + c * 4 * kTileRows + lane_offset);
  }
};

#if defined(PAGEDSERVE_A8_AVX512)
// vpdpbusd takes unsigned weights: q + 128 (the sign bit flipped), then
// sum (q + 128) a - 128 sum a = sum q a.
struct Q8_0 : Q8_0Scales {
  static inline void quants(const uint8_t* qs, int64_t lane_offset, Lanes::I w[8]) {
    for (int c = 0; c < 8; ++c)
      w[c] = Lanes::flip_sign_bits(Lanes::load(qs + c * 4 * kTileRows + lane_offset));
  }
  static inline void dots(const Lanes::I w[8], const int32_as_bytes* a4,
                          const ActivationBlocks& a, int64_t i, Lanes::I out[1]) {
    out[0] = Lanes::add(dot_u8_block(w, a4), -128 * a.sum[i]);
  }
};
#else
// The signed quants as they are, multiplied as |q| times a with q's sign: pairs stay
// within int16 (|q| <= 128, |a| <= 127).
struct Q8_0 : Q8_0Scales {
  static inline void quants(const uint8_t* qs, int64_t lane_offset, Lanes::I w[8]) {
    values(qs, lane_offset, w);
  }
  static inline void dots(const Lanes::I w[8], const int32_as_bytes* a4,
                          const ActivationBlocks&, int64_t, Lanes::I out[1]) {
    Lanes::I sum = Lanes::zero();
    for (int k = 0; k < 8; ++k) {
      const Lanes::I av = _mm256_set1_epi32(a4[k]);
      const Lanes::I p =
          _mm256_maddubs_epi16(_mm256_sign_epi8(w[k], w[k]), _mm256_sign_epi8(av, w[k]));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
    }
    out[0] = sum;
  }
};
#endif

// FP4 codes looked up as kFP4Biased (unsigned, for vpdpbusd), in Q4_1's nibble order; for
// AMX tiles as kFP4Values (signed).
struct FP4Codes {
  static constexpr bool kUnsignedValues = false;
  static inline void quants(const uint8_t* qs, int64_t lane_offset, Lanes::I w[8]) {
    lookup(kFP4Biased, qs, lane_offset, w);
  }
  static inline void values(const uint8_t* qs, int64_t lane_offset, Lanes::I w[8]) {
    lookup(kFP4Values, qs, lane_offset, w);
  }
  static inline void lookup(const FP4Table& t, const uint8_t* qs, int64_t lane_offset,
                            Lanes::I w[8]) {
    const Lanes::I table = Lanes::table(t.v);
    nibbles(qs, lane_offset, w);
    for (int k = 0; k < 8; ++k) w[k] = Lanes::lookup(table, w[k]);
  }
};

struct MXFP4 : MXFP4Layout, FP4Codes, NoTail, OneScale {
  static inline Scales scales(const uint8_t* blk, int64_t lane_offset) {
    return {Lanes::e8m0_half(blk + lane_offset / 4)};
  }
  static inline void dots(const Lanes::I w[8], const int32_as_bytes* a4,
                          const ActivationBlocks& a, int64_t i, Lanes::I out[1]) {
    out[0] = Lanes::add(dot_u8_block(w, a4), -kFP4Bias * a.sum[i]);
  }
};

struct NVFP4 : NVFP4Layout, FP4Codes {
  using Scales = TwoScales;  // of quants 0..15, of quants 16..31
  static constexpr int kDots = 2;
  static inline Scales scales(const uint8_t* blk, int64_t lane_offset) {
    return TwoScales::load(blk, lane_offset);
  }
  // Registers 0..3 hold quants 0..15 (low nibbles), 4..7 quants 16..31.
  static inline void dots(const Lanes::I w[8], const int32_as_bytes* a4,
                          const ActivationBlocks& a, int64_t i, Lanes::I out[2]) {
    const int32_t low_sum = a.sum_low[i], high_sum = a.sum[i] - low_sum;
    out[0] = Lanes::add(dot_u8_block(w, a4, 0, 4), -kFP4Bias * low_sum);
    out[1] = Lanes::add(dot_u8_block(w, a4, 4, 8), -kFP4Bias * high_sum);
  }
  static inline Lanes::F add(Lanes::F acc, const Scales& s, const Lanes::I* dots,
                             const ActivationBlocks& a, int64_t i) {
    acc = Lanes::fma(Lanes::cvt(dots[0]), Lanes::mul(s.first, a.d[i]), acc);
    return Lanes::fma(Lanes::cvt(dots[1]), Lanes::mul(s.second, a.d[i]), acc);
  }
  static inline Lanes::F finish(Lanes::F acc, const uint8_t* tail, int64_t lane_offset) {
    return Lanes::mul(acc, Lanes::loadf(tail + lane_offset));  // the rows' r
  }
};

// out[m * ldo + r] for r < kRows, m < MT: rows m0.. of x times kRows rows of a tile
// (lane_offset: their bytes' offset within each 64-byte group of the tile).
template <typename Format, int MT, typename Out>
void tile_rows(const uint8_t* tile, int64_t lane_offset, const ActivationBlocks& a, int64_t m0,
               bool prefetch, const NextTile& next, Out* out, int64_t ldo) {
  const int64_t nb = a.blocks_per_row;
  Lanes::F acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = Lanes::fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* qs = tile + quant_offset<Format>(nb, b);
    if (prefetch)
      for (int64_t off = 0; off < tile_block_bytes<Format>(); off += 64)
        __builtin_prefetch(qs + kPrefetchBytes + off);
    next.prefetch(b);
    const typename Format::Scales scales =
        Format::scales(tile + scale_offset<Format>(nb, b), lane_offset);
    Lanes::I w[8];
    Format::quants(qs, lane_offset, w);
    for (int m = 0; m < MT; ++m) {
      const auto* a4 =
          reinterpret_cast<const int32_as_bytes*>(a.quants(m0 + m, b));
      Lanes::I dots[Format::kDots];
      Format::dots(w, a4, a, (m0 + m) * nb + b, dots);
      acc[m] = Format::add(acc[m], scales, dots, a, (m0 + m) * nb + b);
    }
  }
  const uint8_t* tail = tile + tail_offset<Format>(nb);
  for (int m = 0; m < MT; ++m)
    Lanes::store(out + m * ldo, Format::finish(acc[m], tail, lane_offset));
}

template <typename Format, int MT, typename Out>
void tile_pass(const uint8_t* tile, const ActivationBlocks& a, int64_t m0, const NextTile& next,
               Out* out, int64_t ldo) {
  for (int64_t half = 0; half < kTileRows / Lanes::kRows; ++half)
    tile_rows<Format, MT>(tile, half * 4 * Lanes::kRows, a, m0, m0 == 0 && half == 0,
                          half == 0 ? next : NextTile{}, out + half * Lanes::kRows, ldo);
}

#if defined(PAGEDSERVE_AMX)
// With AMX tiles (amx_tiles.h), 16 rows of x meet a tile's block as one tile product:
// A = the rows' 32 activation quants (16 rows x 32 bytes, together in x's quants grouped
// by 16 rows), B = the block's values (the 8 registers of `values` stored: 4 quants of
// each of the 16 output rows a row, 64 bytes), C = their 16 x 16 int32 dot products: the
// integers the vector kernel's dots make (integer sums are exact in any order). The
// float32 sums take them through the format's add, block after block, as the vector
// kernel does: the same bits whichever kernel a row count runs (tested). TDPBSUD for
// unsigned values (Q4_1), TDPBSSD for signed ones; NVFP4's two halves are two products
// of 16 quants each. A tile's values are stored once a call and meet every group of 16
// rows, where the vector kernel unpacks them for each pass of 8 rows and makes 64 of the
// products an instruction (a tile product: 8,192). What remains is the float32 adds, a
// register of 16 sums per row and block either way (`add`): 1.4-1.8x the vector kernel at
// 256-2,048 rows, 1.0-1.2x at 16-35 (benchmarks/README.md).
namespace amx_a8 {

constexpr int64_t kValueBytes = 8 * 64;  // a block's B tile

// At least one whole A tile of rows: fewer would leave most of each product unused.
inline bool applies(int64_t M) { return M >= kTileRows && pagedserve_amx::tiles_permitted(); }

// A block is kDots products of kK quants each (the whole block, or NVFP4's halves), and
// successive blocks alternate between two sets of tiles, so that a block's product runs
// while the one before is stored (tiles are not renamed as vector registers are). Set 0:
// C tiles 0 and 1 (16 rows x 16 int32: a product each), A tile 4 (16 rows x kK bytes), B
// tile 5 (kK / 4 rows x 64 bytes); set 1: 2, 3, 6 and 7.
template <typename Format>
constexpr int64_t kK = kBlock / Format::kDots;

template <typename Format>
inline void configure() {
  pagedserve_amx::TileConfig config;
  for (int set = 0; set < 2; ++set) {
    for (int c = 0; c < 2; ++c) config.colsb[2 * set + c] = 64, config.rows[2 * set + c] = 16;
    config.colsb[4 + 2 * set] = kK<Format>, config.rows[4 + 2 * set] = 16;
    config.colsb[5 + 2 * set] = 64, config.rows[5 + 2 * set] = kK<Format> / 4;
  }
  pagedserve_amx::load_config(config);
}

// Tile set `set`'s C tiles (product h of a block in C tile h) get the dot products of 16
// rows of a block's quants a (32 bytes apart) with its values; store_dots writes them to
// c[h][16 rows][16 columns]. Apart, so that the vector adds of the step before run while
// the products do: a store waits for its product. Macros: tile numbers are literals.
#define PAGEDSERVE_A8_PRODUCTS(C0, C1, A, B)                     \
  do {                                                           \
    for (int h = 0; h < Format::kDots; ++h) {                    \
      _tile_loadd(A, a + h * kK<Format>, kBlock);                \
      _tile_loadd(B, values + h * kK<Format> * kTileRows, 64);   \
      if (h == 0) {                                              \
        _tile_zero(C0);                                          \
        if constexpr (Format::kUnsignedValues)                   \
          _tile_dpbsud(C0, A, B);                                \
        else                                                     \
          _tile_dpbssd(C0, A, B);                                \
      } else {                                                   \
        _tile_zero(C1);                                          \
        _tile_dpbssd(C1, A, B);                                  \
      }                                                          \
    }                                                            \
  } while (0)

template <typename Format>
inline void block_products(int64_t set, const int8_t* a, const uint8_t* values) {
  static_assert(Format::kDots == 1 || !Format::kUnsignedValues);
  if (set == 0)
    PAGEDSERVE_A8_PRODUCTS(0, 1, 4, 5);
  else
    PAGEDSERVE_A8_PRODUCTS(2, 3, 6, 7);
}

#undef PAGEDSERVE_A8_PRODUCTS

template <typename Format>
inline void store_dots(int64_t set, int32_t* c) {
  constexpr int64_t kNext = kTileRows * kTileRows;  // product 1's sums
  if (set == 0) {
    _tile_stored(0, c, 64);
    if constexpr (Format::kDots == 2) _tile_stored(1, c + kNext, 64);
  } else {
    _tile_stored(2, c, 64);
    if constexpr (Format::kDots == 2) _tile_stored(3, c + kNext, 64);
  }
}

// out[m * ldo + n] for m < M, n < 16: x's rows (a in groups of 16 rows) times the tile
// whose blocks' values are `values`. Each group's sums are 16 registers, a row each; the
// steps (group, block) run as one pipeline: step j's tile product runs while step j - 1's
// dots add, so that a group's last block does not wait for the product alone.
template <typename Format, typename Out>
void tile_rows(const uint8_t* tile, const uint8_t* values, const uint8_t* next,
               const ActivationBlocks& a, int64_t M, Out* out, int64_t ldo) {
  const int64_t nb = a.blocks_per_row, steps = (M + kTileRows - 1) / kTileRows * nb;
  constexpr int64_t kSums = Format::kDots * kTileRows * kTileRows;
  alignas(64) int32_t c[2 * kSums];  // two steps' dots: one being stored, one being added
  const uint8_t* tail = tile + tail_offset<Format>(nb);
  Lanes::F acc[kTileRows];
  for (int r = 0; r < kTileRows; ++r) acc[r] = Lanes::fzero();
  const auto add_step = [&](int64_t j) {
    const int64_t m0 = j / nb * kTileRows, b = j % nb, rows = std::min(kTileRows, M - m0);
    const int32_t* sums = c + (j & 1) * kSums;
    const typename Format::Scales scales = Format::scales(tile + scale_offset<Format>(nb, b), 0);
    // The last group's rows past M are zeros: their sums are not made (a decode step's
    // 35 rows are 48 of a tile product's rows, but 35 of the adds).
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      if (r == rows) break;
      Lanes::I dots[Format::kDots];
      for (int h = 0; h < Format::kDots; ++h)
        dots[h] = _mm512_load_si512(sums + (h * kTileRows + r) * kTileRows);
      acc[r] = Format::add(acc[r], scales, dots, a, (m0 + r) * nb + b);
    }
    // The next group's output lines, asked for one per step (row b; the rest at the last
    // block): a store that misses the cache holds up the tile stores behind it.
    for (int64_t r = b, last = b == nb - 1 ? kTileRows : std::min(b + 1, kTileRows); r < last; ++r)
      if (m0 + kTileRows + r < M) __builtin_prefetch(out + (m0 + kTileRows + r) * ldo, 1);
    if (b == nb - 1)
      for (int r = 0; r < rows; ++r) {
        Lanes::store(out + (m0 + r) * ldo, Format::finish(acc[r], tail, 0));
        acc[r] = Lanes::fzero();
      }
  };
  // The next tile's bytes are asked for a share per step: its values are built from them
  // next, and the tiles' blocks are apart (each in its own weights' rows).
  const int64_t lines = next == nullptr ? 0 : (tile_bytes_of<Format>(nb) + 63) / 64;
  const int64_t lines_per_step = (lines + steps - 1) / steps;
  for (int64_t j = 0; j < steps; ++j) {
    block_products<Format>(j & 1, a.quants(j / nb * kTileRows, j % nb),
                           values + j % nb * kValueBytes);
    for (int64_t i = j * lines_per_step; i < std::min(lines, (j + 1) * lines_per_step); ++i)
      __builtin_prefetch(next + 64 * i);
    if (j > 0) add_step(j - 1);
    store_dots<Format>(j & 1, c + (j & 1) * kSums);
  }
  add_step(steps - 1);
}

template <typename Format, typename Out>
void mul_mat(const uint8_t* W, const ActivationBlocks& a, int64_t M, int64_t N, Out* out) {
  const int64_t nb = a.blocks_per_row, tile_bytes = tile_bytes_of<Format>(nb);
  at::parallel_for(0, N / kTileRows, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> values;  // a tile's blocks' B tiles
    values.resize(std::max<size_t>(values.size(), nb * kValueBytes));
    configure<Format>();
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = W + t * tile_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        Lanes::I w[8];
        Format::values(tile + quant_offset<Format>(nb, b), 0, w);
        for (int k = 0; k < 8; ++k) _mm512_storeu_si512(&values[b * kValueBytes + k * 64], w[k]);
      }
      const uint8_t* next = t + 1 < N / kTileRows ? tile + tile_bytes : nullptr;
      tile_rows<Format>(tile, values.data(), next, a, M, out + t * kTileRows, N);
    }
    _tile_release();
  });
}

}  // namespace amx_a8
#endif

#else  // portable: the same layout, one product at a time

template <typename In>
void quantize_x_block(const In* x, int8_t* q, float* d, float* s, int32_t* sum,
                      int32_t* sum_low) {
  float v[kBlock];
  for (int j = 0; j < kBlock; ++j) v[j] = static_cast<float>(x[j]);
  quantize_block(v, q, d, s, sum, sum_low);
}

// Per format: quant j of row r of a tile's block (signed, FP4's doubled), the block's
// addition to row r's output for one row of x, and row r's factor after the last block.
inline int32_t nibble(const uint8_t* qs, int64_t r, int j) {
  const uint8_t byte = qs[(j % 16) / 4 * 4 * kTileRows + 4 * r + j % 4];
  return j < 16 ? (byte & 0x0F) : (byte >> 4);
}

template <typename Format>
int32_t int_dot(const uint8_t* qs, int64_t r, const int8_t* aq, int j0, int j1) {
  int32_t sum = 0;
  for (int j = j0; j < j1; ++j) sum += Format::quant(qs, r, j) * aq[j];
  return sum;
}

struct NoTail {
  static inline float row_factor(const uint8_t*, int64_t) { return 1.f; }
};

struct Q4_1 : Q4_1Layout, NoTail {
  static inline int32_t quant(const uint8_t* qs, int64_t r, int j) { return nibble(qs, r, j); }
  static inline float block(const uint8_t* sc, const uint8_t* qs, int64_t r, const int8_t* aq,
                            const ActivationBlocks& a, int64_t i) {
    const float d = fp16_at(sc + 2 * r), m = fp16_at(sc + 2 * (kTileRows + r));
    const int32_t sum = int_dot<Q4_1>(qs, r, aq, 0, kBlock);
    return static_cast<float>(sum) * (d * a.d[i]) + m * a.s[i];
  }
};

struct Q8_0 : Q8_0Layout, NoTail {
  static inline int32_t quant(const uint8_t* qs, int64_t r, int j) {
    return static_cast<int8_t>(qs[j / 4 * 4 * kTileRows + 4 * r + j % 4]);
  }
  static inline float block(const uint8_t* sc, const uint8_t* qs, int64_t r, const int8_t* aq,
                            const ActivationBlocks& a, int64_t i) {
    const int32_t sum = int_dot<Q8_0>(qs, r, aq, 0, kBlock);
    return static_cast<float>(sum) * (fp16_at(sc + 2 * r) * a.d[i]);
  }
};

struct FP4Codes {  // the code's value doubled
  static inline int32_t quant(const uint8_t* qs, int64_t r, int j) {
    return kFP4Values.v[nibble(qs, r, j)];
  }
};

struct MXFP4 : MXFP4Layout, FP4Codes, NoTail {
  static inline float block(const uint8_t* sc, const uint8_t* qs, int64_t r, const int8_t* aq,
                            const ActivationBlocks& a, int64_t i) {
    const float d = std::ldexp(1.f, static_cast<int>(sc[r]) - 128);  // exact
    const int32_t sum = int_dot<MXFP4>(qs, r, aq, 0, kBlock);
    return static_cast<float>(sum) * (d * a.d[i]);
  }
};

struct NVFP4 : NVFP4Layout, FP4Codes {
  static inline float block(const uint8_t* sc, const uint8_t* qs, int64_t r, const int8_t* aq,
                            const ActivationBlocks& a, int64_t i) {
    const float low = fp16_at(sc + 2 * r), high = fp16_at(sc + 2 * (kTileRows + r));
    const int32_t lo = int_dot<NVFP4>(qs, r, aq, 0, kBlock / 2);
    const int32_t hi = int_dot<NVFP4>(qs, r, aq, kBlock / 2, kBlock);
    return static_cast<float>(lo) * (low * a.d[i]) + static_cast<float>(hi) * (high * a.d[i]);
  }
  static inline float row_factor(const uint8_t* tail, int64_t r) {
    float f;
    std::memcpy(&f, tail + 4 * r, 4);
    return f;
  }
};

template <typename Format, int MT, typename Out>
void tile_pass(const uint8_t* tile, const ActivationBlocks& a, int64_t m0, const NextTile&,
               Out* out, int64_t ldo) {
  const int64_t nb = a.blocks_per_row;
  float acc[MT][kTileRows] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* sc = tile + scale_offset<Format>(nb, b);
    const uint8_t* qs = tile + quant_offset<Format>(nb, b);
    for (int64_t r = 0; r < kTileRows; ++r)
      for (int m = 0; m < MT; ++m) {
        const int8_t* aq = a.quants(m0 + m, b);
        acc[m][r] += Format::block(sc, qs, r, aq, a, (m0 + m) * nb + b);
      }
  }
  const uint8_t* tail = tile + tail_offset<Format>(nb);
  for (int m = 0; m < MT; ++m)
    for (int64_t r = 0; r < kTileRows; ++r)
      out[m * ldo + r] = static_cast<Out>(acc[m][r] * Format::row_factor(tail, r));
}

#endif

// x's M rows quantized, in groups of group_rows (the last group's rows after M zeros).
template <typename In>
ActivationBlocks quantize_rows(const In* x, int64_t M, int64_t K, int64_t group_rows) {
  const int64_t nb = K / kBlock, rows = (M + group_rows - 1) / group_rows * group_rows;
  ActivationBlocks a{nb, group_rows, std::vector<int8_t>(rows * K), std::vector<float>(rows * nb),
                     std::vector<float>(rows * nb), std::vector<int32_t>(rows * nb),
                     std::vector<int32_t>(rows * nb)};
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_x_block(x + i * kBlock, a.quants(i / nb, i % nb), &a.d[i], &a.s[i], &a.sum[i],
                       &a.sum_low[i]);
  });
  return a;
}

template <typename Format, typename Out>
void mul_mat(const uint8_t* W, const ActivationBlocks& a, int64_t M, int64_t N, Out* out) {
  const int64_t tile_bytes = tile_bytes_of<Format>(a.blocks_per_row);
  const int64_t passes = (M + kMaxRowsPerPass - 1) / kMaxRowsPerPass, nb = a.blocks_per_row;
  const int64_t lines = (tile_bytes + 63) / 64;
  const int64_t lines_per_step =
      passes > 1 ? (lines + (passes - 1) * nb - 1) / ((passes - 1) * nb) : 0;
  // Tile t's columns for all M rows; next_t: the tile this thread takes next (or -1), whose
  // bytes are asked for during the passes after the first.
  auto tile_of = [&](int64_t t, int64_t next_t) {
    const uint8_t* tile = W + t * tile_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsPerPass) {
      NextTile next;
      if (m0 > 0 && next_t >= 0)
        next = {W + next_t * tile_bytes, lines_per_step, (m0 / kMaxRowsPerPass - 1) * nb, lines};
      Out* o = out + m0 * N + t * kTileRows;
      // Output lines two tiles on asked for now: a store that misses the cache holds up
      // the stores behind it (the tied LM head's 64 rows of 49,152: 1.24x).
      if (next_t == t + 1 && t + 2 < N / kTileRows)
        for (int64_t m = m0; m < std::min(M, m0 + kMaxRowsPerPass); ++m)
          __builtin_prefetch(out + m * N + (t + 2) * kTileRows, 1);
      switch (std::min(M - m0, kMaxRowsPerPass)) {
        case 1: tile_pass<Format, 1, Out>(tile, a, m0, next, o, N); break;
        case 2: tile_pass<Format, 2, Out>(tile, a, m0, next, o, N); break;
        case 3: tile_pass<Format, 3, Out>(tile, a, m0, next, o, N); break;
        case 4: tile_pass<Format, 4, Out>(tile, a, m0, next, o, N); break;
        case 5: tile_pass<Format, 5, Out>(tile, a, m0, next, o, N); break;
        case 6: tile_pass<Format, 6, Out>(tile, a, m0, next, o, N); break;
        case 7: tile_pass<Format, 7, Out>(tile, a, m0, next, o, N); break;
        default: tile_pass<Format, 8, Out>(tile, a, m0, next, o, N); break;
      }
    }
  };
  pagedserve_sharing::for_each_item(N / kTileRows, tile_of);
}

}  // namespace

namespace {

// out = x @ W^T in x's dtype (In: float or at::BFloat16).
template <typename In>
void mul_mat_of(const uint8_t* W, int64_t qweight_type, const torch::Tensor& x,
                torch::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
#if defined(PAGEDSERVE_AMX)
  const bool tiles = amx_a8::applies(M);
#else
  constexpr bool tiles = false;
#endif
  const ActivationBlocks a = quantize_rows(x.data_ptr<In>(), M, K, tiles ? kTileRows : 1);
  In* o = out.data_ptr<In>();
  with_type<Q4_1, Q8_0, MXFP4, NVFP4>(qweight_type, [&](auto format) {
    using Format = decltype(format);
#if defined(PAGEDSERVE_AMX)
    if (tiles) return amx_a8::mul_mat<Format>(W, a, M, N, o);
#endif
    mul_mat<Format>(W, a, M, N, o);
  });
}

}  // namespace

// qweight: uint8 [N / 16, tile bytes] (K / 32 blocks of 320 bytes for Q4_1, 544 for Q8_0,
// 320 and a tail of 64 for NVFP4; for MXFP4 pad64(K / 32 * 16) + K / 32 * 256), blocks
// repacked in tiles of 16 rows (see the layout above); x: float32 or bfloat16 [M, K], K a
// multiple of 32. Returns [M, N] in x's dtype: a bfloat16 x gives the float32 product
// rounded to nearest even (bit-equal to the float32 x's result .to(torch.bfloat16), NaN
// aside; x's bfloat16 values are exact in float32). Raises (RuntimeError) on another
// qweight_type, dtype or shape.
torch::Tensor ggml_mul_mat_a8(torch::Tensor qweight, torch::Tensor x, int64_t qweight_type) {
  TORCH_CHECK(is_kernel_type(qweight_type), "ggml_mul_mat_a8: qweight_type must be 3 (Q4_1), ",
              "8 (Q8_0), 39 (MXFP4) or 40 (NVFP4), got ", qweight_type);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "ggml_mul_mat_a8: qweight must be a contiguous uint8 [N / 16, tile_bytes] tensor");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2,
              "ggml_mul_mat_a8: x must be a float32 or bfloat16 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0) * kTileRows;
  TORCH_CHECK(K % kBlock == 0 && qweight.size(1) == tile_bytes(qweight_type, K),
              "ggml_mul_mat_a8: x has K = ", K, " columns, qweight tiles have ", qweight.size(1),
              " bytes; expected K a multiple of 32 and ", tile_bytes(qweight_type, K), " bytes");
  x = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  if (x.scalar_type() == at::kFloat)
    mul_mat_of<float>(qweight.data_ptr<uint8_t>(), qweight_type, x, out);
  else
    mul_mat_of<at::BFloat16>(qweight.data_ptr<uint8_t>(), qweight_type, x, out);
  return out;
}

// Load-time conversions (see the top of the file); raise (RuntimeError) on another type,
// dtype or shape.
torch::Tensor dequantize_gguf_blocks(torch::Tensor blocks, int64_t type) {
  check_blocks(blocks, type, false, "dequantize_gguf_blocks");
  blocks = blocks.contiguous();
  const int64_t size = block_bytes(type), rows = blocks.size(0);
  const int64_t num_blocks = rows * (blocks.size(1) / size);
  auto out = torch::empty({rows, blocks.size(1) / size * kBlock}, torch::kFloat);
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  float* w = out.data_ptr<float>();
  at::parallel_for(0, num_blocks, kDequantGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (type == kQ4_1)
        dequantize_q4_1(in + b * size, w + b * kBlock);
      else
        dequantize_q8_0(in + b * size, w + b * kBlock);
    }
  });
  return out;
}

torch::Tensor repack_gguf_blocks(torch::Tensor rows, int64_t type) {
  check_blocks(rows, type, true, "repack_gguf_blocks");
  TORCH_CHECK(rows.size(0) % kTileRows == 0, "repack_gguf_blocks: ", rows.size(0),
              " rows are not whole tiles of ", kTileRows);
  rows = rows.contiguous();
  const int64_t size = block_bytes(type), row_bytes = rows.size(1);
  const int64_t nb = row_bytes / size, tiles = rows.size(0) / kTileRows;
  const int64_t scales = scale_bytes(type), field = scale_field_bytes(type);
  const int64_t chunks = (size - scales) / 4;
  const int64_t out_bytes = tile_bytes(type, nb * kBlock);  // no tail: NVFP4 is not repacked
  auto out = torch::zeros({tiles, out_bytes}, torch::kByte);  // zeros: the padding
  const uint8_t* in = rows.data_ptr<uint8_t>();
  uint8_t* packed = out.data_ptr<uint8_t>();
  with_layout(type, [&](auto l) {
    using L = decltype(l);
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* tile_block = in + t * kTileRows * row_bytes + b * size;
          uint8_t* o = packed + t * out_bytes + scale_offset<L>(nb, b);
          for (int64_t f = 0; f < scales; f += field)  // d, then m (Q4_1); e (MXFP4)
            for (int64_t r = 0; r < kTileRows; ++r, o += field)
              std::memcpy(o, tile_block + r * row_bytes + f, field);
          o = packed + t * out_bytes + quant_offset<L>(nb, b);
          for (int64_t c = 0; c < chunks; ++c)
            for (int64_t r = 0; r < kTileRows; ++r, o += 4)
              std::memcpy(o, tile_block + r * row_bytes + scales + 4 * c, 4);
        }
    });
    return 0;
  });
  return out;
}

namespace {

// One row of a tile moved back into GGUF block order (repack_gguf_blocks' moves undone):
// its nb blocks of `size` bytes each (NVFP4's as Q4_1's: s0, s1, then the quants).
template <typename L>
void unpack_row(const uint8_t* tile, int64_t nb, int64_t r, int64_t size, uint8_t* row) {
  constexpr int64_t scales = L::kScaleBytes / kTileRows, field = L::kScaleField;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* block = row + b * size;
    for (int64_t f = 0; f < scales; f += field)
      std::memcpy(block + f, tile + scale_offset<L>(nb, b) + f * kTileRows + r * field, field);
    for (int64_t c = 0; c < (size - scales) / 4; ++c)
      std::memcpy(block + scales + 4 * c, tile + quant_offset<L>(nb, b) + (c * kTileRows + r) * 4,
                  4);
  }
}

// FP4 blocks: w = scale * kv[c] / 2 (kv the doubled E2M1 values), exact in float32 but for
// NVFP4's row scale r, applied last (one rounding).
PRECISE void dequantize_fp4(const uint8_t* qs, float s_low, float s_high, float r, float* w) {
  for (int j = 0; j < 16; ++j) {
    w[j] = r * (s_low * static_cast<float>(kFP4Values.v[qs[j] & 0x0F]));
    w[j + 16] = r * (s_high * static_cast<float>(kFP4Values.v[qs[j] >> 4]));
  }
}

PRECISE void dequantize_block(int64_t type, const uint8_t* block, float row_scale, float* w) {
  switch (type) {
    case kQ4_1: dequantize_q4_1(block, w); break;
    case kQ8_0: dequantize_q8_0(block, w); break;
    case kMXFP4: {  // E8M0 e: 2^(e - 127), halved for the doubled values
      const float d = std::ldexp(1.0f, static_cast<int>(block[0]) - 128);
      dequantize_fp4(block + 1, d, d, 1.0f, w);
      break;
    }
    default:  // NVFP4 kernel rows: halved E4M3 scales s0, s1 (fp16), the row's scale r
      dequantize_fp4(block + 4, fp16_at(block), fp16_at(block + 2), row_scale, w);
  }
}

}  // namespace

// qweight as ggml_mul_mat_a8's (W [N, K] in tiles), ids int64 [T] in [0, N): returns float32
// [T, K], W's rows ids (an embedding's lookup from its blocks). Q4_1 and Q8_0 bit-equal to
// dequantize_gguf_blocks (and gguf-py); MXFP4 2^(e - 127) * v exactly; NVFP4 r * (s * v).
// Raises (RuntimeError) on another type, dtype or shape, or an id out of range.
torch::Tensor ggml_get_rows(torch::Tensor qweight, torch::Tensor ids, int64_t qweight_type) {
  TORCH_CHECK(is_kernel_type(qweight_type), "ggml_get_rows: qweight_type must be 3, 8, 39 or 40",
              ", got ", qweight_type);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "ggml_get_rows: qweight must be a contiguous uint8 [N / 16, tile_bytes] tensor");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1,
              "ggml_get_rows: ids must be an int64 [T] tensor");
  ids = ids.contiguous();
  const int64_t T = ids.size(0), N = qweight.size(0) * kTileRows, tile = qweight.size(1);
  const int64_t size = block_bytes(qweight_type);
  const int64_t nb = with_layout(qweight_type, [tile](auto l) {
    using L = decltype(l);
    int64_t n = 0;  // the block count whose tile has these bytes
    while (tile_bytes_of<L>(n) < tile) ++n;
    return tile_bytes_of<L>(n) == tile ? n : int64_t{-1};
  });
  TORCH_CHECK(nb > 0, "ggml_get_rows: tiles of ", tile, " bytes are not whole blocks");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < N, "ggml_get_rows: id ", id[t], " is not in [0, ", N, ")");
  auto out = torch::empty({T, nb * kBlock}, torch::kFloat);
  const uint8_t* W = qweight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> row(nb * size);
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile_bytes = W + id[t] / kTileRows * tile;
      const int64_t r = id[t] % kTileRows;
      float row_scale = 1.0f;
      with_layout(qweight_type, [&](auto l) {
        using L = decltype(l);
        unpack_row<L>(tile_bytes, nb, r, size, row.data());
        if (L::kTailBytes) std::memcpy(&row_scale, tile_bytes + tail_offset<L>(nb) + 4 * r, 4);
        return 0;
      });
      for (int64_t b = 0; b < nb; ++b)
        dequantize_block(qweight_type, row.data() + b * size, row_scale, o + (t * nb + b) * kBlock);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("ggml_mul_mat_a8", &ggml_mul_mat_a8);
  m.def("ggml_get_rows", &ggml_get_rows);
  m.def("dequantize_gguf_blocks", &dequantize_gguf_blocks);
  m.def("repack_gguf_blocks", &repack_gguf_blocks);
}
