/* Delta updates' hot loops (weight_transfer.delta, weight_transfer.transport.{cma,shm}).
 *
 * wt_delta_runs: one pass over an output and its shadow: compare in g-byte blocks, emit the
 *   byte runs of changed blocks (merged across gaps of at most `gap` unchanged bytes) into
 *   caller arrays, and copy every changed block into the shadow. No per-run Python.
 * wt_check_segments: every segment inside [0, span) and non-empty (bounds before any byte moves).
 * wt_scatter: memcpy of N (offset, length) segments from one base to another (shm).
 * wt_cma_write: process_vm_writev of N segments, IOV_MAX (1024) iovecs per call, resuming a
 *   partial copy at the exact iovec and offset (cma).
 *
 * Units: bytes. Offsets are int64 relative to the bases the caller passes.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>

static inline uint64_t ld64(const uint8_t *p) {
    uint64_t x;
    memcpy(&x, p, 8);
    return x;
}

/* Nonzero when [a, a+len) and [b, b+len) differ. */
static inline int differs(const uint8_t *a, const uint8_t *b, int64_t len) {
    int64_t i = 0;
    uint64_t d = 0;
    for (; i + 8 <= len; i += 8) d |= ld64(a + i) ^ ld64(b + i);
    for (; i < len; i++) d |= (uint64_t)(a[i] ^ b[i]);
    return d != 0;
}

/* Append the run [cs, ce) as starts[*nr], lens[*nr] and add its bytes to *tot; 0, or -1 when
 * cap runs are already there (nothing written). */
static inline int emit_run(int64_t *starts, int64_t *lens, int64_t cap, int64_t *nr, int64_t *tot, int64_t cs,
                           int64_t ce) {
    if (*nr >= cap) return -1;
    starts[*nr] = cs;
    lens[*nr] = ce - cs;
    *tot += ce - cs;
    (*nr)++;
    return 0;
}

/* Returns the number of runs (<= cap), or -1 when there would be more than cap (then the
 * shadow holds an unspecified mix of old and new bytes: the caller refreshes it whole).
 * *changed: bytes covered by the runs (including merged gaps). */
int64_t wt_delta_runs(const uint8_t *nw, uint8_t *old, int64_t n, int64_t g, int64_t gap, int64_t *starts,
                      int64_t *lens, int64_t cap, int64_t *changed) {
    int64_t nr = 0, cs = -1, ce = 0, tot = 0;
    const int fast = (g <= 64) && (64 % g == 0);
    int64_t i = 0;
    while (i < n) {
        int64_t lim;
        if (fast && i + 64 <= n) {
            uint64_t d = 0;
            for (int k = 0; k < 64; k += 8) d |= ld64(nw + i + k) ^ ld64(old + i + k);
            if (!d) {
                i += 64;
                continue;
            }
            lim = i + 64;
        } else {
            lim = fast ? n : (i + g < n ? i + g : n);
        }
        for (int64_t b = i; b < lim; b += g) {
            int64_t e = b + g < n ? b + g : n;
            if (e - b == 8) { /* the default block: one 64-bit word */
                uint64_t x = ld64(nw + b);
                if (x == ld64(old + b)) continue;
                memcpy(old + b, &x, 8);
            } else {
                if (!differs(nw + b, old + b, e - b)) continue;
                memcpy(old + b, nw + b, (size_t)(e - b));
            }
            if (cs >= 0 && b - ce <= gap) {
                ce = e;
            } else {
                if (cs >= 0 && emit_run(starts, lens, cap, &nr, &tot, cs, ce) < 0) return -1;
                cs = b;
                ce = e;
            }
        }
        i = lim;
    }
    if (cs >= 0 && emit_run(starts, lens, cap, &nr, &tot, cs, ce) < 0) return -1;
    *changed = tot;
    return nr;
}

/* Index of the first segment not inside [0, span) or empty, or -1 when all are fine (then
 * *total is the bytes of all segments). */
int64_t wt_check_segments(const int64_t *starts, const int64_t *lens, int64_t m, int64_t span, int64_t *total) {
    int64_t tot = 0;
    for (int64_t k = 0; k < m; k++) {
        int64_t s = starts[k], l = lens[k];
        if (s < 0 || l <= 0 || l > span || s > span - l) return k;
        tot += l;
    }
    *total = tot;
    return -1;
}

int64_t wt_scatter(uint8_t *dst, const uint8_t *src, const int64_t *starts, const int64_t *lens, int64_t m) {
    int64_t tot = 0;
    for (int64_t k = 0; k < m; k++) {
        memcpy(dst + starts[k], src + starts[k], (size_t)lens[k]);
        tot += lens[k];
    }
    return tot;
}

#if defined(__SSE2__)
#include <immintrin.h>
/* Copy n bytes with non-temporal (streaming) stores: the destination's cache lines are written
 * without being read first (no read-for-ownership). glibc's memcpy streams only above a
 * threshold of about three quarters of the last-level cache (hundreds of MB on a server), so a
 * piece of a weight update (a row segment, a fused band, a tensor) is copied with regular
 * stores. Measured on the 2-core dev VM, two processes at once, each 256 MiB in pieces of 768 B
 * to 16 MiB: memcpy 6.3-6.9 GB/s each, SSE2 streaming 7.2-8.4, AVX2 streaming 8.9-10.1. The
 * AVX2 variant is picked at run time where the CPU has it. Ordered before later stores by the
 * sfence in wt_copy_pieces. */
static void copy_nt_sse2(uint8_t *d, const uint8_t *s, size_t n) {
    size_t h = (16 - ((uintptr_t)d & 15)) & 15;
    if (h > n) h = n;
    memcpy(d, s, h);
    d += h, s += h, n -= h;
    size_t k = n / 64;
    for (size_t i = 0; i < k; i++, s += 64, d += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n - k * 64);
}

__attribute__((target("avx2"))) static void copy_nt_avx2(uint8_t *d, const uint8_t *s, size_t n) {
    size_t h = (32 - ((uintptr_t)d & 31)) & 31;
    if (h > n) h = n;
    memcpy(d, s, h);
    d += h, s += h, n -= h;
    size_t k = n / 128;
    for (size_t i = 0; i < k; i++, s += 128, d += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)s), b = _mm256_loadu_si256((const __m256i *)(s + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64)), e = _mm256_loadu_si256((const __m256i *)(s + 96));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
        _mm256_stream_si256((__m256i *)(d + 64), c);
        _mm256_stream_si256((__m256i *)(d + 96), e);
    }
    memcpy(d, s, n - k * 128);
}

static void (*copy_nt)(uint8_t *, const uint8_t *, size_t) = 0;
#define WT_NT_MIN 256 /* pieces shorter than this: plain memcpy (a streamed head and tail cost more) */
#endif

/* A shm write: copy piece k from laddr[k] to raddr[k] + delta (delta: this sender's mapping of
 * the receiver's segment minus the receiver's own address of it), lens[k] bytes; streamed
 * (copy_nt: AVX2 or SSE2) from WT_NT_MIN bytes on x86-64, then one store fence so that every byte is globally
 * visible before the caller publishes the version. Returns the sum of lens. The caller checked
 * every piece against its regions. */
int64_t wt_copy_pieces(int64_t delta, const uint64_t *laddr, const uint64_t *raddr, const uint64_t *lens, int64_t m) {
    int64_t tot = 0;
#if defined(__SSE2__)
    if (!copy_nt) copy_nt = __builtin_cpu_supports("avx2") ? copy_nt_avx2 : copy_nt_sse2;
#endif
    for (int64_t k = 0; k < m; k++) {
        uint8_t *d = (uint8_t *)(uintptr_t)(raddr[k] + (uint64_t)delta);
        const uint8_t *s = (const uint8_t *)(uintptr_t)laddr[k];
#if defined(__SSE2__)
        if (lens[k] >= WT_NT_MIN) {
            copy_nt(d, s, (size_t)lens[k]);
            tot += (int64_t)lens[k];
            continue;
        }
#endif
        memcpy(d, s, (size_t)lens[k]);
        tot += (int64_t)lens[k];
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
    return tot;
}

#define WT_IOV_MAX 1024

/* Returns the bytes written (all of them: sum of lens), or -errno; then *failed is the index of
 * the first segment not completely written and *done the bytes written before the error. */
int64_t wt_cma_write(int pid, uint64_t lbase, uint64_t rbase, const int64_t *starts, const int64_t *lens, int64_t m,
                     int64_t *failed, int64_t *done) {
    struct iovec liov[WT_IOV_MAX], riov[WT_IOV_MAX];
    int64_t tot = 0, k = 0, skip = 0; /* skip: bytes of segment k already written */
    while (k < m) {
        int64_t c = 0;
        for (; c < WT_IOV_MAX && k + c < m; c++) {
            int64_t o = starts[k + c] + (c == 0 ? skip : 0);
            size_t l = (size_t)(lens[k + c] - (c == 0 ? skip : 0));
            liov[c].iov_base = (void *)(uintptr_t)(lbase + (uint64_t)o);
            riov[c].iov_base = (void *)(uintptr_t)(rbase + (uint64_t)o);
            liov[c].iov_len = riov[c].iov_len = l;
        }
        ssize_t r = process_vm_writev(pid, liov, (unsigned long)c, riov, (unsigned long)c, 0);
        if (r < 0) {
            *failed = k;
            *done = tot;
            return -(int64_t)errno;
        }
        if (r == 0) {
            *failed = k;
            *done = tot;
            return -(int64_t)EFAULT;
        }
        tot += r;
        /* advance k/skip by r bytes */
        int64_t left = r;
        while (left > 0 && k < m) {
            int64_t rem = lens[k] - skip;
            if (left >= rem) {
                left -= rem;
                k++;
                skip = 0;
            } else {
                skip += left;
                left = 0;
            }
        }
    }
    *failed = -1;
    *done = tot;
    return tot;
}

/* ---- packed delta (weight_transfer.delta_packed) ------------------------------------------
 * A packed record's index holds one entry per run: two uint32, the gap (bytes from the end of
 * the previous run, the first from the span's first byte) and the length; the changed bytes
 * follow the index back to back, in run order. */

/* Pack runs (starts/lens, ascending, disjoint, each < 2^32 from the previous end) of src into
 * index (2 x m uint32) and data; returns the data bytes. The caller checked the bounds. */
int64_t wt_pack_runs(const uint8_t *src, const int64_t *starts, const int64_t *lens, int64_t m, uint32_t *index,
                     uint8_t *data) {
    int64_t end = 0, at = 0;
    for (int64_t k = 0; k < m; k++) {
        index[2 * k] = (uint32_t)(starts[k] - end);
        index[2 * k + 1] = (uint32_t)lens[k];
        memcpy(data + at, src + starts[k], (size_t)lens[k]);
        at += lens[k];
        end = starts[k] + lens[k];
    }
    return at;
}

/* Check a packed index of m runs against a span of `span` bytes: every run non-empty and
 * inside [0, span) (runs ascending by construction: gaps are unsigned). Returns -1 when all are
 * fine (then *tot is the data bytes the runs carry), else the index of the first bad run. */
int64_t wt_check_packed(const uint32_t *index, int64_t m, int64_t span, int64_t *tot) {
    int64_t end = 0, t = 0;
    for (int64_t k = 0; k < m; k++) {
        int64_t s = end + (int64_t)index[2 * k], l = (int64_t)index[2 * k + 1];
        if (l <= 0 || s > span - l) return k;
        end = s + l;
        t += l;
    }
    *tot = t;
    return -1;
}

/* Scatter a checked packed record: run k's bytes from data to dst + its start. Returns bytes. */
int64_t wt_unpack(uint8_t *dst, const uint32_t *index, const uint8_t *data, int64_t m) {
    int64_t end = 0, at = 0;
    for (int64_t k = 0; k < m; k++) {
        int64_t s = end + (int64_t)index[2 * k], l = (int64_t)index[2 * k + 1];
        memcpy(dst + s, data + at, (size_t)l);
        at += l;
        end = s + l;
    }
    return at;
}

/* ---- fused cast + compare (weight_transfer.delta_fused) ------------------------------------
 * fp32 -> bf16 as torch rounds it (round to nearest even; NaN -> 0x7FC0 with its sign dropped,
 * as c10::BFloat16 does), written to out, compared with the shadow in g-byte blocks of the bf16
 * output in the same pass (4 KiB at a time, so the output is compared while in L1), changed
 * blocks copied into the shadow and emitted as runs like wt_delta_runs. Returns the runs, or
 * -1 when there would be more than cap (the conversion still completes and the shadow is then
 * refreshed whole), or -2 at the first NaN (nothing defined: the caller casts with torch and
 * refreshes the shadow whole). g must divide 4096. */
int64_t wt_cast_bf16_delta(const uint32_t *src, int64_t n_el, uint16_t *out, uint16_t *shadow, int64_t g, int64_t gap,
                           int64_t *starts, int64_t *lens, int64_t cap, int64_t *changed) {
    const int64_t n = n_el * 2, CH = 4096;
    const uint8_t *nw = (const uint8_t *)out;
    uint8_t *old = (uint8_t *)shadow;
    int64_t nr = 0, cs = -1, ce = 0, tot = 0;
    int over = 0;
    for (int64_t lo = 0; lo < n; lo += CH) {
        int64_t hi = lo + CH < n ? lo + CH : n;
        uint32_t nan = 0;
        for (int64_t e = lo / 2; e < hi / 2; e++) { /* branch-free: vectorizes; a NaN chunk is redone by torch */
            uint32_t u = src[e];
            nan |= (u & 0x7fffffffu) > 0x7f800000u;
            out[e] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
        if (nan) return -2; /* torch's NaN bits differ by code path: the caller casts with torch, writes whole */
        if (over) {
            memcpy(old + lo, nw + lo, (size_t)(hi - lo));
            continue;
        }
        for (int64_t i = lo; i < hi;) {
            int64_t lim;
            if (g <= 64 && 64 % g == 0 && i + 64 <= hi) {
                uint64_t d = 0;
                for (int k = 0; k < 64; k += 8) d |= ld64(nw + i + k) ^ ld64(old + i + k);
                if (!d) {
                    i += 64;
                    continue;
                }
                lim = i + 64;
            } else {
                lim = hi;
            }
            for (int64_t b = i; b < lim; b += g) {
                int64_t e = b + g < n ? b + g : n;
                if (e - b == 8) { /* the default block: one 64-bit word */
                    uint64_t x = ld64(nw + b);
                    if (x == ld64(old + b)) continue;
                    memcpy(old + b, &x, 8);
                } else {
                    if (!differs(nw + b, old + b, e - b)) continue;
                    memcpy(old + b, nw + b, (size_t)(e - b));
                }
                if (cs >= 0 && b - ce <= gap) {
                    ce = e;
                } else {
                    if (cs >= 0 && emit_run(starts, lens, cap, &nr, &tot, cs, ce) < 0) {
                        over = 1;
                        break;
                    }
                    cs = b;
                    ce = e;
                }
            }
            if (over) {
                memcpy(old + lo, nw + lo, (size_t)(hi - lo));
                break;
            }
            i = lim;
        }
    }
    if (over) return -1;
    if (cs >= 0 && emit_run(starts, lens, cap, &nr, &tot, cs, ce) < 0) return -1;
    *changed = tot;
    return nr;
}
