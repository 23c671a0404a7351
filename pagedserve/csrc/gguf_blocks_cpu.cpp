// Load-time conversions of GGUF Q4_1 / Q8_0 blocks, for CPU: one pass over the bytes each,
// where the PyTorch versions made 4-6 passes with temporaries (SmolLM2-135M's 96 MB of
// blocks: ~0.6 s of a 1.6 s engine start).
//
//   dequantize_gguf_blocks(blocks uint8 [R, K / 32 * type_size], type) -> float32 [R, K]
//       Q4_1: w = d * q + m; Q8_0: w = d * q, in float32 as gguf-py's quants.py computes
//       them (a product, then a sum: no fused multiply-add), so bit-equal to it.
//   repack_gguf_blocks(rows uint8 [N, K / 32 * type_size], type) -> uint8 [N / 16, ...]
//       The same bytes in ggml_mul_mat_a8's tile layout (gguf_gemm_cpu.cpp): per tile of
//       16 rows and block after block, the 16 rows' scales d, (Q4_1) their mins m, then
//       their quants in chunks of 4 bytes, chunk-major ([chunk][row][4 bytes]).
//
// Block formats (ggml's ggml-common.h block_q4_1 / block_q8_0): Q4_1 (type 3), 20 bytes
// per 32 weights: fp16 d, fp16 m, 16 bytes whose low nibbles are weights 0-15 and high
// nibbles 16-31; Q8_0 (type 8), 34 bytes: fp16 d, int8 q[32].

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#define PRECISE __attribute__((optimize("no-fast-math", "fp-contract=off")))

namespace {

constexpr int64_t kBlock = 32;     // weights per block
constexpr int64_t kTileRows = 16;  // rows per tile of the kernel's layout
constexpr int64_t kGrain = 256;    // blocks per parallel task

enum GGMLType : int64_t { kQ4_1 = 3, kQ8_0 = 8 };

int64_t block_bytes(int64_t type) { return type == kQ4_1 ? 20 : 34; }

float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
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

void check_blocks(const torch::Tensor& t, int64_t type, const char* op) {
  TORCH_CHECK(type == kQ4_1 || type == kQ8_0, op, ": type must be 3 (Q4_1) or 8 (Q8_0), got ",
              type);
  TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 2 && t.is_cpu(), op,
              ": expected a uint8 [rows, blocks * type_size] CPU tensor");
  TORCH_CHECK(t.size(1) % block_bytes(type) == 0, op, ": rows of ", t.size(1),
              " bytes are not whole blocks of ", block_bytes(type));
}

}  // namespace

torch::Tensor dequantize_gguf_blocks(torch::Tensor blocks, int64_t type) {
  check_blocks(blocks, type, "dequantize_gguf_blocks");
  blocks = blocks.contiguous();
  const int64_t size = block_bytes(type), rows = blocks.size(0);
  const int64_t num_blocks = rows * (blocks.size(1) / size);
  auto out = torch::empty({rows, blocks.size(1) / size * kBlock}, torch::kFloat);
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  float* w = out.data_ptr<float>();
  at::parallel_for(0, num_blocks, kGrain, [&](int64_t begin, int64_t end) {
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
  check_blocks(rows, type, "repack_gguf_blocks");
  TORCH_CHECK(rows.size(0) % kTileRows == 0, "repack_gguf_blocks: ", rows.size(0),
              " rows are not whole tiles of ", kTileRows);
  rows = rows.contiguous();
  const int64_t size = block_bytes(type), row_bytes = rows.size(1);
  const int64_t blocks_per_row = row_bytes / size, tiles = rows.size(0) / kTileRows;
  const int64_t scale_bytes = type == kQ4_1 ? 4 : 2;  // d (and m) per block and row
  const int64_t chunks = (size - scale_bytes) / 4;
  auto out = torch::empty({tiles, kTileRows * row_bytes}, torch::kByte);
  const uint8_t* in = rows.data_ptr<uint8_t>();
  uint8_t* packed = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      uint8_t* o = packed + t * kTileRows * row_bytes;
      for (int64_t b = 0; b < blocks_per_row; ++b) {
        const uint8_t* tile_block = in + t * kTileRows * row_bytes + b * size;
        for (int64_t field = 0; field < scale_bytes; field += 2)  // d, then m
          for (int64_t r = 0; r < kTileRows; ++r, o += 2)
            std::memcpy(o, tile_block + r * row_bytes + field, 2);
        for (int64_t c = 0; c < chunks; ++c)
          for (int64_t r = 0; r < kTileRows; ++r, o += 4)
            std::memcpy(o, tile_block + r * row_bytes + scale_bytes + 4 * c, 4);
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("dequantize_gguf_blocks", &dequantize_gguf_blocks);
  m.def("repack_gguf_blocks", &repack_gguf_blocks);
}
