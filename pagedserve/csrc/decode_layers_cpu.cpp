// The decoder layers of a Llama-family model for one step of few decode tokens on CPU,
// in one call (torch.ops.pagedserve.llama_decode_layers): the CPU's answer to a captured
// CUDA graph. At batch 1 the Python of ~25 ops a layer (module calls, views, dispatch) cost
// ~6.5 ms a token, as much as reading the 4-bit weights.
//
// Per layer, as LlamaDecoderLayer.forward (pagedserve/models/llama.py) and with the same
// kernels in the same order, so the result is bit-equal to it (tests check):
//   x = rms_norm(h); q, k, v = split(x @ Wqkv^T); rotary(q, k); cache <- k, v
//   h += paged_attention(q, cache) @ Wo^T
//   x = rms_norm(h); gate, up = split(x @ Wgate_up^T); h += (silu(gate) * up) @ Wdown^T
// Every projection is a GGUF block weight (ggml_mul_mat_a8); any float dtype.

#include <torch/extension.h>

#include <vector>

// The kernels this calls, defined in the other csrc files.
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k,
                      torch::Tensor cos, torch::Tensor sin, int64_t rotary_dim,
                      bool interleaved);
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
                       torch::Tensor slot_mapping);
void paged_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                     torch::Tensor seq_lens, torch::Tensor query_start_loc, torch::Tensor out,
                     double scale, int64_t window);
torch::Tensor ggml_mul_mat_a8(torch::Tensor qweight, torch::Tensor x, int64_t qweight_type);

namespace {

constexpr int64_t kTensorsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate_up, down

// x [T, K] @ W^T from W's GGUF blocks; the kernel takes and gives float32 rows, as in
// quant.linear (no-op casts in float32).
torch::Tensor project(const torch::Tensor& qweight, const torch::Tensor& x, int64_t qtype) {
  return ggml_mul_mat_a8(qweight, x.to(at::kFloat), qtype).to(x.scalar_type());
}

}  // namespace

// hidden [T, hidden_size] (the model's dtype), updated in place. weights: per layer, in
// order, the input norm's weight, qkv_proj's blocks, o_proj's, the post-attention norm's
// weight, gate_up_proj's, down_proj's; qtypes: per layer the four projections' GGUF types.
// kv_caches, windows (0: none): per layer. The index tensors are AttentionMetadata's for
// a step whose sequences are all decodes. Raises (RuntimeError) on inconsistent lengths.
void llama_decode_layers(torch::Tensor hidden, torch::Tensor positions,
                         std::vector<torch::Tensor> weights, std::vector<int64_t> qtypes,
                         std::vector<torch::Tensor> kv_caches, std::vector<int64_t> windows,
                         torch::Tensor slot_mapping, torch::Tensor block_tables,
                         torch::Tensor seq_lens, torch::Tensor query_start_loc,
                         torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kTensorsPerLayer * layers &&
                  static_cast<int64_t>(qtypes.size()) == 4 * layers &&
                  static_cast<int64_t>(windows.size()) == layers,
              "llama_decode_layers: 6 weights, 4 qtypes and 1 window per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(),
              "llama_decode_layers: hidden must be a contiguous [T, hidden_size]");
  const int64_t T = hidden.size(0), q_size = num_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim;
  auto x = torch::empty_like(hidden);
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + kTensorsPerLayer * l;
    const int64_t* types = qtypes.data() + 4 * l;
    rms_norm(x, hidden, w[0], eps);
    const auto qkv = project(w[1], x, types[0]);
    auto q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    auto k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    rotary_embedding(positions, q, k, cos, sin, head_dim, false);
    reshape_and_cache(k, v, kv_caches[l], slot_mapping);
    auto attn = torch::empty({T, num_heads, head_dim}, hidden.options());
    paged_attention(q.contiguous(), kv_caches[l], block_tables, seq_lens, query_start_loc, attn,
                    scale, windows[l]);
    hidden.add_(project(w[2], attn.view({T, q_size}), types[1]));
    rms_norm(x, hidden, w[3], eps);
    const auto gate_up = project(w[4], x, types[2]);
    const int64_t inter = gate_up.size(1) / 2;
    const auto act = at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
    hidden.add_(project(w[5], act, types[3]));
  }
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("llama_decode_layers", &llama_decode_layers);
}
