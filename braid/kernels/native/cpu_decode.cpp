// The decoder layers of a Llama-family model for one decode token per row, on the CPU, in
// one call: `braid_cpu.CpuDecoder.forward`. Built by braid/kernels/cpu_decode.py (g++, once
// per machine) and loaded with torch.ops.load_library.
//
// Why: at batch 1 the embedded SmolLM2's forward spent about half its time in the hundreds of
// small torch calls between the int4 matmuls (norms, rotary, the KV store, attention, the
// activation; each a few microseconds of dispatch for microseconds of work). Here those run
// as plain loops over the rows, and the matmuls call torch's own int4 kernel
// (`_weight_int4pack_mm_for_cpu`, bfloat16 in and out) exactly as the Python path does.
//
// Numerics: the same operations at the same rounding points as the Python path (float32
// everywhere but the matmuls' bfloat16 input and output), the sums in another order: norms
// and dot products in 16 fixed lanes, softmax and SiLU through `exp_approx`. Built with
// -ffp-contract=off, so no product is fused into a sum and the result does not depend on
// which vector instructions the compiler picked.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using c10::BFloat16;

// How a segment's input is laid out for its kernel (braid/runtime/quantization/gguf_cpu.py,
// `CpuInt4Weight.expand`): x itself; x beside x (Q8_0's two halves); each 16 columns as
// 8 x beside x (Q6_K).
enum Feed : int64_t { kSame = 0, kTwice = 1, kQ6K = 2 };

struct Segment {
  at::Tensor packed, table;
  int64_t rows, feed;
};

struct Linear {
  std::vector<Segment> segments;
  at::Tensor bias;  // float32 [out], or undefined
  int64_t in = 0, out = 0;
};

struct Layer {
  Linear qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm, q_norm, k_norm;  // q_norm / k_norm: Qwen3 only
};

constexpr int kLanes = 16;

// The lanes' total, halving: four dependent adds, where adding them one by one would make
// a chain of sixteen (at a head dim of 64 that chain cost more than the products).
inline float fold(float* acc) {
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

// Sums in kLanes fixed lanes (the tail's elements added to the first lanes), then folds
// them: the same bits whether or not the compiler vectorised the loop.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  return fold(acc);
}

inline float sum(const float* a, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i];
  return fold(acc);
}

// e^x within 1.5 ulp over [-87, 88] (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in
// r, 2^n from the exponent bits), as straight-line arithmetic that the compiler vectorises,
// where a call to std::exp per element cost about as much as all the matmuls of a 16-row
// step. x is clamped to [-87.3, 88.3]: e^-87.3 (1e-38) stands for anything smaller, e^88.3
// (2e38) for anything larger.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  // n = round(x / ln 2): adding and removing 1.5 * 2^23 rounds to an integer (std::floor
  // would keep the loop from vectorising).
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.f;
  return y * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// Key rows requested from memory ahead of their use in `attend`.
constexpr int64_t kAhead = 8;

inline void prefetch(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(row + i);  // a 64-byte line each
}

// a[b, i] = silu(g[b, i]) * g[b, n + i] for rows g of [gate | up], n wide each.
inline void silu_and_mul(const float* __restrict g, float* __restrict a, int64_t rows,
                         int64_t n) {
  for (int64_t b = 0; b < rows; ++b) {
    const float* __restrict gate = g + b * 2 * n;
    const float* __restrict up = gate + n;
    float* __restrict out = a + b * n;
    for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.f + exp_approx(-gate[i])) * up[i];
  }
}

// out = x * rsqrt(mean(x^2) + eps) * w, as `rmsnorm_reference` rounds it in float32.
inline void rmsnorm(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float mean = dot(x, x, n) / static_cast<float>(n);
  const float r = 1.f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

// q * cos + rotate_half(q) * sin for one head of `d` values, in place.
inline void rotate(float* q, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  float buf[512];
  for (int64_t i = 0; i < d; ++i) {
    const float rot = i < half ? -q[i + half] : q[i - half];
    buf[i] = q[i] * cos[i] + rot * sin[i];
  }
  std::memcpy(q, buf, d * sizeof(float));
}

class CpuDecoder : public torch::CustomClassHolder {
 public:
  // dims: hidden, heads, kv_heads, head_dim, intermediate, layers, group, qk_norm (0/1).
  // norms: per layer input and post-attention norms (then q_norm, k_norm with qk_norm), then
  // the final norm. linears: per layer qkv, o, gate_up, down, each as its segment count
  // then (rows, feed) per segment; packed / tables: the segments' tensors in that order;
  // biases: one per linear, an empty tensor where it has none.
  CpuDecoder(std::vector<int64_t> dims, double eps, std::vector<at::Tensor> norms,
             std::vector<int64_t> linears, std::vector<at::Tensor> packed,
             std::vector<at::Tensor> tables, std::vector<at::Tensor> biases)
      : eps_(static_cast<float>(eps)) {
    TORCH_CHECK(dims.size() == 8, "CpuDecoder: dims has ", dims.size(), " entries, expected 8");
    hidden_ = dims[0];
    heads_ = dims[1];
    kv_heads_ = dims[2];
    head_dim_ = dims[3];
    inter_ = dims[4];
    const int64_t n_layers = dims[5];
    group_ = dims[6];
    qk_norm_ = dims[7] != 0;
    TORCH_CHECK(heads_ % kv_heads_ == 0, "CpuDecoder: heads not a multiple of kv_heads");
    TORCH_CHECK(head_dim_ % 2 == 0 && head_dim_ <= 512, "CpuDecoder: head_dim ", head_dim_);
    const int64_t per_layer_norms = qk_norm_ ? 4 : 2;
    TORCH_CHECK(static_cast<int64_t>(norms.size()) == n_layers * per_layer_norms + 1,
                "CpuDecoder: ", norms.size(), " norms for ", n_layers, " layers");
    TORCH_CHECK(static_cast<int64_t>(biases.size()) == n_layers * 4, "CpuDecoder: biases");
    const int64_t q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
    const int64_t ins[4] = {hidden_, q, hidden_, inter_};
    const int64_t outs[4] = {q + 2 * kv, hidden_, 2 * inter_, hidden_};
    size_t at_info = 0, at_seg = 0;
    for (int64_t l = 0; l < n_layers; ++l) {
      Layer layer;
      Linear* lin[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
      for (int j = 0; j < 4; ++j) {
        Linear& L = *lin[j];
        L.in = ins[j];
        L.out = outs[j];
        TORCH_CHECK(at_info < linears.size(), "CpuDecoder: linears too short");
        const int64_t n_seg = linears[at_info++];
        int64_t rows = 0;
        for (int64_t s = 0; s < n_seg; ++s) {
          TORCH_CHECK(at_info + 2 <= linears.size() && at_seg < packed.size(),
                      "CpuDecoder: linears too short");
          Segment seg{packed[at_seg], tables[at_seg], linears[at_info], linears[at_info + 1]};
          at_info += 2;
          ++at_seg;
          TORCH_CHECK(seg.feed >= kSame && seg.feed <= kQ6K, "CpuDecoder: feed ", seg.feed);
          rows += seg.rows;
          L.segments.push_back(seg);
        }
        TORCH_CHECK(rows == L.out, "CpuDecoder: layer ", l, " linear ", j, " has ", rows,
                    " rows, expected ", L.out);
        const at::Tensor& b = biases[l * 4 + j];
        if (b.numel() > 0) {
          TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == L.out && b.is_contiguous(),
                      "CpuDecoder: bias of layer ", l, " linear ", j);
          L.bias = b;
        }
      }
      const int64_t base = l * per_layer_norms;
      layer.input_norm = norms[base];
      layer.post_norm = norms[base + 1];
      if (qk_norm_) {
        layer.q_norm = norms[base + 2];
        layer.k_norm = norms[base + 3];
      }
      layers_.push_back(std::move(layer));
    }
    TORCH_CHECK(at_info == linears.size() && at_seg == packed.size(),
                "CpuDecoder: linears left over");
    final_norm_ = norms.back();
    for (const auto& t : norms) {
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "CpuDecoder: norms");
    }
  }

  // The pool's per-layer K and V buffers (float32 [slots, kv_heads, head_dim]).
  void set_pool(std::vector<at::Tensor> k, std::vector<at::Tensor> v) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(),
                "CpuDecoder: one K and one V buffer per layer");
    for (size_t i = 0; i < k.size(); ++i) {
      for (const auto* t : {&k[i], &v[i]}) {
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                        t->size(1) == kv_heads_ && t->size(2) == head_dim_,
                    "CpuDecoder: pool buffers must be float32 [slots, kv_heads, head_dim]");
      }
    }
    k_ = std::move(k);
    v_ = std::move(v);
  }

  // x: float32 [B, hidden] (the rows' embeddings); cos, sin: float32 [B, head_dim] rows of
  // the rows' positions; table: int64 [requests, context] (slots by position); rows, seq_lens,
  // out_loc: int64 [B]. Stores each row's K and V at out_loc, attends to the row's first
  // seq_len slots, and returns the final norm of the last layer's output, float32 [B, hidden].
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor table,
                     at::Tensor rows, at::Tensor seq_lens, at::Tensor out_loc) {
    TORCH_CHECK(!k_.empty(), "CpuDecoder: set_pool was never called");
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == hidden_ &&
                    x.is_contiguous(),
                "CpuDecoder: x must be float32 [B, hidden]");
    const int64_t B = x.size(0);
    for (const auto* t : {&cos, &sin}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                      t->numel() == B * head_dim_,
                  "CpuDecoder: cos and sin must be float32 [B, head_dim]");
    }
    for (const auto* t : {&rows, &seq_lens, &out_loc}) {
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == B,
                  "CpuDecoder: rows, seq_lens and out_loc must be int64 [B]");
    }
    TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.is_contiguous(),
                "CpuDecoder: table must be int64 [requests, context]");
    const int64_t* row = rows.data_ptr<int64_t>();
    const int64_t* len = seq_lens.data_ptr<int64_t>();
    const int64_t* loc = out_loc.data_ptr<int64_t>();
    const int64_t slots = k_[0].size(0), width = table.size(1);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(row[b] >= 0 && row[b] < table.size(0), "CpuDecoder: row ", row[b]);
      TORCH_CHECK(len[b] >= 1 && len[b] <= width, "CpuDecoder: seq_len ", len[b]);
      TORCH_CHECK(loc[b] >= 0 && loc[b] < slots, "CpuDecoder: out_loc ", loc[b]);
      const int64_t* slot = table.data_ptr<int64_t>() + row[b] * width;
      for (int64_t j = 0; j < len[b]; ++j) {
        TORCH_CHECK(slot[j] >= 0 && slot[j] < slots, "CpuDecoder: row ", row[b], " position ",
                    j, " holds slot ", slot[j], ", outside the pool");
      }
    }

    const int64_t H = hidden_, D = head_dim_;
    const int64_t q_size = heads_ * D, kv_size = kv_heads_ * D;
    at::Tensor out = at::empty({B, H}, x.options());
    std::vector<float> res(x.data_ptr<float>(), x.data_ptr<float>() + B * H);
    std::vector<float> delta(B * H), normed(B * H), qkv(B * (q_size + 2 * kv_size)),
        attn(B * q_size), gate_up(B * 2 * inter_), act(B * inter_);
    const float* cs = cos.data_ptr<float>();
    const float* sn = sin.data_ptr<float>();
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      // The residual stream gains the previous sublayer's output, then is normed (layer 0:
      // the embeddings themselves are the residual).
      add_and_norm(res, delta, l > 0, layer.input_norm, normed, B);
      linear(layer.qkv, normed.data(), B, qkv.data());
      const int64_t width_qkv = q_size + 2 * kv_size;
      for (int64_t b = 0; b < B; ++b) {
        float* r = qkv.data() + b * width_qkv;
        for (int64_t h = 0; h < heads_ + kv_heads_; ++h) {
          float* head = r + h * D;
          if (qk_norm_) {
            const at::Tensor& w = h < heads_ ? layer.q_norm : layer.k_norm;
            float tmp[512];
            rmsnorm(head, w.data_ptr<float>(), tmp, D, eps_);
            std::memcpy(head, tmp, D * sizeof(float));
          }
          rotate(head, cs + b * D, sn + b * D, D);
        }
        float* kd = k_[l].data_ptr<float>() + loc[b] * kv_size;
        float* vd = v_[l].data_ptr<float>() + loc[b] * kv_size;
        std::memcpy(kd, r + q_size, kv_size * sizeof(float));
        std::memcpy(vd, r + q_size + kv_size, kv_size * sizeof(float));
      }
      attend(l, qkv.data(), width_qkv, table.data_ptr<int64_t>(), width, row, len, B,
             attn.data());
      linear(layer.o, attn.data(), B, delta.data());
      add_and_norm(res, delta, true, layer.post_norm, normed, B);
      linear(layer.gate_up, normed.data(), B, gate_up.data());
      silu_and_mul(gate_up.data(), act.data(), B, inter_);
      linear(layer.down, act.data(), B, delta.data());
    }
    add_and_norm(res, delta, true, final_norm_, normed, B);
    std::memcpy(out.data_ptr<float>(), normed.data(), B * H * sizeof(float));
    return out;
  }

 private:
  // res += delta (when `add`), then normed = rmsnorm(res) row by row.
  void add_and_norm(std::vector<float>& res, const std::vector<float>& delta, bool add,
                    const at::Tensor& w, std::vector<float>& normed, int64_t B) const {
    const int64_t H = hidden_;
    if (add) {
      for (int64_t i = 0; i < B * H; ++i) res[i] = res[i] + delta[i];
    }
    for (int64_t b = 0; b < B; ++b) {
      rmsnorm(res.data() + b * H, w.data_ptr<float>(), normed.data() + b * H, H, eps_);
    }
  }

  // y [B, L.out] = x [B, L.in] @ W.T (+ bias): each segment through torch's int4 kernel
  // with x rounded to bfloat16 (round to nearest even, as .to(torch.bfloat16)), its bfloat16
  // output widened to float32 and the bias added after, as the Python path does.
  void linear(const Linear& L, const float* x, int64_t B, float* y) const {
    int64_t start = 0;
    for (const Segment& s : L.segments) {
      const int64_t k = s.feed == kSame ? L.in : 2 * L.in;
      at::Tensor xb = at::empty({B, k}, at::TensorOptions().dtype(at::kBFloat16));
      BFloat16* p = xb.data_ptr<BFloat16>();
      for (int64_t b = 0; b < B; ++b) {
        const float* xr = x + b * L.in;
        BFloat16* pr = p + b * k;
        if (s.feed == kSame) {
          for (int64_t i = 0; i < L.in; ++i) pr[i] = BFloat16(xr[i]);
        } else if (s.feed == kTwice) {
          for (int64_t i = 0; i < L.in; ++i) pr[i] = pr[L.in + i] = BFloat16(xr[i]);
        } else {
          for (int64_t g = 0; g < L.in / 16; ++g) {
            for (int64_t i = 0; i < 16; ++i) {
              const BFloat16 v(xr[g * 16 + i]);
              pr[g * 32 + i] = BFloat16(static_cast<float>(v) * 8.f);  // exact
              pr[g * 32 + 16 + i] = v;
            }
          }
        }
      }
      at::Tensor yb = at::_weight_int4pack_mm_for_cpu(xb, s.packed, group_, s.table);
      const BFloat16* q = yb.data_ptr<BFloat16>();
      const float* bias = L.bias.defined() ? L.bias.data_ptr<float>() + start : nullptr;
      for (int64_t b = 0; b < B; ++b) {
        float* yr = y + b * L.out + start;
        const BFloat16* qr = q + b * s.rows;
        for (int64_t i = 0; i < s.rows; ++i) {
          yr[i] = bias ? static_cast<float>(qr[i]) + bias[i] : static_cast<float>(qr[i]);
        }
      }
      start += s.rows;
    }
  }

  // Each row's query heads against its first seq_len slots' keys (query head h reads KV
  // head h / (heads / kv_heads)), softmax(q.k * scale) @ v; one (row, KV head) per task.
  void attend(size_t l, const float* qkv, int64_t width_qkv, const int64_t* table,
              int64_t width, const int64_t* row, const int64_t* len, int64_t B,
              float* out) const {
    const int64_t D = head_dim_, G = heads_ / kv_heads_, kv_size = kv_heads_ * D;
    const float scale = 1.f / std::sqrt(static_cast<float>(D));
    const float* kp = k_[l].data_ptr<float>();
    const float* vp = v_[l].data_ptr<float>();
    int64_t keys = 0;
    for (int64_t b = 0; b < B; ++b) keys += len[b];
    // Small steps stay on this thread: a parallel region costs microseconds.
    const int64_t grain = keys * G * D * kv_heads_ < (1 << 18) ? B * kv_heads_ : 1;
    at::parallel_for(0, B * kv_heads_, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / kv_heads_, kvh = task % kv_heads_, n = len[b];
        const int64_t* slot = table + row[b] * width;
        scores.assign(G * n, 0.f);
        const float* q = qkv + b * width_qkv + kvh * G * D;
        for (int64_t j = 0; j < n; ++j) {
          // The slots are scattered over the pool: ask for the key row a few ahead, and for
          // this key's value row, which the products below read.
          if (j + kAhead < n) prefetch(kp + slot[j + kAhead] * kv_size + kvh * D, D);
          prefetch(vp + slot[j] * kv_size + kvh * D, D);
          const float* kr = kp + slot[j] * kv_size + kvh * D;
          for (int64_t g = 0; g < G; ++g) scores[g * n + j] = dot(q + g * D, kr, D) * scale;
        }
        for (int64_t g = 0; g < G; ++g) {
          float* s = scores.data() + g * n;
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
          for (int64_t j = 0; j < n; ++j) s[j] = exp_approx(s[j] - m);
          const float total = sum(s, n);
          float* o = out + b * heads_ * D + (kvh * G + g) * D;
          std::fill(o, o + D, 0.f);
          for (int64_t j = 0; j < n; ++j) {
            const float* vr = vp + slot[j] * kv_size + kvh * D;
            const float p = s[j];
            for (int64_t d = 0; d < D; ++d) o[d] += p * vr[d];
          }
          const float inv = 1.f / total;
          for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        }
      }
    });
  }

  float eps_;
  int64_t hidden_ = 0, heads_ = 0, kv_heads_ = 0, head_dim_ = 0, inter_ = 0, group_ = 0;
  bool qk_norm_ = false;
  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  std::vector<at::Tensor> k_, v_;
};

}  // namespace

TORCH_LIBRARY(braid_cpu, m) {
  m.class_<CpuDecoder>("CpuDecoder")
      .def(torch::init<std::vector<int64_t>, double, std::vector<at::Tensor>,
                       std::vector<int64_t>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>>())
      .def("set_pool", &CpuDecoder::set_pool)
      .def("forward", &CpuDecoder::forward);
}
