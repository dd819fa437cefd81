/* FP8 e4m3 block quantization on the CPU, two passes per 128-row band (DeepSeek-V3 format).
 *
 * Built and loaded by reference/convert/quant.py (ctypes; compiled once per machine with the system C
 * compiler, `-O3 -march=native -ffp-contract=off`, no fast-math, so IEEE float semantics and
 * denormals are kept). Arithmetic, bit for bit the torch reference in reference/convert/quant.py
 * (docs/LAYOUTS.md):
 *
 *   amax  = max |x| over each block (zero padding at the edges never raises it)
 *   scale = max(amax, 1e-12f) / 448.0f                       (float32, true division)
 *   q     = fp8_e4m3fn(clamp(x / scale, -448, 448))          (x / scale correctly rounded,
 *                                                             then round to nearest even;
 *                                                             the clamp is implied, fp8_of)
 *
 * - |x| is taken on the bit pattern (sign bit cleared): for finite values and infinities the
 *   unsigned order of those patterns is the order of the magnitudes, so an integer max gives the
 *   float amax exactly. A band that holds a non-finite value (inf, NaN: pattern >= the
 *   infinity's) is NOT quantized here: it is flagged in `bad` and the caller redoes it with the
 *   torch reference, so the inf/NaN bytes are the reference's by construction.
 * - Pass 1 (amax) keeps one row of running maxima (K integers, L1-resident); pass 2 reads the
 *   band again (L2-resident: 128 x K x 2 bytes) and writes the FP8 bytes.
 * - The sign of q is x's sign (scale > 0), the magnitude is quantized from |x| / scale: that
 *   keeps -0.0 -> 0x80 whatever the division does with zeros.
 * - BF16 input: |x| / scale is computed as q0 = |x| * r, e = fma(-q0, s, |x|), q1 = fma(e, r, q0)
 *   with r = RN(1/s) (Markstein's FMA correction of a quotient): about 10% faster than a vector
 *   division here. Its byte equals the correctly rounded quotient's for EVERY bf16 x and every
 *   scale that a bf16 block holding x can produce: checked exhaustively by
 *   fp8_check_bf16_division() below (tests/test_quant_fast.py). Float32 input uses a true
 *   division (its inputs cannot be enumerated).
 * - The FP8 conversion is c10::detail::fp8e4m3fn_from_fp32_value (c10/util/Float8_e4m3fn.h),
 *   without branches so the compiler vectorizes it, and without the clamp, which is implied
 *   (fp8_of says why; dropping it made the kernel 20% faster).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline float f_of(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t bits_of(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* c10 fp8e4m3fn_from_fp32_value(min(a, 448)), OR-ed with the sign byte, for finite
 * 0 <= a < 464. No clamp is needed: a quotient |x| / scale with |x| <= amax and
 * scale = RN(max(amax, 1e-12) / 448) is below 448 * (1 + 2^-22), and every a in [448, 464)
 * rounds to 448 (0x7E) as the clamped value does; 464 is the midpoint to the next code. */
static inline uint8_t fp8_of(float a, uint32_t sign) {
    const uint32_t b = bits_of(a);
    /* a < 2^-6: subnormal e4m3; adding 2^14 rounds to a multiple of 2^-9 (nearest even) */
    const uint32_t denorm_mask = 141u << 23;
    const uint32_t d = bits_of(a + f_of(denorm_mask)) - denorm_mask;
    /* normal: re-bias the exponent (127 -> 7), round the mantissa to 3 bits (nearest even) */
    const uint32_t n = (b + (uint32_t)((7 - 127) << 23) + 0x7FFFFu + ((b >> 20) & 1u)) >> 20;
    const uint32_t r = b < (121u << 23) ? d : n;
    return (uint8_t)(r | sign);
}

/* the reference's order: clamp, then convert (for the check below) */
static inline uint8_t fp8_ref(float a) { return fp8_of(a < 448.0f ? a : 448.0f, 0); }

/* |x| / s correctly rounded, for a = |x| a bf16 value and s a scale of a bf16 block */
static inline float div_bf16(float a, float s, float r) {
    const float q = a * r;
    const float e = fmaf(-q, s, a);
    return fmaf(e, r, q);
}

static inline float scale_of(float amax) {
    const float s = amax < 1e-12f ? 1e-12f : amax;
    return s / 448.0f;
}

/* x: [L, N, K] with row stride ldx (elements) and slab stride sx; columns contiguous.
 * q: [L, N, K] contiguous bytes. scale: [L, nb, kb] float32. bad: [L, nb] (1 = band not done).
 * acc: K uint16 of scratch. Returns the number of bands flagged in bad. */
int64_t fp8_block_bf16(const uint16_t *restrict x, int64_t L, int64_t N, int64_t K, int64_t ldx,
                       int64_t sx, int64_t block, uint8_t *restrict q, float *restrict scale,
                       uint8_t *restrict bad, uint16_t *restrict acc) {
    const int64_t nb = (N + block - 1) / block, kb = (K + block - 1) / block;
    int64_t nbad = 0;
    for (int64_t l = 0; l < L; l++) {
        for (int64_t i = 0; i < nb; i++) {
            const int64_t r0 = i * block, r1 = r0 + block < N ? r0 + block : N;
            const uint16_t *xb = x + l * sx + r0 * ldx;
            uint8_t *qb = q + (l * N + r0) * K;
            float *sb = scale + (l * nb + i) * kb;
            memset(acc, 0, (size_t)K * sizeof(uint16_t));
            for (int64_t r = 0; r < r1 - r0; r++) {
                const uint16_t *xr = xb + r * ldx;
                for (int64_t c = 0; c < K; c++) {
                    const uint16_t v = xr[c] & 0x7FFFu;
                    acc[c] = acc[c] > v ? acc[c] : v;
                }
            }
            int finite = 1;
            for (int64_t j = 0; j < kb; j++) {
                const int64_t c0 = j * block, c1 = c0 + block < K ? c0 + block : K;
                uint16_t m = 0;
                for (int64_t c = c0; c < c1; c++) m = acc[c] > m ? acc[c] : m;
                if (m >= 0x7F80u) finite = 0;
                sb[j] = scale_of(f_of((uint32_t)m << 16));
            }
            bad[l * nb + i] = (uint8_t)!finite;
            if (!finite) { nbad++; continue; }
            for (int64_t r = 0; r < r1 - r0; r++) {
                const uint16_t *xr = xb + r * ldx;
                uint8_t *qr = qb + r * K;
                for (int64_t j = 0; j < kb; j++) {
                    const int64_t c0 = j * block, c1 = c0 + block < K ? c0 + block : K;
                    const float s = sb[j], rs = 1.0f / s;
                    for (int64_t c = c0; c < c1; c++) {
                        const uint32_t v = xr[c];
                        qr[c] = fp8_of(div_bf16(f_of((v & 0x7FFFu) << 16), s, rs), (v >> 8) & 0x80u);
                    }
                }
            }
        }
    }
    return nbad;
}

/* The same for float32 input (acc: K uint32 of scratch), with a true division. */
int64_t fp8_block_f32(const uint32_t *restrict x, int64_t L, int64_t N, int64_t K, int64_t ldx,
                      int64_t sx, int64_t block, uint8_t *restrict q, float *restrict scale,
                      uint8_t *restrict bad, uint32_t *restrict acc) {
    const int64_t nb = (N + block - 1) / block, kb = (K + block - 1) / block;
    int64_t nbad = 0;
    for (int64_t l = 0; l < L; l++) {
        for (int64_t i = 0; i < nb; i++) {
            const int64_t r0 = i * block, r1 = r0 + block < N ? r0 + block : N;
            const uint32_t *xb = x + l * sx + r0 * ldx;
            uint8_t *qb = q + (l * N + r0) * K;
            float *sb = scale + (l * nb + i) * kb;
            memset(acc, 0, (size_t)K * sizeof(uint32_t));
            for (int64_t r = 0; r < r1 - r0; r++) {
                const uint32_t *xr = xb + r * ldx;
                for (int64_t c = 0; c < K; c++) {
                    const uint32_t v = xr[c] & 0x7FFFFFFFu;
                    acc[c] = acc[c] > v ? acc[c] : v;
                }
            }
            int finite = 1;
            for (int64_t j = 0; j < kb; j++) {
                const int64_t c0 = j * block, c1 = c0 + block < K ? c0 + block : K;
                uint32_t m = 0;
                for (int64_t c = c0; c < c1; c++) m = acc[c] > m ? acc[c] : m;
                if (m >= 0x7F800000u) finite = 0;
                sb[j] = scale_of(f_of(m));
            }
            bad[l * nb + i] = (uint8_t)!finite;
            if (!finite) { nbad++; continue; }
            for (int64_t r = 0; r < r1 - r0; r++) {
                const uint32_t *xr = xb + r * ldx;
                uint8_t *qr = qb + r * K;
                for (int64_t j = 0; j < kb; j++) {
                    const int64_t c0 = j * block, c1 = c0 + block < K ? c0 + block : K;
                    const float s = sb[j];
                    for (int64_t c = c0; c < c1; c++) {
                        const uint32_t v = xr[c];
                        qr[c] = fp8_of(f_of(v & 0x7FFFFFFFu) / s, (v >> 24) & 0x80u);
                    }
                }
            }
        }
    }
    return nbad;
}

/* Exhaustive check of the BF16 path's arithmetic against the reference's: for the bf16 block
 * amax patterns m in [m_lo, m_hi) stepping by m_step, and EVERY finite bf16 magnitude a <= m
 * (all that a block with that amax can hold), the kernel's byte fp8_of(div_bf16(a, s)) against
 * the reference's fp8(clamp(a / s)) with a true division, s = scale_of(m). Returns the number
 * of pairs whose byte differs (0 expected); *f32_diff gets the number of pairs whose float32
 * quotient differs, among a >= 2^-100 with a normal quotient (0 expected: the correction's
 * proof assumes that nothing underflows; the residual e, about 2^-24 a, does for smaller a,
 * and a subnormal quotient does itself. There the quotient may come out 1 ulp off, but it is
 * below 2^-51 (2^-100 over the smallest scale) or 2^-126, far under FP8's smallest subnormal
 * 2^-9: the byte is 0 either way, which the byte count checks). */
int64_t fp8_check_bf16_division(uint32_t m_lo, uint32_t m_hi, uint32_t m_step, int64_t *f32_diff) {
    int64_t bad8 = 0, bad32 = 0;
    for (uint32_t m = m_lo; m < m_hi && m < 0x7F80u; m += m_step) {
        const float s = scale_of(f_of(m << 16)), r = 1.0f / s;
        for (uint32_t a = 0; a <= m; a++) {
            const float af = f_of(a << 16);
            const float t = af / s, u = div_bf16(af, s, r);
            bad32 += af >= 0x1p-100f && t >= 0x1p-126f && bits_of(t) != bits_of(u);
            bad8 += fp8_of(u, 0) != fp8_ref(t);
        }
    }
    *f32_diff = bad32;
    return bad8;
}
