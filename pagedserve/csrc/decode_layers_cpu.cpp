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
// A residual add and the norm after it run as one pass (fused_add_rms_norm: the same bits).
// Each projection W as its quantization method holds it (LinearWeight.fused_kernel, in
// pagedserve/quantization/): GGUF blocks (ggml_mul_mat_a8), int8 rows (int8_linear:
// per-token quantization, torch._int_mm or our packed product, scales), or a float weight
// (fixed_order_linear on its packed copy, else F.linear); any float dtype. With LoRA
// adapters (pagedserve/lora/), each projection then adds its rows' LoRA terms (lora_add),
// as LoRAWeight.apply does.

#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <vector>

// The kernels this calls, defined in the other csrc files.
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor delta,
                        torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k,
                      torch::Tensor cos, torch::Tensor sin, int64_t rotary_dim,
                      bool interleaved);
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
                       torch::Tensor slot_mapping);
void paged_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                     torch::Tensor seq_lens, torch::Tensor query_start_loc, torch::Tensor out,
                     double scale, int64_t window);
torch::Tensor ggml_mul_mat_a8(torch::Tensor qweight, torch::Tensor x, int64_t qweight_type);
std::tuple<torch::Tensor, torch::Tensor> quantize_rows_int8(torch::Tensor x);
torch::Tensor fixed_order_linear(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor int8_scaled_mm_epilogue(torch::Tensor acc, torch::Tensor x_scale,
                                      torch::Tensor w_scale, std::optional<torch::Tensor> bias,
                                      at::ScalarType dtype);
torch::Tensor int8_packed_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor w_scale,
                                 std::optional<torch::Tensor> bias, int64_t N);
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up);
void lora_add(torch::Tensor out, torch::Tensor x, torch::Tensor slots, torch::Tensor A,
              torch::Tensor Bt, torch::Tensor ranks, torch::Tensor shard_cols);

namespace {

// Per layer: input norm, qkv (2 tensors), o (2), post-attention norm, gate_up (2), down (2).
constexpr int64_t kTensorsPerLayer = 10;
// A projection's kind (quantization/base.py): a GGUF type id (>= 0), or one of these.
constexpr int64_t kInt8 = -1, kFloat = -2;

// x [T, K] @ W^T as the layer's method (apply) computes it. a, b: GGUF blocks and an empty
// tensor; int8 rows [N, K] (or their packed copy, 4-D or, for AMX tiles, 5-D) and their
// float32 scales [N]; a float weight [N, K] and its packed copy for fixed_order_linear
// (empty if none).
torch::Tensor project(const torch::Tensor& a, const torch::Tensor& b, int64_t kind,
                      const torch::Tensor& x) {
  if (kind == kInt8) {
    if (a.dim() >= 4) return int8_packed_linear(x, a, b, std::nullopt, b.numel());
    auto [q, scale] = quantize_rows_int8(x);
    return int8_scaled_mm_epilogue(at::_int_mm(q, a.t()), scale, b, std::nullopt,
                                   x.scalar_type());
  }
  if (kind == kFloat)
    return b.numel() > 0 ? fixed_order_linear(x, b, a.size(0)) : at::linear(x, a);
  // The GGUF kernel reads and writes float32 and bfloat16 rows.
  if (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)
    return ggml_mul_mat_a8(a, x, kind);
  return ggml_mul_mat_a8(a, x.to(at::kFloat), kind).to(x.scalar_type());
}

// silu(gate) * up for gate_up [T, 2 * I], as LlamaMLP computes it: one pass in float32 and
// bfloat16, else PyTorch's two ops.
torch::Tensor silu_and_mul_of(const torch::Tensor& gate_up) {
  const int64_t inter = gate_up.size(1) / 2;
  if (gate_up.scalar_type() != at::kFloat && gate_up.scalar_type() != at::kBFloat16)
    return at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  silu_and_mul(out, gate_up);
  return out;
}

// Per projection with LoRA: its stack's A, Bt, ranks and shard_cols (lora/layers.py).
constexpr int64_t kLoRATensors = 4;

// project(), then the LoRA terms of the rows with an adapter when the step has any
// (lora: this projection's kLoRATensors tensors, or null).
torch::Tensor project_lora(const torch::Tensor& a, const torch::Tensor& b, int64_t kind,
                           const torch::Tensor& x, const torch::Tensor* lora,
                           const torch::Tensor& lora_slots) {
  auto out = project(a, b, kind, x);
  if (lora != nullptr && lora_slots.numel() > 0)
    lora_add(out, x, lora_slots, lora[0], lora[1], lora[2], lora[3]);
  return out;
}

}  // namespace

// hidden [T, hidden_size] (the model's dtype), updated in place (the residual stream);
// returns the final norm's output [T, hidden_size] (final_norm: its weight), as the model's
// forward makes it. weights: per layer, in order, the input norm's weight, qkv_proj's two
// tensors (see project), o_proj's, the post-attention norm's weight, gate_up_proj's,
// down_proj's; kinds: per layer the four projections' kinds. kv_caches, windows (0: none):
// per layer. The index tensors are AttentionMetadata's for a step whose sequences are all
// decodes. lora: empty, or per layer per projection its LoRA stack's kLoRATensors tensors;
// lora_slots: each row's adapter slot (-1: none), empty when no row of the step has one.
// Raises (RuntimeError) on inconsistent lengths.
torch::Tensor llama_decode_layers(
    torch::Tensor hidden, torch::Tensor positions, std::vector<torch::Tensor> weights,
    torch::Tensor final_norm, std::vector<int64_t> kinds, std::vector<torch::Tensor> kv_caches,
    std::vector<int64_t> windows, torch::Tensor slot_mapping, torch::Tensor block_tables,
    torch::Tensor seq_lens, torch::Tensor query_start_loc, torch::Tensor cos, torch::Tensor sin,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
    std::vector<torch::Tensor> lora, torch::Tensor lora_slots) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kTensorsPerLayer * layers &&
                  static_cast<int64_t>(kinds.size()) == 4 * layers &&
                  static_cast<int64_t>(windows.size()) == layers,
              "llama_decode_layers: 10 weights, 4 kinds and 1 window per layer");
  TORCH_CHECK(lora.empty() || static_cast<int64_t>(lora.size()) == 4 * kLoRATensors * layers,
              "llama_decode_layers: 4 LoRA stacks of ", kLoRATensors, " tensors per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(),
              "llama_decode_layers: hidden must be a contiguous [T, hidden_size]");
  const int64_t T = hidden.size(0), q_size = num_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim;
  auto x = torch::empty_like(hidden);
  torch::Tensor down;  // the layer before's MLP output, added with this layer's first norm
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + kTensorsPerLayer * l;
    const int64_t* kind = kinds.data() + 4 * l;
    const torch::Tensor* lw = lora.empty() ? nullptr : lora.data() + 4 * kLoRATensors * l;
    auto lora_of = [&](int p) { return lw == nullptr ? nullptr : lw + kLoRATensors * p; };
    if (down.defined())
      fused_add_rms_norm(x, hidden, down, w[0], eps);
    else
      rms_norm(x, hidden, w[0], eps);
    const auto qkv = project_lora(w[1], w[2], kind[0], x, lora_of(0), lora_slots);
    auto q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    auto k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    rotary_embedding(positions, q, k, cos, sin, head_dim, false);
    reshape_and_cache(k, v, kv_caches[l], slot_mapping);
    auto attn = torch::empty({T, num_heads, head_dim}, hidden.options());
    paged_attention(q.contiguous(), kv_caches[l], block_tables, seq_lens, query_start_loc, attn,
                    scale, windows[l]);
    fused_add_rms_norm(x, hidden,
                       project_lora(w[3], w[4], kind[1], attn.view({T, q_size}), lora_of(1),
                                    lora_slots),
                       w[5], eps);
    const auto gate_up = project_lora(w[6], w[7], kind[2], x, lora_of(2), lora_slots);
    const auto act = silu_and_mul_of(gate_up);
    down = project_lora(w[8], w[9], kind[3], act, lora_of(3), lora_slots);
  }
  // the last residual add with the final norm, as between layers
  if (down.defined())
    fused_add_rms_norm(x, hidden, down, final_norm, eps);
  else
    rms_norm(x, hidden, final_norm, eps);
  return x;
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("llama_decode_layers", &llama_decode_layers);
}
