// Decode attention over many caches in one call, prefill attention over many prompts in one call, and a Llama
// layer's pointwise ops in one pass each (the CPU seam of dejavu_engine.native; the prefill kernel and the
// pointwise ops are described where they start, below).
//
// One query token per row. Row r first writes its new key and value at position end_r - 1 of its
// cache, then reads keys and values [start_r, end_r) of row `index_r` of group
// `group_r`'s cache, so rows of differently sized microbatches, each at its own length, attend in
// one parallel loop instead of one attention call per microbatch. Caches are
// [batch, kv_heads, max_len, head_dim] and contiguous; the q heads of one kv head are done
// together, so each key and value is read once per row. paged_decode_attention does the same over a
// paged cache: fixed-size blocks in shared slabs, found through each row's block table.
//
// Tensors are float32 or bfloat16, all of one dtype. bfloat16 keys and values are widened to float32 as
// they are loaded (a shift), every score, softmax and sum is float32, and the output is rounded once to
// bfloat16 (nearest even), as torch's CPU attention does for bfloat16 inputs. Where the CPU has AVX512-BF16,
// bfloat16 decode and prefill run on its bfloat16 dot products instead (attend_bf16 and prefill_rows_bf16, below:
// scores and sums still float32, each probability rounded to bfloat16 before it weighs the values, as torch does).
//
// The build is for the host's CPU (-march=native): 16-lane AVX-512 loops where it has AVX-512, 8-lane AVX2
// ones where it has AVX2, plain loops the compiler vectorizes elsewhere. On the 2-core AVX-512 host of
// docs/benchmarks.md the AVX-512 softmax alone took a decode step's attention (16 rows of 1000 positions,
// 30 layers) from 18.0 to 13.8 ms in bfloat16 and from 26.3 to 23.4 ms in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// e^x, x clamped to [-87, 88] (past it e^x under- or overflows float32 anyway): x = n ln 2 + r with n the
// nearest integer to x log2 e and ln 2 in two parts (r exact to float32's precision, |r| <= ln 2 / 2), e^r by
// a degree-7 polynomial (Cephes' expf), 2^n in the exponent bits. Relative error about 1e-7 (1-2 ulp; a
// first version took the fraction of x log2 e on [0, 1) and was off by up to 9e-6). Vectorizes.
inline float exp_any(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.4426950408889634f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

using BF16 = c10::BFloat16;

inline float to_float(float x) { return x; }
inline float to_float(BF16 x) { return static_cast<float>(x); }

// Asks for the cache lines of [p, p + bytes) ahead of their use: into L1 (locality 3) or L2 (2); a
// no-op where unsupported.
template <int locality = 3>
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(c + line, 0, locality);
}

// Store n float32 values as T (bfloat16: rounded to nearest even).
inline void store(const float* x, int64_t n, float* out) { std::memcpy(out, x, sizeof(float) * n); }
inline void store(const float* x, int64_t n, BF16* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = BF16(x[i]);
}

// The vector kernels below are written once over a lane type: Lanes8 (AVX2) or, where the host has
// AVX-512 (the build is for its CPU: -march=native), Lanes16, half the instructions and as fast again
// where the FMA units are 512 bits wide.
#if defined(__AVX2__) && defined(__FMA__)
struct Lanes8 {
  using V = __m256;
  static constexpr int W = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  // Eight bfloat16 as float32: the 16 bits are a float32's upper half.
  static V load(const BF16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V broadcast(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#endif

#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static constexpr int W = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const BF16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V broadcast(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V x) { return _mm512_reduce_add_ps(x); }
};
#endif

// Keeps a loaded vector in a register: without it GCC folds the load into each FMA that uses it (a memory
// operand), so a vector shared by four rows' FMAs was loaded four times, and the prefill loops were bound by
// loads instead of FMAs (a prefill tile's scores 2x slower per FMA than its value sums).
template <typename V>
inline void in_register(V& x) {
  asm("" : "+v"(x));
}

#if defined(__AVX512F__)
// The 64 bytes at p, loaded into a register that the compiler cannot fold into the instructions that use it (an
// array element held with in_register was also stored to the stack on every iteration, and a pair of keys held
// so had one reloaded from the stack).
inline __m512i load_kept(const void* p) {
  __m512i x;
  asm("vmovdqu64 %1, %0" : "=v"(x) : "m"(*static_cast<const char(*)[64]>(p)));
  return x;
}
#endif

// n values of type T as float32: the pointer itself for float32, a copy in ``out`` for bfloat16 (a query,
// or a chunk of V widened once for the heads that share it).
inline const float* widen(const float* x, int64_t, std::vector<float>&) { return x; }
inline const float* widen(const BF16* x, int64_t n, std::vector<float>& out) {
  out.resize(n);
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + Lanes8::W <= n; i += Lanes8::W) Lanes8::store(out.data() + i, Lanes8::load(x + i));
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
  return out.data();
}

#if defined(__AVX2__) && defined(__FMA__)
// scores[h * ld + j] = scale * q[h] . k[j] for h < g, j < n, head_dim = L::W * C (C even): each key is
// loaded once for the g heads that share it (ld > n where k is one chunk of a longer span, as in a paged
// cache). The keys ahead and this key's value are prefetched, so the value pass that follows finds them
// in cache (one row's K and V of one kv head are a few hundred KB at most).
template <class L, int C, typename T>
void dot_keys_heads(const float* q, int64_t g, const T* k, const T* v, int64_t n, float scale, float* scores,
                    int64_t ld) {
  constexpr int64_t d = L::W * C;
  constexpr int64_t bytes = d * sizeof(T);  // of one key
  constexpr int64_t ahead = 8;  // keys
  for (int64_t j = 0; j < n; ++j) {
    const T* kj = k + j * d;
    if (j + ahead < n) prefetch_lines(kj + ahead * d, bytes);
    prefetch_lines<2>(v + j * d, bytes);
    typename L::V kv[C];
    for (int c = 0; c < C; ++c) kv[c] = L::load(kj + L::W * c);
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = q + h * d;
      auto a0 = L::mul(L::load(qh), kv[0]);
      auto a1 = L::mul(L::load(qh + L::W), kv[1]);
      for (int c = 2; c < C; c += 2) {
        a0 = L::fma(L::load(qh + L::W * c), kv[c], a0);
        a1 = L::fma(L::load(qh + L::W * (c + 1)), kv[c + 1], a1);
      }
      scores[h * ld + j] = L::sum(L::add(a0, a1)) * scale;
    }
  }
}

// out = sum_j p[j] * v[j] over j < n, head_dim = L::W * C (accumulators kept in registers); out += that
// where `accumulate` (the chunks of a span after its first).
template <class L, int C>
void weigh_values(const float* p, const float* v, int64_t n, float* out, bool accumulate) {
  typename L::V acc[C];
  for (int c = 0; c < C; ++c) acc[c] = accumulate ? L::load(out + L::W * c) : L::zero();
  for (int64_t j = 0; j < n; ++j) {
    const auto pj = L::broadcast(p[j]);
    const float* vj = v + j * L::W * C;
    for (int c = 0; c < C; ++c) acc[c] = L::fma(pj, L::load(vj + L::W * c), acc[c]);
  }
  for (int c = 0; c < C; ++c) L::store(out + L::W * c, acc[c]);
}
#endif

// The same for any head_dim, left to the compiler.
template <typename T>
void dot_keys_any(const float* q, const T* k, int64_t n, int64_t d, float scale, float* scores) {
  for (int64_t j = 0; j < n; ++j) {
    const T* kj = k + j * d;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t e = 0; e < d; ++e) s += q[e] * to_float(kj[e]);
    scores[j] = s * scale;
  }
}

void weigh_values_any(const float* p, const float* v, int64_t n, int64_t d, float* out, bool accumulate) {
  if (!accumulate) std::fill(out, out + d, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * d;
#pragma omp simd
    for (int64_t e = 0; e < d; ++e) out[e] += p[j] * vj[e];
  }
}

// scores of head h land at scores[h * ld, h * ld + n).
template <typename T>
void dot_keys_heads(const float* q, int64_t g, const T* k, const T* v, int64_t n, int64_t d, float scale,
                    float* scores, int64_t ld) {
#if defined(__AVX512F__)
  if (d == 64) return dot_keys_heads<Lanes16, 4, T>(q, g, k, v, n, scale, scores, ld);
  if (d == 128) return dot_keys_heads<Lanes16, 8, T>(q, g, k, v, n, scale, scores, ld);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (d == 64) return dot_keys_heads<Lanes8, 8, T>(q, g, k, v, n, scale, scores, ld);
  if (d == 128) return dot_keys_heads<Lanes8, 16, T>(q, g, k, v, n, scale, scores, ld);
#endif
  (void)v;
  for (int64_t h = 0; h < g; ++h) dot_keys_any(q + h * d, k, n, d, scale, scores + h * ld);
}

// Values are float32 here: bfloat16 chunks are widened once for the heads that share them (widen).
void weigh_values(const float* p, const float* v, int64_t n, int64_t d, float* out, bool accumulate = false) {
#if defined(__AVX512F__)
  if (d == 64) return weigh_values<Lanes16, 4>(p, v, n, out, accumulate);
  if (d == 128) return weigh_values<Lanes16, 8>(p, v, n, out, accumulate);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (d == 64) return weigh_values<Lanes8, 8>(p, v, n, out, accumulate);
  if (d == 128) return weigh_values<Lanes8, 16>(p, v, n, out, accumulate);
#endif
  weigh_values_any(p, v, n, d, out, accumulate);
}

#if defined(__AVX512F__)
// exp_any of 16 lanes: the same reduction and polynomial, 2^n applied by scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// x rounded to bfloat16 (nearest even) and back, 16 lanes; x finite.
inline __m512 round_bf16_16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// The numerators of a softmax of n scores, e^(s_j - max s), 16 at a time (the last n % 16 through a mask): each
// group is handed to put(j, e, lanes) (e's lanes for positions j.., `lanes` the valid ones). Returns their sum.
template <class Put>
inline float softmax_numerators16(const float* s, int64_t n, Put put) {
  const int64_t whole = n - n % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < whole; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
  if (tail) m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + whole));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < whole; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), top));
    put(j, e, static_cast<__mmask16>(0xFFFF));
    total = _mm512_add_ps(total, e);
  }
  if (tail) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + whole), top));
    put(whole, e, tail);
    total = _mm512_mask_add_ps(total, tail, total, e);
  }
  return _mm512_reduce_add_ps(total);
}
#endif

// The numerators of a softmax of n scores in place, e^(s - max) (16 at a time where the build has AVX-512);
// returns their sum. With round_exps, each is rounded to bfloat16 (the sum is of the unrounded ones), as torch's
// CPU flash attention does for bfloat16 inputs before it multiplies the values.
template <bool round_exps = false>
float softmax_numerators_row(float* s, int64_t n) {
#if defined(__AVX512F__)
  return softmax_numerators16(s, n, [&](int64_t j, __m512 e, __mmask16 lanes) {
    _mm512_mask_storeu_ps(s + j, lanes, round_exps ? round_bf16_16(e) : e);
  });
#else
  float m = s[0];
  for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float e = exp_any(s[j] - m);
    s[j] = round_exps ? static_cast<float>(BF16(e)) : e;
    total += e;
  }
  return total;
#endif
}

// Softmax of each of the g rows of n scores at s[h * n], in place (max subtracted, so exp's argument <= 0);
// round_exps as softmax_numerators_row.
template <bool round_exps = false>
void softmax_rows(float* scores, int64_t g, int64_t n) {
  for (int64_t h = 0; h < g; ++h) {
    float* s = scores + h * n;
    const float inv = 1.0f / softmax_numerators_row<round_exps>(s, n);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] *= inv;
  }
}

}  // namespace

namespace {

// The dtype every tensor of a call shares: float32 or bfloat16.
void check_dtype(const torch::Tensor& t, torch::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype, what, " is ", t.scalar_type(), ", not ", dtype,
              " as the query (every tensor of a call has one dtype)");
}

torch::ScalarType call_dtype(const torch::Tensor& q) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "q is ", dtype, ": float32 or bfloat16 only");
  return dtype;
}

// A paged pool's slabs of one layer: every k and v slab of the first one's shape, of `dtype`, contiguous, on the
// CPU.
void check_slabs(const std::vector<torch::Tensor>& k_slabs, const std::vector<torch::Tensor>& v_slabs,
                 torch::ScalarType dtype) {
  const auto shape = k_slabs[0].sizes();
  for (size_t i = 0; i < k_slabs.size(); ++i) {
    const auto& k = k_slabs[i];
    const auto& v = v_slabs[i];
    TORCH_CHECK(k.sizes() == shape && v.sizes() == shape, "slab ", i, ": every k and v slab has the shape of the first, ",
                shape);
    check_dtype(k, dtype, "a k slab");
    check_dtype(v, dtype, "a v slab");
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "slab ", i, ": contiguous");
    TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), "slab ", i, ": on the CPU");
  }
}

// Every block of one row's table holding a position in [start, end) is one of the slabs' n_blocks (what = "row"
// or "segment", i its index, for the message).
void check_blocks(const int64_t* row_table, int64_t start, int64_t end, int64_t block_size, int64_t n_blocks,
                  const char* what, int64_t i) {
  for (int64_t lb = start / block_size; lb <= (end - 1) / block_size; ++lb) {
    const int64_t b = row_table[lb];
    TORCH_CHECK(0 <= b && b < n_blocks, what, " ", i, ": logical block ", lb, " is block ", b, ", not one of the ",
                n_blocks, " in the slabs");
  }
}

// Segment i's tokens [offset, offset + length) are within the call's and in no earlier segment (marked in covered).
void check_tokens(std::vector<char>& covered, int64_t offset, int64_t length, int64_t i) {
  const int64_t n_tokens = static_cast<int64_t>(covered.size());
  TORCH_CHECK(0 <= offset && 0 < length && offset + length <= n_tokens, "segment ", i, ": tokens [", offset, ", ",
              offset + length, ") are not within the call's ", n_tokens);
  for (int64_t j = offset; j < offset + length; ++j) {
    TORCH_CHECK(!covered[j], "segment ", i, ": token ", j, " is in an earlier segment too");
    covered[j] = 1;
  }
}

// A prefill's output [tokens, heads, head_dim]: tokens in no segment read 0; where every token is in one, nothing
// is left to clear.
torch::Tensor output_for(const torch::Tensor& q, const std::vector<char>& covered) {
  const bool all = std::all_of(covered.begin(), covered.end(), [](char c) { return c != 0; });
  const auto shape = {q.size(0), q.size(1), q.size(2)};
  return all ? torch::empty(shape, q.options()) : torch::zeros(shape, q.options());
}

// Keys and values of one kv head of one row, for attend_bf16: `n` positions in order at `k` and `v` (head_dim
// apart). A paged row is one chunk per block, a contiguous cache one chunk.
struct Chunk {
  const BF16* k;
  const BF16* v;
  int64_t n;
};

// Whether bfloat16 decode attention runs through attend_bf16 (below): on a CPU with AVX512-BF16, for heads of
// a multiple of 32 dims up to 128 and at most 8 q heads per kv head.
inline bool bf16_dot_products(int64_t d, int64_t g) {
#if defined(__AVX512BF16__)
  return g <= 8 && d % 32 == 0 && d <= 128;
#else
  (void)d, (void)g;
  return false;
#endif
}

#if defined(__AVX512BF16__)
// ---- bfloat16 decode, paged or contiguous, on the CPU's bfloat16 dot products (AVX512-BF16) ----
//
// The attention of paged_rows<BF16> and decode_rows<BF16>, in fewer instructions: widening every key and value to float32
// made the bfloat16 kernel compute-bound, as slow per step as the float32 one over twice the bytes.
// vdpbf16ps multiplies bfloat16 pairs exactly and adds them into float32 lanes, so:
// - q . k runs on the stored bfloat16 values directly, C = head_dim / 32 instructions per key and head; a
//   run of 16 keys is summed across lanes in one shuffle tree (about 3 instructions per key and head,
//   instead of a horizontal sum of about 8 each);
// - each e^(s - max) is rounded to bfloat16 (the sum is of the unrounded ones), as torch's CPU flash
//   attention rounds before it multiplies the values; the values of two keys are interleaved in pairs
//   (one unpack per 32 dims), so p_j v_j + p_j+1 v_j+1 is one instruction per 16 dims, and the sum is
//   divided out at the end.
// Scores, sums and the output accumulate in float32 and the output is rounded once. (vdpbf16ps treats
// denormal inputs as zero: a probability below 2^-126 of the largest weighs nothing.)
constexpr int64_t kKeys = 16;

// dot[j] = q . k[j] over 16 keys (C zmm of 32 bfloat16 each), summed across lanes by a transpose tree.
template <int C>
inline __m512 dot16_bf16(const __m512bh* qh, const BF16* k) {
  constexpr int64_t d = 32 * C;
  __m512 acc[kKeys];
  for (int j = 0; j < kKeys; ++j) {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) {
      a = _mm512_dpbf16_ps(a, qh[c], (__m512bh)_mm512_loadu_si512(k + j * d + 32 * c));
    }
    acc[j] = a;
  }
  // 16 vectors of 16 partial sums -> 8 of 2 x 8 -> 4 of 4 x 4 -> 2 of 8 x 2 -> 1 of 16 x 1.
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  }
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  // Lane 4m + t of z holds key m + 4t.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// q . k of one key, summed across lanes.
template <int C>
inline float dot1_bf16(const __m512bh* qh, const BF16* k) {
  __m512 a = _mm512_setzero_ps();
  for (int c = 0; c < C; ++c) a = _mm512_dpbf16_ps(a, qh[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
  return _mm512_reduce_add_ps(a);
}

// The g q heads at `q` attend over the `n_chunks` chunks (`n` positions in all) into `out` (g * d).
template <int C>
void attend_bf16(const BF16* q, int64_t g, const Chunk* chunks, int64_t n_chunks, int64_t n, float scale,
                 std::vector<float>& scores, std::vector<uint16_t>& probs, BF16* out) {
  constexpr int64_t d = 32 * C;
  constexpr int64_t row_bytes = d * static_cast<int64_t>(sizeof(BF16));
  scores.resize(g * n);
  probs.resize(g * n);  // e^(s - max) as bfloat16 bits, per head
  __m512bh qv[8][C];    // g <= 8
  for (int64_t h = 0; h < g; ++h) {
    for (int c = 0; c < C; ++c) qv[h][c] = (__m512bh)_mm512_loadu_si512(q + h * d + 32 * c);
  }
  // 16 keys at a time, each read once from memory for the g heads, their values asked for into L2 for the
  // value pass, and the keys 32 positions ahead into L1 (so memory and arithmetic overlap: without it a
  // contiguous cache's 16 x 1000 positions took the time of both added up). A paged row's chunks are blocks
  // that lie anywhere, which the hardware prefetcher cannot guess: the keys two chunks ahead are asked for
  // into L1, the keys and values five ahead into the outer caches (as paged_rows does).
  if (n_chunks > 1) prefetch_lines(chunks[1].k, chunks[1].n * row_bytes);
  float* s0 = scores.data();
  for (int64_t i = 0; i < n_chunks; ++i) {
    const Chunk& ch = chunks[i];
    if (i + 2 < n_chunks) prefetch_lines(chunks[i + 2].k, chunks[i + 2].n * row_bytes);
    if (i + 5 < n_chunks) {
      prefetch_lines<1>(chunks[i + 5].k, chunks[i + 5].n * row_bytes);
      prefetch_lines<1>(chunks[i + 5].v, chunks[i + 5].n * row_bytes);
    }
    int64_t j = 0;
    for (; j + kKeys <= ch.n; j += kKeys) {
      if (j + 3 * kKeys <= ch.n) prefetch_lines(ch.k + (j + 2 * kKeys) * d, kKeys * row_bytes);  // a long chunk
      prefetch_lines<2>(ch.v + j * d, kKeys * row_bytes);
      for (int64_t h = 0; h < g; ++h) {
        _mm512_storeu_ps(s0 + h * n + j,
                         _mm512_mul_ps(dot16_bf16<C>(qv[h], ch.k + j * d), _mm512_set1_ps(scale)));
      }
    }
    prefetch_lines<2>(ch.v + j * d, (ch.n - j) * row_bytes);
    for (; j < ch.n; ++j) {
      for (int64_t h = 0; h < g; ++h) s0[h * n + j] = dot1_bf16<C>(qv[h], ch.k + j * d) * scale;
    }
    s0 += ch.n;
  }
  // Softmax numerators, rounded to bfloat16; each total is of the unrounded ones.
  float totals[8];
  for (int64_t h = 0; h < g; ++h) {
    uint16_t* p = probs.data() + h * n;
    totals[h] = softmax_numerators16(scores.data() + h * n, n, [&](int64_t j, __m512 e, __mmask16 lanes) {
      _mm256_mask_storeu_epi16(p + j, lanes, (__m256i)_mm512_cvtneps_pbh(e));
    });
  }
  // sum_j p_j v_j, two keys per instruction: v_j and v_j+1 interleaved by 16-bit unpacks, so lane 4L + i of
  // the lo accumulator of 32 dims holds dim 8L + i and the hi one dim 8L + 4 + i.
  __m512 lo[8][C], hi[8][C];
  for (int64_t h = 0; h < g; ++h) {
    for (int c = 0; c < C; ++c) lo[h][c] = hi[h][c] = _mm512_setzero_ps();
  }
  const __m512i zero = _mm512_setzero_si512();
  int64_t at = 0;  // position of the chunk's first key among the n
  for (int64_t i = 0; i < n_chunks; ++i) {
    const Chunk& ch = chunks[i];
    if (i + 2 < n_chunks) prefetch_lines(chunks[i + 2].v, chunks[i + 2].n * row_bytes);
    for (int64_t j = 0; j < ch.n; j += 2) {
      if (j % kKeys == 0 && j + 3 * kKeys <= ch.n) prefetch_lines(ch.v + (j + 2 * kKeys) * d, kKeys * row_bytes);
      const bool pair = j + 1 < ch.n;  // an odd last key pairs with zeros
      __m512i va[C], vb[C];
      for (int c = 0; c < C; ++c) {
        const __m512i x = _mm512_loadu_si512(ch.v + j * d + 32 * c);
        const __m512i y = pair ? _mm512_loadu_si512(ch.v + (j + 1) * d + 32 * c) : zero;
        va[c] = _mm512_unpacklo_epi16(x, y);
        vb[c] = _mm512_unpackhi_epi16(x, y);
      }
      for (int64_t h = 0; h < g; ++h) {
        const uint16_t* ph = probs.data() + h * n + at + j;
        const uint32_t two = ph[0] | (pair ? static_cast<uint32_t>(ph[1]) << 16 : 0u);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(two));
        for (int c = 0; c < C; ++c) {
          lo[h][c] = _mm512_dpbf16_ps(lo[h][c], w, (__m512bh)va[c]);
          hi[h][c] = _mm512_dpbf16_ps(hi[h][c], w, (__m512bh)vb[c]);
        }
      }
    }
    at += ch.n;
  }
  const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = 0; h < g; ++h) {
    const __m512 inv = _mm512_set1_ps(1.0f / totals[h]);
    for (int c = 0; c < C; ++c) {
      const __m512 a = _mm512_mul_ps(_mm512_permutex2var_ps(lo[h][c], first16, hi[h][c]), inv);
      const __m512 z = _mm512_mul_ps(_mm512_permutex2var_ps(lo[h][c], second16, hi[h][c]), inv);
      _mm512_storeu_si512(out + h * d + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(z, a));
    }
  }
}

void attend_bf16(int64_t d, const BF16* q, int64_t g, const Chunk* chunks, int64_t n_chunks, int64_t n,
                 float scale, std::vector<float>& scores, std::vector<uint16_t>& probs, BF16* out) {
  switch (d / 32) {
    case 1: return attend_bf16<1>(q, g, chunks, n_chunks, n, scale, scores, probs, out);
    case 2: return attend_bf16<2>(q, g, chunks, n_chunks, n, scale, scores, probs, out);
    case 3: return attend_bf16<3>(q, g, chunks, n_chunks, n, scale, scores, probs, out);
    default: return attend_bf16<4>(q, g, chunks, n_chunks, n, scale, scores, probs, out);
  }
}
#endif

template <typename T>
void decode_rows(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                 const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                 const int64_t* meta, int64_t kv_heads, double scale, torch::Tensor& out) {
  const int64_t n_rows = q.size(0), heads = q.size(1), d = q.size(2), g = heads / kv_heads;
  std::vector<T*> kp, vp;
  std::vector<int64_t> max_len;
  for (size_t i = 0; i < k_caches.size(); ++i) {
    kp.push_back(k_caches[i].data_ptr<T>());
    vp.push_back(v_caches[i].data_ptr<T>());
    max_len.push_back(k_caches[i].size(2));
  }
  const T* qp = q.data_ptr<T>();
  const T* knp = k_new.data_ptr<T>();
  const T* vnp = v_new.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  const bool bf16_dots = std::is_same_v<T, BF16> && bf16_dot_products(d, g);
  at::parallel_for(0, n_rows * kv_heads, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> scores, qf, vf;
    std::vector<uint16_t> probs;
    std::vector<float> acc(g * d);
    for (int64_t item = begin; item < stop; ++item) {
      const int64_t r = item / kv_heads, kh = item % kv_heads;
      const int64_t grp = meta[4 * r], idx = meta[4 * r + 1], start = meta[4 * r + 2], end = meta[4 * r + 3];
      const int64_t n = end - start;
      const int64_t offset = ((idx * kv_heads + kh) * max_len[grp] + start) * d;
      T* k = kp[grp] + offset;
      T* v = vp[grp] + offset;
      std::memcpy(k + (n - 1) * d, knp + (r * kv_heads + kh) * d, sizeof(T) * d);  // this step's K/V
      std::memcpy(v + (n - 1) * d, vnp + (r * kv_heads + kh) * d, sizeof(T) * d);
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, BF16>) {
        if (bf16_dots) {
          const Chunk all{k, v, n};
          attend_bf16(d, qp + (r * heads + kh * g) * d, g, &all, 1, n, sc, scores, probs, op + (r * heads + kh * g) * d);
          continue;
        }
      }
#endif
      const float* qh = widen(qp + (r * heads + kh * g) * d, g * d, qf);
      scores.resize(g * n);
      dot_keys_heads(qh, g, k, v, n, d, sc, scores.data(), n);
      softmax_rows(scores.data(), g, n);
      const float* vw = widen(v, n * d, vf);
      for (int64_t h = 0; h < g; ++h) weigh_values(scores.data() + h * n, vw, n, d, acc.data() + h * d);
      store(acc.data(), g * d, op + (r * heads + kh * g) * d);
    }
  });
}

template <typename T>
void paged_rows(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                const std::vector<torch::Tensor>& k_slabs, const std::vector<torch::Tensor>& v_slabs,
                const int64_t* table, int64_t max_blocks, const int64_t* span, double scale, torch::Tensor& out) {
  const int64_t n_rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t slab_blocks = k_slabs[0].size(0), kv_heads = k_slabs[0].size(1), block_size = k_slabs[0].size(2);
  const int64_t g = heads / kv_heads;
  std::vector<T*> kp, vp;
  for (size_t i = 0; i < k_slabs.size(); ++i) {
    kp.push_back(k_slabs[i].data_ptr<T>());
    vp.push_back(v_slabs[i].data_ptr<T>());
  }
  const T* qp = q.data_ptr<T>();
  const T* knp = k_new.data_ptr<T>();
  const T* vnp = v_new.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  // Offset of kv head kh's position o of block id b in its slab (b's slab is b / slab_blocks).
  auto at = [&](int64_t b, int64_t kh, int64_t o) {
    return (((b % slab_blocks) * kv_heads + kh) * block_size + o) * d;
  };
  const int64_t block_bytes = block_size * d * static_cast<int64_t>(sizeof(T));  // of one kv head
  const bool bf16_dots = std::is_same_v<T, BF16> && bf16_dot_products(d, g);
  at::parallel_for(0, n_rows * kv_heads, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> scores, qf, vf;
    std::vector<uint16_t> probs;
    std::vector<Chunk> chunks;
    std::vector<float> acc(g * d);
    for (int64_t item = begin; item < stop; ++item) {
      const int64_t r = item / kv_heads, kh = item % kv_heads;
      const int64_t start = span[2 * r], end = span[2 * r + 1];
      const int64_t n = end - start;
      const int64_t* row_table = table + r * max_blocks;
      const int64_t last = row_table[(end - 1) / block_size];  // this step's K/V
      const int64_t last_at = at(last, kh, (end - 1) % block_size);
      std::memcpy(kp[last / slab_blocks] + last_at, knp + (r * kv_heads + kh) * d, sizeof(T) * d);
      std::memcpy(vp[last / slab_blocks] + last_at, vnp + (r * kv_heads + kh) * d, sizeof(T) * d);
      const int64_t first = start / block_size, past = (end - 1) / block_size + 1;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, BF16>) {
        if (bf16_dots) {
          chunks.clear();
          for (int64_t lb = first; lb < past; ++lb) {
            const int64_t lo = std::max(start, lb * block_size), hi = std::min(end, (lb + 1) * block_size);
            const int64_t b = row_table[lb], off = at(b, kh, lo - lb * block_size);
            chunks.push_back({kp[b / slab_blocks] + off, vp[b / slab_blocks] + off, hi - lo});
          }
          attend_bf16(d, qp + (r * heads + kh * g) * d, g, chunks.data(), static_cast<int64_t>(chunks.size()), n, sc,
                      scores, probs, op + (r * heads + kh * g) * d);
          continue;
        }
      }
#endif
      const float* qh = widen(qp + (r * heads + kh * g) * d, g * d, qf);
      scores.resize(g * n);
      // Chunk of logical block lb: positions [lo, hi) of the span, at offset lo - start of each head's scores.
      if (first + 1 < past) {
        const int64_t nb = row_table[first + 1];
        prefetch_lines(kp[nb / slab_blocks] + at(nb, kh, 0), block_bytes);
      }
      for (int64_t lb = first; lb < past; ++lb) {
        const int64_t lo = std::max(start, lb * block_size), hi = std::min(end, (lb + 1) * block_size);
        const int64_t b = row_table[lb], off = at(b, kh, lo - lb * block_size);
        if (lb + 2 < past) {  // blocks lie anywhere: the hardware prefetcher cannot guess them; two ahead
          const int64_t nb = row_table[lb + 2];
          prefetch_lines(kp[nb / slab_blocks] + at(nb, kh, 0), block_bytes);
        }
        // And five ahead, keys and values, into the outer caches: more misses in flight than the L1's fill
        // buffers allow (a row's walk is bound by them): 16 rows x 1000 positions 25.8 -> 23.8 ms per 30 layers
        // in float32, 14.9 -> 14.4 in bfloat16 (medians of 8 interleaved rounds; no change at 320 positions).
        if (lb + 5 < past) {
          const int64_t nb = row_table[lb + 5];
          prefetch_lines<1>(kp[nb / slab_blocks] + at(nb, kh, 0), block_bytes);
          prefetch_lines<1>(vp[nb / slab_blocks] + at(nb, kh, 0), block_bytes);
        }
        dot_keys_heads(qh, g, kp[b / slab_blocks] + off, vp[b / slab_blocks] + off, hi - lo, d, sc,
                       scores.data() + (lo - start), n);
      }
      softmax_rows(scores.data(), g, n);
      // Block-major, so each chunk of values is read once (from L1) for the g heads that share it.
      for (int64_t lb = first; lb < past; ++lb) {
        const int64_t lo = std::max(start, lb * block_size), hi = std::min(end, (lb + 1) * block_size);
        const int64_t b = row_table[lb];
        if (lb + 2 < past) {
          const int64_t nb = row_table[lb + 2];
          prefetch_lines(vp[nb / slab_blocks] + at(nb, kh, 0), block_bytes);
        }
        const float* v = widen(vp[b / slab_blocks] + at(b, kh, lo - lb * block_size), (hi - lo) * d, vf);
        for (int64_t h = 0; h < g; ++h) {
          weigh_values(scores.data() + h * n + (lo - start), v, hi - lo, d, acc.data() + h * d, lb != first);
        }
      }
      store(acc.data(), g * d, op + (r * heads + kh * g) * d);
    }
  });
}


// ---- Prefill: causal attention of prompts or prompt chunks, packed back to back (prefill_attention,
// paged_prefill_attention) ----
//
// Segment s is tokens [offset_s, offset_s + length_s) of the call, at positions [start_s, start_s + length_s) of
// one sequence: its query at position p attends causally over the sequence's keys [0, p] (start_s = 0: a whole
// prompt over its own keys only; start_s > 0: a chunk over its cached prefix and itself). Where the keys come
// from is a Source (below): the call's own k and v, or the sequence's blocks of a paged cache. Work items are
// (segment, kv head, tile of up to kTile query positions); the g q heads of a kv head and the tile's positions
// make g * tile query rows that share every key. Keys are transposed (and widened) once per call, so scores come
// out 2 * W keys at a time from broadcast FMAs, with no horizontal sums: S[rows, keys] = Q . K^T four rows at a
// time, each row's softmax over its own causal length, then O = P . V four rows (two for head_dim 128) at a time
// with the value rows loaded once for them.

constexpr int64_t kTile = 16;  // query positions per work item

struct PrefillItem {
  int64_t offset, length, kh, t0, tq;
  // Where the segment starts in the call's per-segment layouts: its first key column (key_cols of each segment
  // before it), its first pair of keys (prefill_rows_bf16's values) and its first key (prefill_rows' values).
  int64_t keys_at, pairs_at, values_at;
  int64_t start, seg;  // the position of the segment's first token (keys before it: its prefix), its index
  int64_t keys() const { return start + length; }  // the keys the segment's last query sees
};

// Where a segment's keys and values are: key(it, j) and value(it, j) point at the head_dim values of kv head
// it.kh of position j of it's sequence, j < it.keys().
// The call's own tokens (a whole prompt: position j is token offset + j); strided, the last dimension contiguous.
template <typename T>
struct TokenSource {
  const T* k;
  const T* v;
  int64_t ks0, ks1, vs0, vs1;
  TokenSource(const torch::Tensor& kt, const torch::Tensor& vt)
      : k(kt.data_ptr<T>()), v(vt.data_ptr<T>()), ks0(kt.stride(0)), ks1(kt.stride(1)), vs0(vt.stride(0)),
        vs1(vt.stride(1)) {}
  const T* key(const PrefillItem& it, int64_t j) const { return k + (it.offset + j) * ks0 + it.kh * ks1; }
  const T* value(const PrefillItem& it, int64_t j) const { return v + (it.offset + j) * vs0 + it.kh * vs1; }
};

// A paged cache (as paged_decode_attention's): position j of segment s is in block tables[s, j / block_size].
template <typename T>
struct BlockSource {
  std::vector<const T*> kb, vb;
  const int64_t* table;
  int64_t max_blocks, slab_blocks, kv_heads, block_size, d;
  BlockSource(const std::vector<torch::Tensor>& k_slabs, const std::vector<torch::Tensor>& v_slabs,
              const int64_t* tables, int64_t max_blocks_)
      : table(tables), max_blocks(max_blocks_), slab_blocks(k_slabs[0].size(0)), kv_heads(k_slabs[0].size(1)),
        block_size(k_slabs[0].size(2)), d(k_slabs[0].size(3)) {
    for (size_t i = 0; i < k_slabs.size(); ++i) {
      kb.push_back(k_slabs[i].data_ptr<T>());
      vb.push_back(v_slabs[i].data_ptr<T>());
    }
  }
  int64_t at(const PrefillItem& it, int64_t j, int64_t& slab) const {
    const int64_t b = table[it.seg * max_blocks + j / block_size];
    slab = b / slab_blocks;
    return (((b % slab_blocks) * kv_heads + it.kh) * block_size + j % block_size) * d;
  }
  const T* key(const PrefillItem& it, int64_t j) const {
    int64_t slab;
    const int64_t off = at(it, j, slab);
    return kb[slab] + off;
  }
  const T* value(const PrefillItem& it, int64_t j) const {
    int64_t slab;
    const int64_t off = at(it, j, slab);
    return vb[slab] + off;
  }
};

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Columns of a segment's transposed keys: its length rounded up to a block of 32 keys, and 16 more so that rows
// are never a multiple of 4 KB apart (1024 keys' rows all fell in the same L1 sets: 1 x 1000 bfloat16 tokens took
// 2.29 ms a call instead of 1.99).
inline int64_t key_cols(int64_t length) { return round_up(length, 32) + 16; }

// The per-segment layouts are written in parts of up to kLayoutChunk tokens (even, so that pairs of tokens do not
// straddle two parts), one per (segment, kv head, chunk): a long prompt's are shared among the threads.
constexpr int64_t kLayoutChunk = 64;

// Items dealt to n_bins bins (one per thread), longest first onto the least loaded bin: a causal tile's cost
// grows with its position, so contiguous ranges of items would leave one thread with the long ones.
std::vector<std::vector<int64_t>> deal_longest_first(const std::vector<PrefillItem>& items, int64_t n_bins) {
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  auto cost = [&](int64_t i) { return (items[i].start + items[i].t0 + items[i].tq) * items[i].tq; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  std::vector<std::vector<int64_t>> bins(n_bins);
  std::vector<int64_t> load(n_bins, 0);
  for (int64_t i : order) {
    const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    bins[b].push_back(i);
    load[b] += cost(i);
  }
  return bins;
}

// fn(it, state) for every item, the items dealt longest first onto one bin per thread; each thread makes its own
// State (its buffers) once.
template <class State, class Fn>
void for_each_item(const std::vector<PrefillItem>& items, Fn fn) {
  const int64_t n_bins = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  const auto bins = deal_longest_first(items, n_bins);
  at::parallel_for(0, n_bins, 1, [&](int64_t begin, int64_t stop) {
    State state;
    for (int64_t bin = begin; bin < stop; ++bin) {
      for (int64_t i : bins[bin]) fn(items[i], state);
    }
  });
}

// fn(it, j0, j1) for every part of the per-segment layouts: keys [j0, j1) of it's segment and kv head (`it` is
// the segment's tile at position 0 for that kv head).
template <class Fn>
void for_each_layout_part(const std::vector<PrefillItem>& items, Fn fn) {
  std::vector<std::pair<const PrefillItem*, int64_t>> parts;  // (item, first key)
  for (const PrefillItem& it : items) {
    if (it.t0 != 0) continue;
    for (int64_t j = 0; j < it.keys(); j += kLayoutChunk) parts.emplace_back(&it, j);
  }
  at::parallel_for(0, static_cast<int64_t>(parts.size()), 1, [&](int64_t begin, int64_t stop) {
    for (int64_t part = begin; part < stop; ++part) {
      const PrefillItem& it = *parts[part].first;
      fn(it, parts[part].second, std::min(it.keys(), parts[part].second + kLayoutChunk));
    }
  });
}

// The causal length of each of an item's rows: row t * g + h (position start + t0 + t, q head kh * g + h) sees
// its sequence's first start + t0 + t + 1 keys.
inline void tile_lens(const PrefillItem& it, int64_t g, std::vector<int64_t>& lens) {
  lens.resize(g * it.tq);
  for (int64_t t = 0; t < it.tq; ++t) {
    std::fill(lens.begin() + t * g, lens.begin() + (t + 1) * g, it.start + it.t0 + t + 1);
  }
}

// The items of segment `seg`: tokens [offset, offset + length) at positions [start, start + length), one per kv
// head and tile; advances the layouts' running offsets past the segment's keys.
void add_segment(std::vector<PrefillItem>& items, int64_t seg, int64_t offset, int64_t length, int64_t start,
                 int64_t kv_heads, int64_t& keys_at, int64_t& pairs_at, int64_t& values_at);

#if defined(__AVX2__) && defined(__FMA__)
// R rows' scores (rows d apart) against the 2 * W keys at kc (dims ldk apart), into s (rows lds apart).
template <class L, int R>
inline void prefill_scores_rows(const float* q, int64_t d, const float* kc, int64_t ldk, float* s, int64_t lds) {
  constexpr int64_t W = L::W;
  typename L::V a[R][2];
  for (int i = 0; i < R; ++i) a[i][0] = a[i][1] = L::zero();
  for (int64_t e = 0; e < d; ++e) {
    auto k0 = L::load(kc + e * ldk), k1 = L::load(kc + e * ldk + W);
    asm("" : "+v"(k0), "+v"(k1));  // in_register, both at once
    for (int i = 0; i < R; ++i) {
      const auto b = L::broadcast(q[i * d + e]);
      a[i][0] = L::fma(b, k0, a[i][0]);
      a[i][1] = L::fma(b, k1, a[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    L::store(s + i * lds, a[i][0]);
    L::store(s + i * lds + W, a[i][1]);
  }
}

// s[r * lds + j] = qf[r] . kt[:, j] for the rows' keys j < lens[r] (rounded up to 2 * W; those past a row's
// length are computed and later masked). kt is [d][ldk]: keys along a row. Eight rows at a time on AVX-512, four
// on AVX2. Not inlined: inside the item loop GCC kept integers in vector registers and spilled (see
// prefill_scores_bf16).
template <class L>
__attribute__((noinline)) void prefill_scores(const float* qf, int64_t rows, int64_t d, const float* kt, int64_t ldk,
                                              const int64_t* lens, float* s, int64_t lds) {
  constexpr int64_t KB = 2 * L::W;
  const int64_t cols = round_up(lens[rows - 1], KB);  // lens never decrease along the rows
  for (int64_t jb = 0; jb < cols; jb += KB) {  // one block of keys stays in L1 for every row that needs it
    int64_t r = 0;
    while (r < rows && lens[r] <= jb) ++r;
    if constexpr (L::W == 16) {  // 16 accumulators: AVX-512 has the registers for them, AVX2 not
      for (; r + 8 <= rows; r += 8) prefill_scores_rows<L, 8>(qf + r * d, d, kt + jb, ldk, s + r * lds + jb, lds);
    }
    for (; r + 4 <= rows; r += 4) prefill_scores_rows<L, 4>(qf + r * d, d, kt + jb, ldk, s + r * lds + jb, lds);
    for (; r < rows; ++r) prefill_scores_rows<L, 1>(qf + r * d, d, kt + jb, ldk, s + r * lds + jb, lds);
  }
}

// out[r] = inv[r] * sum_j p[r * lds + j] * vf[j] over j < the largest length of the rows done together (p is 0
// past each row's own), head_dim = W * C, R rows at a time so that each value row is loaded once for R rows.
template <class L, int C>
void prefill_values(const float* p, int64_t rows, const int64_t* lens, int64_t lds, const float* vf, const float* inv,
                    float* const* out) {
  constexpr int R = C <= 4 ? 4 : 2;  // at most 16 accumulators
  constexpr int64_t d = L::W * C;
  int64_t r = 0;
  for (; r + R <= rows; r += R) {
    typename L::V acc[R][C];
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < C; ++c) acc[i][c] = L::zero();
    const int64_t n = lens[r + R - 1];
    for (int64_t j = 0; j < n; ++j) {
      typename L::V vj[C];
      for (int c = 0; c < C; ++c) {
        vj[c] = L::load(vf + j * d + L::W * c);
        in_register(vj[c]);
      }
      for (int i = 0; i < R; ++i) {
        const auto b = L::broadcast(p[(r + i) * lds + j]);
        for (int c = 0; c < C; ++c) acc[i][c] = L::fma(b, vj[c], acc[i][c]);
      }
    }
    for (int i = 0; i < R; ++i) {
      const auto scale = L::broadcast(inv[r + i]);
      for (int c = 0; c < C; ++c) L::store(out[r + i] + L::W * c, L::mul(acc[i][c], scale));
    }
  }
  for (; r < rows; ++r) {
    weigh_values<L, C>(p + r * lds, vf, lens[r], out[r], false);
    for (int c = 0; c < C; ++c) L::store(out[r] + L::W * c, L::mul(L::load(out[r] + L::W * c), L::broadcast(inv[r])));
  }
}
#endif

// The same for any lane width and head_dim, left to the compiler.
void prefill_scores_any(const float* qf, int64_t rows, int64_t d, const float* kt, int64_t ldk, const int64_t* lens,
                        float* s, int64_t lds) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * lds;
    std::fill(sr, sr + lens[r], 0.0f);
    for (int64_t e = 0; e < d; ++e) {
      const float qe = qf[r * d + e];
      const float* ke = kt + e * ldk;
#pragma omp simd
      for (int64_t j = 0; j < lens[r]; ++j) sr[j] += qe * ke[j];
    }
  }
}

void prefill_values_any(const float* p, int64_t rows, const int64_t* lens, int64_t lds, const float* vf, int64_t d,
                        const float* inv, float* const* out) {
  for (int64_t r = 0; r < rows; ++r) {
    weigh_values(p + r * lds, vf, lens[r], d, out[r]);
#pragma omp simd
    for (int64_t e = 0; e < d; ++e) out[r][e] *= inv[r];
  }
}

void prefill_scores_dispatch(const float* qf, int64_t rows, int64_t d, const float* kt, int64_t ldk,
                             const int64_t* lens, float* s, int64_t lds) {
#if defined(__AVX512F__)
  return prefill_scores<Lanes16>(qf, rows, d, kt, ldk, lens, s, lds);
#elif defined(__AVX2__) && defined(__FMA__)
  return prefill_scores<Lanes8>(qf, rows, d, kt, ldk, lens, s, lds);
#else
  return prefill_scores_any(qf, rows, d, kt, ldk, lens, s, lds);
#endif
}

void prefill_values_dispatch(const float* p, int64_t rows, const int64_t* lens, int64_t lds, const float* vf,
                             int64_t d, const float* inv, float* const* out) {
#if defined(__AVX512F__)
  if (d == 16) return prefill_values<Lanes16, 1>(p, rows, lens, lds, vf, inv, out);
  if (d == 32) return prefill_values<Lanes16, 2>(p, rows, lens, lds, vf, inv, out);
  if (d == 64) return prefill_values<Lanes16, 4>(p, rows, lens, lds, vf, inv, out);
  if (d == 128) return prefill_values<Lanes16, 8>(p, rows, lens, lds, vf, inv, out);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (d == 8) return prefill_values<Lanes8, 1>(p, rows, lens, lds, vf, inv, out);
  if (d == 16) return prefill_values<Lanes8, 2>(p, rows, lens, lds, vf, inv, out);
  if (d == 32) return prefill_values<Lanes8, 4>(p, rows, lens, lds, vf, inv, out);
  if (d == 64) return prefill_values<Lanes8, 8>(p, rows, lens, lds, vf, inv, out);
#endif
  prefill_values_any(p, rows, lens, lds, vf, d, inv, out);
}

template <typename T, class Source>
void prefill_rows(const torch::Tensor& q, const Source& src, int64_t kv_heads, const std::vector<PrefillItem>& items,
                  double scale, torch::Tensor& out) {
  const int64_t heads = q.size(1), d = q.size(2), g = heads / kv_heads;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Per kv head and segment, contiguous (a tile's keys and values are one block of memory): the segment's keys
  // transposed and widened ([d][cols] floats, cols = key_cols(keys), zero past its last key: a tile's keys
  // are read in blocks of 2 * W, those past a row's length masked), and its values widened ([keys][d]).
  const PrefillItem& last = items.back();  // of the last segment: the layout's size
  const int64_t total_cols = last.keys_at + key_cols(last.keys()), total_keys = last.values_at + last.keys();
  std::unique_ptr<float[]> kt(new float[kv_heads * total_cols * d]), vf(new float[kv_heads * total_keys * d]);
  auto keys_of = [&](const PrefillItem& it) { return kt.get() + (it.kh * total_cols + it.keys_at) * d; };
  auto values_of = [&](const PrefillItem& it) { return vf.get() + (it.kh * total_keys + it.values_at) * d; };
  for_each_layout_part(items, [&](const PrefillItem& it, int64_t j0, int64_t j1) {
    const int64_t cols = key_cols(it.keys());
    float* ktk = keys_of(it);
    for (int64_t j = j0; j < j1; ++j) {
      const T* kj = src.key(it, j);
      for (int64_t e = 0; e < d; ++e) ktk[e * cols + j] = to_float(kj[e]);
      const T* vj = src.value(it, j);
      float* vfj = values_of(it) + j * d;
      for (int64_t e = 0; e < d; ++e) vfj[e] = to_float(vj[e]);
    }
    if (j1 == it.keys()) {
      for (int64_t e = 0; e < d; ++e) std::fill(ktk + e * cols + it.keys(), ktk + (e + 1) * cols, 0.0f);
    }
  });
  struct Buffers {
    std::vector<float> qf, s, o, inv;  // scaled queries, scores, outputs (bfloat16's, before rounding), 1 / sums
    std::vector<int64_t> lens;
    std::vector<float*> dst;  // each row's output
  };
  const float sc = static_cast<float>(scale);
  for_each_item<Buffers>(items, [&](const PrefillItem& it, Buffers& b) {
    const int64_t rows = g * it.tq;
    const int64_t lds = round_up(it.start + it.t0 + it.tq, 32);
    b.qf.resize(rows * d);
    b.s.resize(rows * lds);
    b.o.resize(rows * d);
    b.inv.resize(rows);
    b.dst.resize(rows);
    tile_lens(it, g, b.lens);
    for (int64_t t = 0; t < it.tq; ++t) {  // row t * g + h: position t0 + t, q head kh * g + h
      for (int64_t h = 0; h < g; ++h) {
        const T* src = qp + (it.offset + it.t0 + t) * qs0 + (it.kh * g + h) * qs1;
        float* row = b.qf.data() + (t * g + h) * d;
        for (int64_t e = 0; e < d; ++e) row[e] = to_float(src[e]) * sc;
      }
    }
    prefill_scores_dispatch(b.qf.data(), rows, d, keys_of(it), key_cols(it.keys()), b.lens.data(), b.s.data(), lds);
    // The softmax's numerators weigh the values, and each row's sum is divided out of its output at the end
    // (as torch's flash attention divides), not out of every probability first.
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = b.s.data() + r * lds;
      b.inv[r] = 1.0f / softmax_numerators_row<std::is_same_v<T, BF16>>(sr, b.lens[r]);  // bfloat16: rounded
      std::fill(sr + b.lens[r], sr + lds, 0.0f);  // rows done together read up to the longest of them
    }
    // float32 rows land in the output; bfloat16 ones are rounded into it from o.
    for (int64_t t = 0; t < it.tq; ++t) {
      float* row = b.o.data() + t * g * d;
      if constexpr (std::is_same_v<T, float>) row = op + ((it.offset + it.t0 + t) * heads + it.kh * g) * d;
      for (int64_t h = 0; h < g; ++h) b.dst[t * g + h] = row + h * d;
    }
    prefill_values_dispatch(b.s.data(), rows, b.lens.data(), lds, values_of(it), d, b.inv.data(), b.dst.data());
    if constexpr (std::is_same_v<T, BF16>) {
      for (int64_t t = 0; t < it.tq; ++t) {
        store(b.o.data() + t * g * d, g * d, op + ((it.offset + it.t0 + t) * heads + it.kh * g) * d);
      }
    }
  });
}

#if defined(__AVX512BF16__)
// ---- bfloat16 prefill on the CPU's bfloat16 dot products (AVX512-BF16) ----
//
// prefill_rows<BF16> widens every key and value to float32 and runs at float32's FMA rate; where the CPU has
// AVX512-BF16, a head_dim that is a multiple of 32 up to 128 runs the same items, tiles and causal lengths on
// vdpbf16ps instead, two multiply-adds per lane:
// - keys transposed in pairs of dims once per call: lane j of pair row i of a kv head holds key j's dims 2i and
//   2i + 1, so a query row's broadcast pair of dims times one vector is 16 keys' partial sums;
// - each segment's values interleaved in pairs of tokens once per call: lane e of pair m holds dim e of the
//   segment's tokens 2m and 2m + 1 (an odd last token pairs with zeros), so a row's broadcast pair of
//   probabilities weighs two value rows per instruction;
// - scores are q . k on the stored values times the scale (as torch's CPU flash attention scales after its
//   bfloat16 GEMM); each row's numerators are rounded to bfloat16 and the sum of the unrounded ones is divided
//   out at the end, as prefill_rows<BF16> does. (vdpbf16ps treats denormal inputs as zero: a probability below
//   2^-126 of the row's largest weighs nothing.)

// Scores of R query rows (pairs of dims, pairs apart) against the 32 keys at kc (pair rows ldk apart), times
// the scale, into s (rows lds apart).
template <int R>
inline void prefill_scores_bf16_rows(const uint32_t* q, int64_t pairs, const uint32_t* kc, int64_t ldk, __m512 scale,
                                     float* s, int64_t lds) {
  __m512 a[R][2];
  for (int i = 0; i < R; ++i) a[i][0] = a[i][1] = _mm512_setzero_ps();
  for (int64_t e = 0; e < pairs; ++e) {
    const __m512i k0 = load_kept(kc + e * ldk), k1 = load_kept(kc + e * ldk + 16);
    for (int i = 0; i < R; ++i) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(q[i * pairs + e]));
      a[i][0] = _mm512_dpbf16_ps(a[i][0], b, (__m512bh)k0);
      a[i][1] = _mm512_dpbf16_ps(a[i][1], b, (__m512bh)k1);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(s + i * lds, _mm512_mul_ps(a[i][0], scale));
    _mm512_storeu_ps(s + i * lds + 16, _mm512_mul_ps(a[i][1], scale));
  }
}

// s[r * lds + j] = scale * q[r] . k[j] for the rows' keys j < lens[r] (rounded up to 32; those past a row's
// length are computed and never read), eight rows at a time (16 accumulators: vdpbf16ps's latency needs more
// in flight than an FMA's). Not inlined: inside the item loop GCC kept integers in vector registers and spilled a
// key vector on every iteration.
__attribute__((noinline)) void prefill_scores_bf16(const uint32_t* q, int64_t rows, int64_t pairs, const uint32_t* ktp,
                                                   int64_t ldk, const int64_t* lens, float scale, float* s,
                                                   int64_t lds) {
  const __m512 sc = _mm512_set1_ps(scale);
  const int64_t cols = round_up(lens[rows - 1], 32);  // lens never decrease along the rows
  for (int64_t jb = 0; jb < cols; jb += 32) {  // one block of keys stays in L1 for every row that needs it
    int64_t r = 0;
    while (r < rows && lens[r] <= jb) ++r;
    for (; r + 8 <= rows; r += 8) {
      prefill_scores_bf16_rows<8>(q + r * pairs, pairs, ktp + jb, ldk, sc, s + r * lds + jb, lds);
    }
    for (; r + 4 <= rows; r += 4) {
      prefill_scores_bf16_rows<4>(q + r * pairs, pairs, ktp + jb, ldk, sc, s + r * lds + jb, lds);
    }
    for (; r < rows; ++r) prefill_scores_bf16_rows<1>(q + r * pairs, pairs, ktp + jb, ldk, sc, s + r * lds + jb, lds);
  }
}

// R rows' outputs, sum over the pairs m < n_pairs of p[i][m] . vp[m] (p: bfloat16, rows ldp apart; vp:
// [pairs][32 * C] pairs of tokens), times inv[i], rounded to bfloat16 into out[i].
template <int C, int R>
inline void prefill_values_bf16_rows(const uint16_t* p, int64_t ldp, int64_t n_pairs, const uint32_t* vp,
                                     const float* inv, BF16* const* out) {
  constexpr int Z = 2 * C;  // vectors of 16 dims per pair row
  constexpr int64_t d = 32 * C;
  __m512 acc[R][Z];
  for (int i = 0; i < R; ++i)
    for (int z = 0; z < Z; ++z) acc[i][z] = _mm512_setzero_ps();
  for (int64_t m = 0; m < n_pairs; ++m) {
    __m512i v[Z];
    for (int z = 0; z < Z; ++z) v[z] = load_kept(vp + m * d + 16 * z);
    for (int i = 0; i < R; ++i) {
      int32_t two;  // probabilities 2m and 2m + 1
      std::memcpy(&two, p + i * ldp + 2 * m, sizeof(two));
      const __m512bh w = (__m512bh)_mm512_set1_epi32(two);
      for (int z = 0; z < Z; ++z) acc[i][z] = _mm512_dpbf16_ps(acc[i][z], w, (__m512bh)v[z]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const __m512 scale = _mm512_set1_ps(inv[i]);
    for (int z = 0; z < Z; ++z) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[i] + 16 * z),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[i][z], scale)));
    }
  }
}

// Every row's output, R rows at a time (at most 16 accumulators), each over the pairs its group's longest
// row needs (the others' probabilities are 0 past their own lengths).
template <int C>
void prefill_values_bf16(const uint16_t* p, int64_t rows, int64_t ldp, const int64_t* lens, const uint32_t* vp,
                         const float* inv, BF16* const* out) {
  constexpr int R = C == 1 ? 8 : C == 2 ? 4 : 2;
  int64_t r = 0;
  for (; r + R <= rows; r += R) {
    prefill_values_bf16_rows<C, R>(p + r * ldp, ldp, (lens[r + R - 1] + 1) / 2, vp, inv + r, out + r);
  }
  for (; r < rows; ++r) prefill_values_bf16_rows<C, 1>(p + r * ldp, ldp, (lens[r] + 1) / 2, vp, inv + r, out + r);
}

template <int C, class Source>
void prefill_rows_bf16(const torch::Tensor& q, const Source& src, int64_t kv_heads,
                       const std::vector<PrefillItem>& items, double scale, torch::Tensor& out) {
  constexpr int64_t d = 32 * C, pairs = 16 * C;
  const int64_t heads = q.size(1), g = heads / kv_heads;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const BF16* qp = q.data_ptr<BF16>();
  BF16* op = out.data_ptr<BF16>();
  // Per kv head and segment, contiguous (a tile's keys and values are one block of memory): its keys transposed
  // in pairs of dims ([pairs][cols] words, cols = key_cols(keys), zero past its last key: a tile's
  // keys are read in blocks of 32), and its values in pairs of keys ([pairs of keys][d] words).
  const PrefillItem& last = items.back();  // of the last segment: the layouts' sizes
  const int64_t total_cols = last.keys_at + key_cols(last.keys());
  const int64_t total_pairs = last.pairs_at + (last.keys() + 1) / 2;
  std::unique_ptr<uint32_t[]> kt(new uint32_t[kv_heads * total_cols * pairs]);
  std::unique_ptr<uint32_t[]> vt(new uint32_t[kv_heads * total_pairs * d]);
  auto keys_of = [&](const PrefillItem& it) { return kt.get() + (it.kh * total_cols + it.keys_at) * pairs; };
  auto values_of = [&](const PrefillItem& it) { return vt.get() + (it.kh * total_pairs + it.pairs_at) * d; };
  alignas(64) int16_t interleave[2][32];  // dim e of two tokens side by side: x0 y0 x1 y1 ... (then from x16)
  for (int half = 0; half < 2; ++half) {
    for (int e = 0; e < 16; ++e) {
      interleave[half][2 * e] = static_cast<int16_t>(16 * half + e);
      interleave[half][2 * e + 1] = static_cast<int16_t>(32 + 16 * half + e);
    }
  }
  const __m512i lo_pairs = _mm512_load_si512(interleave[0]), hi_pairs = _mm512_load_si512(interleave[1]);
  for_each_layout_part(items, [&](const PrefillItem& it, int64_t j0, int64_t j1) {
    const int64_t cols = key_cols(it.keys());
    uint32_t* ktk = keys_of(it);
    for (int64_t j = j0; j < j1; ++j) {
      const BF16* kj = src.key(it, j);
      for (int64_t e = 0; e < pairs; ++e) std::memcpy(ktk + e * cols + j, kj + 2 * e, sizeof(uint32_t));
    }
    if (j1 == it.keys()) {
      for (int64_t e = 0; e < pairs; ++e) std::fill(ktk + e * cols + it.keys(), ktk + (e + 1) * cols, 0u);
    }
    uint32_t* vtk = values_of(it);
    for (int64_t m = j0 / 2; 2 * m < j1; ++m) {  // j0 is even
      const BF16* a = src.value(it, 2 * m);
      const BF16* b = 2 * m + 1 < it.keys() ? src.value(it, 2 * m + 1) : nullptr;
      for (int c = 0; c < C; ++c) {
        const __m512i x = _mm512_loadu_si512(a + 32 * c);
        const __m512i y = b != nullptr ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
        _mm512_storeu_si512(vtk + m * d + 32 * c, _mm512_permutex2var_epi16(x, lo_pairs, y));
        _mm512_storeu_si512(vtk + m * d + 32 * c + 16, _mm512_permutex2var_epi16(x, hi_pairs, y));
      }
    }
  });
  struct Buffers {
    std::vector<uint32_t> qt;  // the item's query rows, pairs of dims
    std::vector<float> s;      // scores
    std::vector<uint16_t> pb;  // numerators, bfloat16 bits
    std::vector<float> inv;
    std::vector<int64_t> lens;
    std::vector<BF16*> dst;
  };
  const float sc = static_cast<float>(scale);
  for_each_item<Buffers>(items, [&](const PrefillItem& it, Buffers& b) {
    const int64_t rows = g * it.tq;
    const int64_t lds = round_up(it.start + it.t0 + it.tq, 32);
    b.qt.resize(rows * pairs);
    b.s.resize(rows * lds);
    b.pb.resize(rows * lds);
    b.inv.resize(rows);
    b.dst.resize(rows);
    tile_lens(it, g, b.lens);
    for (int64_t t = 0; t < it.tq; ++t) {  // row t * g + h: position t0 + t, q head kh * g + h
      const int64_t token = it.offset + it.t0 + t;
      for (int64_t h = 0; h < g; ++h) {
        std::memcpy(b.qt.data() + (t * g + h) * pairs, qp + token * qs0 + (it.kh * g + h) * qs1, d * sizeof(BF16));
        b.dst[t * g + h] = op + (token * heads + it.kh * g + h) * d;
      }
    }
    const int64_t* lens = b.lens.data();
    prefill_scores_bf16(b.qt.data(), rows, pairs, keys_of(it), key_cols(it.keys()), lens, sc, b.s.data(), lds);
    const int64_t longest = round_up(lens[rows - 1], 2);
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* pr = b.pb.data() + r * lds;
      b.inv[r] = 1.0f / softmax_numerators16(b.s.data() + r * lds, lens[r], [&](int64_t j, __m512 e, __mmask16 lanes) {
        _mm256_mask_storeu_epi16(pr + j, lanes, (__m256i)_mm512_cvtneps_pbh(e));
      });
      std::fill(pr + lens[r], pr + longest, uint16_t{0});  // rows done together read up to the longest
    }
    prefill_values_bf16<C>(b.pb.data(), rows, lds, lens, values_of(it), b.inv.data(), b.dst.data());
  });
}

template <class Source>
void prefill_rows_bf16(const torch::Tensor& q, const Source& src, int64_t kv_heads,
                       const std::vector<PrefillItem>& items, double scale, torch::Tensor& out) {
  switch (q.size(2) / 32) {
    case 1: return prefill_rows_bf16<1>(q, src, kv_heads, items, scale, out);
    case 2: return prefill_rows_bf16<2>(q, src, kv_heads, items, scale, out);
    case 3: return prefill_rows_bf16<3>(q, src, kv_heads, items, scale, out);
    default: return prefill_rows_bf16<4>(q, src, kv_heads, items, scale, out);
  }
}
#endif

void add_segment(std::vector<PrefillItem>& items, int64_t seg, int64_t offset, int64_t length, int64_t start,
                 int64_t kv_heads, int64_t& keys_at, int64_t& pairs_at, int64_t& values_at) {
  for (int64_t kh = 0; kh < kv_heads; ++kh) {
    for (int64_t t0 = 0; t0 < length; t0 += kTile) {
      items.push_back({offset, length, kh, t0, std::min(kTile, length - t0), keys_at, pairs_at, values_at, start, seg});
    }
  }
  keys_at += key_cols(start + length);
  pairs_at += (start + length + 1) / 2;
  values_at += start + length;
}

// The attention of a call's items, whichever the source of their keys (make_source(T{}): a Source of T's): on the
// bfloat16 dot products where the CPU has them (head_dim a multiple of 32 up to 128), widened to float32 otherwise.
template <class MakeSource>
void prefill_dispatch(const torch::Tensor& q, MakeSource make_source, int64_t kv_heads,
                      const std::vector<PrefillItem>& items, double scale, torch::Tensor& out) {
  if (q.scalar_type() == torch::kBFloat16) {
    const auto src = make_source(BF16{});
#if defined(__AVX512BF16__)
    if (q.size(2) % 32 == 0 && q.size(2) <= 128) return prefill_rows_bf16(q, src, kv_heads, items, scale, out);
#endif
    return prefill_rows<BF16>(q, src, kv_heads, items, scale, out);
  }
  prefill_rows<float>(q, make_source(float{}), kv_heads, items, scale, out);
}

}  // namespace

torch::Tensor decode_attention(
    const torch::Tensor& q,                     // [rows, heads, head_dim]
    const torch::Tensor& k_new,                 // [rows, kv_heads, head_dim]: written at end - 1
    const torch::Tensor& v_new,
    const std::vector<torch::Tensor>& k_caches,  // per group [batch, kv_heads, max_len, head_dim]
    const std::vector<torch::Tensor>& v_caches,
    const torch::Tensor& rows,                  // int64 [rows, 4]: group, index in group, start, end
    double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.device().is_cpu(), "q: [rows, heads, d], contiguous, on the CPU");
  const auto dtype = call_dtype(q);
  TORCH_CHECK(rows.dim() == 2 && rows.size(1) == 4 && rows.scalar_type() == torch::kInt64, "rows: int64 [rows, 4]");
  TORCH_CHECK(k_caches.size() == v_caches.size() && !k_caches.empty(), "one k and one v cache per group");
  const int64_t n_rows = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(rows.size(0) == n_rows, "one rows entry per query row");
  const int64_t kv_heads = k_caches[0].size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(k_new.sizes() == v_new.sizes() && k_new.dim() == 3 && k_new.size(0) == n_rows && k_new.size(1) == kv_heads &&
                  k_new.size(2) == d,
              "new k/v: [rows, kv_heads, head_dim]");
  check_dtype(k_new, dtype, "new k");
  check_dtype(v_new, dtype, "new v");
  TORCH_CHECK(k_new.is_contiguous() && v_new.is_contiguous(), "new k/v are contiguous");
  std::vector<int64_t> batch, max_len;
  for (size_t i = 0; i < k_caches.size(); ++i) {
    const auto& k = k_caches[i];
    const auto& v = v_caches[i];
    TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(1) == kv_heads && k.size(3) == d,
                "cache ", i, ": [batch, kv_heads, max_len, head_dim] with the query's head_dim");
    check_dtype(k, dtype, "a k cache");
    check_dtype(v, dtype, "a v cache");
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "caches are contiguous");
    TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), "caches are on the CPU");
    batch.push_back(k.size(0));
    max_len.push_back(k.size(2));
  }
  auto rows_c = rows.contiguous();
  const int64_t* meta = rows_c.data_ptr<int64_t>();
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t grp = meta[4 * r], idx = meta[4 * r + 1], start = meta[4 * r + 2], end = meta[4 * r + 3];
    TORCH_CHECK(0 <= grp && grp < static_cast<int64_t>(k_caches.size()), "row ", r, ": no group ", grp);
    TORCH_CHECK(0 <= idx && idx < batch[grp], "row ", r, ": no row ", idx, " in group ", grp);
    TORCH_CHECK(0 <= start && start < end && end <= max_len[grp], "row ", r, ": bad span [", start, ", ", end, ")");
  }
  auto out = torch::empty_like(q);
  if (dtype == torch::kBFloat16) {
    decode_rows<BF16>(q, k_new, v_new, k_caches, v_caches, meta, kv_heads, scale, out);
  } else {
    decode_rows<float>(q, k_new, v_new, k_caches, v_caches, meta, kv_heads, scale, out);
  }
  return out;
}

// The same over a paged cache: keys and values live in blocks of block_size positions, a row's table maps its
// logical block i (positions [i * block_size, (i + 1) * block_size)) to a physical block id, and block id b is
// index b % slab_blocks of slab b / slab_blocks. Slabs are [slab_blocks, kv_heads, block_size, head_dim]
// and contiguous, so one kv head's positions of one block are contiguous and are read as one chunk: scores are
// computed chunk by chunk into one array per row, softmaxed whole, then values are summed chunk by chunk.
torch::Tensor paged_decode_attention(
    const torch::Tensor& q,                     // [rows, heads, head_dim]
    const torch::Tensor& k_new,                 // [rows, kv_heads, head_dim]: written at logical position end - 1
    const torch::Tensor& v_new,
    const std::vector<torch::Tensor>& k_slabs,  // each [slab_blocks, kv_heads, block_size, head_dim]
    const std::vector<torch::Tensor>& v_slabs,
    const torch::Tensor& tables,                // int64 [rows, max_blocks]: physical block ids, -1 = none
    const torch::Tensor& spans,                 // int64 [rows, 2]: start, end (logical positions)
    double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.device().is_cpu(),
              "q: [rows, heads, head_dim], contiguous, on the CPU");
  const auto dtype = call_dtype(q);
  const int64_t n_rows = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(!k_slabs.empty() && k_slabs.size() == v_slabs.size(), "as many k slabs as v slabs, at least one");
  const auto slab_shape = k_slabs[0].sizes().vec();
  TORCH_CHECK(slab_shape.size() == 4, "slabs: [slab_blocks, kv_heads, block_size, head_dim]");
  const int64_t slab_blocks = slab_shape[0], kv_heads = slab_shape[1], block_size = slab_shape[2];
  TORCH_CHECK(slab_blocks > 0 && block_size > 0, "slabs hold at least one block of at least one position");
  TORCH_CHECK(slab_shape[3] == d, "slabs' head_dim (", slab_shape[3], ") is the query's (", d, ")");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads (", heads, ") must be a multiple of kv_heads (",
              kv_heads, ")");
  TORCH_CHECK(k_new.dim() == 3 && k_new.sizes() == v_new.sizes() && k_new.size(0) == n_rows &&
                  k_new.size(1) == kv_heads && k_new.size(2) == d,
              "new k/v: [rows, kv_heads, head_dim]");
  check_dtype(k_new, dtype, "new k");
  check_dtype(v_new, dtype, "new v");
  TORCH_CHECK(k_new.is_contiguous() && v_new.is_contiguous(), "new k/v are contiguous");
  TORCH_CHECK(k_new.device().is_cpu() && v_new.device().is_cpu(), "new k/v are on the CPU");
  check_slabs(k_slabs, v_slabs, dtype);
  const int64_t n_blocks = static_cast<int64_t>(k_slabs.size()) * slab_blocks;
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == torch::kInt64 && tables.size(0) == n_rows &&
                  tables.device().is_cpu(),
              "tables: int64 [rows, max_blocks] on the CPU");
  TORCH_CHECK(spans.dim() == 2 && spans.scalar_type() == torch::kInt64 && spans.size(0) == n_rows &&
                  spans.size(1) == 2 && spans.device().is_cpu(),
              "spans: int64 [rows, 2] on the CPU");
  const int64_t max_blocks = tables.size(1);
  auto tables_c = tables.contiguous();
  auto spans_c = spans.contiguous();
  const int64_t* table = tables_c.data_ptr<int64_t>();
  const int64_t* span = spans_c.data_ptr<int64_t>();
  // Every block a row touches is checked here, so the loop reads and writes only inside the slabs.
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t start = span[2 * r], end = span[2 * r + 1];
    TORCH_CHECK(0 <= start && start < end && end <= max_blocks * block_size,
                "row ", r, ": bad span [", start, ", ", end, ") for ", max_blocks, " blocks of ", block_size);
    check_blocks(table + r * max_blocks, start, end, block_size, n_blocks, "row", r);
  }
  auto out = torch::empty_like(q);
  if (dtype == torch::kBFloat16) {
    paged_rows<BF16>(q, k_new, v_new, k_slabs, v_slabs, table, max_blocks, span, scale, out);
  } else {
    paged_rows<float>(q, k_new, v_new, k_slabs, v_slabs, table, max_blocks, span, scale, out);
  }
  return out;
}

// Causal attention of whole prompts packed back to back: segment s = (offset, length) is tokens [offset, offset +
// length) of q, k and v, and each of its queries attends over the segment's keys up to its own position (the
// segment's prompt alone, as SDPA with is_causal does). q, k and v may be strided views (the last dimension
// contiguous), as a fused QKV projection leaves them; the output is contiguous.
torch::Tensor prefill_attention(
    const torch::Tensor& q,         // [tokens, heads, head_dim]
    const torch::Tensor& k,         // [tokens, kv_heads, head_dim]
    const torch::Tensor& v,         // [tokens, kv_heads, head_dim]
    const torch::Tensor& segments,  // int64 [segments, 2]: offset, length
    double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v: [tokens, heads, head_dim]");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "q, k, v are on the CPU");
  const auto dtype = call_dtype(q);
  check_dtype(k, dtype, "k");
  check_dtype(v, dtype, "v");
  const int64_t n_tokens = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == n_tokens && k.size(2) == d,
              "k and v: [tokens, kv_heads, head_dim] with q's tokens and head_dim");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads (", heads, ") must be a multiple of kv_heads (", kv_heads,
              ")");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k, v: the last dimension contiguous");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 2 && segments.scalar_type() == torch::kInt64 &&
                  segments.device().is_cpu(),
              "segments: int64 [segments, 2] on the CPU");
  auto segs = segments.contiguous();
  const int64_t* sp = segs.data_ptr<int64_t>();
  std::vector<PrefillItem> items;
  int64_t keys_at = 0, pairs_at = 0, values_at = 0;
  std::vector<char> covered(n_tokens, 0);
  for (int64_t i = 0; i < segs.size(0); ++i) {
    const int64_t offset = sp[2 * i], length = sp[2 * i + 1];
    check_tokens(covered, offset, length, i);
    add_segment(items, i, offset, length, 0, kv_heads, keys_at, pairs_at, values_at);
  }
  auto out = output_for(q, covered);
  if (items.empty()) return out;
  prefill_dispatch(q, [&](auto tag) { return TokenSource<decltype(tag)>(k, v); }, kv_heads, items, scale, out);
  return out;
}

// The same for prompt chunks over a paged cache: segment s = (offset, length, start) is tokens [offset, offset +
// length) of q at positions [start, start + length) of the sequence whose blocks tables[s] lists, and its query at
// position p attends over that sequence's keys and values [0, p], read from its blocks (every one of them there
// already: the chunk's own written by paged_write first). start = 0 is a whole prompt; start > 0 a chunk over its
// cached prefix. q may be a strided view (the last dimension contiguous); the output is contiguous.
torch::Tensor paged_prefill_attention(
    const torch::Tensor& q,                     // [tokens, heads, head_dim]
    const std::vector<torch::Tensor>& k_slabs,  // each [slab_blocks, kv_heads, block_size, head_dim]
    const std::vector<torch::Tensor>& v_slabs,
    const torch::Tensor& tables,    // int64 [segments, max_blocks]: physical block ids, -1 = none
    const torch::Tensor& segments,  // int64 [segments, 3]: offset, length, start
    double scale) {
  TORCH_CHECK(q.dim() == 3 && q.device().is_cpu() && q.stride(2) == 1,
              "q: [tokens, heads, head_dim] on the CPU, the last dimension contiguous");
  const auto dtype = call_dtype(q);
  const int64_t n_tokens = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(!k_slabs.empty() && k_slabs.size() == v_slabs.size(), "as many k slabs as v slabs, at least one");
  const auto slab_shape = k_slabs[0].sizes().vec();
  TORCH_CHECK(slab_shape.size() == 4 && slab_shape[0] > 0 && slab_shape[2] > 0 && slab_shape[3] == d,
              "slabs: [slab_blocks, kv_heads, block_size, head_dim] with the query's head_dim");
  const int64_t kv_heads = slab_shape[1], block_size = slab_shape[2];
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads (", heads, ") must be a multiple of kv_heads (", kv_heads,
              ")");
  check_slabs(k_slabs, v_slabs, dtype);
  const int64_t n_blocks = static_cast<int64_t>(k_slabs.size()) * slab_shape[0];
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == torch::kInt64 && tables.device().is_cpu(),
              "tables: int64 [segments, max_blocks] on the CPU");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 3 && segments.size(0) == tables.size(0) &&
                  segments.scalar_type() == torch::kInt64 && segments.device().is_cpu(),
              "segments: int64 [segments, 3] on the CPU, a row per row of tables");
  auto tables_c = tables.contiguous();
  auto segs = segments.contiguous();
  const int64_t* table = tables_c.data_ptr<int64_t>();
  const int64_t* sp = segs.data_ptr<int64_t>();
  const int64_t max_blocks = tables.size(1);
  std::vector<PrefillItem> items;
  int64_t keys_at = 0, pairs_at = 0, values_at = 0;
  std::vector<char> covered(n_tokens, 0);
  // Every token and block a segment touches is checked here, so the loops read only inside q and the slabs.
  for (int64_t i = 0; i < segs.size(0); ++i) {
    const int64_t offset = sp[3 * i], length = sp[3 * i + 1], start = sp[3 * i + 2];
    check_tokens(covered, offset, length, i);
    TORCH_CHECK(0 <= start && start + length <= max_blocks * block_size, "segment ", i, ": bad positions [", start,
                ", ", start + length, ") for ", max_blocks, " blocks of ", block_size);
    check_blocks(table + i * max_blocks, 0, start + length, block_size, n_blocks, "segment", i);
    add_segment(items, i, offset, length, start, kv_heads, keys_at, pairs_at, values_at);
  }
  auto out = output_for(q, covered);
  if (items.empty()) return out;
  prefill_dispatch(
      q, [&](auto tag) { return BlockSource<decltype(tag)>(k_slabs, v_slabs, table, max_blocks); }, kv_heads, items,
      scale, out);
  return out;
}

// ---- Pointwise: a layer's RMSNorm and SiLU-gated product, one pass each (rms_norm, silu_mul) ----
//
// Each is several torch ops (RMSNorm six, with their dispatch and temporaries); here one loop over each row,
// written so the compiler vectorizes it. The arithmetic is transformers' op for op, so the results are
// torch's: RMSNorm normalises in float32 and rounds to the input's dtype before scaling by the weight
// (rounded again); SiLU rounds silu(gate) to the dtype before multiplying by up. What can differ is the
// order of the sum of squares (within float32 rounding) and e^x (below 2e-7 relative, torch's within 1 ulp).

namespace {

// float32 -> bfloat16 bits, nearest even (NaN stays a quiet NaN), as c10::BFloat16 rounds; vectorizable.
inline uint16_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

inline float bf16_value(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// x as the dtype T holds it (bfloat16: rounded), back in float32.
inline float round_to(float x, float*) { return x; }
inline float round_to(float x, BF16*) { return bf16_value(bf16_bits(x)); }

inline void put(float x, float* out) { *out = x; }
inline void put(float x, BF16* out) {
  const uint16_t h = bf16_bits(x);
  std::memcpy(out, &h, sizeof(h));
}

// Rows per parallel chunk: a decode step's few rows run on the calling thread (a thread hand-off costs
// more than the work); a prefill's thousands are split.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(width, 1)); }

#if defined(__AVX512F__)
// 16 float32 lanes as T holds them (bfloat16: rounded to nearest even, NaN kept), back in float32.
inline __m512 round16(__m512 x, float*) { return x; }
inline void put16(__m512 x, float* out) { _mm512_storeu_ps(out, x); }
#if defined(__AVX512BF16__)  // the host converts in one instruction (nearest even, NaN kept)
inline __m512 round16(__m512 x, BF16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
inline void put16(__m512 x, BF16* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(x));
}
#else
inline __m512 round16(__m512 x, BF16*) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), round_bf16_16(x), x);
}
inline void put16(__m512 x, BF16* out) {  // rounded, its upper halves are the bfloat16s
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round16(x, out)), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
}
#endif
#endif

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, grain(h), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * h;
      T* o = out + r * h;
      float ss = 0.0f;
      int64_t i = 0;
#if defined(__AVX512F__)
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      for (; i + 32 <= h; i += 32) {
        const __m512 v0 = Lanes16::load(xr + i), v1 = Lanes16::load(xr + i + 16);
        a0 = _mm512_fmadd_ps(v0, v0, a0);
        a1 = _mm512_fmadd_ps(v1, v1, a1);
      }
      for (; i + 16 <= h; i += 16) {
        const __m512 v = Lanes16::load(xr + i);
        a0 = _mm512_fmadd_ps(v, v, a0);
      }
      ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#endif
      for (; i < h; ++i) {
        const float v = to_float(xr[i]);
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
      int64_t k = 0;
#if defined(__AVX512F__)
      const __m512 vinv = _mm512_set1_ps(inv);
      for (; k + 16 <= h; k += 16)
        put16(_mm512_mul_ps(Lanes16::load(w + k), round16(_mm512_mul_ps(Lanes16::load(xr + k), vinv), o)), o + k);
#endif
      for (; k < h; ++k) put(to_float(w[k]) * round_to(to_float(xr[k]) * inv, o), o + k);
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t k = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.0f);
      for (; k + 16 <= n; k += 16) {
        const __m512 x = Lanes16::load(g + k);
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        put16(_mm512_mul_ps(round16(silu, o), Lanes16::load(u + k)), o + k);
      }
#endif
      for (; k < n; ++k) {
        const float x = to_float(g[k]);
        put(round_to(x / (1.0f + exp_any(-x)), o) * to_float(u[k]), o + k);
      }
    }
  });
}

// Rotary embedding in place: x * cos + swap_halves(x) * sin of each of the first `heads` heads of every row of
// x ([rows, width], a head every d values), with cos and sin [rows, d] (the sign of rotate_half lives in sin).
// Each product is rounded to T before the sum (rounded again), as transformers' q * cos + rotate_half(q) * sin
// rounds: two products and a sum, never a fused multiply-add (in_register keeps the compiler from contracting
// them; torch's addcmul would fuse the second product into the sum).
template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t rows, int64_t width, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, grain(heads * d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* c = cos + r * d;
      const T* s = sin + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* a = x + r * width + h * d;  // the first half; b the second
        T* b = a + half;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= half; i += 16) {
          const __m512 x1 = Lanes16::load(a + i), x2 = Lanes16::load(b + i);
          __m512 p1 = round16(_mm512_mul_ps(x1, Lanes16::load(c + i)), a);
          __m512 q1 = round16(_mm512_mul_ps(x2, Lanes16::load(s + i)), a);
          __m512 p2 = round16(_mm512_mul_ps(x2, Lanes16::load(c + half + i)), a);
          __m512 q2 = round16(_mm512_mul_ps(x1, Lanes16::load(s + half + i)), a);
          in_register(p1);
          in_register(q1);
          in_register(p2);
          in_register(q2);
          put16(_mm512_add_ps(p1, q1), a + i);
          put16(_mm512_add_ps(p2, q2), b + i);
        }
#endif
        for (; i < half; ++i) {
          const float x1 = to_float(a[i]), x2 = to_float(b[i]);
          volatile float p1 = round_to(x1 * to_float(c[i]), a), q1 = round_to(x2 * to_float(s[i]), a);
          volatile float p2 = round_to(x2 * to_float(c[half + i]), a), q2 = round_to(x1 * to_float(s[half + i]), a);
          put(p1 + q1, a + i);
          put(p2 + q2, b + i);
        }
      }
    }
  });
}

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), what, " must be contiguous");
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const auto dtype = call_dtype(x);
  check_dtype(weight, dtype, "weight");
  const int64_t h = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h && weight.is_contiguous(), "weight must be [", h, "]");
  check_rows(x, "x");
  auto out = torch::empty_like(x);
  const int64_t rows = h ? x.numel() / h : 0;
  if (dtype == torch::kFloat32)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, h,
                  static_cast<float>(eps));
  else
    rms_norm_rows(x.data_ptr<BF16>(), weight.data_ptr<BF16>(), out.data_ptr<BF16>(), rows, h,
                  static_cast<float>(eps));
  return out;
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  const auto dtype = call_dtype(gate_up);
  const int64_t width = gate_up.size(-1);
  TORCH_CHECK(width % 2 == 0, "gate_up's last dimension must be even (gate, then up)");
  check_rows(gate_up, "gate_up");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = width / 2;
  auto out = torch::empty(sizes, gate_up.options());
  const int64_t rows = width ? gate_up.numel() / width : 0;
  if (dtype == torch::kFloat32)
    silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, width / 2);
  else
    silu_mul_rows(gate_up.data_ptr<BF16>(), out.data_ptr<BF16>(), rows, width / 2);
  return out;
}

void rope_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads) {
  const auto dtype = call_dtype(x);
  check_dtype(cos, dtype, "cos");
  check_dtype(sin, dtype, "sin");
  TORCH_CHECK(x.dim() >= 2 && x.is_contiguous() && x.device().is_cpu(), "x: [..., heads, head_dim], contiguous, on the CPU");
  const int64_t d = x.size(-1), all_heads = x.size(-2);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(0 <= heads && heads <= all_heads, "rotates ", heads, " heads of ", all_heads);
  const int64_t width = all_heads * d, rows = width ? x.numel() / width : 0;
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() && t->numel() == rows * d && t->size(-1) == d,
                "cos and sin: [rows, head_dim] (", rows, " x ", d, "), contiguous, on the CPU");
  }
  if (dtype == torch::kFloat32)
    rope_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), rows, width, heads, d);
  else
    rope_rows(x.data_ptr<BF16>(), cos.data_ptr<BF16>(), sin.data_ptr<BF16>(), rows, width, heads, d);
}

// ---- A prefill's keys and values into a paged cache's blocks (paged_write) ----
//
// Segment s writes tokens [offset, offset + end - start) of k and v ([tokens, kv_heads, head_dim], strided views
// whose last dimension is contiguous, as a fused QKV projection leaves them) at logical positions [start, end) of
// row s of `tables`, each position into its block: what a prefill over a paged pool writes, layer by layer,
// without a contiguous copy of the prompts' positions to scatter afterwards. With clear_before, a segment is a
// whole left-padded prompt: the positions of its first block before `start` (padding) are cleared, as a contiguous
// cache's; without, the positions before `start` are the sequence's cached prefix and are left as they are (a
// prompt chunk, a decode step).
namespace {
template <typename T>
void write_rows(const torch::Tensor& k, const torch::Tensor& v, const std::vector<torch::Tensor>& k_slabs,
                const std::vector<torch::Tensor>& v_slabs, const int64_t* table, int64_t max_blocks,
                const int64_t* place, int64_t n_segments, bool clear_before) {
  const int64_t kv_heads = k.size(1), d = k.size(2);
  const int64_t slab_blocks = k_slabs[0].size(0), block_size = k_slabs[0].size(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  std::vector<T*> kb, vb;
  for (size_t i = 0; i < k_slabs.size(); ++i) {
    kb.push_back(k_slabs[i].data_ptr<T>());
    vb.push_back(v_slabs[i].data_ptr<T>());
  }
  // One item per (segment, logical block): its positions are one run of each head's block.
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t s = 0; s < n_segments; ++s)
    for (int64_t lb = place[3 * s + 1] / block_size; lb * block_size < place[3 * s + 2]; ++lb) items.emplace_back(s, lb);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const auto [s, lb] = items[i];
      const int64_t offset = place[3 * s], start = place[3 * s + 1], end = place[3 * s + 2];
      const int64_t b = table[s * max_blocks + lb], slab = b / slab_blocks, in_slab = b % slab_blocks;
      const int64_t p0 = std::max(start, lb * block_size), p1 = std::min(end, (lb + 1) * block_size);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t cell = ((in_slab * kv_heads + h) * block_size + p0 % block_size) * d;
        if (clear_before && p0 == start && p0 % block_size) {  // the row's padding in its first block reads as 0
          const int64_t first = (in_slab * kv_heads + h) * block_size * d, cleared = (p0 % block_size) * d;
          std::memset(kb[slab] + first, 0, sizeof(T) * cleared);
          std::memset(vb[slab] + first, 0, sizeof(T) * cleared);
        }
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t t = offset + p - start;
          std::memcpy(kb[slab] + cell + (p - p0) * d, kp + t * ks0 + h * ks1, sizeof(T) * d);
          std::memcpy(vb[slab] + cell + (p - p0) * d, vp + t * vs0 + h * vs1, sizeof(T) * d);
        }
      }
    }
  });
}
}  // namespace

void paged_write(const torch::Tensor& k,                   // [tokens, kv_heads, head_dim]
                 const torch::Tensor& v,                   // [tokens, kv_heads, head_dim]
                 const std::vector<torch::Tensor>& k_slabs,  // each [slab_blocks, kv_heads, block_size, head_dim]
                 const std::vector<torch::Tensor>& v_slabs,
                 const torch::Tensor& tables,  // int64 [segments, max_blocks]: physical block ids, -1 = none
                 const torch::Tensor& places,  // int64 [segments, 3]: token offset, start, end (logical positions)
                 bool clear_before) {
  const auto dtype = call_dtype(k);
  check_dtype(v, dtype, "v");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "k and v: [tokens, kv_heads, head_dim]");
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), "k and v are on the CPU");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v: the last dimension contiguous");
  const int64_t n_tokens = k.size(0), kv_heads = k.size(1), d = k.size(2);
  TORCH_CHECK(!k_slabs.empty() && k_slabs.size() == v_slabs.size(), "as many k slabs as v slabs, at least one");
  const auto slab_shape = k_slabs[0].sizes().vec();
  TORCH_CHECK(slab_shape.size() == 4 && slab_shape[0] > 0 && slab_shape[2] > 0 && slab_shape[1] == kv_heads &&
                  slab_shape[3] == d,
              "slabs: [slab_blocks, kv_heads, block_size, head_dim] with k's kv_heads and head_dim");
  check_slabs(k_slabs, v_slabs, dtype);
  const int64_t block_size = slab_shape[2], n_blocks = static_cast<int64_t>(k_slabs.size()) * slab_shape[0];
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == torch::kInt64 && tables.device().is_cpu(),
              "tables: int64 [segments, max_blocks] on the CPU");
  TORCH_CHECK(places.dim() == 2 && places.size(1) == 3 && places.size(0) == tables.size(0) &&
                  places.scalar_type() == torch::kInt64 && places.device().is_cpu(),
              "places: int64 [segments, 3] on the CPU, a row per row of tables");
  auto tables_c = tables.contiguous();
  auto places_c = places.contiguous();
  const int64_t* table = tables_c.data_ptr<int64_t>();
  const int64_t* place = places_c.data_ptr<int64_t>();
  const int64_t n_segments = places.size(0), max_blocks = tables.size(1);
  // Every token and block a segment touches is checked here, so the copies stay inside k, v and the slabs.
  for (int64_t s = 0; s < n_segments; ++s) {
    const int64_t offset = place[3 * s], start = place[3 * s + 1], end = place[3 * s + 2];
    TORCH_CHECK(0 <= start && start < end && end <= max_blocks * block_size, "segment ", s, ": bad positions [",
                start, ", ", end, ") for ", max_blocks, " blocks of ", block_size);
    TORCH_CHECK(0 <= offset && offset + (end - start) <= n_tokens, "segment ", s, ": tokens [", offset, ", ",
                offset + end - start, ") are not within the call's ", n_tokens);
    check_blocks(table + s * max_blocks, start, end, block_size, n_blocks, "segment", s);
  }
  if (dtype == torch::kFloat32)
    write_rows<float>(k, v, k_slabs, v_slabs, table, max_blocks, place, n_segments, clear_before);
  else
    write_rows<BF16>(k, v, k_slabs, v_slabs, table, max_blocks, place, n_segments, clear_before);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "one-token attention of many rows over their own caches and spans");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one-token attention of many rows over their own spans of a paged cache (block tables over slabs)");
  m.def("prefill_attention", &prefill_attention,
        "causal attention of whole prompts packed back to back, each over its own tokens");
  m.def("rms_norm", &rms_norm, "RMSNorm of the last dimension, as transformers computes it");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [..., gate | up], as transformers computes it");
  m.def("rope_", &rope_, "rotary embedding of the first heads of [..., heads, head_dim] in place");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of prompt chunks packed back to back, each over its sequence's blocks up to itself");
  m.def("paged_write", &paged_write, "a prefill's keys and values into their blocks of a paged cache");
#if defined(__AVX512F__)
  m.attr("POINTWISE_FAST") = true;
#else
  m.attr("POINTWISE_FAST") = false;  // scalar loops here: torch's vectorized ops are faster
#endif
}
