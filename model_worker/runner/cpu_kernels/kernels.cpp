// CPU kernels of the decoder's hot path, called through ctypes (model_worker/runner/cpu_kernels/ops.py).
//
// Plain C++ with no torch headers, so a build takes about a second. Tensors arrive as pointers and
// element strides; every entry point exists for float32 ("_f32") and bfloat16 ("_bf16", raw uint16
// bits), and computes in float32. Parallel loops use OpenMP: the library links libgomp.so.1, the
// soname torch's own OpenMP runtime is loaded under, so both share one thread team (ops.py loads
// this library only after torch).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif



namespace {

using bf16 = uint16_t;

// Rows of at least this many elements in all are worth a parallel region; below it this thread
// does them without entering OpenMP at all (even an `if (false)` region costs the calling thread a
// few microseconds beside a spinning team, and a decode step's rows are a few hundred elements).
constexpr int64_t kParallelElements = 1 << 15;

// body(i) for i in [0, n): across the thread team when `parallel`, else on this thread alone.
template <typename Body>
void for_each_index(int64_t n, bool parallel, const Body& body) {
  if (!parallel) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) body(i);
}

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
// Round to nearest even, as torch's float -> bfloat16 conversion does; NaN stays a quiet NaN.
template <> inline bf16 from_float<bf16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16>(bits >> 16);
}

// exp_clamped's (and exp8_clamped's) constants: the range it clamps x to, log2(e), ln 2 split in a
// high part exact in few bits and the rest (Cody-Waite), and Cephes' expf polynomial for e^r,
// highest degree first, the terms of degree 2 to 6 (r^0 and r^1 are added exactly after).
constexpr float kExpLow = -87.f, kExpHigh = 88.f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr int kExpPolyTerms = 6;
constexpr float kExpPoly[kExpPolyTerms] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// Whether attention's scores for T are summed on bfloat16 pairs (dpbf16ps, on CPUs with
// AVX512_BF16): the query and K as they are, two adjacent dimensions a 32-bit word, the exact
// products of a word added in float32, the scale applied to the sums (decode_part_avx512,
// prefill_scores_pairs).
template <typename T>
constexpr bool kPairScores =
#if defined(__AVX512BF16__)
    std::is_same_v<T, bf16>;
#else
    false;
#endif

#if defined(__AVX512F__)
// 16 floats from 16 elements at p.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// 16 floats to 16 elements at p, rounded as from_float rounds each. With AVX512_BF16 one
// vcvtneps2bf16 does it (SiLU-times-up 1.2x faster at 256-2,048 rows), with the same bits except
// for denormal floats (below 2^-126), which it flushes to a zero of their sign.
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  return;
#endif
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// v rounded to T's precision as store16 rounds it, kept as floats.
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(32) bf16 rounded[16];
    store16(rounded, v);
    return load16(rounded);
  }
}

// e^x to about 2 ulp for x in [-87, 88] (clamped to it): x = n ln2 + r with |r| <= ln2 / 2, e^r by
// a degree-6 polynomial, times 2^n by scalef.
inline __m512 exp_clamped(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLow)), _mm512_set1_ps(kExpHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < kExpPolyTerms; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Lane j of the result is the sum of the 16 lanes of v[j].
inline __m512 reduce16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: the lane's sums of four vectors
    const __m512d a = _mm512_castps_pd(pairs[2 * j]), b = _mm512_castps_pd(pairs[2 * j + 1]);
    quads[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// A cache row of head_dim = 16 * C elements as C float vectors. bfloat16 with C even is read 32
// elements a load and widened without shuffles: the even elements by a shift, the odd ones by a
// mask (a bfloat16 is the top half of its float), so vector 2i holds elements 32i + 2j and vector
// 2i + 1 elements 32i + 2j + 1 (j = 0..15): `split_pairs` says whether T reads in that order, and
// the query and the accumulators are kept in it too (to_pair_order, from_pair_order). Widening
// by vpmovzxwd, as load16 does, takes the shuffle port that the reductions of the scores need.
template <typename T, int C>
constexpr bool split_pairs = std::is_same_v<T, bf16> && C % 2 == 0;

template <typename T, int C>
inline void load_row(const T* p, __m512* out) {
  if constexpr (split_pairs<T, C>) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for (int i = 0; i < C / 2; ++i) {
      const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(p + 32 * i));
      out[2 * i] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      out[2 * i + 1] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
  } else {
    for (int c = 0; c < C; ++c) out[c] = load16(p + 16 * c);
  }
}

// D = 16 * C floats at p, rewritten in place into load_row's order, and back: each 32 floats
// (a, b) become (a b permuted by first, a b permuted by second).
template <typename T, int C>
inline void permute_pairs(float* p, __m512i first, __m512i second) {
  if constexpr (split_pairs<T, C>) {
    for (int i = 0; i < C / 2; ++i) {
      const __m512 a = _mm512_loadu_ps(p + 32 * i), b = _mm512_loadu_ps(p + 32 * i + 16);
      _mm512_storeu_ps(p + 32 * i, _mm512_permutex2var_ps(a, first, b));
      _mm512_storeu_ps(p + 32 * i + 16, _mm512_permutex2var_ps(a, second, b));
    }
  }
}

template <typename T, int C>
inline void to_pair_order(float* p) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  permute_pairs<T, C>(p, even, _mm512_add_epi32(even, _mm512_set1_epi32(1)));
}

template <typename T, int C>
inline void from_pair_order(float* p) {
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  permute_pairs<T, C>(p, low, _mm512_add_epi32(low, _mm512_set1_epi32(8)));
}

// DecodePart::run for G query heads per kv head and head_dim = 16 * C, with a kv head's queries and
// accumulators in registers: the range is walked 16 positions at a time, and within each tile every
// kv head in turn (the tile's slots, all kv heads, are contiguous in the cache: read front to back,
// not one stride per kv head), first K for the scores of the 16 positions (their 16 dot products
// summed across lanes together), then, after the exponentials, V weighted by them.
//
// With `touch`, before the K pass, one pass of plain loads over the range's K and V slots together
// brings them into L2 (a range is at most ops.SPLIT_LEN = 256 positions: 96 KB of K and 96 KB of V
// for SmolLM2 in bfloat16, 1 MB each for 8 kv heads of 128 in float32). A loop that only loads keeps
// as many misses in flight as the core can track; the compute loops, with their hundreds of
// instructions between two slots, kept few, and prefetch instructions a tile ahead changed nothing
// measurable. 64 rows at 290 positions over 30 layers' caches: 48 ms a step with the prefetches,
// 33 with a pass over K before the K pass and one over V before the V pass; a plain read of the
// same 6 KB blocks in random order runs at 19 GB/s on this machine, the kernel read them at 9
// (docs/benchmarks.md, thirteenth pass). One pass over both, two streams at once, is 5-8% faster
// again at 60 rows (sixteenth pass); loads of the V range or the next part's K spread between the
// K tiles' compute, or prefetches in their place, were 10-30% slower. Without `touch` (a step of
// few parts), each tile's slots are prefetched while the one before is computed.
template <typename T, int G, int C>
void decode_part_avx512(const T* k_cache, const T* v_cache, const int64_t* blocks, int64_t num_kv_heads,
                        int64_t block_size, const float* query, const T* raw_query, float scale, int64_t begin,
                        int64_t end, float* scores, float* row_max, float* denom, float* acc, bool touch) {
  constexpr int64_t D = 16 * C;
  constexpr bool pairs = kPairScores<T> && C % 2 == 0;
  const int64_t len = end - begin, slot_stride = num_kv_heads * D, num_heads = num_kv_heads * G;
  // Each position's slot, once: the load passes, the K and V passes and the prefetches all read it
  // (it was a division by the block size each time).
  thread_local std::vector<int64_t> offsets;
  offsets.resize(len);
  for (int64_t i = 0, block = begin / block_size, within = begin % block_size; i < len; ++i) {
    offsets[i] = (blocks[block] * block_size + within) * slot_stride;
    if (++within == block_size) {
      within = 0;
      ++block;
    }
  }
  auto slot = [&](const T* cache, int64_t pos) { return cache + offsets[pos - begin]; };
  const int64_t slot_bytes = slot_stride * static_cast<int64_t>(sizeof(T));
  auto prefetch_tile = [&](const T* cache, int64_t tile) {
    const int64_t stop = std::min<int64_t>(tile + 16, end);
    for (int64_t pos = tile; pos < stop; ++pos) {
      const char* p = reinterpret_cast<const char*>(slot(cache, pos));
      for (int64_t b = 0; b < slot_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    }
  };
  // With `touch`, every K and V slot of the range, line by line, into L2.
  if (touch) {
    __m512i seen = _mm512_setzero_si512();
    for (int64_t i = 0; i < len; ++i) {
      const char* k = reinterpret_cast<const char*>(k_cache + offsets[i]);
      const char* v = reinterpret_cast<const char*>(v_cache + offsets[i]);
      for (int64_t b = 0; b < slot_bytes; b += 64)
        seen = _mm512_or_si512(seen, _mm512_or_si512(_mm512_loadu_si512(k + b), _mm512_loadu_si512(v + b)));
    }
    asm volatile("" : : "v"(seen));  // the loads are the point: keep them
  } else {
    prefetch_tile(k_cache, begin);  // the K pass prefetches the rest a tile ahead
  }
  for (int64_t tile = begin; tile < end; tile += 16) {
    if (!touch) prefetch_tile(k_cache, tile + 16);
    const int n = static_cast<int>(std::min<int64_t>(16, end - tile));
    const __mmask16 valid = static_cast<__mmask16>(n == 16 ? 0xffffu : (1u << n) - 1u);
    for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
      // The kv head's queries: bfloat16 pairs as they are (pairs), else floats in load_row's order.
      __m512bh q_pairs[G][pairs ? C / 2 : 1];
      __m512 q[G][C];
      for (int g = 0; g < G; ++g) {
        if constexpr (pairs) {
          for (int i = 0; i < C / 2; ++i)
            q_pairs[g][i] = (__m512bh)_mm512_loadu_si512(raw_query + (kv * G + g) * D + 32 * i);
        } else {
          alignas(64) float ordered[D];
          std::memcpy(ordered, query + (kv * G + g) * D, sizeof(ordered));
          to_pair_order<T, C>(ordered);
          for (int c = 0; c < C; ++c) q[g][c] = _mm512_load_ps(ordered + 16 * c);
        }
      }
      __m512 dots[G][16];
      for (int p = 0; p < 16; ++p) {
        if (p >= n) {
          for (int g = 0; g < G; ++g) dots[g][p] = _mm512_setzero_ps();
          continue;
        }
        const T* k = slot(k_cache, tile + p) + kv * D;
        if constexpr (pairs) {
          __m512bh kw[C / 2];
          for (int i = 0; i < C / 2; ++i) kw[i] = (__m512bh)_mm512_loadu_si512(k + 32 * i);
          for (int g = 0; g < G; ++g) {
            __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), kw[0], q_pairs[g][0]);
            for (int i = 1; i < C / 2; ++i) sum = _mm512_dpbf16_ps(sum, kw[i], q_pairs[g][i]);
            dots[g][p] = sum;
          }
        } else {
          __m512 kc[C];
          load_row<T, C>(k, kc);
          for (int g = 0; g < G; ++g) {
            __m512 sum = _mm512_mul_ps(q[g][0], kc[0]);
            for (int c = 1; c < C; ++c) sum = _mm512_fmadd_ps(q[g][c], kc[c], sum);
            dots[g][p] = sum;
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        const int64_t h = kv * G + g;
        const __m512 s = pairs ? _mm512_mul_ps(reduce16(dots[g]), _mm512_set1_ps(scale)) : reduce16(dots[g]);
        _mm512_mask_storeu_ps(scores + h * len + (tile - begin), valid, s);
      }
    }
  }
  // Each head's maximum over the stored scores, in one pass: a reduction to a float per tile and
  // head was a serial chain through row_max.
  for (int64_t h = 0; h < num_heads; ++h) {
    const float* sh = scores + h * len;
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 valid = static_cast<__mmask16>(len - i >= 16 ? 0xffffu : (1u << (len - i)) - 1u);
      m = _mm512_mask_max_ps(m, valid, m, _mm512_maskz_loadu_ps(valid, sh + i));
    }
    row_max[h] = _mm512_reduce_max_ps(m);
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    float* sh = scores + h * len;
    const __m512 m = _mm512_set1_ps(row_max[h]);
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 valid = static_cast<__mmask16>(len - i >= 16 ? 0xffffu : (1u << (len - i)) - 1u);
      const __m512 e = _mm512_maskz_mov_ps(valid, exp_clamped(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, sh + i), m)));
      _mm512_mask_storeu_ps(sh + i, valid, e);
      total = _mm512_add_ps(total, e);
    }
    denom[h] = _mm512_reduce_add_ps(total);
  }
  std::fill(acc, acc + num_heads * D, 0.f);
  if (!touch) prefetch_tile(v_cache, begin);  // the V pass prefetches the rest a tile ahead
  for (int64_t tile = begin; tile < end; tile += 16) {
    if (!touch) prefetch_tile(v_cache, tile + 16);
    const int64_t stop = std::min<int64_t>(tile + 16, end);
    for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
      __m512 out[G][C];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) out[g][c] = _mm512_loadu_ps(acc + (kv * G + g) * D + 16 * c);
      for (int64_t pos = tile; pos < stop; ++pos) {
        const T* v = slot(v_cache, pos) + kv * D;
        __m512 vc[C];
        load_row<T, C>(v, vc);
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[(kv * G + g) * len + pos - begin]);
          for (int c = 0; c < C; ++c) out[g][c] = _mm512_fmadd_ps(p, vc[c], out[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (kv * G + g) * D + 16 * c, out[g][c]);
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) from_pair_order<T, C>(acc + h * D);
}

template <typename T>
using DecodePartFn = void (*)(const T*, const T*, const int64_t*, int64_t, int64_t, const float*, const T*, float,
                              int64_t, int64_t, float*, float*, float*, float*, bool);

// The register-resident variant for this head shape, or nullptr.
template <typename T>
DecodePartFn<T> decode_part_for(int64_t group, int64_t head_dim) {
#define ITERSERVE_CASE(G, C) \
  if (group == G && head_dim == 16 * C) return decode_part_avx512<T, G, C>;
  ITERSERVE_CASE(1, 4) ITERSERVE_CASE(2, 4) ITERSERVE_CASE(3, 4) ITERSERVE_CASE(4, 4) ITERSERVE_CASE(6, 4)
  ITERSERVE_CASE(8, 4) ITERSERVE_CASE(1, 8) ITERSERVE_CASE(2, 8) ITERSERVE_CASE(4, 8) ITERSERVE_CASE(8, 8)
#undef ITERSERVE_CASE
  return nullptr;
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 (no AVX-512): 8 floats a vector.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// exp_clamped's e^x (the same reduction and polynomial), 8 lanes; 2^n built in the exponent bits.
inline __m256 exp8_clamped(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLow)), _mm256_set1_ps(kExpHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < kExpPolyTerms; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // n is in [-126, 127]: 2^n is the float with exponent field n + 127.
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// Lane j of the result is the sum of the 8 lanes of v[j].
inline __m256 reduce8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a: the halves' sums of v0-v3 (low 128 bits the low halves), b those of v4-v7.
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// V weighted by the scores of one query head, for the `NC` 8-float chunks at `offset` in each V slot:
// acc[0, 8 NC) = the sum over the range's positions of p[pos] * those chunks, the sums in registers.
template <typename T, int NC, typename Slot>
inline void weighted_v_avx2(const Slot& v_slot, int64_t begin, int64_t end, int64_t offset, const float* p,
                            float* acc) {
  __m256 sums[NC];
  for (int j = 0; j < NC; ++j) sums[j] = _mm256_setzero_ps();
  for (int64_t pos = begin; pos < end; ++pos) {
    const T* v = v_slot(pos) + offset;
    const __m256 weight = _mm256_set1_ps(p[pos - begin]);
    for (int j = 0; j < NC; ++j) sums[j] = _mm256_fmadd_ps(weight, load8(v + 8 * j), sums[j]);
  }
  for (int j = 0; j < NC; ++j) _mm256_storeu_ps(acc + 8 * j, sums[j]);
}
#endif

// One (row, position range) of decode attention: for each query head, the scores of the range's
// positions, their maximum, the sum of their exponentials and the exponential-weighted sum of V.
// Every K and V slot of the range is read once, whole (all kv heads: contiguous in the cache), and
// converted once for the query heads that share it.
template <typename T>
struct DecodePart {
  const T* k_cache;
  const T* v_cache;
  const int64_t* blocks;
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  // Load each range's K and V into L2 before computing on them (decode_part_avx512).
  bool touch;

  const T* slot(const T* cache, int64_t pos) const {
    return cache + (blocks[pos / block_size] * block_size + pos % block_size) * num_kv_heads * head_dim;
  }

  // query: (num_heads, head_dim) scaled floats, raw_query the same unscaled as T (what kPairScores
  // multiplies), scale what scaled it; scores: (num_heads, end - begin) scratch; row:
  // (num_kv_heads * head_dim) scratch; writes row_max, denom (num_heads) and acc (num_heads, head_dim).
  void run(const float* query, const T* raw_query, float scale, int64_t begin, int64_t end, float* scores, float* row,
           float* row_max, float* denom, float* acc) const {
    const int64_t len = end - begin, group = num_heads / num_kv_heads, width = num_kv_heads * head_dim;
#if defined(__AVX512F__)
    if (const DecodePartFn<T> fast = decode_part_for<T>(group, head_dim)) {
      fast(k_cache, v_cache, blocks, num_kv_heads, block_size, query, raw_query, scale, begin, end, scores, row_max,
           denom, acc, touch);
      return;
    }
#endif
    for (int64_t h = 0; h < num_heads; ++h) row_max[h] = -std::numeric_limits<float>::infinity();
    std::fill(acc, acc + num_heads * head_dim, 0.f);
#if defined(__AVX512F__)
    if (head_dim % 16 == 0) {
      const int64_t chunks = head_dim / 16;
      for (int64_t pos = begin; pos < end; ++pos) {
        const T* k = slot(k_cache, pos);
        for (int64_t c = 0; c < width / 16; ++c) _mm512_storeu_ps(row + 16 * c, load16(k + 16 * c));
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* qh = query + h * head_dim;
          const float* kh = row + (h / group) * head_dim;
          __m512 sum = _mm512_mul_ps(load16(qh), load16(kh));
          for (int64_t c = 1; c < chunks; ++c) sum = _mm512_fmadd_ps(load16(qh + 16 * c), load16(kh + 16 * c), sum);
          const float s = _mm512_reduce_add_ps(sum);
          scores[h * len + pos - begin] = s;
          row_max[h] = s > row_max[h] ? s : row_max[h];
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* sh = scores + h * len;
        const __m512 max = _mm512_set1_ps(row_max[h]);
        __m512 total = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= len; i += 16) {
          const __m512 e = exp_clamped(_mm512_sub_ps(_mm512_loadu_ps(sh + i), max));
          _mm512_storeu_ps(sh + i, e);
          total = _mm512_add_ps(total, e);
        }
        if (i < len) {
          const __mmask16 tail = static_cast<__mmask16>((1u << (len - i)) - 1u);
          const __m512 e = exp_clamped(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sh + i), max));
          _mm512_mask_storeu_ps(sh + i, tail, e);
          total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, e));
        }
        denom[h] = _mm512_reduce_add_ps(total);
      }
      for (int64_t pos = begin; pos < end; ++pos) {
        const T* v = slot(v_cache, pos);
        for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
          for (int64_t c = 0; c < chunks; ++c) {
            const __m512 vc = load16(v + kv * head_dim + 16 * c);
            for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
              float* a = acc + h * head_dim + 16 * c;
              _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[h * len + pos - begin]), vc, _mm512_loadu_ps(a)));
            }
          }
        }
      }
      return;
    }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    // AVX2: per query head, the scores of 8 positions at a time (8 dot products in registers, summed
    // across lanes together), the exponentials 8 at a time, then V weighted by them, up to 8 chunks
    // of the head's accumulator in registers while the range's V rows pass.
    if (head_dim % 8 == 0) {
      const int64_t chunks = head_dim / 8;
      // Each position's K and V slot, found once (a position's block is a division away).
      thread_local std::vector<const T*> slots;
      slots.resize(2 * len);
      const T** k_slots = slots.data();
      const T** v_slots = k_slots + len;
      for (int64_t pos = begin; pos < end;) {
        const int64_t block = pos / block_size, first = pos - block * block_size;
        const int64_t n = std::min(end - pos, block_size - first);
        const int64_t at = (blocks[block] * block_size + first) * width;
        for (int64_t i = 0; i < n; ++i) {
          k_slots[pos - begin + i] = k_cache + at + i * width;
          v_slots[pos - begin + i] = v_cache + at + i * width;
        }
        pos += n;
      }
      const auto k_slot = [&](int64_t pos) { return k_slots[pos - begin]; };
      const auto v_slot = [&](int64_t pos) { return v_slots[pos - begin]; };
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* qh = query + h * head_dim;
        const int64_t offset = (h / group) * head_dim;
        float* sh = scores + h * len;
        __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        int64_t pos = begin;
        for (; pos + 8 <= end; pos += 8) {
          const T* ks[8];
          for (int j = 0; j < 8; ++j) ks[j] = k_slot(pos + j) + offset;
          __m256 dots[8];
          for (int j = 0; j < 8; ++j) dots[j] = _mm256_mul_ps(_mm256_loadu_ps(qh), load8(ks[j]));
          for (int64_t c = 1; c < chunks; ++c) {
            const __m256 qc = _mm256_loadu_ps(qh + 8 * c);
            for (int j = 0; j < 8; ++j) dots[j] = _mm256_fmadd_ps(qc, load8(ks[j] + 8 * c), dots[j]);
          }
          const __m256 s8 = reduce8(dots);
          _mm256_storeu_ps(sh + pos - begin, s8);
          best = _mm256_max_ps(best, s8);
        }
        float m = hmax8(best);
        for (; pos < end; ++pos) {
          const T* k = k_slot(pos) + offset;
          __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(qh), load8(k));
          for (int64_t c = 1; c < chunks; ++c) dot = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), load8(k + 8 * c), dot);
          const float s = hsum8(dot);
          sh[pos - begin] = s;
          m = s > m ? s : m;
        }
        row_max[h] = m;
        const __m256 max = _mm256_set1_ps(m);
        __m256 total = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= len; i += 8) {
          const __m256 e = exp8_clamped(_mm256_sub_ps(_mm256_loadu_ps(sh + i), max));
          _mm256_storeu_ps(sh + i, e);
          total = _mm256_add_ps(total, e);
        }
        float sum = hsum8(total);
        for (; i < len; ++i) {
          sh[i] = std::exp(sh[i] - m);
          sum += sh[i];
        }
        denom[h] = sum;
        float* a = acc + h * head_dim;
        int64_t c = 0;
        for (; c + 8 <= chunks; c += 8) weighted_v_avx2<T, 8>(v_slot, begin, end, offset + 8 * c, sh, a + 8 * c);
        for (; c + 4 <= chunks; c += 4) weighted_v_avx2<T, 4>(v_slot, begin, end, offset + 8 * c, sh, a + 8 * c);
        for (; c < chunks; ++c) weighted_v_avx2<T, 1>(v_slot, begin, end, offset + 8 * c, sh, a + 8 * c);
      }
      return;
    }
#endif
    for (int64_t pos = begin; pos < end; ++pos) {
      const T* k = slot(k_cache, pos);
      for (int64_t e = 0; e < width; ++e) row[e] = to_float(k[e]);
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* qh = query + h * head_dim;
        const float* kh = row + (h / group) * head_dim;
        float s = 0.f;
        for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * kh[d];
        scores[h * len + pos - begin] = s;
        row_max[h] = s > row_max[h] ? s : row_max[h];
      }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
      float* sh = scores + h * len;
      float total = 0.f;
      for (int64_t i = 0; i < len; ++i) {
        sh[i] = std::exp(sh[i] - row_max[h]);
        total += sh[i];
      }
      denom[h] = total;
    }
    for (int64_t pos = begin; pos < end; ++pos) {
      const T* v = slot(v_cache, pos);
      for (int64_t e = 0; e < width; ++e) row[e] = to_float(v[e]);
      for (int64_t h = 0; h < num_heads; ++h) {
        const float p = scores[h * len + pos - begin];
        const float* vh = row + (h / group) * head_dim;
        float* a = acc + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
      }
    }
  }
};

// A step of at least this many parts a thread loads each part's K and V into L2 before computing
// on them (decode_part_avx512's `touch`; decode_attention says why).
constexpr int64_t kTouchPartsPerThread = 4;

// Decode attention over the paged cache, read in place: one query token per row, and for each of
// its query heads a softmax over every cached position of its sequence, the K/V of query head h
// being those of kv head h / (num_heads / num_kv_heads), as transformers' repeat_kv assigns them.
// A row's context is cut into parts of at most split_len positions, so that a few long rows still
// keep every thread busy; the parts of a row are combined by their maxima (flash-decoding).
template <typename T>
void decode_attention(const T* q, int64_t q_token_stride, const T* k_cache, const T* v_cache,
                      const int64_t* token_rows, const int64_t* block_tables, int64_t block_table_stride,
                      const int64_t* context_lens, T* out, int64_t out_token_stride, int64_t num_rows,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                      int64_t split_len) {
  // Row i is cut into as few parts as split_len allows, of about equal length: part p covers
  // [p * part_len[i], min((p + 1) * part_len[i], context_len)), part_len[i] a multiple of 16 (a
  // part starts at a tile of decode_part_avx512, and with 16-slot blocks at a block). Parts of
  // split_len and a short rest left one thread most of a lone row's work: a batch-1 decode step
  // at 280-320 positions took 10.42 ms with them and 10.14 ms with equal parts (docs/benchmarks.md,
  // nineteenth pass). A row's parts depend on its context length alone, never on the batch.
  std::vector<int64_t> first_part(num_rows + 1, 0), part_len(num_rows);
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t parts = (context_lens[i] + split_len - 1) / split_len;
    part_len[i] = parts > 0 ? std::min(split_len, ((context_lens[i] + parts - 1) / parts + 15) / 16 * 16) : split_len;
    first_part[i + 1] = first_part[i] + (context_lens[i] + part_len[i] - 1) / part_len[i];
  }
  const int64_t num_parts = first_part[num_rows];
  // Many parts a thread: the step reads far more K/V than the caches hold, and a pass of plain loads
  // before each part's compute fetches it about twice as fast (decode_part_avx512). A few parts: the
  // prefetches that overlap fetch and compute were as fast or faster (float32, 1-2 rows at 300
  // positions: 4-10%). Measured on SmolLM2's heads (docs/benchmarks.md, thirteenth pass).
  const bool touch = num_parts >= kTouchPartsPerThread * omp_get_max_threads();
  // Per part: the max and denominator of each head, then its accumulator; only split rows use it.
  const int64_t part_floats = num_heads * (2 + head_dim);
  std::vector<float> partials(num_parts > num_rows ? num_parts * part_floats : 0);
  // One thread's scratch: the scaled query, a converted cache row, the scores of a part, and the
  // result of a part that is its row's whole context (the merge reuses `query` as its accumulator).
  struct Scratch {
    std::vector<float> query, row, scores, own;
  };
  auto make_scratch = [&] {
    return Scratch{std::vector<float>(num_heads * head_dim), std::vector<float>(num_kv_heads * head_dim),
                   std::vector<float>(num_heads * split_len), std::vector<float>(part_floats)};
  };
  auto run_part = [&](int64_t part, Scratch& scratch) {
    const int64_t i = std::upper_bound(first_part.begin(), first_part.end(), part) - first_part.begin() - 1;
    const int64_t begin = (part - first_part[i]) * part_len[i];
    const int64_t end = std::min(begin + part_len[i], context_lens[i]);
    const bool whole = first_part[i + 1] - first_part[i] == 1;
    const T* q_row = q + token_rows[i] * q_token_stride;
    for (int64_t e = 0; e < num_heads * head_dim; ++e) scratch.query[e] = to_float(q_row[e]) * scale;
    float* result = whole ? scratch.own.data() : partials.data() + part * part_floats;
    DecodePart<T>{k_cache, v_cache, block_tables + i * block_table_stride, num_heads, num_kv_heads, head_dim,
                  block_size, touch}
        .run(scratch.query.data(), q_row, scale, begin, end, scratch.scores.data(), scratch.row.data(), result,
             result + num_heads, result + 2 * num_heads);
    if (whole) {
      T* o_row = out + token_rows[i] * out_token_stride;
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = 1.f / result[num_heads + h];
        const float* a = result + 2 * num_heads + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o_row[h * head_dim + d] = from_float<T>(a[d] * inv);
      }
    }
  };
  auto merge_row = [&](int64_t i, Scratch& scratch) {
    if (first_part[i + 1] - first_part[i] == 1) return;
    T* o_row = out + token_rows[i] * out_token_stride;
    float* combined = scratch.query.data();
    for (int64_t h = 0; h < num_heads; ++h) {
      float max = -std::numeric_limits<float>::infinity();
      for (int64_t part = first_part[i]; part < first_part[i + 1]; ++part)
        max = std::max(max, partials[part * part_floats + h]);
      float denom = 0.f;
      std::fill(combined, combined + head_dim, 0.f);
      for (int64_t part = first_part[i]; part < first_part[i + 1]; ++part) {
        const float* p = partials.data() + part * part_floats;
        const float weight = std::exp(p[h] - max);
        denom += weight * p[num_heads + h];
        const float* a = p + 2 * num_heads + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) combined[d] += weight * a[d];
      }
      for (int64_t d = 0; d < head_dim; ++d) o_row[h * head_dim + d] = from_float<T>(combined[d] / denom);
    }
  };
  if (num_parts < 2) {  // one part: this thread alone, no parallel region to enter
    Scratch scratch = make_scratch();
    for (int64_t part = 0; part < num_parts; ++part) run_part(part, scratch);
    return;
  }
#pragma omp parallel
  {
    Scratch scratch = make_scratch();
#pragma omp for schedule(static)
    for (int64_t part = 0; part < num_parts; ++part) run_part(part, scratch);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_rows; ++i) merge_row(i, scratch);
  }
}


// RMSNorm of each row as transformers computes it: the mean square in float32, x * rsqrt(ms + eps)
// rounded to the model dtype, then times the weight, rounded again. bfloat16 with AVX-512: 16
// elements a vector (four sums in flight), 2x the loop the compiler made of the scalar code with
// the same bits (twelfth pass); float32 keeps the scalar code, whose sums are in another order.
template <typename T>
void rms_norm(const T* x, int64_t x_row_stride, const T* weight, T* out, int64_t rows, int64_t width, float eps) {
  for_each_index(rows, rows * width >= kParallelElements, [&](int64_t r) {
    const T* xr = x + r * x_row_stride;
    T* o = out + r * width;
    float sum = 0.f;
    int64_t e = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, bf16>) {
      __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (; e + 64 <= width; e += 64)
        for (int j = 0; j < 4; ++j) {
          const __m512 v = load16(xr + e + 16 * j);
          sums[j] = _mm512_fmadd_ps(v, v, sums[j]);
        }
      for (; e + 16 <= width; e += 16) {
        const __m512 v = load16(xr + e);
        sums[0] = _mm512_fmadd_ps(v, v, sums[0]);
      }
      sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3])));
    }
#endif
#pragma omp simd reduction(+ : sum)
    for (int64_t i = e; i < width; ++i) sum += to_float(xr[i]) * to_float(xr[i]);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
    e = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, bf16>) {
      const __m512 scale = _mm512_set1_ps(inv);
      for (; e + 16 <= width; e += 16)
        store16(o + e, _mm512_mul_ps(load16(weight + e), round16<T>(_mm512_mul_ps(load16(xr + e), scale))));
    }
#endif
#pragma omp simd
    for (int64_t i = e; i < width; ++i)
      o[i] = from_float<T>(to_float(weight[i]) * to_float(from_float<T>(to_float(xr[i]) * inv)));
  });
}

// Rotary embedding of q and k in place, and k and v into the paged cache. qkv: (T, row stride),
// each row q (num_heads * head_dim), then k, then v (num_kv_heads * head_dim each); cos, sin:
// (max_len, head_dim) float32 tables; the rotation pairs element e with e + head_dim / 2, as
// transformers' rotate_half does, in float32, rounded once. Token t's k and v go to slot
// slots[t] of the caches (num_slots, num_kv_heads * head_dim).
template <typename T>
void rotary_and_cache(T* qkv, int64_t qkv_row_stride, const int64_t* positions, const float* cos, const float* sin,
                      const int64_t* slots, T* k_cache, T* v_cache, int64_t tokens, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2, kv_width = num_kv_heads * head_dim;
  for_each_index(tokens, tokens * (num_heads + 2 * num_kv_heads) * head_dim >= kParallelElements, [&](int64_t t) {
    T* row = qkv + t * qkv_row_stride;
    const float* c = cos + positions[t] * head_dim;
    const float* s = sin + positions[t] * head_dim;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
      T* x = row + h * head_dim;
      int64_t e = 0;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, bf16>) {  // float32 keeps the compiler's loop and its bits
        for (; e + 16 <= half; e += 16) {
          const __m512 lo = load16(x + e), hi = load16(x + e + half);
          store16(x + e, _mm512_sub_ps(_mm512_mul_ps(lo, _mm512_loadu_ps(c + e)),
                                       _mm512_mul_ps(hi, _mm512_loadu_ps(s + e))));
          store16(x + e + half, _mm512_add_ps(_mm512_mul_ps(hi, _mm512_loadu_ps(c + e + half)),
                                              _mm512_mul_ps(lo, _mm512_loadu_ps(s + e + half))));
        }
      }
#endif
#pragma omp simd
      for (int64_t i = e; i < half; ++i) {
        const float lo = to_float(x[i]), hi = to_float(x[i + half]);
        x[i] = from_float<T>(lo * c[i] - hi * s[i]);
        x[i + half] = from_float<T>(hi * c[i + half] + lo * s[i + half]);
      }
    }
    const T* k = row + num_heads * head_dim;
    std::memcpy(k_cache + slots[t] * kv_width, k, kv_width * sizeof(T));
    std::memcpy(v_cache + slots[t] * kv_width, k + kv_width, kv_width * sizeof(T));
  });
}

// SiLU(gate) * up of each row of x (rows, 2 * width): gate the first half, up the second, in
// float32, rounded once.
template <typename T>
void silu_and_mul(const T* x, int64_t x_row_stride, T* out, int64_t rows, int64_t width) {
  for_each_index(rows, rows * width >= kParallelElements, [&](int64_t r) {
    const T* gate = x + r * x_row_stride;
    const T* up = gate + width;
    T* o = out + r * width;
    int64_t e = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; e + 16 <= width; e += 16) {
      const __m512 g = load16(gate + e);
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_clamped(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      store16(o + e, _mm512_mul_ps(silu, load16(up + e)));
    }
#endif
    for (; e < width; ++e) {
      const float g = to_float(gate[e]);
      o[e] = from_float<T>(g / (1.f + std::exp(-g)) * to_float(up[e]));
    }
  });
}

// The index of each row's largest value (the first of equal ones), as torch.argmax returns it.
template <typename T>
void argmax_rows(const T* x, int64_t row_stride, int64_t rows, int64_t width, int64_t* out) {
  for_each_index(rows, rows >= 2 && rows * width >= kParallelElements, [&](int64_t r) {
    const T* xr = x + r * row_stride;
#if defined(__AVX512F__)
    // Per lane the largest value and the first index holding it, then the lanes' best; a row with a
    // NaN (torch's argmax picks the first NaN) takes the scalar loop below.
    if (width >= 16) {
      __m512 best_values = load16(xr);
      __m512i best_indices = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __m512i indices = best_indices;
      const __m512i step = _mm512_set1_epi32(16);
      __mmask16 nan = _mm512_cmp_ps_mask(best_values, best_values, _CMP_UNORD_Q);
      int64_t e = 16;
      for (; e + 16 <= width; e += 16) {
        indices = _mm512_add_epi32(indices, step);
        const __m512 v = load16(xr + e);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 greater = _mm512_cmp_ps_mask(v, best_values, _CMP_GT_OQ);
        best_values = _mm512_mask_mov_ps(best_values, greater, v);
        best_indices = _mm512_mask_mov_epi32(best_indices, greater, indices);
      }
      if (!nan && width < (int64_t{1} << 31)) {
        alignas(64) float values[16];
        alignas(64) int32_t where[16];
        _mm512_store_ps(values, best_values);
        _mm512_store_si512(where, best_indices);
        int64_t best = where[0];
        float best_value = values[0];
        for (int j = 1; j < 16; ++j)
          if (values[j] > best_value || (values[j] == best_value && where[j] < best)) {
            best_value = values[j];
            best = where[j];
          }
        for (; e < width; ++e) {  // the tail, after every index the lanes saw
          const float v = to_float(xr[e]);
          if (std::isnan(v)) {
            best = -1;
            break;
          }
          if (v > best_value) {
            best_value = v;
            best = e;
          }
        }
        if (best >= 0) {
          out[r] = best;
          return;
        }
      }
    }
#endif
    int64_t best = 0;
    float best_value = to_float(xr[0]);
    for (int64_t e = 1; e < width; ++e) {
      const float v = to_float(xr[e]);
      if (v > best_value || (std::isnan(v) && !std::isnan(best_value))) {
        best_value = v;
        best = e;
      }
    }
    out[r] = best;
  });
}

// Sampling at a temperature, with no top-k or top-p, by the Gumbel-max trick: token i wins with
// probability softmax(x / T)[i] when it maximises x[i] / T - ln(E[i]), E[i] = -ln(U[i]) ~ Exp(1)
// (the exponential race of model_worker/runner/sampler.py in log space: no softmax, no division,
// no pass over the row but this one). U[i] comes from a hash of (the row's seed, i), not from a
// generator's stream, so a row's draw depends on its seed alone and needs no noise tensor. Every
// operation is an IEEE single operation written out (fma where fused), with no reassociation, so
// the vectorised loop and its scalar remainder round alike: the same seed and logits give the
// same token whatever the machine's vector width.
inline uint32_t fmix32(uint32_t h) {  // MurmurHash3's finaliser: every input bit moves every output bit
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// ln(x) for a positive normal float, to about 1 ulp: x = m * 2^e with m in [sqrt(1/2), sqrt(2)),
// ln(m) by Cephes' logf polynomial.
inline float ln_positive(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 127);
  const uint32_t mantissa_bits = (bits & 0x007fffffu) | 0x3f800000u;
  float m;
  std::memcpy(&m, &mantissa_bits, sizeof(m));
  const bool high = m > 1.41421356f;
  m = high ? m * 0.5f : m;
  e = high ? e + 1.f : e;
  const float f = m - 1.f, z = f * f;
  float p = 7.0376836292e-2f;
  p = std::fma(p, f, -1.1514610310e-1f);
  p = std::fma(p, f, 1.1676998740e-1f);
  p = std::fma(p, f, -1.2420140846e-1f);
  p = std::fma(p, f, 1.4249322787e-1f);
  p = std::fma(p, f, -1.6668057665e-1f);
  p = std::fma(p, f, 2.0000714765e-1f);
  p = std::fma(p, f, -2.4999993993e-1f);
  p = std::fma(p, f, 3.3333331174e-1f);
  float y = p * f * z;
  y = std::fma(e, -2.12194440e-4f, y);
  y = std::fma(z, -0.5f, y);
  const float r = f + y;
  return std::fma(e, 0.693359375f, r);
}

// Elements of a row scored per pass: the scores stay in L1 between the scoring and the search.
constexpr int64_t kSampleBlock = 2048;

// out[r] = the token row r draws at inverse temperature inv_temperatures[r] with noise seeded by
// seeds[r]; a row holding a NaN gives its first NaN's index, as torch.argmax would.
template <typename T>
void sample_rows(const T* x, int64_t row_stride, int64_t rows, int64_t width, const float* inv_temperatures,
                 const int64_t* seeds, int64_t* out) {
  for_each_index(rows, rows >= 2 && rows * width >= kParallelElements, [&](int64_t r) {
    const T* xr = x + r * row_stride;
    const float inv_t = inv_temperatures[r];
    const uint64_t seed = static_cast<uint64_t>(seeds[r]);
    const uint32_t seed_lo = static_cast<uint32_t>(seed), seed_hi = static_cast<uint32_t>(seed >> 32);
    alignas(64) float scores[kSampleBlock];
    int64_t best = 0;
    float best_score = -std::numeric_limits<float>::infinity();
    for (int64_t start = 0; start < width; start += kSampleBlock) {
      const int64_t n = std::min(kSampleBlock, width - start);
      int nans = 0;
#pragma omp simd simdlen(16) reduction(+ : nans)
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t index = static_cast<uint32_t>(start + i);
        const uint32_t h = fmix32(fmix32(index * 0x9e3779b9u + seed_lo) ^ seed_hi);
        const float u = static_cast<float>(h >> 8) * 0x1p-24f + 0x1p-25f;  // in (0, 1), exact
        const float exponential = -ln_positive(u);                         // in (0, 17.4]
        const float v = to_float(xr[start + i]);
        const float s = std::fma(v, inv_t, -ln_positive(exponential));
        scores[i] = s;
        nans += s != s;
      }
      if (nans) {
        for (int64_t i = 0;; ++i)
          if (scores[i] != scores[i]) {
            best = start + i;
            break;
          }
        break;
      }
      float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
      for (int64_t i = 0; i < n; ++i) top = std::max(top, scores[i]);
      if (top > best_score || start == 0) {
        int64_t i = 0;
        while (scores[i] != top) ++i;
        best_score = top;
        best = start + i;
      }
    }
    out[r] = best;
  });
}

// Linear layers: out[m] = x[m] @ w^T (+ bias) (+ residual[m]), summed in float32 and rounded once,
// for w packed once at load in panels of 16 output features (ops.py, pack_panels): float32
// (out/16, in, 16), each panel row the 16 features' weights for one input; bfloat16 (out/16, in/2,
// 16, 2), each panel row the 16 features' weights for two inputs side by side, the pairs that
// dpbf16ps and AMX's tdpbf16ps multiply. A decode step reads every weight once and does little else,
// so what counts is how close the read comes to the memory's bandwidth: a thread walks three panels
// at once, front to back, against up to eight x rows broadcast an input at a time (8 x 3
// accumulators, no sums across lanes), so every weight byte it reads serves every row, and a step
// of 8 rows costs little more than one of 1. Where the CPU has AMX, bfloat16 goes through tiles
// instead (below). oneDNN's packed matmuls read these weights at about 60% of a streaming read,
// these at 80-90% (docs/benchmarks.md, 'Speed on the CPU against vLLM, fifth pass'). Returns false
// where this build has no such kernel (no AVX-512 BW; for float32, no AVX2 with FMA either): the caller
// keeps oneDNN.
// Output features a panel; panels a thread walks together (a group).
constexpr int kPanel = 16;
constexpr int kPanelGroup = 3;
// Rows a matmul takes through every panel group at a time: a block of x stays in L2 (a prompt
// step's x is megabytes) while the groups pass over it.
constexpr int64_t kPanelRowBlock = 256;
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kPanelRows = 8;
// Panel rows (64 bytes each) a thread prefetches ahead in each of the three panels it walks: the
// hardware prefetcher alone left the float32 kernel a fifth slower at 8 rows (48 from an A/B of
// 0 / 8 / 16 / 32 / 48 / 64 / 96 on an Intel AVX-512 machine: 23.2 / - / - / 20.1 / 20.0 / 20.5 /
// 20.5 ms for SmolLM2's matrices at 8 rows).
constexpr int64_t kPanelAhead = 48;

template <typename T>
struct PanelTraits;

template <>
struct PanelTraits<float> {
  static constexpr int64_t kStep = 1;  // inputs per panel row
  struct W { __m512 v; };
  static W load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static __m512 madd(__m512 acc, W w, const float* x) { return _mm512_fmadd_ps(w.v, _mm512_set1_ps(*x), acc); }
};

#if defined(__AVX512BF16__)
template <>
struct PanelTraits<bf16> {
  static constexpr int64_t kStep = 2;
  struct W { __m512i v; };
  static W load(const bf16* p) { return {_mm512_loadu_si512(p)}; }
  static __m512 madd(__m512 acc, W w, const bf16* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return _mm512_dpbf16_ps(acc, (__m512bh)w.v, (__m512bh)_mm512_set1_epi32(pair));
  }
};
#else
template <>
struct PanelTraits<bf16> {
  static constexpr int64_t kStep = 2;
  struct W { __m512 even, odd; };
  static W load(const bf16* p) {
    const __m512i v = _mm512_loadu_si512(p);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))))};
  }
  static __m512 madd(__m512 acc, W w, const bf16* x) {
    return _mm512_fmadd_ps(w.odd, _mm512_set1_ps(to_float(x[1])),
                           _mm512_fmadd_ps(w.even, _mm512_set1_ps(to_float(x[0])), acc));
  }
};
#endif

// tile[m][16 p + j] = x[m] . feature j of panel p, for m < M, p < P.
template <typename T, int M, int P>
void panel_block(const T* x, int64_t x_row_stride, const T* panel, int64_t panel_elements, int64_t in,
                 float (*tile)[kPanelGroup * kPanel]) {
  using Traits = PanelTraits<T>;
  __m512 acc[M][P];
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < P; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += Traits::kStep) {
    typename Traits::W w[P];
    for (int p = 0; p < P; ++p) {
      w[p] = Traits::load(panel + p * panel_elements + k * kPanel);
      _mm_prefetch(reinterpret_cast<const char*>(panel + p * panel_elements + (k + kPanelAhead * Traits::kStep) * kPanel),
                   _MM_HINT_T0);
    }
    for (int m = 0; m < M; ++m)
      for (int p = 0; p < P; ++p) acc[m][p] = Traits::madd(acc[m][p], w[p], x + m * x_row_stride + k);
  }
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(tile[m] + p * kPanel, acc[m][p]);
}

template <typename T, int P>
void panel_block_rows(int rows, const T* x, int64_t x_row_stride, const T* panel, int64_t panel_elements, int64_t in,
                      float (*tile)[kPanelGroup * kPanel]) {
  switch (rows) {
    case 1: return panel_block<T, 1, P>(x, x_row_stride, panel, panel_elements, in, tile);
    case 2: return panel_block<T, 2, P>(x, x_row_stride, panel, panel_elements, in, tile);
    case 3: return panel_block<T, 3, P>(x, x_row_stride, panel, panel_elements, in, tile);
    case 4: return panel_block<T, 4, P>(x, x_row_stride, panel, panel_elements, in, tile);
    case 5: return panel_block<T, 5, P>(x, x_row_stride, panel, panel_elements, in, tile);
    case 6: return panel_block<T, 6, P>(x, x_row_stride, panel, panel_elements, in, tile);
    case 7: return panel_block<T, 7, P>(x, x_row_stride, panel, panel_elements, in, tile);
    default: return panel_block<T, 8, P>(x, x_row_stride, panel, panel_elements, in, tile);
  }
}

// out rows [m, m + rows) and features [o, o + width) from tile (float32 sums, row stride
// kPanelGroup * kPanel), plus bias and residual, rounded once.
template <typename T>
void panel_store(const float* tile, int rows, int64_t m, int64_t o, int width, const T* bias, const T* residual,
                 int64_t residual_row_stride, T* out, int64_t out_row_stride) {
  for (int i = 0; i < rows; ++i) {
    T* orow = out + (m + i) * out_row_stride + o;
    const T* rrow = residual ? residual + (m + i) * residual_row_stride + o : nullptr;
    for (int c = 0; c < width; c += kPanel) {
      __m512 v = _mm512_loadu_ps(tile + i * kPanelGroup * kPanel + c);
      if (bias) v = _mm512_add_ps(v, load16(bias + o + c));
      if (rrow) v = _mm512_add_ps(v, load16(rrow + c));
      store16(orow + c, v);
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// bfloat16 panels through AMX where the CPU has it: the panel layout is the layout of tdpbf16ps's
// second operand (16 rows of 16 pairs, 1 KB per 32 inputs), so a tile loads straight from a panel.
// Tiles 0-2 hold the sums of three panels for up to 16 x rows, tile 3 those rows' next 32 inputs,
// tiles 4-6 the three panels' next 32 inputs. The dot products are summed in float32 as dpbf16ps
// sums them, in another order.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxInputs = 32;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this process may use AMX tiles (Linux grants it on request, once per process).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

void amx_configure(int rows) {
  TileConfig config;
  for (int t = 0; t < 4; ++t) {
    config.rows[t] = static_cast<uint8_t>(rows);
    config.colsb[t] = 64;
  }
  for (int t = 4; t < 7; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

template <int P>
void amx_panel_block(const bf16* x, int64_t x_row_stride, const bf16* panel, int64_t panel_elements, int64_t in,
                     float* tile) {
  _tile_zero(0);
  if (P > 1) _tile_zero(1);
  if (P > 2) _tile_zero(2);
  const int64_t x_stride_bytes = x_row_stride * static_cast<int64_t>(sizeof(bf16));
  for (int64_t k = 0; k < in; k += kAmxInputs) {
    _tile_loadd(3, x + k, x_stride_bytes);
    _tile_loadd(4, panel + k * kPanel, 64);
    _tile_dpbf16ps(0, 3, 4);
    if (P > 1) {
      _tile_loadd(5, panel + panel_elements + k * kPanel, 64);
      _tile_dpbf16ps(1, 3, 5);
    }
    if (P > 2) {
      _tile_loadd(6, panel + 2 * panel_elements + k * kPanel, 64);
      _tile_dpbf16ps(2, 3, 6);
    }
  }
  constexpr int64_t kTileStride = kPanelGroup * kPanel * sizeof(float);
  _tile_stored(0, tile, kTileStride);
  if (P > 1) _tile_stored(1, tile + kPanel, kTileStride);
  if (P > 2) _tile_stored(2, tile + 2 * kPanel, kTileStride);
}

bool amx_panel_linear(const bf16* x, int64_t x_row_stride, int64_t rows, const bf16* panels, int64_t in,
                      int64_t out_features, const bf16* bias, const bf16* residual, int64_t residual_row_stride,
                      bf16* out, int64_t out_row_stride) {
  if (in % kAmxInputs != 0 || !amx_permitted()) return false;
  const int64_t num_panels = out_features / kPanel, panel_elements = in * kPanel;
  const int64_t groups = (num_panels + kPanelGroup - 1) / kPanelGroup;
#pragma omp parallel if (groups > 1)
  {
    int configured = 0;
    alignas(64) float tile[kAmxRows * kPanelGroup * kPanel];
    // Rows in blocks of kPanelRowBlock, each block through every panel group before the next: a
    // block of x stays in L2 while a thread's groups pass over it (the same groups in every
    // block). Without the blocks, a prompt step streamed all of x from L3 once per group, and a
    // step of 2048 rows ran 1.4x slower than oneDNN's matmuls (docs/benchmarks.md, twelfth pass).
    for (int64_t block = 0; block < rows; block += kPanelRowBlock) {
      const int64_t block_end = std::min(rows, block + kPanelRowBlock);
#pragma omp for schedule(static) nowait
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = g * kPanelGroup;
        const int n = static_cast<int>(std::min<int64_t>(kPanelGroup, num_panels - first));
        const bf16* panel = panels + first * panel_elements;
        for (int64_t m = block; m < block_end; m += kAmxRows) {
          const int rows_here = static_cast<int>(std::min<int64_t>(kAmxRows, block_end - m));
          if (rows_here != configured) {
            amx_configure(rows_here);
            configured = rows_here;
          }
          const bf16* xm = x + m * x_row_stride;
          if (n == 3) amx_panel_block<3>(xm, x_row_stride, panel, panel_elements, in, tile);
          else if (n == 2) amx_panel_block<2>(xm, x_row_stride, panel, panel_elements, in, tile);
          else amx_panel_block<1>(xm, x_row_stride, panel, panel_elements, in, tile);
          panel_store(tile, rows_here, m, first * kPanel, n * kPanel, bias, residual, residual_row_stride, out,
                      out_row_stride);
        }
      }
    }
    if (configured) _tile_release();
  }
  return true;
}
#endif

template <typename T>
bool panel_linear(const T* x, int64_t x_row_stride, int64_t rows, const T* panels, int64_t in, int64_t out_features,
                  const T* bias, const T* residual, int64_t residual_row_stride, T* out, int64_t out_row_stride) {
  if (rows < 1 || out_features % kPanel != 0 || in % PanelTraits<T>::kStep != 0) return false;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    if (amx_panel_linear(x, x_row_stride, rows, panels, in, out_features, bias, residual, residual_row_stride, out,
                         out_row_stride))
      return true;
  }
#endif
  const int64_t num_panels = out_features / kPanel, panel_elements = in * kPanel;
  const int64_t groups = (num_panels + kPanelGroup - 1) / kPanelGroup;
  // Rows in blocks, each block through every panel group before the next, as amx_panel_linear.
  for (int64_t block = 0; block < rows; block += kPanelRowBlock) {
    const int64_t block_end = std::min(rows, block + kPanelRowBlock);
    for_each_index(groups, groups > 1, [&](int64_t g) {
      const int64_t first = g * kPanelGroup;
      const int n = static_cast<int>(std::min<int64_t>(kPanelGroup, num_panels - first));
      const T* panel = panels + first * panel_elements;
      float tile[kPanelRows * kPanelGroup * kPanel];
      auto* rows_of_tile = reinterpret_cast<float (*)[kPanelGroup * kPanel]>(tile);
      for (int64_t m = block; m < block_end; m += kPanelRows) {
        const int rows_here = static_cast<int>(std::min<int64_t>(kPanelRows, block_end - m));
        const T* xm = x + m * x_row_stride;
        if (n == 3) panel_block_rows<T, 3>(rows_here, xm, x_row_stride, panel, panel_elements, in, rows_of_tile);
        else if (n == 2) panel_block_rows<T, 2>(rows_here, xm, x_row_stride, panel, panel_elements, in, rows_of_tile);
        else panel_block_rows<T, 1>(rows_here, xm, x_row_stride, panel, panel_elements, in, rows_of_tile);
        panel_store(tile, rows_here, m, first * kPanel, n * kPanel, bias, residual, residual_row_stride, out,
                    out_row_stride);
      }
    });
  }
  return true;
}
#elif defined(__AVX2__) && defined(__FMA__)
// float32 panels on CPUs with AVX2 and FMA but no AVX-512 (bfloat16 keeps oneDNN there: it has no
// native bfloat16 to gain from). The same layout, a panel row two 8-float vectors. Sixteen vector
// registers hold the sums of 6 rows of one panel (12 vectors, BLIS's 6 x 16 block for such CPUs:
// a panel row loaded once serves six broadcast inputs), or of 1-2 rows of up to three panels, where
// a decode step of one or two rows reads its weights from memory once and three streams keep more
// loads in flight than one.
constexpr int kPanelRows = 6;
// Panel rows (64 bytes each) a thread prefetches ahead in each panel it walks.
constexpr int64_t kPanelAhead = 32;

// tile[m][16 p + j] = x[m] . feature j of panel p, for m < M, p < P; tile rows kPanelGroup * kPanel apart.
template <int M, int P>
void panel_block_avx2(const float* x, int64_t x_row_stride, const float* panel, int64_t panel_elements, int64_t in,
                      float* tile) {
  __m256 acc[M][2 * P];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 2 * P; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    __m256 w[2 * P];
    for (int p = 0; p < P; ++p) {
      const float* row = panel + p * panel_elements + k * kPanel;
      w[2 * p] = _mm256_loadu_ps(row);
      w[2 * p + 1] = _mm256_loadu_ps(row + 8);
      _mm_prefetch(reinterpret_cast<const char*>(row + kPanelAhead * kPanel), _MM_HINT_T0);
    }
    for (int m = 0; m < M; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * x_row_stride + k);
      for (int j = 0; j < 2 * P; ++j) acc[m][j] = _mm256_fmadd_ps(w[j], xb, acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 2 * P; ++j) _mm256_storeu_ps(tile + m * kPanelGroup * kPanel + 8 * j, acc[m][j]);
}

template <int P>
void panel_block_few_rows(int rows, const float* x, int64_t x_row_stride, const float* panel, int64_t panel_elements,
                          int64_t in, float* tile) {
  if (rows == 1) panel_block_avx2<1, P>(x, x_row_stride, panel, panel_elements, in, tile);
  else panel_block_avx2<2, P>(x, x_row_stride, panel, panel_elements, in, tile);
}

void panel_block_one_panel(int rows, const float* x, int64_t x_row_stride, const float* panel, int64_t in,
                           float* tile) {
  switch (rows) {
    case 1: return panel_block_avx2<1, 1>(x, x_row_stride, panel, 0, in, tile);
    case 2: return panel_block_avx2<2, 1>(x, x_row_stride, panel, 0, in, tile);
    case 3: return panel_block_avx2<3, 1>(x, x_row_stride, panel, 0, in, tile);
    case 4: return panel_block_avx2<4, 1>(x, x_row_stride, panel, 0, in, tile);
    case 5: return panel_block_avx2<5, 1>(x, x_row_stride, panel, 0, in, tile);
    default: return panel_block_avx2<6, 1>(x, x_row_stride, panel, 0, in, tile);
  }
}

// As the AVX-512 panel_store, for float32.
void panel_store(const float* tile, int rows, int64_t m, int64_t o, int width, const float* bias,
                 const float* residual, int64_t residual_row_stride, float* out, int64_t out_row_stride) {
  for (int i = 0; i < rows; ++i) {
    float* orow = out + (m + i) * out_row_stride + o;
    const float* rrow = residual ? residual + (m + i) * residual_row_stride + o : nullptr;
    for (int c = 0; c < width; c += 8) {
      __m256 v = _mm256_loadu_ps(tile + i * kPanelGroup * kPanel + c);
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + o + c));
      if (rrow) v = _mm256_add_ps(v, _mm256_loadu_ps(rrow + c));
      _mm256_storeu_ps(orow + c, v);
    }
  }
}

template <typename T>
bool panel_linear(const T* x, int64_t x_row_stride, int64_t rows, const T* panels, int64_t in, int64_t out_features,
                  const T* bias, const T* residual, int64_t residual_row_stride, T* out, int64_t out_row_stride) {
  if constexpr (!std::is_same_v<T, float>) {
    return false;
  } else {
    if (rows < 1 || out_features % kPanel != 0) return false;
    const int64_t num_panels = out_features / kPanel, panel_elements = in * kPanel;
    const int64_t groups = (num_panels + kPanelGroup - 1) / kPanelGroup;
    for (int64_t block = 0; block < rows; block += kPanelRowBlock) {
      const int64_t block_end = std::min(rows, block + kPanelRowBlock);
      for_each_index(groups, groups > 1, [&](int64_t g) {
        const int64_t first = g * kPanelGroup;
        const int n = static_cast<int>(std::min<int64_t>(kPanelGroup, num_panels - first));
        const float* panel = panels + first * panel_elements;
        alignas(32) float tile[kPanelRows * kPanelGroup * kPanel];
        if (block_end - block <= 2) {
          const int rows_here = static_cast<int>(block_end - block);
          const float* xm = x + block * x_row_stride;
          if (n == 3) panel_block_few_rows<3>(rows_here, xm, x_row_stride, panel, panel_elements, in, tile);
          else if (n == 2) panel_block_few_rows<2>(rows_here, xm, x_row_stride, panel, panel_elements, in, tile);
          else panel_block_few_rows<1>(rows_here, xm, x_row_stride, panel, panel_elements, in, tile);
          panel_store(tile, rows_here, block, first * kPanel, n * kPanel, bias, residual, residual_row_stride, out,
                      out_row_stride);
          return;
        }
        // Rows in blocks of at most kPanelRows, as even as can be (8 rows: 4 + 4, not 6 + 2: each
        // block reads the panels again, so a block of two costs nearly what one of six does).
        const int64_t row_blocks = (block_end - block + kPanelRows - 1) / kPanelRows;
        const int64_t per_block = (block_end - block + row_blocks - 1) / row_blocks;
        for (int64_t m = block; m < block_end; m += per_block) {
          const int rows_here = static_cast<int>(std::min<int64_t>(per_block, block_end - m));
          const float* xm = x + m * x_row_stride;
          for (int p = 0; p < n; ++p)
            panel_block_one_panel(rows_here, xm, x_row_stride, panel + p * panel_elements, in, tile + p * kPanel);
          panel_store(tile, rows_here, m, first * kPanel, n * kPanel, bias, residual, residual_row_stride, out,
                      out_row_stride);
        }
      });
    }
    return true;
  }
}
#else
template <typename T>
bool panel_linear(const T*, int64_t, int64_t, const T*, int64_t, int64_t, const T*, const T*, int64_t, T*, int64_t) {
  return false;
}
#endif

// A step's prompt chunks, as prefill_attention takes them (num_seqs 0: none).
struct PromptChunks {
  const int64_t* token_starts;
  const int64_t* query_lens;
  const int64_t* starts;
  const int64_t* block_tables;
  int64_t block_table_stride;
  int64_t num_seqs;
};

// Whether prefill_attention has its fast path for this head size in this build (where it has none
// it writes nothing and returns false): the cases of its switch, below.
inline bool prefill_attention_built(int64_t head_dim) {
#if defined(__AVX512F__)
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

template <typename T>
bool prefill_attention(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* token_starts,
                       const int64_t* query_lens, const int64_t* starts, const int64_t* block_tables,
                       int64_t block_table_stride, int64_t num_seqs, T* out, int64_t out_stride, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale);

template <typename T>
struct LayerWeightsPtrs {
  const T* input_norm;
  const T* qkv;
  const T* qkv_bias;
  const T* o;
  const T* o_bias;
  const T* post_norm;
  const T* gate_up;
  const T* down;
};

// One decoder layer of a step of `rows` tokens, each either one of the num_decode_rows decode rows
// (their tokens in token_rows) or a token of a prompt chunk of `chunks` (llama.py, LlamaDecoder._packed_layer's
// panel path, the same calls in the same order, so the same bits): RMSNorm, the q/k/v matmul,
// rotary embedding and the cache write, decode attention for the decode rows and prompt attention
// for the chunks, the o matmul and its residual, RMSNorm, gate/up, SiLU-times-up, the down matmul
// and its residual. One call a layer instead of nine from Python. Tensors as in each function
// above; `scratch` holds rows * (hidden + qkv_width + q_width + hidden + 2 * intermediate +
// intermediate) elements; the matrices packed in panels. False, with nothing written, where
// panel_linear is not built or the step has chunks and prefill_attention has no fast path for
// head_dim.
template <typename T>
bool small_layer(const T* hidden, T* out, int64_t rows, int64_t hidden_size, int64_t intermediate, float eps,
                 const LayerWeightsPtrs<T>& w, const int64_t* positions, const float* cos, const float* sin,
                 const int64_t* slots, T* k_cache, T* v_cache, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, const int64_t* token_rows, const int64_t* block_tables, int64_t block_table_stride,
                 const int64_t* context_lens, int64_t num_decode_rows, const PromptChunks& chunks, int64_t block_size,
                 float scale, int64_t split_len, T* scratch) {
  // Checked before anything is written: a layer must not stop halfway.
  if (chunks.num_seqs > 0 && !prefill_attention_built(head_dim)) return false;
  const int64_t q_width = num_heads * head_dim, qkv_width = q_width + 2 * num_kv_heads * head_dim;
  T* normed = scratch;
  T* qkv = normed + rows * hidden_size;
  T* attn = qkv + rows * qkv_width;
  T* mid = attn + rows * q_width;
  T* gate_up = mid + rows * hidden_size;
  T* act = gate_up + rows * 2 * intermediate;
  rms_norm(hidden, hidden_size, w.input_norm, normed, rows, hidden_size, eps);
  if (!panel_linear(normed, hidden_size, rows, w.qkv, hidden_size, qkv_width, w.qkv_bias,
                    static_cast<const T*>(nullptr), 0, qkv, qkv_width))
    return false;
  rotary_and_cache(qkv, qkv_width, positions, cos, sin, slots, k_cache, v_cache, rows, num_heads, num_kv_heads,
                   head_dim);
  if (num_decode_rows > 0)
    decode_attention(static_cast<const T*>(qkv), qkv_width, static_cast<const T*>(k_cache),
                     static_cast<const T*>(v_cache), token_rows, block_tables, block_table_stride, context_lens, attn,
                     q_width, num_decode_rows, num_heads, num_kv_heads, head_dim, block_size, scale, split_len);
  if (chunks.num_seqs > 0)
    prefill_attention(static_cast<const T*>(qkv), qkv_width, static_cast<const T*>(k_cache),
                      static_cast<const T*>(v_cache), chunks.token_starts, chunks.query_lens, chunks.starts,
                      chunks.block_tables, chunks.block_table_stride, chunks.num_seqs, attn, q_width, num_heads,
                      num_kv_heads, head_dim, block_size, scale);
  panel_linear(static_cast<const T*>(attn), q_width, rows, w.o, q_width, hidden_size, w.o_bias, hidden, hidden_size,
               mid, hidden_size);
  rms_norm(static_cast<const T*>(mid), hidden_size, w.post_norm, normed, rows, hidden_size, eps);
  panel_linear(static_cast<const T*>(normed), hidden_size, rows, w.gate_up, hidden_size, 2 * intermediate,
               static_cast<const T*>(nullptr), static_cast<const T*>(nullptr), 0, gate_up, 2 * intermediate);
  silu_and_mul(static_cast<const T*>(gate_up), 2 * intermediate, act, rows, intermediate);
  panel_linear(static_cast<const T*>(act), intermediate, rows, w.down, intermediate, hidden_size,
               static_cast<const T*>(nullptr), static_cast<const T*>(mid), hidden_size, out, hidden_size);
  return true;
}

// Attention of prompt chunks (query_lens[s] > 1 tokens of sequence s, at positions starts[s] ..
// starts[s] + query_lens[s] - 1, each attending causally to every position up to its own), their
// K/V read from the paged cache through the sequence's block table. q, out: (T, num_heads,
// head_dim) rows of token_starts[s] + i, token rows contiguous. Computed in float32: the queries
// (scaled) and the context's K (transposed) and V are widened once per call into one buffer, then
// each (sequence, kv head, block of query tokens) is an item of the thread team, its rows the
// block's tokens times the kv head's query heads. Scores in tiles of 6 rows x 32 keys, an online
// softmax over chunks of kPrefillKeyChunk keys, P V in tiles of rows x head_dim. bfloat16 on a CPU
// with dpbf16ps keeps the queries and K as they are (K transposed in pairs of dimensions) and sums
// the exact products of each pair in float32, the scale applied to the sums (kPairScores): 1.3x the
// widened path at 256-2048 tokens, with the same error against float64 SDPA as torch's bfloat16
// SDPA (docs/benchmarks.md, eleventh pass). P V stays in float32. Returns false
// (nothing written) where the fast path is not built or head_dim is not 16, 32, 64 or 128: the
// caller keeps SDPA then. Torch's flash kernel takes about 1.4 ms a layer for one 256-token prompt
// of SmolLM2 (9 heads, 3 kv heads, head_dim 64) on a 2-core Zen 4; see docs/benchmarks.md, ninth
// pass.
constexpr int64_t kPrefillKeyChunk = 256;
constexpr int64_t kPrefillQueryBlock = 16;

#if defined(__AVX512F__)
// s[r][0..32) = q[r] . kt[.][0..32) for RT rows of q (head_dim floats each), kt (head_dim, stride).
template <int RT>
inline void prefill_scores(const float* q, int64_t head_dim, const float* kt, int64_t kt_stride, float* s,
                           int64_t s_stride) {
  __m512 acc[RT][2];
  for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kt_stride), k1 = _mm512_loadu_ps(kt + d * kt_stride + 16);
    for (int r = 0; r < RT; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * head_dim + d]);
      acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < RT; ++r) {
    _mm512_storeu_ps(s + r * s_stride, acc[r][0]);
    _mm512_storeu_ps(s + r * s_stride + 16, acc[r][1]);
  }
}

#if defined(__AVX512BF16__)
// Where the CPU multiplies bfloat16 pairs (dpbf16ps), a bfloat16 model's scores take half the
// instructions: the query rows and K stay bfloat16, each 32-bit word two adjacent dimensions, and
// one dpbf16ps adds both products of a word for 16 keys. The products are exact in float32; the
// scale is applied to the sums. s[r][0..32) = scale * q[r] . kp[.][0..32) for RT rows of q (`pairs`
// words each, q_stride words apart), kp (pairs, stride) words: (k[2i], k[2i + 1]) of each key.
template <int RT>
inline void prefill_scores_pairs(const uint32_t* q, int64_t q_stride, int64_t pairs, const uint32_t* kp,
                                 int64_t kp_stride, float scale, float* s, int64_t s_stride) {
  __m512 acc[RT][2];
  for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + i * kp_stride);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + i * kp_stride + 16);
    for (int r = 0; r < RT; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * q_stride + i]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, qv);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, qv);
    }
  }
  const __m512 f = _mm512_set1_ps(scale);
  for (int r = 0; r < RT; ++r) {
    _mm512_storeu_ps(s + r * s_stride, _mm512_mul_ps(acc[r][0], f));
    _mm512_storeu_ps(s + r * s_stride + 16, _mm512_mul_ps(acc[r][1], f));
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// Where the CPU has AMX, prefill_scores_pairs's product on tiles: s[r][0..n32) = scale * q[r] .
// kp[.][0..n32) for `rows` query rows, 16 rows by 32 keys a time. K's pairs are already the layout
// of tdpbf16ps's second operand (a tile row is one pair of dimensions of 16 keys), and a query row
// of `pairs` words (a multiple of 16) is its first. The products are exact and summed in float32,
// as dpbf16ps sums them. Only where amx_attention says so.
inline void amx_pair_scores(const uint32_t* q, int64_t q_stride, int64_t pairs, int64_t rows, const uint32_t* kp,
                            int64_t kp_stride, int64_t n32, float scale, float* s, int64_t s_stride) {
  int configured = 0;
  for (int64_t r = 0; r < rows; r += 16) {
    const int rows_here = static_cast<int>(std::min<int64_t>(16, rows - r));
    if (rows_here != configured) {
      TileConfig config;
      for (int t = 0; t < 3; ++t) {  // the sums of 16 and of 16 more keys, the query rows
        config.rows[t] = static_cast<uint8_t>(rows_here);
        config.colsb[t] = 64;
      }
      for (int t = 3; t < 5; ++t) {  // 16 pairs of dimensions of 16 keys, twice
        config.rows[t] = 16;
        config.colsb[t] = 64;
      }
      _tile_loadconfig(&config);
      configured = rows_here;
    }
    for (int64_t j = 0; j < n32; j += 32) {
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t i = 0; i < pairs; i += 16) {
        _tile_loadd(2, q + r * q_stride + i, q_stride * static_cast<int64_t>(sizeof(uint32_t)));
        _tile_loadd(3, kp + i * kp_stride + j, kp_stride * static_cast<int64_t>(sizeof(uint32_t)));
        _tile_loadd(4, kp + i * kp_stride + j + 16, kp_stride * static_cast<int64_t>(sizeof(uint32_t)));
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
      }
      _tile_stored(0, s + r * s_stride + j, s_stride * static_cast<int64_t>(sizeof(float)));
      _tile_stored(1, s + r * s_stride + j + 16, s_stride * static_cast<int64_t>(sizeof(float)));
    }
  }
  if (configured) _tile_release();
  const __m512 f = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n32; j += 16)
      _mm512_storeu_ps(s + r * s_stride + j, _mm512_mul_ps(f, _mm512_loadu_ps(s + r * s_stride + j)));
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// o[r] += sum_j p[r][j] v[j] for `rows` rows and n32 keys on AMX tiles, D = 16 C. Each
// probability is split into two bfloat16s, p = hi + lo (hi: p rounded; lo: the rest, rounded):
// together they hold p to about 2^-17 of itself, where one bfloat16 would hold it to 2^-9 (the
// eleventh pass found P V on single bfloat16s 1.2x torch's error). V is bfloat16 already, so every
// product is exact and the sums are float32, as in prefill_pv. p: (rows, p_stride floats), zero
// past each row's keys; vp: V in pairs of keys (n32 / 2 rows of D words, a word the two keys'
// values of one dimension), zeros past the context; o: (rows, D) floats; hi, lo: scratch of
// rows * n32 / 2 words each.
template <int C>
void amx_pv(const float* p, int64_t p_stride, int64_t rows, int64_t n32, const uint32_t* vp, float* o, uint32_t* hi,
            uint32_t* lo) {
  constexpr int64_t D = 16 * C;
  const int64_t words = n32 / 2;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n32; j += 32) {
      const __m512 p0 = _mm512_loadu_ps(p + r * p_stride + j), p1 = _mm512_loadu_ps(p + r * p_stride + j + 16);
      const __m512 h0 = round16<bf16>(p0), h1 = round16<bf16>(p1);
      _mm512_storeu_si512(hi + r * words + j / 2, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(h1, h0)));
      _mm512_storeu_si512(lo + r * words + j / 2,
                          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_sub_ps(p1, h1), _mm512_sub_ps(p0, h0))));
    }
  constexpr int kGroup = C < 4 ? C : 4;  // output tiles at a time (tiles 0-3), with tiles 4-6
  // The tile intrinsics name their tiles by literal numbers (the assembler reads them as register
  // names), so each output tile is spelled out below rather than looped over.
  for (int64_t r = 0; r < rows; r += 16) {
    const int rows_here = static_cast<int>(std::min<int64_t>(16, rows - r));
    TileConfig config;
    for (int t = 0; t < 6; ++t) {  // sums of 16 dimensions (0-3), hi and lo of 32 keys (4, 5)
      config.rows[t] = static_cast<uint8_t>(rows_here);
      config.colsb[t] = 64;
    }
    config.rows[6] = 16;  // 16 pairs of keys of 16 dimensions
    config.colsb[6] = 64;
    _tile_loadconfig(&config);
    for (int c0 = 0; c0 < C; c0 += kGroup) {
      constexpr int64_t o_stride = D * sizeof(float);
      float* out = o + r * D + 16 * c0;
      _tile_loadd(0, out, o_stride);
      if (kGroup > 1) _tile_loadd(1, out + 16, o_stride);
      if (kGroup > 2) _tile_loadd(2, out + 32, o_stride);
      if (kGroup > 3) _tile_loadd(3, out + 48, o_stride);
      for (int64_t k = 0; k < words; k += 16) {
        _tile_loadd(4, hi + r * words + k, words * static_cast<int64_t>(sizeof(uint32_t)));
        _tile_loadd(5, lo + r * words + k, words * static_cast<int64_t>(sizeof(uint32_t)));
        const uint32_t* v = vp + k * D + 16 * c0;
        constexpr int64_t v_stride = D * sizeof(uint32_t);
        _tile_loadd(6, v, v_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(0, 5, 6);
        if (kGroup > 1) {
          _tile_loadd(6, v + 16, v_stride);
          _tile_dpbf16ps(1, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
        }
        if (kGroup > 2) {
          _tile_loadd(6, v + 32, v_stride);
          _tile_dpbf16ps(2, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
        }
        if (kGroup > 3) {
          _tile_loadd(6, v + 48, v_stride);
          _tile_dpbf16ps(3, 4, 6);
          _tile_dpbf16ps(3, 5, 6);
        }
      }
      _tile_stored(0, out, o_stride);
      if (kGroup > 1) _tile_stored(1, out + 16, o_stride);
      if (kGroup > 2) _tile_stored(2, out + 32, o_stride);
      if (kGroup > 3) _tile_stored(3, out + 48, o_stride);
    }
  }
  _tile_release();
}
#endif

// The scores of RT query rows (head_dim floats apart) for 32 keys of kt (kt_stride apart): by
// prefill_scores_pairs where T has it (rows and kt then hold bfloat16 pairs, unscaled), else by
// prefill_scores (rows scaled already).
template <typename T, int RT>
inline void prefill_score_tile(const float* q, int64_t head_dim, const float* kt, int64_t kt_stride, float scale,
                               float* s, int64_t s_stride) {
#if defined(__AVX512BF16__)
  if constexpr (kPairScores<T>) {
    prefill_scores_pairs<RT>(reinterpret_cast<const uint32_t*>(q), head_dim, head_dim / 2,
                             reinterpret_cast<const uint32_t*>(kt), kt_stride, scale, s, s_stride);
    return;
  }
#endif
  (void)scale;
  prefill_scores<RT>(q, head_dim, kt, kt_stride, s, s_stride);
}

// o[r] += sum_j p[r][j] v[j] for RT rows, j in [0, len); v (len, 16 C) floats, o (RT, 16 C).
template <int C, int RT>
inline void prefill_pv(const float* p, int64_t p_stride, int64_t len, const float* v, float* o) {
  __m512 acc[RT][C];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(o + (r * C + c) * 16);
  for (int64_t j = 0; j < len; ++j) {
    __m512 vj[C];
    for (int c = 0; c < C; ++c) vj[c] = _mm512_loadu_ps(v + (j * C + c) * 16);
    for (int r = 0; r < RT; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * p_stride + j]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vj[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + (r * C + c) * 16, acc[r][c]);
}

// The first n lanes of a vector (none for n <= 0, all for n >= 16).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? 0xffff : static_cast<__mmask16>(n > 0 ? (1u << n) - 1u : 0u);
}

// Rows of one P V tile: 24 accumulators of the 32 registers.
template <int C>
constexpr int kPvRows = C >= 8 ? 3 : (C >= 4 ? 6 : 8);

template <int C>
void prefill_pv_rows(const float* p, int64_t p_stride, const int64_t* lens, int64_t rows, const float* v, float* o) {
  constexpr int RT = kPvRows<C>;
  int64_t r = 0;
  // Rows go in order of position, so a tile's last row has its longest context.
  for (; r + RT <= rows; r += RT) prefill_pv<C, RT>(p + r * p_stride, p_stride, lens[r + RT - 1], v, o + r * 16 * C);
  for (; r < rows; ++r) prefill_pv<C, 1>(p + r * p_stride, p_stride, lens[r], v, o + r * 16 * C);
}

// Whether prompt attention for T and head_dim 16 C runs on AMX tiles here: bfloat16 pairs, a
// query row of whole tiles (head_dim a multiple of 32), and the OS lets this process use them.
template <typename T, int C>
bool amx_attention() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if constexpr (kPairScores<T> && C % 2 == 0) return amx_permitted();
#endif
  return false;
}

template <typename T, int C>
void prefill_attention_avx512(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                              const int64_t* token_starts, const int64_t* query_lens, const int64_t* starts,
                              const int64_t* block_tables, int64_t block_table_stride, int64_t num_seqs, T* out,
                              int64_t out_stride, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                              float scale) {
  constexpr int64_t D = 16 * C;
  const int64_t group = num_heads / num_kv_heads, width = num_kv_heads * D;
  // bfloat16 on AMX tiles where the CPU has them: the scores (amx_pair_scores) and P V (amx_pv),
  // V then packed in pairs of keys.
  const bool tiles = amx_attention<T, C>();
  // Per sequence and kv head: K transposed (D, padded context) and V (context, D), as floats, or
  // V in pairs of keys (padded / 2, D) words for the tiles.
  std::vector<int64_t> padded(num_seqs), head_floats(num_seqs), packed_at(num_seqs + 1, 0), first_item(num_seqs + 1, 0);
  int64_t total_tokens = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t context = starts[s] + query_lens[s];
    padded[s] = (context + 31) / 32 * 32;
    head_floats[s] = D * padded[s] + (tiles ? padded[s] / 2 * D : context * D);
    packed_at[s + 1] = packed_at[s] + num_kv_heads * head_floats[s];
    total_tokens += query_lens[s];
  }
  // Blocks of fewer query tokens where the step has few, so that every thread has items.
  const int64_t threads = std::max(1, omp_get_max_threads());
  const int64_t query_block = std::clamp<int64_t>(total_tokens * num_kv_heads / (4 * threads), 1, kPrefillQueryBlock);
  for (int64_t s = 0; s < num_seqs; ++s)
    first_item[s + 1] = first_item[s] + num_kv_heads * ((query_lens[s] + query_block - 1) / query_block);
  const int64_t num_items = first_item[num_seqs];
  static thread_local std::vector<float> packed;
  if (static_cast<int64_t>(packed.size()) < packed_at[num_seqs]) packed.resize(packed_at[num_seqs]);
  float* const packed_base = packed.data();
  const int64_t num_rows_max = query_block * group;

#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < num_seqs * num_kv_heads; ++pair) {
      const int64_t s = pair / num_kv_heads, kh = pair % num_kv_heads;
      const int64_t context = starts[s] + query_lens[s];
      float* kt = packed_base + packed_at[s] + kh * head_floats[s];
      float* vf = kt + D * padded[s];
      T* vp = reinterpret_cast<T*>(vf);  // with tiles: word (i, d) holds dimension d of keys 2i, 2i + 1
      if (tiles)  // zeros past the context, which P's zeros multiply
        std::fill(vp + context / 2 * 2 * D, vp + padded[s] * D, T{});
      const int64_t* blocks = block_tables + s * block_table_stride;
      for (int64_t pos = 0; pos < context; ++pos) {
        const int64_t slot = blocks[pos / block_size] * block_size + pos % block_size;
        const T* k = k_cache + slot * width + kh * D;
        const T* v = v_cache + slot * width + kh * D;
        if (tiles) {
          T* row = vp + pos / 2 * 2 * D + pos % 2;
          for (int64_t d = 0; d < D; ++d) row[2 * d] = v[d];
        } else {
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(vf + pos * D + 16 * c, load16(v + 16 * c));
        }
        if constexpr (kPairScores<T>) {
          uint32_t words[D / 2];
          std::memcpy(words, k, sizeof(words));
          uint32_t* kp = reinterpret_cast<uint32_t*>(kt);
          for (int64_t i = 0; i < D / 2; ++i) kp[i * padded[s] + pos] = words[i];
        } else {
          for (int64_t d = 0; d < D; ++d) kt[d * padded[s] + pos] = to_float(k[d]);
        }
      }
      // Zeros past the context (bits of 0.f either way), which the last tile of 32 keys reads.
      const int64_t kt_rows = kPairScores<T> ? D / 2 : D;
      for (int64_t d = 0; d < kt_rows; ++d) std::fill(kt + d * padded[s] + context, kt + (d + 1) * padded[s], 0.f);
    }
    std::vector<float> qs(num_rows_max * D), acc(num_rows_max * D), scores(num_rows_max * kPrefillKeyChunk);
    std::vector<uint32_t> p_hi(tiles ? num_rows_max * kPrefillKeyChunk / 2 : 0), p_lo(p_hi.size());
    std::vector<float> row_max(num_rows_max), denom(num_rows_max);
    std::vector<int64_t> valid(num_rows_max);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t s = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const int64_t blocks_of_seq = (first_item[s + 1] - first_item[s]) / num_kv_heads;
      const int64_t local = item - first_item[s], kh = local % num_kv_heads;
      // The longest blocks (the last tokens) first, so that the short ones fill the end.
      const int64_t block = blocks_of_seq - 1 - local / num_kv_heads;
      const int64_t t0 = block * query_block, t1 = std::min(t0 + query_block, query_lens[s]);
      const int64_t rows = (t1 - t0) * group, context = starts[s] + t1;
      const float* kt = packed_base + packed_at[s] + kh * head_floats[s];
      const float* vf = kt + D * padded[s];
      for (int64_t r = 0; r < rows; ++r) {
        const T* qr = q + (token_starts[s] + t0 + r / group) * q_stride + (kh * group + r % group) * D;
        if constexpr (kPairScores<T>) {
          std::memcpy(qs.data() + r * D, qr, D * sizeof(T));  // as D / 2 words, unscaled
        } else {
          for (int c = 0; c < C; ++c)
            _mm512_storeu_ps(qs.data() + r * D + 16 * c, _mm512_mul_ps(load16(qr + 16 * c), _mm512_set1_ps(scale)));
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * D, 0.f);
      std::fill(row_max.begin(), row_max.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(denom.begin(), denom.begin() + rows, 0.f);
      for (int64_t c0 = 0; c0 < context; c0 += kPrefillKeyChunk) {
        const int64_t n = std::min(kPrefillKeyChunk, context - c0), n32 = (n + 31) / 32 * 32;
        float* sc = scores.data();
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
        if (tiles)  // bfloat16 pairs (kPairScores), as prefill_score_tile reads them
          amx_pair_scores(reinterpret_cast<const uint32_t*>(qs.data()), D, D / 2, rows,
                          reinterpret_cast<const uint32_t*>(kt + c0), padded[s], n32, scale, sc, kPrefillKeyChunk);
        else
#endif
        for (int64_t j = 0; j < n32; j += 32) {
          int64_t r = 0;
          for (; r + 6 <= rows; r += 6)
            prefill_score_tile<T, 6>(qs.data() + r * D, D, kt + c0 + j, padded[s], scale,
                                     sc + r * kPrefillKeyChunk + j, kPrefillKeyChunk);
          for (; r < rows; ++r)
            prefill_score_tile<T, 1>(qs.data() + r * D, D, kt + c0 + j, padded[s], scale,
                                     sc + r * kPrefillKeyChunk + j, kPrefillKeyChunk);
        }
        for (int64_t r = 0; r < rows; ++r) {
          // Keys of this chunk at or before the row's own position.
          const int64_t len = std::clamp<int64_t>(starts[s] + t0 + r / group + 1 - c0, 0, n);
          valid[r] = len;
          float* sr = sc + r * kPrefillKeyChunk;
          const int64_t len32 = (len + 31) / 32 * 32;
          if (len == 0) {
            std::fill(sr, sr + n32, 0.f);
            continue;
          }
          __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          for (int64_t j = 0; j < len32; j += 16) {
            mx = _mm512_mask_max_ps(mx, first_lanes(len - j), mx, _mm512_loadu_ps(sr + j));
          }
          const float new_max = std::max(row_max[r], _mm512_reduce_max_ps(mx));
          const float rescale = std::exp(row_max[r] - new_max);  // 0 for the first chunk (-inf)
          row_max[r] = new_max;
          const __m512 m = _mm512_set1_ps(new_max);
          __m512 total = _mm512_setzero_ps();
          for (int64_t j = 0; j < n32; j += 16) {
            const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(sr + j), m);
            const __m512 e = _mm512_maskz_mov_ps(first_lanes(len - j), exp_clamped(x));
            _mm512_storeu_ps(sr + j, e);
            total = _mm512_add_ps(total, e);
          }
          denom[r] = denom[r] * rescale + _mm512_reduce_add_ps(total);
          if (rescale != 1.f) {
            const __m512 f = _mm512_set1_ps(rescale);
            float* acc_r = acc.data() + r * D;
            for (int c = 0; c < C; ++c)
              _mm512_storeu_ps(acc_r + 16 * c, _mm512_mul_ps(f, _mm512_loadu_ps(acc_r + 16 * c)));
          }
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
        if (tiles) {
          amx_pv<C>(sc, kPrefillKeyChunk, rows, n32, reinterpret_cast<const uint32_t*>(vf) + c0 / 2 * D, acc.data(),
                    p_hi.data(), p_lo.data());
          continue;
        }
#endif
        prefill_pv_rows<C>(sc, kPrefillKeyChunk, valid.data(), rows, vf + c0 * D, acc.data());
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* o = out + (token_starts[s] + t0 + r / group) * out_stride + (kh * group + r % group) * D;
        const __m512 inv = _mm512_set1_ps(1.f / denom[r]);
        for (int c = 0; c < C; ++c) store16(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(&acc[r * D + 16 * c]), inv));
      }
    }
  }
}
#endif

template <typename T>
bool prefill_attention(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* token_starts,
                       const int64_t* query_lens, const int64_t* starts, const int64_t* block_tables,
                       int64_t block_table_stride, int64_t num_seqs, T* out, int64_t out_stride, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {
#if defined(__AVX512F__)
#define ITERSERVE_PREFILL(C)                                                                                     \
  prefill_attention_avx512<T, C>(q, q_stride, k_cache, v_cache, token_starts, query_lens, starts, block_tables, \
                                 block_table_stride, num_seqs, out, out_stride, num_heads, num_kv_heads,       \
                                 block_size, scale);                                                           \
  return true;
  switch (head_dim) {
    case 16: ITERSERVE_PREFILL(1)
    case 32: ITERSERVE_PREFILL(2)
    case 64: ITERSERVE_PREFILL(4)
    case 128: ITERSERVE_PREFILL(8)
    default: return false;
  }
#undef ITERSERVE_PREFILL
#else
  return false;
#endif
}

}  // namespace

extern "C" {

void decode_attention_f32(const float* q, int64_t q_token_stride, const float* k_cache, const float* v_cache,
                          const int64_t* token_rows, const int64_t* block_tables, int64_t block_table_stride,
                          const int64_t* context_lens, float* out, int64_t out_token_stride, int64_t num_rows,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                          int64_t split_len) {
  decode_attention(q, q_token_stride, k_cache, v_cache, token_rows, block_tables, block_table_stride, context_lens,
                   out, out_token_stride, num_rows, num_heads, num_kv_heads, head_dim, block_size, scale, split_len);
}

void decode_attention_bf16(const bf16* q, int64_t q_token_stride, const bf16* k_cache, const bf16* v_cache,
                           const int64_t* token_rows, const int64_t* block_tables, int64_t block_table_stride,
                           const int64_t* context_lens, bf16* out, int64_t out_token_stride, int64_t num_rows,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                          int64_t split_len) {
  decode_attention(q, q_token_stride, k_cache, v_cache, token_rows, block_tables, block_table_stride, context_lens,
                   out, out_token_stride, num_rows, num_heads, num_kv_heads, head_dim, block_size, scale, split_len);
}

#define ITERSERVE_EXPORT(SUFFIX, T)                                                                                 \
  void rms_norm_##SUFFIX(const T* x, int64_t x_row_stride, const T* weight, T* out, int64_t rows, int64_t width,   \
                         float eps) {                                                                               \
    rms_norm(x, x_row_stride, weight, out, rows, width, eps);                                                       \
  }                                                                                                                 \
  void rotary_and_cache_##SUFFIX(T* qkv, int64_t qkv_row_stride, const int64_t* positions, const float* cos,        \
                                 const float* sin, const int64_t* slots, T* k_cache, T* v_cache, int64_t tokens,    \
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {                       \
    rotary_and_cache(qkv, qkv_row_stride, positions, cos, sin, slots, k_cache, v_cache, tokens, num_heads,          \
                     num_kv_heads, head_dim);                                                                       \
  }                                                                                                                 \
  void argmax_rows_##SUFFIX(const T* x, int64_t row_stride, int64_t rows, int64_t width, int64_t* out) {            \
    argmax_rows(x, row_stride, rows, width, out);                                                                   \
  }                                                                                                                 \
  void sample_rows_##SUFFIX(const T* x, int64_t row_stride, int64_t rows, int64_t width,                          \
                            const float* inv_temperatures, const int64_t* seeds, int64_t* out) {                   \
    sample_rows(x, row_stride, rows, width, inv_temperatures, seeds, out);                                          \
  }                                                                                                                 \
  void silu_and_mul_##SUFFIX(const T* x, int64_t x_row_stride, T* out, int64_t rows, int64_t width) {               \
    silu_and_mul(x, x_row_stride, out, rows, width);                                                                \
  }                                                                                                                 \
  int panel_linear_##SUFFIX(const T* x, int64_t x_row_stride, int64_t rows, const T* panels, int64_t in,            \
                            int64_t out_features, const T* bias, const T* residual, int64_t residual_row_stride,    \
                            T* out, int64_t out_row_stride) {                                                       \
    return panel_linear(x, x_row_stride, rows, panels, in, out_features, bias, residual, residual_row_stride, out,   \
                        out_row_stride);                                                                            \
  }                                                                                                                 \
  int prefill_attention_##SUFFIX(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,                    \
                                 const int64_t* token_starts, const int64_t* query_lens, const int64_t* starts,    \
                                 const int64_t* block_tables, int64_t block_table_stride, int64_t num_seqs, T* out, \
                                 int64_t out_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,    \
                                 int64_t block_size, float scale) {                                                \
    return prefill_attention(q, q_stride, k_cache, v_cache, token_starts, query_lens, starts, block_tables,         \
                             block_table_stride, num_seqs, out, out_stride, num_heads, num_kv_heads, head_dim,      \
                             block_size, scale);                                                                    \
  }                                                                                                                 \
  int small_layer_##SUFFIX(const T* hidden, T* out, int64_t rows, int64_t hidden_size, int64_t intermediate,        \
                           float eps, const T* const* weights, const int64_t* positions, const float* cos,          \
                           const float* sin, const int64_t* slots, T* k_cache, T* v_cache, int64_t num_heads,       \
                           int64_t num_kv_heads, int64_t head_dim, const int64_t* token_rows,                      \
                           const int64_t* block_tables, int64_t block_table_stride, const int64_t* context_lens,    \
                           int64_t num_decode_rows, const int64_t* chunk_token_starts,                              \
                           const int64_t* chunk_query_lens, const int64_t* chunk_starts,                            \
                           const int64_t* chunk_block_tables, int64_t chunk_block_table_stride, int64_t num_chunks, \
                           int64_t block_size, float scale, int64_t split_len, T* scratch) {                        \
    const LayerWeightsPtrs<T> w{weights[0], weights[1], weights[2], weights[3],                                     \
                                weights[4], weights[5], weights[6], weights[7]};                                    \
    const PromptChunks chunks{chunk_token_starts, chunk_query_lens, chunk_starts,                                   \
                              chunk_block_tables, chunk_block_table_stride, num_chunks};                            \
    return small_layer(hidden, out, rows, hidden_size, intermediate, eps, w, positions, cos, sin, slots, k_cache,   \
                       v_cache, num_heads, num_kv_heads, head_dim, token_rows, block_tables, block_table_stride,    \
                       context_lens, num_decode_rows, chunks, block_size, scale, split_len, scratch);              \
  }

// Whether prefill_attention (and so small_layer with prompt chunks) runs this head size here.
int prefill_attention_built_for(int64_t head_dim) { return prefill_attention_built(head_dim) ? 1 : 0; }

// Whether bfloat16 panels go through AMX tiles: built for them and permitted by the OS.
int panel_amx() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

ITERSERVE_EXPORT(f32, float)
ITERSERVE_EXPORT(bf16, bf16)
#undef ITERSERVE_EXPORT

// A grammar's allowed tokens (model_worker/runner/grammar.py): each listed row of x keeps the values
// whose bit is set in its bitmask row (token t is bit t % 32 of word t / 32) and gets -inf elsewhere.
// A word of all ones (inside a JSON string most tokens are allowed) is skipped whole, one of zeros
// filled whole.
void mask_rows_f32(float* x, int64_t row_stride, const int64_t* rows, int64_t num_rows, int64_t width,
                   const int32_t* bitmask, int64_t mask_stride) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for_each_index(num_rows, num_rows >= 2 && num_rows * width >= kParallelElements, [&](int64_t i) {
    float* xr = x + rows[i] * row_stride;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(bitmask + rows[i] * mask_stride);
    for (int64_t w = 0; w * 32 < width; ++w) {
      const uint32_t bits = words[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t count = std::min<int64_t>(32, width - w * 32);
      if (bits == 0) {  // at a JSON brace or a key most words allow nothing
        std::fill_n(xr + w * 32, count, neg_inf);
        continue;
      }
      for (int64_t b = 0; b < count; ++b)
        if (!((bits >> b) & 1u)) xr[w * 32 + b] = neg_inf;
    }
  });
}

}  // extern "C"
