// Weight-only quantized GEMMs: x (float32) times quantized weights with float32 scales (and offsets) per group.
//
// A weight W [N, K] is held as values q, scales s [N, G] and optional offsets o [N, G], with G groups of K / G
// consecutive values per output row: W[n, k] = s[n, g] * q[n, k] (+ o[n, g]), g = k / (K / G). The values come two
// ways:
// * int8, one a byte (q [N, K]). One group per row (G = 1) is symmetric int8 per output channel; groups of 32 are
//   GGUF's blocks (Q8_0, and any of the packed types widened to int8).
// * 4-bit, two a byte in blocks of 32 values (q uint8 [N, K / 2], 16 bytes a block): byte i of a block holds
//   the block's value i in its low nibble and value i + 16 in its high nibble (GGUF's own order for Q4_0 and Q4_1,
//   so the file's bytes are used as they are), and the value is the nibble minus `zero` (8 for Q4_0, 0 for Q4_1).
//   A block's low nibbles are its first 16 values and its high ones the next 16, so one load of its bytes, masked
//   or shifted, gives whole registers of consecutive values (AVX-512: 16, AVX2: 8) with no reordering; AVX-512
//   then looks each value's weight up in the block's 16 possible weights (vpermps), AVX2 converts and scales it.
// * 5-bit, packed as GGUF packs Q5_0 and Q5_1: the low 4 bits of each value as the 4-bit layout's nibbles (q uint8
//   [N, K / 2]) and the fifth bits in a 32-bit mask a block (h int32 [N, K / 32], bit i: value i's fifth bit, the
//   file's word as it is), the value (nibble | bit << 4) minus `zero` (16 for Q5_0, 0 for Q5_1). Bits 0-15 of a
//   mask are the fifth bits of the block's low nibbles, bits 16-31 those of its high ones, so a register of
//   consecutive values takes its bits from one shift of the mask: AVX-512 as a lane mask (bit i for lane i) that
//   ORs 16 into the lanes' indices and looks each weight up in the block's 32 (vpermt2ps, two tables of 16), AVX2
//   as a variable shift per lane.
//
// quant_linear widens each int8 weight to float32 in registers (16 lanes on AVX-512, 8 on AVX2) and multiplies it
// into up to four rows of x at once, so a decode step reads each weight byte once from memory; a scale per row
// applies to the row's sum (per channel), a scale per block to each weight as it is widened, and offsets as offset *
// (sum of x over the block): x times the dequantized weight, distributed, in another summation order than a float
// GEMM's, with subnormals flushed to zero while it runs (FlushSubnormals). quant_linear4 is the same for 4-bit
// (and 5-bit) values, unpacked from their nibbles (and fifth bits) in registers: the same products summed in the
// same order, so its results are quant_linear's on the same values widened to int8, bit for bit. quant_dequantize
// (quant_dequantize4) writes the float32 weight (rows [a, b)) for the GEMMs of many rows, which are compute-bound.
// All run on torch's intra-op threads, split over output rows.
//
// Registered as torch operators in this extension's own namespace (torch.ops.<extension name>.quant_linear),
// beside the pybind11 module of kernels.cpp, by dejavu_quant_register.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int kRowTile = 4;  // rows of x per pass over the weight rows (their bytes stay in L1 across the passes)

// The weight lanes of one SIMD register: load `lanes` int8 values, widen to float32, dequantize.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kWeightRows = 4;  // output rows per block: 16 accumulators of the 32 registers
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vq(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
using Nibble = __m128i;  // the value subtracted from each nibble, in every byte
inline Nibble nibble_zero(int zero) { return _mm_set1_epi8(static_cast<char>(zero)); }
// The 16 values in the low (High = false) or high nibbles of 16 bytes, each minus `zero`, as float32.
template <bool High>
inline Vec vq4(const uint8_t* p, Nibble zero) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (High) b = _mm_srli_epi16(b, 4);
  b = _mm_sub_epi8(_mm_and_si128(b, _mm_set1_epi8(0x0F)), zero);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
// The 16 5-bit values whose low 4 bits are the low (High = false) or high nibbles of 16 bytes and whose fifth bits
// are bits 0-15 of `bits` (value i's in bit i), each minus `zero`, as float32.
template <bool High>
inline Vec vq5(const uint8_t* p, int zero, uint32_t bits) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (High) b = _mm_srli_epi16(b, 4);
  __m512i v = _mm512_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F)));
  v = _mm512_mask_or_epi32(v, static_cast<__mmask16>(bits), v, _mm512_set1_epi32(16));
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(zero)));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr int kWeightRows = 2;  // 8 accumulators of the 16 registers
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vq(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
using Nibble = __m128i;
inline Nibble nibble_zero(int zero) { return _mm_set1_epi8(static_cast<char>(zero)); }
// The 8 values in the low (High = false) or high nibbles of 8 bytes, each minus `zero`, as float32.
template <bool High>
inline Vec vq4(const uint8_t* p, Nibble zero) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if (High) b = _mm_srli_epi16(b, 4);
  b = _mm_sub_epi8(_mm_and_si128(b, _mm_set1_epi8(0x0F)), zero);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
// The 8 5-bit values of 8 bytes' low (High = false) or high nibbles and bits 0-7 of `bits`, each minus `zero`.
template <bool High>
inline Vec vq5(const uint8_t* p, int zero, uint32_t bits) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if (High) b = _mm_srli_epi16(b, 4);
  const __m256i v = _mm256_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F)));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i fifth =
      _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(bits)), lane), one), 4);
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(v, fifth), _mm256_set1_epi32(zero)));
}
#else
constexpr int kLanes = 1;  // scalar build: the "register" is one float
constexpr int kWeightRows = 1;
using Vec = float;
inline Vec vzero() { return 0.0f; }
inline Vec vset(float v) { return v; }
inline Vec vload(const float* p) { return *p; }
inline void vstore(float* p, Vec v) { *p = v; }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec vmul(Vec a, Vec b) { return a * b; }
inline Vec vadd(Vec a, Vec b) { return a + b; }
inline Vec vq(const int8_t* p) { return static_cast<float>(*p); }
inline float vsum(Vec v) { return v; }
using Nibble = int;
inline Nibble nibble_zero(int zero) { return zero; }
template <bool High>
inline Vec vq4(const uint8_t* p, Nibble zero) {
  return static_cast<float>(((High ? *p >> 4 : *p) & 0x0F) - zero);
}
template <bool High>
inline Vec vq5(const uint8_t* p, int zero, uint32_t bits) {
  return static_cast<float>((((High ? *p >> 4 : *p) & 0x0F) | static_cast<int>((bits & 1u) << 4)) - zero);
}
#endif

// y[r, j] for rows r < R of x (row stride ldx) and output rows j < NT of a weight with one scale a row and no
// offset (int8 per channel; q, s at row 0, rows K apart): the row's sum of x * q, times its scale once at the end.
// Each x load feeds NT FMAs, each widened weight vector R.
template <int R, int NT>
inline void dot_channel(const float* x, int64_t ldx, const int8_t* q, const float* s, int64_t K, float* y,
                        int64_t ldy) {
  Vec acc[NT][R];
  float tail[NT][R];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < R; ++r) {
      acc[j][r] = vzero();
      tail[j][r] = 0.0f;
    }
  const int64_t body = K - K % kLanes;
  for (int64_t k = 0; k < body; k += kLanes) {
    Vec w[NT];
    for (int j = 0; j < NT; ++j) w[j] = vq(q + j * K + k);
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload(x + r * ldx + k);
      for (int j = 0; j < NT; ++j) acc[j][r] = vfma(xv, w[j], acc[j][r]);
    }
  }
  for (int64_t k = body; k < K; ++k)  // the last values of a row of odd K
    for (int j = 0; j < NT; ++j)
      for (int r = 0; r < R; ++r) tail[j][r] += x[r * ldx + k] * static_cast<float>(q[j * K + k]);
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < R; ++r) y[r * ldy + j] = (vsum(acc[j][r]) + tail[j][r]) * s[j];
}

// The same with G groups of K / G values a row (GGUF's blocks), each with its scale and optional offset (rows G
// scales apart): x . (s[g] * q) over the groups, each weight scaled in registers as it is widened, plus
// sum_g o[g] * xsum[r, g], where xsum (row stride G) holds the sums of x over each group, made once a call.
template <int R, int NT>
inline void dot_groups(const float* x, int64_t ldx, const int8_t* q, const float* s, const float* o,
                       const float* xsum, int64_t K, int64_t groups, float* y, int64_t ldy) {
  Vec acc[NT][R];
  float tail[NT][R];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < R; ++r) {
      acc[j][r] = vzero();
      tail[j][r] = 0.0f;
    }
  const int64_t group = K / groups;
  const int64_t body = group - group % kLanes;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * group;
    Vec vs[NT];
    for (int j = 0; j < NT; ++j) vs[j] = vset(s[j * groups + g]);
    for (int64_t k = k0; k < k0 + body; k += kLanes) {
      Vec w[NT];
      for (int j = 0; j < NT; ++j) w[j] = vmul(vq(q + j * K + k), vs[j]);
      for (int r = 0; r < R; ++r) {
        const Vec xv = vload(x + r * ldx + k);
        for (int j = 0; j < NT; ++j) acc[j][r] = vfma(xv, w[j], acc[j][r]);
      }
    }
    for (int64_t k = k0 + body; k < k0 + group; ++k)  // a group's last values, where it is no whole register
      for (int j = 0; j < NT; ++j) {
        const float w = static_cast<float>(q[j * K + k]) * s[j * groups + g];
        for (int r = 0; r < R; ++r) tail[j][r] += x[r * ldx + k] * w;
      }
  }
  if (o != nullptr) {
    for (int j = 0; j < NT; ++j)
      for (int r = 0; r < R; ++r)
        for (int64_t g = 0; g < groups; ++g) tail[j][r] += o[j * groups + g] * xsum[r * groups + g];
  }
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < R; ++r) y[r * ldy + j] = vsum(acc[j][r]) + tail[j][r];
}

// A block of 4-bit values: kBlock values in kHalf bytes, value i in byte i's low nibble, value i + kHalf in its high.
constexpr int64_t kBlock = 32;
constexpr int64_t kHalf = kBlock / 2;

// Adds x . (s * v) over half a block (the values of its low nibbles, High = false, or of its high ones) to acc: x
// at the half's first value, q at row 0's block (rows `row` bytes apart), vs the rows' scales of the block. Five:
// 5-bit values, h the block's fifth-bit masks (rows `hrow` words apart), z the zero as an int.
template <bool High, bool Five, int R, int NT>
__attribute__((always_inline)) inline void dot_half(const float* x, int64_t ldx, const uint8_t* q, int64_t row,
                                                    const uint32_t* h, int64_t hrow, const Vec (&vs)[NT],
                                                    Nibble zero, int z, Vec (&acc)[NT][R]) {
  for (int64_t c = 0; c < kHalf; c += kLanes) {
    Vec w[NT];
    for (int j = 0; j < NT; ++j) {
      if constexpr (Five) {
        w[j] = vmul(vq5<High>(q + j * row + c, z, h[j * hrow] >> ((High ? kHalf : 0) + c)), vs[j]);
      } else {
        w[j] = vmul(vq4<High>(q + j * row + c, zero), vs[j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload(x + r * ldx + c);
      for (int j = 0; j < NT; ++j) acc[j][r] = vfma(xv, w[j], acc[j][r]);
    }
  }
}

// dot_groups for 4-bit values in blocks of kBlock (q at row 0, rows K / 2 bytes apart; a scale and optional offset
// a block; each value its nibble minus `zero`): the weights are the products scale * value dot_groups forms from
// the same values widened to int8, added to the same accumulators in the same order (a block's low nibbles, then
// its high ones), and the offsets are added as it adds them, so the results are dot_groups's bit for bit. With
// Channel (one block a row and no offset, which the int8 kernel takes as a scale per output channel) the values
// are summed unscaled and the row's sum scaled once, as dot_channel does. Five: 5-bit values, h their fifth-bit
// masks (a word a block, rows K / 32 words apart), each value (nibble | bit << 4) minus `zero`.
template <int R, int NT, bool Channel, bool Five>
inline void dot_blocks4(const float* x, int64_t ldx, const uint8_t* q, const uint32_t* h, const float* s,
                        const float* o, const float* xsum, int64_t K, int zero, float* y, int64_t ldy) {
  Vec acc[NT][R];
  float tail[NT][R];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < R; ++r) {
      acc[j][r] = vzero();
      tail[j][r] = 0.0f;
    }
  const int64_t blocks = K / kBlock, row = K / 2;
#if defined(__AVX512F__)
  // The 16 values a nibble can stand for, 0 - zero to 15 - zero, in lane order.
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const Vec levels = _mm512_cvtepi32_ps(_mm512_sub_epi32(lanes, _mm512_set1_epi32(zero)));
  // 5-bit values: the 16 with the fifth bit set, 16 - zero to 31 - zero (the others are `levels`).
  const Vec upper = _mm512_cvtepi32_ps(_mm512_sub_epi32(lanes, _mm512_set1_epi32(zero - 16)));
  const __m512i nibble = _mm512_set1_epi32(0x0F), sixteen = _mm512_set1_epi32(16);
#else
  const Nibble z = nibble_zero(zero);
#endif
  for (int64_t g = 0; g < blocks; ++g) {
    const uint8_t* qg = q + g * kHalf;
    const float* xg = x + g * kBlock;
#if defined(__AVX512F__)
    // A block's 16 bytes, one a 32-bit lane, are its first 16 values in their low nibbles and its next 16 in their
    // high ones; vpermps reads the low 4 bits of a lane's index only, so it looks each value's weight up in the
    // row's 16 possible weights (scale * level, the products dot_groups forms) straight from the byte, shifted
    // for the high nibbles: no mask, no conversion and no multiply a value.
    // 5-bit values: a lane's fifth bit ORs 16 into its index, and vpermt2ps, which reads its low 5 bits, looks it up
    // in the 32 weights of two registers (so the low nibbles are masked first).
    Vec low[NT], high[NT];
    for (int j = 0; j < NT; ++j) {
      const Vec weights = Channel ? levels : vmul(levels, vset(s[j * blocks + g]));
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + j * row)));
      if constexpr (Five) {
        const Vec weights5 = Channel ? upper : vmul(upper, vset(s[j * blocks + g]));
        const uint32_t bits = h[j * blocks + g];
        const __m512i lo = _mm512_and_si512(bytes, nibble), hi = _mm512_srli_epi32(bytes, 4);
        low[j] = _mm512_permutex2var_ps(
            weights, _mm512_mask_or_epi32(lo, static_cast<__mmask16>(bits), lo, sixteen), weights5);
        high[j] = _mm512_permutex2var_ps(
            weights, _mm512_mask_or_epi32(hi, static_cast<__mmask16>(bits >> 16), hi, sixteen), weights5);
      } else {
        low[j] = _mm512_permutexvar_ps(bytes, weights);
        high[j] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), weights);
      }
    }
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload(xg + r * ldx);
      for (int j = 0; j < NT; ++j) acc[j][r] = vfma(xv, low[j], acc[j][r]);
    }
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload(xg + r * ldx + kHalf);
      for (int j = 0; j < NT; ++j) acc[j][r] = vfma(xv, high[j], acc[j][r]);
    }
#else
    Vec vs[NT];
    for (int j = 0; j < NT; ++j) vs[j] = vset(Channel ? 1.0f : s[j * blocks + g]);  // times 1: exact
    const uint32_t* hg = Five ? h + g : nullptr;
    dot_half<false, Five, R, NT>(xg, ldx, qg, row, hg, blocks, vs, z, zero, acc);
    dot_half<true, Five, R, NT>(xg + kHalf, ldx, qg, row, hg, blocks, vs, z, zero, acc);
#endif
  }
  if (o != nullptr) {
    for (int j = 0; j < NT; ++j)
      for (int r = 0; r < R; ++r)
        for (int64_t g = 0; g < blocks; ++g) tail[j][r] += o[j * blocks + g] * xsum[r * blocks + g];
  }
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < R; ++r) {
      const float sum = vsum(acc[j][r]) + tail[j][r];
      y[r * ldy + j] = Channel ? sum * s[j] : sum;
    }
}

// Output rows j < NT (a block of the weight) for `rows` <= kRowTile rows of x.
template <int NT>
void dot_tile(int rows, const float* x, int64_t ldx, const int8_t* q, const float* s, const float* o,
              const float* xsum, int64_t K, int64_t groups, float* y, int64_t ldy) {
  if (groups == 1 && o == nullptr) {
    switch (rows) {
      case 4: dot_channel<4, NT>(x, ldx, q, s, K, y, ldy); break;
      case 3: dot_channel<3, NT>(x, ldx, q, s, K, y, ldy); break;
      case 2: dot_channel<2, NT>(x, ldx, q, s, K, y, ldy); break;
      default: dot_channel<1, NT>(x, ldx, q, s, K, y, ldy); break;
    }
    return;
  }
  switch (rows) {
    case 4: dot_groups<4, NT>(x, ldx, q, s, o, xsum, K, groups, y, ldy); break;
    case 3: dot_groups<3, NT>(x, ldx, q, s, o, xsum, K, groups, y, ldy); break;
    case 2: dot_groups<2, NT>(x, ldx, q, s, o, xsum, K, groups, y, ldy); break;
    default: dot_groups<1, NT>(x, ldx, q, s, o, xsum, K, groups, y, ldy); break;
  }
}

// The same for 4-bit values (as dot_tile, a row of one block and no offset is summed as a channel), and 5-bit ones
// (Five: h their fifth-bit masks).
template <int NT, bool Five>
void dot_tile4(int rows, const float* x, int64_t ldx, const uint8_t* q, const uint32_t* h, const float* s,
               const float* o, const float* xsum, int64_t K, int zero, float* y, int64_t ldy) {
  if (K == kBlock && o == nullptr) {
    switch (rows) {
      case 4: dot_blocks4<4, NT, true, Five>(x, ldx, q, h, s, o, xsum, K, zero, y, ldy); break;
      case 3: dot_blocks4<3, NT, true, Five>(x, ldx, q, h, s, o, xsum, K, zero, y, ldy); break;
      case 2: dot_blocks4<2, NT, true, Five>(x, ldx, q, h, s, o, xsum, K, zero, y, ldy); break;
      default: dot_blocks4<1, NT, true, Five>(x, ldx, q, h, s, o, xsum, K, zero, y, ldy); break;
    }
    return;
  }
  switch (rows) {
    case 4: dot_blocks4<4, NT, false, Five>(x, ldx, q, h, s, o, xsum, K, zero, y, ldy); break;
    case 3: dot_blocks4<3, NT, false, Five>(x, ldx, q, h, s, o, xsum, K, zero, y, ldy); break;
    case 2: dot_blocks4<2, NT, false, Five>(x, ldx, q, h, s, o, xsum, K, zero, y, ldy); break;
    default: dot_blocks4<1, NT, false, Five>(x, ldx, q, h, s, o, xsum, K, zero, y, ldy); break;
  }
}

// Flushes subnormal inputs and results to zero on this thread while it lives (x86's MXCSR DAZ and FTZ bits), then
// restores the mode. A subnormal operand (|v| < 2^-126; SwiGLU's output for very negative gates is one) costs an
// FMA a microcode assist of ~100 cycles, which made whole projections 3-10x slower; as zero, it changes a result
// by less than 2^-126 * |w| a term.
class FlushSubnormals {
 public:
#if defined(__SSE2__)
  FlushSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kDaz | kFtz); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kDaz = 0x0040, kFtz = 0x8000;
  unsigned saved_;
#endif
};

void check_scales(const at::Tensor& scale, const std::optional<at::Tensor>& offset) {
  TORCH_CHECK(scale.device().is_cpu(), "quant: CPU tensors only");
  if (offset.has_value()) {
    TORCH_CHECK(offset->device().is_cpu() && offset->scalar_type() == at::kFloat && offset->is_contiguous() &&
                    offset->sizes() == scale.sizes(),
                "quant: offset must be a contiguous float32 tensor shaped like scale");
  }
}

void check_weight(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& offset) {
  check_scales(scale, offset);
  TORCH_CHECK(q.device().is_cpu(), "quant: CPU tensors only");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "quant: q must be a contiguous int8 [N, K] tensor");
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.size(0) == q.size(0) && scale.size(1) >= 1 && q.size(1) % scale.size(1) == 0,
              "quant: scale must be a contiguous float32 [N, G] tensor with G dividing K, got ", scale.sizes(),
              " for q ", q.sizes());
}

// 4-bit values: uint8 [N, K / 2], K a multiple of kBlock, a scale (and offset) a block, zero a nibble's value;
// 5-bit ones (high given): the same and a fifth-bit mask a block (int32 [N, K / 32]), zero a 5-bit value.
void check_weight4(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                   int64_t zero, const std::optional<at::Tensor>& high) {
  check_scales(scale, offset);
  TORCH_CHECK(q.device().is_cpu(), "quant: CPU tensors only");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous() && q.size(1) % kHalf == 0,
              "quant: 4-bit values must be a contiguous uint8 [N, K / 2] tensor, K a multiple of ", kBlock, ", got ",
              q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.size(0) == q.size(0) && scale.size(1) * kHalf == q.size(1),
              "quant: 4-bit values need a float32 scale a block of ", kBlock, " ([N, K / ", kBlock, "]), got ",
              scale.sizes(), " for q ", q.sizes());
  if (high.has_value()) {
    TORCH_CHECK(high->device().is_cpu() && high->scalar_type() == at::kInt && high->is_contiguous() &&
                    high->sizes() == scale.sizes(),
                "quant: 5-bit values' fifth bits must be a contiguous int32 [N, K / ", kBlock,
                "] tensor (a mask a block), got ", high->scalar_type(), " ", high->sizes());
    TORCH_CHECK(0 <= zero && zero <= 31, "quant: a 5-bit value's zero must be within [0, 31], got ", zero);
  } else {
    TORCH_CHECK(0 <= zero && zero <= 15, "quant: a nibble's zero must be within [0, 15], got ", zero);
  }
}

// What quant_linear and quant_linear4 share: the checks of x (float32 [M, K], rows contiguous) and bias, the sums
// of x over each of the `groups` groups (for the offsets' terms, offset * sum of x over its group), and the
// parallel loop over blocks of kWeightRows output rows, each multiplied into kRowTile rows of x at a time by
// tile(nt, rows, m, n, xsum of row m, y at [m, n]): nt a std::integral_constant, kWeightRows for a whole block,
// else 1 (the last block's rows one at a time).
template <class Tile>
at::Tensor linear_rows(const at::Tensor& x, int64_t K, int64_t N, int64_t groups, bool offsets,
                       const std::optional<at::Tensor>& bias, Tile tile) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "quant_linear: x must be a float32 [M, K] CPU tensor with contiguous rows");
  TORCH_CHECK(x.size(1) == K, "quant_linear: x has ", x.size(1), " columns, the weight ", K);
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N,
                "quant_linear: bias must be a contiguous float32 [N] tensor");
  }
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  std::vector<float> xsum(offsets ? M * groups : 0);
  const int64_t group = K / groups;
  for (int64_t m = 0; offsets && m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += xp[m * ldx + k];
      xsum[m * groups + g] = sum;
    }
  const float* xs = xsum.empty() ? nullptr : xsum.data();
  // Grain: enough output rows per task that a task streams at least ~64 KiB of weights.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K, 1));
  const int64_t blocks = (N + kWeightRows - 1) / kWeightRows;
  at::parallel_for(0, blocks, std::max<int64_t>(1, grain / kWeightRows), [&](int64_t b0, int64_t b1) {
    const FlushSubnormals flush;  // each thread's own mode
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kWeightRows;
      const bool whole = n + kWeightRows <= N;  // the last block may hold fewer rows: one at a time
      for (int64_t j = 0; j < (whole ? 1 : N - n); ++j) {
        const int64_t nj = n + j;
        for (int64_t m = 0; m < M; m += kRowTile) {
          const int rows = static_cast<int>(std::min<int64_t>(kRowTile, M - m));
          const float* xsm = xs != nullptr ? xs + m * groups : nullptr;
          if (whole) {
            tile(std::integral_constant<int, kWeightRows>{}, rows, xp + m * ldx, ldx, nj, xsm, yp + m * N + nj, N);
          } else {
            tile(std::integral_constant<int, 1>{}, rows, xp + m * ldx, ldx, nj, xsm, yp + m * N + nj, N);
          }
        }
      }
      if (bp != nullptr) {
        for (int64_t m = 0; m < M; ++m)
          for (int64_t nj = n; nj < std::min(N, n + kWeightRows); ++nj) yp[m * N + nj] += bp[nj];
      }
    }
  });
  return y;
}

}  // namespace

// x [M, K] (float32, rows contiguous) @ W^T (+ bias [N]) -> [M, N] float32, W (int8 values) dequantized in registers.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias) {
  check_weight(q, scale, offset);
  const int64_t K = q.size(1), groups = scale.size(1);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.has_value() ? offset->data_ptr<float>() : nullptr;
  return linear_rows(x, K, q.size(0), groups, op != nullptr, bias,
                     [&](auto nt, int rows, const float* xm, int64_t ldx, int64_t n, const float* xsm, float* ym,
                         int64_t ldy) {
                       dot_tile<decltype(nt)::value>(rows, xm, ldx, qp + n * K, sp + n * groups,
                                                     op != nullptr ? op + n * groups : nullptr, xsm, K, groups, ym,
                                                     ldy);
                     });
}

// The same for 4-bit values q (uint8 [N, K / 2], blocks of 32, each value its nibble minus `zero`), or 5-bit ones
// (high: int32 [N, K / 32], a fifth-bit mask a block; each value (nibble | bit << 4) minus `zero`): its results are
// quant_linear's on the values widened to int8, bit for bit.
at::Tensor quant_linear4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                         const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias, int64_t zero,
                         const std::optional<at::Tensor>& high) {
  check_weight4(q, scale, offset, zero, high);
  const int64_t K = 2 * q.size(1), blocks = scale.size(1);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint32_t* hp = high.has_value() ? reinterpret_cast<const uint32_t*>(high->data_ptr<int32_t>()) : nullptr;
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.has_value() ? offset->data_ptr<float>() : nullptr;
  const int z = static_cast<int>(zero);
  return linear_rows(x, K, q.size(0), blocks, op != nullptr, bias,
                     [&](auto nt, int rows, const float* xm, int64_t ldx, int64_t n, const float* xsm, float* ym,
                         int64_t ldy) {
                       const uint8_t* qn = qp + n * (K / 2);
                       const float* on = op != nullptr ? op + n * blocks : nullptr;
                       if (hp != nullptr) {
                         dot_tile4<decltype(nt)::value, true>(rows, xm, ldx, qn, hp + n * blocks, sp + n * blocks, on,
                                                              xsm, K, z, ym, ldy);
                       } else {
                         dot_tile4<decltype(nt)::value, false>(rows, xm, ldx, qn, nullptr, sp + n * blocks, on, xsm,
                                                               K, z, ym, ldy);
                       }
                     });
}

// Rows [first, last) of the float32 weight: s * q (+ o), each product rounded before the offset is added
// (numpy's and torch's order, so the values are theirs bit for bit).
__attribute__((optimize("fp-contract=off"))) at::Tensor quant_dequantize(const at::Tensor& q, const at::Tensor& scale,
                                                                          const std::optional<at::Tensor>& offset,
                                                                          int64_t first, int64_t last) {
  check_weight(q, scale, offset);
  const int64_t N = q.size(0), K = q.size(1), groups = scale.size(1), group = K / groups;
  TORCH_CHECK(0 <= first && first <= last && last <= N, "quant_dequantize: rows [", first, ", ", last,
              ") not within [0, ", N, ")");
  at::Tensor w = at::empty({last - first, K}, scale.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.has_value() ? offset->data_ptr<float>() : nullptr;
  float* wp = w.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K, 1));
  at::parallel_for(first, last, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* qn = qp + n * K;
      float* wn = wp + (n - first) * K;
      for (int64_t g = 0; g < groups; ++g) {
        const float s = sp[n * groups + g];
        const float o = op != nullptr ? op[n * groups + g] : 0.0f;
        const Vec vs = vset(s), vo = vset(o);
        const int64_t k0 = g * group, body = k0 + (group - group % kLanes);
        int64_t k = k0;
        for (; k < body; k += kLanes) {
          Vec p = vmul(vq(qn + k), vs);
          if (op != nullptr) p = vadd(p, vo);
          vstore(wn + k, p);
        }
        for (; k < k0 + group; ++k) {
          const float p = static_cast<float>(qn[k]) * s;
          wn[k] = op != nullptr ? p + o : p;
        }
      }
    }
  });
  return w;
}

// The same for 4-bit values (uint8 [N, K / 2], blocks of 32, each value its nibble minus `zero`) and 5-bit ones
// (high: a fifth-bit mask a block): the values widened to int8 give quant_dequantize's weight, bit for bit.
__attribute__((optimize("fp-contract=off"))) at::Tensor quant_dequantize4(
    const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& offset, int64_t zero,
    int64_t first, int64_t last, const std::optional<at::Tensor>& high) {
  check_weight4(q, scale, offset, zero, high);
  const int64_t N = q.size(0), K = 2 * q.size(1), blocks = scale.size(1);
  TORCH_CHECK(0 <= first && first <= last && last <= N, "quant_dequantize4: rows [", first, ", ", last,
              ") not within [0, ", N, ")");
  at::Tensor w = at::empty({last - first, K}, scale.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.has_value() ? offset->data_ptr<float>() : nullptr;
  float* wp = w.data_ptr<float>();
  const uint32_t* hp = high.has_value() ? reinterpret_cast<const uint32_t*>(high->data_ptr<int32_t>()) : nullptr;
  const Nibble z = nibble_zero(static_cast<int>(zero));
  const int zi = static_cast<int>(zero);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K, 1));
  at::parallel_for(first, last, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t g = 0; g < blocks; ++g) {
        const Vec vs = vset(sp[n * blocks + g]);
        const Vec vo = vset(op != nullptr ? op[n * blocks + g] : 0.0f);
        const uint8_t* qg = qp + n * (K / 2) + g * kHalf;
        float* wg = wp + (n - first) * K + g * kBlock;
        const uint32_t bits = hp != nullptr ? hp[n * blocks + g] : 0;
        for (int64_t c = 0; c < kHalf; c += kLanes) {
          Vec low = vmul(hp != nullptr ? vq5<false>(qg + c, zi, bits >> c) : vq4<false>(qg + c, z), vs);
          Vec high = vmul(hp != nullptr ? vq5<true>(qg + c, zi, bits >> (kHalf + c)) : vq4<true>(qg + c, z), vs);
          if (op != nullptr) {
            low = vadd(low, vo);
            high = vadd(high, vo);
          }
          vstore(wg + c, low);
          vstore(wg + kHalf + c, high);
        }
      }
    }
  });
  return w;
}

// The SIMD width the kernels were built with (16: AVX-512, 8: AVX2, 1: scalar).
int64_t quant_lanes() { return kLanes; }

// quant_gemm.cpp: weights in blocks of 32 times many rows, on int8 dot products.
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias, int64_t zero,
                       const std::optional<at::Tensor>& high);
int64_t quant_int8_dot();

// Registers the operators in namespace `ns` (the extension's name), once per library; called by Python through
// ctypes when it first uses them (dejavu_engine.quant). Not a static initializer: a second copy of a build loaded
// in one process (a build made ahead, tried beside this host's own) would register the same names again, and an
// error thrown while a library loads aborts the process. Returns 0, or 1 with the reason in `error`.
extern "C" __attribute__((visibility("default"))) int dejavu_quant_register(const char* ns, char* error,
                                                                            int64_t error_size) {
  static torch::Library* library = nullptr;
  if (library != nullptr) return 0;
  try {
    auto* made = new torch::Library(torch::Library::FRAGMENT, ns, std::nullopt, __FILE__, __LINE__);
    made->def("quant_linear(Tensor x, Tensor q, Tensor scale, Tensor? offset, Tensor? bias) -> Tensor",
              &quant_linear);
    made->def("quant_dequantize(Tensor q, Tensor scale, Tensor? offset, int first, int last) -> Tensor",
              &quant_dequantize);
    made->def("quant_linear4(Tensor x, Tensor q, Tensor scale, Tensor? offset, Tensor? bias, int zero, "
              "Tensor? high=None) -> Tensor",
              &quant_linear4);
    made->def("quant_dequantize4(Tensor q, Tensor scale, Tensor? offset, int zero, int first, int last, "
              "Tensor? high=None) -> Tensor",
              &quant_dequantize4);
    made->def("quant_lanes() -> int", &quant_lanes);
    made->def("quant_gemm(Tensor x, Tensor q, Tensor scale, Tensor? offset, Tensor? bias, int zero, "
              "Tensor? high=None) -> Tensor",
              &quant_gemm);
    made->def("quant_int8_dot() -> int", &quant_int8_dot);
    library = made;
    return 0;
  } catch (const std::exception& exc) {
    if (error != nullptr && error_size > 0) {
      std::strncpy(error, exc.what(), static_cast<size_t>(error_size - 1));
      error[error_size - 1] = '\0';
    }
    return 1;
  }
}
