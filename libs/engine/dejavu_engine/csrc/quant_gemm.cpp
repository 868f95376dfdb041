// Many-row GEMMs of weights in blocks of 32 (GGUF's: Q4_0, Q4_1, Q5_0 and Q5_1 packed, Q8_0 as int8) on int8 dot
// products: a prefill's, a prompt chunk's, a wide decode batch's projections, compute-bound where a decode step of a
// few rows is bound by memory.
//
// The weight is quant.cpp's layout, as the file holds it: values in blocks of 32 with a float32 scale d and optional
// offset m a block, W = d * v + m, the values v int8 (q [N, K]: Q8_0, or a packed type widened), packed 4-bit (q
// uint8 [N, K / 2], byte i of a block's 16: value i in its low nibble, value i + 16 in its high one, v = nibble -
// zero) or packed 5-bit (the same nibbles and a fifth-bit mask a block, h int32 [N, K / 32], bit i for value i: v =
// (nibble | bit << 4) - zero).
// The activations x [M, K] are rounded per row per block of 32 to 15 bits in two int8 parts: u = x / dx with dx =
// max|x| / 127, high = round(u) in [-127, 127] (llama.cpp's q8_0 of x), low = round(128 * (u - high)) in [-64, 64],
// so x ~ dx / 128 * xq with xq = 128 * high + low, within dx / 256 an element (q8_0's high part alone, within dx /
// 2, moved SmolLM2's logits by up to 3.3: its activations have outliers that make dx large). A block's contribution
// to y[r, n] is then d * dx / 128 * (xq . v) + m * sum(x): xq . v an exact int32 sum of int8 dot products of
// unsigned weight bytes and signed x bytes (vpdpbusd on AVX512-VNNI, 4 products a 32-bit lane; vpmaddubsw and
// vpmaddwd on AVX512BW without it, the same sums): 128 * (u8 . high) + (u8 . low) - shift * sum(xq), the weight
// entering as unsigned bytes u8 = v + shift (nibbles, 5-bit values: shift = zero; int8 values: + 128), sum(xq) and
// sum(x) made once a row. Packed values and the same values widened to int8 give the same integers, so the same
// results.
//
// Layout in the loop: a panel of kPanel output rows is unpacked once a call into a scratch that stays in L1/L2 and
// is reused by every row of x: for each block and each 4 consecutive values of it, one 64-byte register holds those
// 4 bytes of 16 output rows (a 32-bit lane a row), so one vpdpbusd of it against x's 4 bytes broadcast adds 64
// products into 16 rows' sums, and a block's 32 values are 8 of them (twice: x's high parts, then, the sums shifted
// by 7 bits, its low ones); its scales (and offsets) sit beside it, 16 a register. A 5-bit value's fifth bit is
// ORed into bit 4 of its byte as the panel is unpacked (4 bits of the mask a 32-bit lane, spread a bit a byte by
// one multiply), so the loop is the 4-bit one. Each block's int32 sums are converted and scaled once into float32
// accumulators of 16 output rows. The 16 rows of a register are a 4 x 4 transpose of the weight's 16-byte block
// rows (row 4a + i in lane 4i + a); the output is permuted back as it is stored.
//
// Built only where the compiler targets AVX512BW (quant_int8_dot() says which dot product); elsewhere Python keeps
// dequantized tiles and torch's GEMM for many rows.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DEJAVU_INT8_GEMM 1
#endif

namespace {

constexpr int64_t kBlock = 32;       // values a block (GGUF's)
constexpr int64_t kHalf = kBlock / 2;  // bytes a packed block
constexpr int64_t kSteps = kBlock / 4;  // 4-value steps a block: one int8 dot product (4 products a lane) each
constexpr int kLowBits = 7;             // x's low part is in units of 2^-7 of its high part's
constexpr int kLow = 1 << kLowBits;

#if defined(DEJAVU_INT8_GEMM)
constexpr int kLanes = 16;          // output rows a register
constexpr int kTiles = 3;           // registers of output rows a panel (3 x 16 and 4 rows of x: 24 accumulators)
constexpr int kPanel = kLanes * kTiles;  // output rows unpacked together
constexpr int kRows = 4;            // rows of x a pass over the panel (kRows * kTiles int32 and float32 accumulators)

// Restores the caller's MXCSR: subnormal activations and products flushed to zero while the kernel runs (as
// quant.cpp's kernels do: a subnormal operand costs an FMA a microcode assist).
class FlushSubnormals {
 public:
  FlushSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x0040 | 0x8000); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
};

// acc + the sums, 4 a 32-bit lane, of unsigned bytes of w times signed bytes of x (|x| <= 127); Wide: w up to
// 255 (int8 values + 128), else up to 15 (nibbles).
template <bool Wide>
inline __m512i dot_u8s8(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, w, x);
#else
  // Pairs into int16, then pairs of those into int32. A pair of nibbles' products is at most 2 * 15 * 127, no
  // saturation; bytes up to 255 would saturate (2 * 255 * 127), so they go as their two nibbles, the high one's
  // sums times 16 as they widen.
  const __m512i ones = _mm512_set1_epi16(1);
  if (!Wide) return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), ones));
  const __m512i low = _mm512_and_si512(w, _mm512_set1_epi8(0x0F));
  const __m512i high = _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F));
  acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(low, x), ones));
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(high, x), _mm512_set1_epi16(16)));
#endif
}

// x quantized per row per block, in two int8 parts (the file's header): q [M, G, 2, 32] (a block's high parts,
// then its low ones), the unit dx / 128 [M, G], and per block the correction zero * sum(128 * high + low) [M, G]
// (where zero != 0) and the float sum of x [M, G] (where the weight has offsets).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> unit;
  std::vector<int32_t> zsum;
  std::vector<float> sum;
};

QuantizedRows quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int zero, bool offsets) {
  const int64_t G = K / kBlock;
  QuantizedRows out;
  out.q.resize(2 * M * K);
  out.unit.resize(M * G);
  if (zero != 0) out.zsum.resize(M * G);
  if (offsets) out.sum.resize(M * G);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    const FlushSubnormals flush;
    const __m512 sign = _mm512_set1_ps(-0.0f), low_scale = _mm512_set1_ps(static_cast<float>(kLow));
    const __m512 largest = _mm512_set1_ps(std::numeric_limits<float>::max());
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        const float* xg = x + m * ldx + g * kBlock;
        int8_t* qg = out.q.data() + (m * G + g) * 2 * kBlock;
        const __m512 a0 = _mm512_andnot_ps(sign, _mm512_loadu_ps(xg));
        const __m512 a1 = _mm512_andnot_ps(sign, _mm512_loadu_ps(xg + 16));
        // An inf or NaN in the block (false in an ordered compare with the largest float) makes its unit NaN, so the
        // row's outputs are NaN, as a float product's would be non-finite, and its values 0.
        const __mmask16 keep =
            _mm512_cmp_ps_mask(a0, largest, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, largest, _CMP_LE_OQ);
        const bool finite = keep == 0xFFFF;
        const float amax = finite ? _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)) : 0.0f;
        const float d = amax / 127.0f;
        const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        __m512i total = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {
          // x / dx, within [-127, 127] (0 in a block that is not finite)
          const __m512 u = _mm512_maskz_mul_ps(finite ? 0xFFFF : 0, _mm512_loadu_ps(xg + 16 * h), id);
          const __m512i high = _mm512_cvtps_epi32(u);  // to nearest even (MXCSR)
          // u - high is exact (both below 128, within 1/2 of each other), and so is its scaling by kLow.
          const __m512 rest = _mm512_sub_ps(u, _mm512_cvtepi32_ps(high));
          const __m512i low = _mm512_cvtps_epi32(_mm512_mul_ps(rest, low_scale));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + 16 * h), _mm512_cvtsepi32_epi8(high));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + kBlock + 16 * h), _mm512_cvtsepi32_epi8(low));
          total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_slli_epi32(high, kLowBits), low));
        }
        out.unit[m * G + g] = finite ? d / static_cast<float>(kLow) : std::numeric_limits<float>::quiet_NaN();
        if (zero != 0) out.zsum[m * G + g] = zero * _mm512_reduce_add_epi32(total);
        if (offsets) {
          out.sum[m * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(xg), _mm512_loadu_ps(xg + 16)));
        }
      }
    }
  });
  return out;
}

// A panel of output rows [n0, n0 + kPanel) unpacked: for block g, step c (values 4c..4c+3) and tile t, 64 bytes at
// ((g * kSteps + c) * kTiles + t) * 64 hold those 4 values of the tile's 16 rows as unsigned bytes (in lane_of's
// order); scales (offsets) of block g, tile t at (g * kTiles + t) * 16. Rows past N are zero weights.
struct Panel {
  std::vector<uint8_t> w;
  std::vector<float> s, o;
  explicit Panel(int64_t K, bool offsets)
      : w(K / kBlock * kSteps * kTiles * 64), s(K / kBlock * kPanel), o(offsets ? K / kBlock * kPanel : 0) {}
};

// Lane of a tile's register that holds output row j of the tile (and, the map being an involution, the reverse).
inline int lane_of(int j) { return 4 * (j % 4) + j / 4; }

// 16 rows' 16 bytes at the same place of each (row base + 4a + i at q + (4a + i) * row, rows past `rows` read
// as zeros), transposed to 32-bit words: lane i of out[w] holds word w (bytes 4w..4w+3) of rows i, 4 + i, 8 + i,
// 12 + i, so word w of row 4a + i is at lane 4i + a (lane_of).
inline void words_of_rows(const uint8_t* q, int64_t row, int64_t rows, __m512i (&out)[4]) {
  alignas(64) static const uint8_t kZeros[kHalf] = {};
  __m512i A[4];
  for (int a = 0; a < 4; ++a) {
    __m512i v = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      const int64_t n = 4 * a + i;
      const uint8_t* p = n < rows ? q + n * row : kZeros;
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), i);
    }
    A[a] = v;
  }
  const __m512i u0 = _mm512_unpacklo_epi32(A[0], A[1]), u1 = _mm512_unpackhi_epi32(A[0], A[1]);
  const __m512i u2 = _mm512_unpacklo_epi32(A[2], A[3]), u3 = _mm512_unpackhi_epi32(A[2], A[3]);
  out[0] = _mm512_unpacklo_epi64(u0, u2);
  out[1] = _mm512_unpackhi_epi64(u0, u2);
  out[2] = _mm512_unpacklo_epi64(u1, u3);
  out[3] = _mm512_unpackhi_epi64(u1, u3);
}

// The fifth bits of step c's values (4c..4c+3) of 16 rows, as bit 4 of their bytes: bits 4c..4c+3 of each 32-bit
// lane's mask in m, which are in the lane's byte c / 2, copied to its 4 bytes (vpshufb), each byte tested against
// its own bit (vptestmb) and made 16 where it is set.
inline __m512i fifth_bits(__m512i m, int c) {
  const __m512i copy = _mm512_add_epi32(_mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0),
                                        _mm512_set1_epi32((c / 2) * 0x01010101));
  const __m512i own = _mm512_set1_epi32(c % 2 != 0 ? static_cast<int>(0x80402010u) : 0x08040201);
  return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(_mm512_shuffle_epi8(m, copy), own), _mm512_set1_epi8(16));
}

// Output rows [n0, n0 + kPanel) into the panel (rows past N: zero weights). Packed 4-bit values (Wide = false, q
// uint8 [N, K / 2]) go as their nibbles, packed 5-bit ones (Five, h their fifth-bit masks [N, K / 32]) as nibble |
// bit << 4; int8 values (Wide, q [N, K]) as value + 128, an unsigned byte.
template <bool Wide, bool Five>
void unpack_panel(const uint8_t* q, const uint32_t* h, const float* scale, const float* offset, int64_t N, int64_t K,
                  int64_t n0, Panel& panel) {
  static_assert(!(Wide && Five), "5-bit values are packed");
  const int64_t G = K / kBlock, row = Wide ? K : K / 2;
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // Where a tile's rows' masks of a block are, in the words' lane order (row lane_of(i) in lane i), G words a row.
  const __m512i by_lane = _mm512_mullo_epi32(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0),
                                             _mm512_set1_epi32(static_cast<int>(G)));
  for (int t = 0; t < kTiles; ++t) {
    const int64_t base = n0 + t * kLanes, rows = std::max<int64_t>(0, N - base);
    __mmask16 present = 0;  // lanes of the rows before N
    for (int i = 0; i < kLanes; ++i) present |= static_cast<__mmask16>((lane_of(i) < rows ? 1u : 0u) << i);
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* out = panel.w.data() + g * kSteps * kTiles * 64 + t * 64;
      __m512i C[4];
      if (Wide) {  // a block's 32 bytes: steps 0-3 in its first 16, 4-7 in its next 16
        for (int half = 0; half < 2; ++half) {
          words_of_rows(q + base * row + g * kBlock + half * kHalf, row, rows, C);
          for (int w = 0; w < 4; ++w)
            _mm512_storeu_si512(out + (half * 4 + w) * kTiles * 64, _mm512_xor_si512(C[w], flip));
        }
      } else {  // a block's 16 bytes: word w's low nibbles are step w, its high ones step 4 + w
        words_of_rows(q + base * row + g * kHalf, row, rows, C);
        __m512i masks = _mm512_setzero_si512();  // the rows' fifth-bit masks, in the words' lane order
        if constexpr (Five) {
          if (present != 0) masks = _mm512_mask_i32gather_epi32(masks, present, by_lane, h + base * G + g, 4);
        }
        for (int w = 0; w < 4; ++w) {
          __m512i first = _mm512_and_si512(C[w], low), second = _mm512_and_si512(_mm512_srli_epi16(C[w], 4), low);
          if constexpr (Five) {  // steps w (values 4w..4w+3) and 4 + w (values 16 + 4w..)
            first = _mm512_or_si512(first, fifth_bits(masks, w));
            second = _mm512_or_si512(second, fifth_bits(masks, 4 + w));
          }
          _mm512_storeu_si512(out + w * kTiles * 64, first);
          _mm512_storeu_si512(out + (w + 4) * kTiles * 64, second);
        }
      }
    }
    for (int j = 0; j < kLanes; ++j) {
      const int64_t n = base + j;
      const int lane = lane_of(j);
      for (int64_t g = 0; g < G; ++g) {
        panel.s[(g * kTiles + t) * kLanes + lane] = n < N ? scale[n * G + g] : 0.0f;
        if (offset != nullptr) panel.o[(g * kTiles + t) * kLanes + lane] = n < N ? offset[n * G + g] : 0.0f;
      }
    }
  }
}

// y[r, n0 + j] for R rows of x (quantized, from row m) and the panel's rows j < valid.
template <int R, bool Wide, bool Zero, bool Offset>
void panel_rows(const QuantizedRows& xq, int64_t m, int64_t K, const Panel& panel, const float* bias, float* y,
                int64_t ldy, int64_t n0, int64_t valid) {
  const int64_t G = K / kBlock;
  __m512 acc[R][kTiles];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < kTiles; ++t) acc[r][t] = _mm512_setzero_ps();
  const int8_t* x = xq.q.data() + m * 2 * K;  // rows 2K bytes apart: each block's high parts, then its low ones
  const float* dx = xq.unit.data() + m * G;
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot[R][kTiles];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < kTiles; ++t) dot[r][t] = _mm512_setzero_si512();
    const uint8_t* wg = panel.w.data() + g * kSteps * kTiles * 64;
    for (int part = 0; part < 2; ++part) {  // sum(w * high) * kLow + sum(w * low), in the same int32 lanes
      if (part == 1) {
        for (int r = 0; r < R; ++r)
          for (int t = 0; t < kTiles; ++t) dot[r][t] = _mm512_slli_epi32(dot[r][t], kLowBits);
      }
      const int8_t* xg = x + (g * 2 + part) * kBlock;
      for (int c = 0; c < kSteps; ++c) {
        __m512i w[kTiles];
        for (int t = 0; t < kTiles; ++t) w[t] = _mm512_loadu_si512(wg + (c * kTiles + t) * 64);
        for (int r = 0; r < R; ++r) {
          int32_t word;
          std::memcpy(&word, xg + r * 2 * K + 4 * c, 4);
          const __m512i xv = _mm512_set1_epi32(word);
          for (int t = 0; t < kTiles; ++t) dot[r][t] = dot_u8s8<Wide>(dot[r][t], w[t], xv);
        }
      }
    }
    __m512 s[kTiles];
    for (int t = 0; t < kTiles; ++t) s[t] = _mm512_loadu_ps(panel.s.data() + (g * kTiles + t) * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(dx[r * G + g]);
      for (int t = 0; t < kTiles; ++t) {
        __m512i sum = dot[r][t];
        if (Zero) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(xq.zsum[(m + r) * G + g]));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s[t], d), acc[r][t]);
      }
    }
    if (Offset) {
      for (int t = 0; t < kTiles; ++t) {
        const __m512 o = _mm512_loadu_ps(panel.o.data() + (g * kTiles + t) * kLanes);
        for (int r = 0; r < R; ++r)
          acc[r][t] = _mm512_fmadd_ps(o, _mm512_set1_ps(xq.sum[(m + r) * G + g]), acc[r][t]);
      }
    }
  }
  // Back to row order (lane_of is its own inverse) and into y, the panel's last rows masked off.
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  for (int t = 0; t < kTiles; ++t) {
    const int64_t left = valid - t * kLanes;
    if (left <= 0) break;
    const __mmask16 mask = left >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const int64_t n = n0 + t * kLanes;
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_add_ps(_mm512_permutexvar_ps(order, acc[r][t]), b);
      _mm512_mask_storeu_ps(y + (m + r) * ldy + n, mask, v);
    }
  }
}

template <bool Wide, bool Zero, bool Offset>
void panel_all_rows(const QuantizedRows& xq, int64_t M, int64_t K, const Panel& panel, const float* bias, float* y,
                    int64_t N, int64_t n0) {
  const int64_t valid = std::min<int64_t>(kPanel, N - n0);
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) panel_rows<kRows, Wide, Zero, Offset>(xq, m, K, panel, bias, y, N, n0, valid);
  static_assert(kRows <= 4, "the rows left over below take up to 3");
  switch (M - m) {
    case 3: panel_rows<3, Wide, Zero, Offset>(xq, m, K, panel, bias, y, N, n0, valid); break;
    case 2: panel_rows<2, Wide, Zero, Offset>(xq, m, K, panel, bias, y, N, n0, valid); break;
    case 1: panel_rows<1, Wide, Zero, Offset>(xq, m, K, panel, bias, y, N, n0, valid); break;
    default: break;
  }
}

// Every panel of the weight, split over torch's threads (each its own panel scratch).
template <bool Wide, bool Five, bool Zero, bool Offset>
void all_panels(const QuantizedRows& xq, int64_t M, int64_t K, const uint8_t* q, const uint32_t* h,
                const float* scale, const float* offset, const float* bias, float* y, int64_t N) {
  at::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t p0, int64_t p1) {
    const FlushSubnormals flush;
    Panel panel(K, Offset);
    for (int64_t p = p0; p < p1; ++p) {
      unpack_panel<Wide, Five>(q, h, scale, offset, N, K, p * kPanel, panel);
      panel_all_rows<Wide, Zero, Offset>(xq, M, K, panel, bias, y, N, p * kPanel);
    }
  });
}

// all_panels for a weight of one layout (Wide, Five), with or without a shift to take off and offsets.
template <bool Wide, bool Five>
void panels_of(bool shift, bool offsets, const QuantizedRows& xq, int64_t M, int64_t K, const uint8_t* q,
               const uint32_t* h, const float* scale, const float* offset, const float* bias, float* y, int64_t N) {
  if (shift && offsets) {
    all_panels<Wide, Five, true, true>(xq, M, K, q, h, scale, offset, bias, y, N);
  } else if (shift) {
    all_panels<Wide, Five, true, false>(xq, M, K, q, h, scale, offset, bias, y, N);
  } else if (offsets) {
    all_panels<Wide, Five, false, true>(xq, M, K, q, h, scale, offset, bias, y, N);
  } else {
    all_panels<Wide, Five, false, false>(xq, M, K, q, h, scale, offset, bias, y, N);
  }
}
#endif

}  // namespace

// The dot product the int8 GEMM uses here: 2 AVX512-VNNI (vpdpbusd), 1 AVX512BW (vpmaddubsw + vpmaddwd), 0 none
// (quant_gemm is not built; many rows go through dequantized tiles).
int64_t quant_int8_dot() {
#if defined(DEJAVU_INT8_GEMM) && defined(__AVX512VNNI__)
  return 2;
#elif defined(DEJAVU_INT8_GEMM)
  return 1;
#else
  return 0;
#endif
}

// x [M, K] (float32, rows contiguous) @ W^T (+ bias [N]) -> [M, N] float32 for W in blocks of 32 with a float32
// scale and optional offset [N, K / 32] a block: int8 values (q int8 [N, K], zero 0) or packed 4-bit ones (q uint8
// [N, K / 2], each value its nibble minus `zero`) or packed 5-bit ones (the same and high, int32 [N, K / 32], a
// fifth-bit mask a block: each value (nibble | bit << 4) minus `zero`); x rounded per row per block to two int8
// parts (the file's header). A packed weight's results are those of its values widened to int8, bit for bit: the
// int32 sums are the same integers and the float arithmetic on them the same.
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                      const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias, int64_t zero,
                      const std::optional<at::Tensor>& high) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "quant_gemm: x must be a float32 [M, K] CPU tensor with contiguous rows");
  const bool wide = q.scalar_type() == at::kChar;
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && (wide || q.scalar_type() == at::kByte) && q.is_contiguous() &&
                  q.size(1) % (wide ? kBlock : kHalf) == 0,
              "quant_gemm: values must be a contiguous int8 [N, K] or packed 4-bit uint8 [N, K / 2] tensor, K a "
              "multiple of ", kBlock, ", got ", q.scalar_type(), " ", q.sizes());
  const int64_t N = q.size(0), K = wide ? q.size(1) : 2 * q.size(1), G = K / kBlock;
  TORCH_CHECK(scale.device().is_cpu() && scale.dim() == 2 && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous() && scale.size(0) == N && scale.size(1) == G,
              "quant_gemm: the values need a float32 scale a block of ", kBlock, " ([N, K / ", kBlock, "]), got ",
              scale.sizes(), " for q ", q.sizes());
  if (offset.has_value()) {
    TORCH_CHECK(offset->device().is_cpu() && offset->scalar_type() == at::kFloat && offset->is_contiguous() &&
                    offset->sizes() == scale.sizes(),
                "quant_gemm: offset must be a contiguous float32 tensor shaped like scale");
  }
  const bool five = high.has_value();
  if (five) {
    TORCH_CHECK(!wide && high->device().is_cpu() && high->scalar_type() == at::kInt && high->is_contiguous() &&
                    high->sizes() == scale.sizes(),
                "quant_gemm: 5-bit values are packed nibbles (uint8) with a contiguous int32 [N, K / ", kBlock,
                "] fifth-bit mask a block, got ", high->scalar_type(), " ", high->sizes(), " for q ", q.scalar_type());
    TORCH_CHECK(0 <= zero && zero <= 31, "quant_gemm: a 5-bit value's zero must be within [0, 31], got ", zero);
  } else {
    TORCH_CHECK(wide ? zero == 0 : 0 <= zero && zero <= 15,
                "quant_gemm: a nibble's zero must be within [0, 15] (int8 values take none), got ", zero);
  }
  TORCH_CHECK(x.size(1) == K, "quant_gemm: x has ", x.size(1), " columns, the weight ", K);
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N,
                "quant_gemm: bias must be a contiguous float32 [N] tensor");
  }
#if defined(DEJAVU_INT8_GEMM)
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const bool offsets = offset.has_value();
  // int8 values enter the dot products as value + 128 (unsigned), so 128 * sum(xq) comes off as a zero's does.
  const int shift = wide ? 128 : static_cast<int>(zero);
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, shift, offsets);
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* op = offsets ? offset->data_ptr<float>() : nullptr;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const uint32_t* hp = five ? reinterpret_cast<const uint32_t*>(high->data_ptr<int32_t>()) : nullptr;
  if (wide) {
    panels_of<true, false>(true, offsets, xq, M, K, qp, hp, sp, op, bp, yp, N);
  } else if (five) {
    panels_of<false, true>(shift != 0, offsets, xq, M, K, qp, hp, sp, op, bp, yp, N);
  } else {
    panels_of<false, false>(shift != 0, offsets, xq, M, K, qp, hp, sp, op, bp, yp, N);
  }
  return y;
#else
  TORCH_CHECK(false, "quant_gemm: not built for this CPU (needs AVX512BW); quant_int8_dot() is 0");
#endif
}
