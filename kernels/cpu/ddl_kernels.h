/* Element-wise reduction, copy and pack loops for the Cython CPU kernels.
 *
 * float16 and bfloat16 are stored as uint16 bit patterns: each element is widened to float32, the
 * op is applied in float32 and the result rounded back to nearest-even -- the same arithmetic
 * NumPy (float16) and ml_dtypes (bfloat16) use, so results match them bit for bit. Integer sum and
 * product wrap (computed in unsigned arithmetic, so no undefined behaviour). Float min/max
 * propagate NaN like np.minimum/np.maximum. Every loop is a plain indexed loop that gcc -O3
 * vectorises for the native types.
 */
#ifndef DDL_KERNELS_H
#define DDL_KERNELS_H

#include <stdint.h>
#include <string.h>

static inline float ddl_bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t ddl_f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* --- float16 <-> float32 ------------------------------------------------------------------- */
static inline float ddl_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in float32 */
        float f = (float)mant * 5.9604644775390625e-08f;
        return ddl_bits_to_f32(ddl_f32_to_bits(f) | sign);
    }
    if (exp == 31) return ddl_bits_to_f32(sign | 0x7f800000u | (mant << 13));
    return ddl_bits_to_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline uint16_t ddl_f2h(float f) {
    uint32_t x = ddl_f32_to_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)                       /* inf or NaN (keep NaN quiet) */
        return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u);
    if (ax >= 0x477ff000u) return sign | 0x7c00u; /* rounds to >= 65520: overflow to inf */
    if (ax < 0x38800000u) {                        /* below 2^-14: half subnormal or zero */
        /* Adding 0.5 puts the value's 2^-24 units in the low mantissa bits, rounded to nearest
         * even by the FPU itself. */
        float r = ddl_bits_to_f32(ax) + 0.5f;
        return sign | (uint16_t)(ddl_f32_to_bits(r) - 0x3f000000u);
    }
    uint32_t odd = (ax >> 13) & 1u;
    ax += 0xc8000fffu + odd;                      /* rebias exponent (-112 << 23), round to even */
    return sign | (uint16_t)(ax >> 13);
}

/* --- bfloat16 <-> float32 ------------------------------------------------------------------ */
static inline float ddl_b2f(uint16_t b) { return ddl_bits_to_f32((uint32_t)b << 16); }

static inline uint16_t ddl_f2b(float f) {
    uint32_t u = ddl_f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* --- ops ----------------------------------------------------------------------------------- */
#define DDL_SUM(a, b) ((a) + (b))
#define DDL_PROD(a, b) ((a) * (b))
#define DDL_IMIN(a, b) ((b) < (a) ? (b) : (a))
#define DDL_IMAX(a, b) ((b) > (a) ? (b) : (a))
/* NaN-propagating, like np.minimum / np.maximum */
#define DDL_FMIN(a, b) (((a) != (a)) ? (a) : (((b) < (a) || (b) != (b)) ? (b) : (a)))
#define DDL_FMAX(a, b) (((a) != (a)) ? (a) : (((b) > (a) || (b) != (b)) ? (b) : (a)))

/* dst[i] = a[i] OP b[i]; dst may alias a or b exactly (element i is read before written). */
#define DDL_NATIVE_LOOP(NAME, T, OP)                                                          \
    static inline void NAME(T *dst, const T *a, const T *b, int64_t n) {                      \
        for (int64_t i = 0; i < n; i++) { T x = a[i], y = b[i]; dst[i] = OP(x, y); }          \
    }

/* Integers: sum and product in the unsigned type of the same width, so overflow wraps. */
#define DDL_WRAP_LOOP(NAME, T, U, OP)                                                         \
    static inline void NAME(T *dst, const T *a, const T *b, int64_t n) {                      \
        for (int64_t i = 0; i < n; i++) dst[i] = (T)(U)OP((U)a[i], (U)b[i]);                   \
    }

#define DDL_HALF_LOOP(NAME, TO_F, FROM_F, OP)                                                 \
    static inline void NAME(uint16_t *dst, const uint16_t *a, const uint16_t *b, int64_t n) { \
        for (int64_t i = 0; i < n; i++) {                                                     \
            float x = TO_F(a[i]), y = TO_F(b[i]);                                             \
            dst[i] = FROM_F(OP(x, y));                                                        \
        }                                                                                     \
    }

#define DDL_FLOAT_OPS(SUFFIX, T)                                                              \
    DDL_NATIVE_LOOP(ddl_sum_##SUFFIX, T, DDL_SUM)                                             \
    DDL_NATIVE_LOOP(ddl_prod_##SUFFIX, T, DDL_PROD)                                           \
    DDL_NATIVE_LOOP(ddl_min_##SUFFIX, T, DDL_FMIN)                                            \
    DDL_NATIVE_LOOP(ddl_max_##SUFFIX, T, DDL_FMAX)

#define DDL_INT_OPS(SUFFIX, T, U)                                                             \
    DDL_WRAP_LOOP(ddl_sum_##SUFFIX, T, U, DDL_SUM)                                            \
    DDL_WRAP_LOOP(ddl_prod_##SUFFIX, T, U, DDL_PROD)                                          \
    DDL_NATIVE_LOOP(ddl_min_##SUFFIX, T, DDL_IMIN)                                            \
    DDL_NATIVE_LOOP(ddl_max_##SUFFIX, T, DDL_IMAX)

#define DDL_HALF_OPS(SUFFIX, TO_F, FROM_F)                                                    \
    DDL_HALF_LOOP(ddl_sum_##SUFFIX, TO_F, FROM_F, DDL_SUM)                                    \
    DDL_HALF_LOOP(ddl_prod_##SUFFIX, TO_F, FROM_F, DDL_PROD)                                  \
    DDL_HALF_LOOP(ddl_min_##SUFFIX, TO_F, FROM_F, DDL_FMIN)                                   \
    DDL_HALF_LOOP(ddl_max_##SUFFIX, TO_F, FROM_F, DDL_FMAX)

DDL_HALF_OPS(f16_portable, ddl_h2f, ddl_f2h)
DDL_HALF_OPS(bf16, ddl_b2f, ddl_f2b)

/* float16 sum and product with the F16C instructions (8 elements per step), chosen at run time
 * when the CPU has them. vcvtph2ps/vcvtps2ph with round-to-nearest-even give exactly the
 * portable conversions' results, so both paths agree bit for bit (tests run both). */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define DDL_F16C_LOOP(NAME, VOP, SOP)                                                         \
    __attribute__((target("avx,f16c"))) static void NAME(uint16_t *dst, const uint16_t *a,   \
                                                          const uint16_t *b, int64_t n) {     \
        int64_t i = 0;                                                                        \
        for (; i + 8 <= n; i += 8) {                                                          \
            __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));            \
            __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));            \
            _mm_storeu_si128((__m128i *)(dst + i),                                            \
                             _mm256_cvtps_ph(VOP(x, y), _MM_FROUND_TO_NEAREST_INT));          \
        }                                                                                     \
        for (; i < n; i++) dst[i] = ddl_f2h(SOP(ddl_h2f(a[i]), ddl_h2f(b[i])));               \
    }
DDL_F16C_LOOP(ddl_sum_f16_f16c, _mm256_add_ps, DDL_SUM)
DDL_F16C_LOOP(ddl_prod_f16_f16c, _mm256_mul_ps, DDL_PROD)
static inline int ddl_have_f16c(void) {
    static int have = -1;
    if (have < 0) { __builtin_cpu_init(); have = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx"); }
    return have;
}
#else
#define ddl_sum_f16_f16c ddl_sum_f16_portable
#define ddl_prod_f16_f16c ddl_prod_f16_portable
static inline int ddl_have_f16c(void) { return 0; }
#endif

/* Set to 1 to force the portable float16 loops (tests compare both paths). */
static int ddl_force_portable_f16 = 0;

static inline void ddl_sum_f16(uint16_t *d, const uint16_t *a, const uint16_t *b, int64_t n) {
    if (!ddl_force_portable_f16 && ddl_have_f16c()) ddl_sum_f16_f16c(d, a, b, n);
    else ddl_sum_f16_portable(d, a, b, n);
}
static inline void ddl_prod_f16(uint16_t *d, const uint16_t *a, const uint16_t *b, int64_t n) {
    if (!ddl_force_portable_f16 && ddl_have_f16c()) ddl_prod_f16_f16c(d, a, b, n);
    else ddl_prod_f16_portable(d, a, b, n);
}
#define ddl_min_f16 ddl_min_f16_portable
#define ddl_max_f16 ddl_max_f16_portable
DDL_FLOAT_OPS(f32, float)
DDL_FLOAT_OPS(f64, double)
DDL_INT_OPS(i8, int8_t, uint8_t)
DDL_INT_OPS(u8, uint8_t, uint8_t)
DDL_INT_OPS(i32, int32_t, uint32_t)
DDL_INT_OPS(i64, int64_t, uint64_t)

/* Dispatch on (dtype code, op code); codes as in kernels/dtypes.py and ddlcore/ops.py.
 * Returns 0, or -1 for an unknown code. */
#define DDL_CASE(CODE, SUFFIX, T)                                                             \
    case CODE:                                                                                \
        switch (op) {                                                                         \
        case 0: ddl_sum_##SUFFIX((T *)dst, (const T *)a, (const T *)b, n); return 0;          \
        case 1: ddl_prod_##SUFFIX((T *)dst, (const T *)a, (const T *)b, n); return 0;         \
        case 2: ddl_min_##SUFFIX((T *)dst, (const T *)a, (const T *)b, n); return 0;          \
        case 3: ddl_max_##SUFFIX((T *)dst, (const T *)a, (const T *)b, n); return 0;          \
        default: return -1;                                                                   \
        }

static inline int ddl_reduce(void *dst, const void *a, const void *b, int64_t n, int dtype, int op) {
    switch (dtype) {
    DDL_CASE(0, f16, uint16_t)
    DDL_CASE(1, bf16, uint16_t)
    DDL_CASE(2, f32, float)
    DDL_CASE(3, f64, double)
    DDL_CASE(4, i8, int8_t)
    DDL_CASE(5, u8, uint8_t)
    DDL_CASE(6, i32, int32_t)
    DDL_CASE(7, i64, int64_t)
    default: return -1;
    }
}

/* Integer division rounded down (floor, toward minus infinity: integer avg's rounding), float
 * division rounded once. The collectives hand integers to it only summed wide (ddlcore/execution/int_avg.py);
 * given a sum that wrapped, it divides what it is given. */
#define DDL_DIV_INT(T)                                                                        \
    { T *p = (T *)dst;                                                                        \
      for (int64_t i = 0; i < n; i++) {                                                       \
          int64_t x = (int64_t)p[i], q = x / divisor;                                         \
          p[i] = (T)(q - (x % divisor != 0 && x < 0));                                        \
      }                                                                                       \
      return 0; }

static inline int ddl_divide(void *dst, int64_t n, int dtype, int64_t divisor) {
    switch (dtype) {
    case 0: { uint16_t *p = (uint16_t *)dst; float d = (float)divisor;
              for (int64_t i = 0; i < n; i++) p[i] = ddl_f2h(ddl_h2f(p[i]) / d); return 0; }
    case 1: { uint16_t *p = (uint16_t *)dst; float d = (float)divisor;
              for (int64_t i = 0; i < n; i++) p[i] = ddl_f2b(ddl_b2f(p[i]) / d); return 0; }
    case 2: { float *p = (float *)dst; float d = (float)divisor;
              for (int64_t i = 0; i < n; i++) p[i] = p[i] / d; return 0; }
    case 3: { double *p = (double *)dst; double d = (double)divisor;
              for (int64_t i = 0; i < n; i++) p[i] = p[i] / d; return 0; }
    case 4: DDL_DIV_INT(int8_t)
    case 5: DDL_DIV_INT(uint8_t)
    case 6: DDL_DIV_INT(int32_t)
    case 7: DDL_DIV_INT(int64_t)
    default: return -1;
    }
}

#endif
