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
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/uio.h>

static inline uint64_t ld64(const uint8_t *p) {
    uint64_t x;
    memcpy(&x, p, 8);
    return x;
}

/* a / q for a >= 0, q >= 1: a shift when q is a power of two (the block sizes 1, 2, 4, 8 the
 * comparison and the packed index use), so that the per-run bookkeeping pays no hardware
 * division (~25-40 cycles each, two to four per run: most of a run's cost at ~1 M runs). */
static inline int64_t qdiv(int64_t a, int64_t q) {
    if (q == 1) return a;
    if (!(q & (q - 1))) return a >> __builtin_ctzll((uint64_t)q);
    return a / q;
}

/* Nonzero when [a, a+len) and [b, b+len) differ. */
static inline int differs(const uint8_t *a, const uint8_t *b, int64_t len) {
    int64_t i = 0;
    uint64_t d = 0;
    for (; i + 8 <= len; i += 8) d |= ld64(a + i) ^ ld64(b + i);
    for (; i < len; i++) d |= (uint64_t)(a[i] ^ b[i]);
    return d != 0;
}

/* The runs being built by a comparison: changed blocks [b, e) are appended to the open run
 * [cs, ce) when they start at most `gap` bytes after it, else the open run is emitted. */
typedef struct {
    int64_t *starts, *lens, cap, nr, cs, ce, tot, gap;
    /* Optional, for a packed record (weight_transfer.delta_packed): nw, the compared bytes;
     * vals (NULL: none), per run of at most 8 bytes its bytes (little-endian, zero-padded),
     * taken while they are in cache so that packing need not read the output again; q, the
     * unit the index counts in (the block size g), ix its bytes so far, pe the last run's end. */
    const uint8_t *nw;
    int64_t *vals, q, ix, pe;
} runs_t;

static inline int vlen(uint64_t v);

/* Append the open run as starts[nr], lens[nr] (and its value, its index bytes); 0, or -1 when
 * cap runs are already there. */
static inline int emit_run(runs_t *r) {
    if (r->nr >= r->cap) return -1;
    int64_t l = r->ce - r->cs;
    r->starts[r->nr] = r->cs;
    r->lens[r->nr] = l;
    if (r->vals) {
        uint64_t v = 0;
        if (l <= 8) memcpy(&v, r->nw + r->cs, (size_t)l);
        r->vals[r->nr] = (int64_t)v;
    }
    r->ix += vlen((uint64_t)qdiv(r->cs - r->pe, r->q)) + vlen((uint64_t)qdiv(l + r->q - 1, r->q));
    r->pe = r->ce;
    r->tot += l;
    r->nr++;
    return 0;
}

/* A changed block [b, e): extend the open run or start a new one; -1 when over cap. */
static inline int block(runs_t *r, int64_t b, int64_t e) {
    if (r->cs >= 0 && b - r->ce <= r->gap) {
        r->ce = e;
        return 0;
    }
    if (r->cs >= 0 && emit_run(r) < 0) return -1;
    r->cs = b;
    r->ce = e;
    return 0;
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define WT_LANES 1
#else
#define WT_LANES 0
#endif

/* One bit (the lane's top bit) per g-byte lane of x that is non-zero, g in {1, 2, 4, 8}. */
static inline uint64_t lane_mask(uint64_t x, int64_t g) {
    uint64_t L;
    switch (g) {
    case 1: L = 0x7f7f7f7f7f7f7f7full; break;
    case 2: L = 0x7fff7fff7fff7fffull; break;
    case 4: L = 0x7fffffff7fffffffull; break;
    default: return x ? 1ull << 63 : 0;
    }
    return (((x & L) + L) | x) & ~L;
}

/* The 8-byte word at w (w + 8 <= n, w a multiple of g): its changed g-byte blocks as runs, the
 * word copied into the shadow when any byte differs. Cost: one load pair per word, one step
 * per changed block (a bit scan), whatever g. */
static inline int word(const uint8_t *nw, uint8_t *old, int64_t w, int64_t g, runs_t *r) {
    uint64_t a = ld64(nw + w), x = a ^ ld64(old + w);
    if (!x) return 0;
    memcpy(old + w, &a, 8);
    for (uint64_t m = lane_mask(x, g); m; m &= m - 1) {
        int64_t b = w + qdiv((int64_t)__builtin_ctzll(m) >> 3, g) * g;
        if (block(r, b, b + g) < 0) return -1;
    }
    return 0;
}

#if defined(__SSE2__)
#include <emmintrin.h>
/* The changed bytes of a 64-byte chunk as a 64-bit mask (bit k: byte k differs). */
static inline uint64_t chunk_mask(const uint8_t *a, const uint8_t *b) {
    uint64_t eq = 0;
    for (int k = 0; k < 4; k++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(a + 16 * k)), y = _mm_loadu_si128((const __m128i *)(b + 16 * k));
        eq |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(x, y)) << (16 * k);
    }
    return ~eq;
}

/* A changed-byte mask widened to whole g-byte blocks (g in {2, 4, 8}): every bit of a block
 * set when any is. */
static inline uint64_t widen(uint64_t m, int64_t g) {
    static const uint64_t first[9] = {0, 0, 0x5555555555555555ull, 0, 0x1111111111111111ull, 0, 0, 0,
                                      0x0101010101010101ull};
    for (int64_t k = 1; k < g; k <<= 1) m |= m >> k;
    m &= first[g];
    return m * ((1ull << g) - 1); /* blocks are disjoint: no carries */
}
#endif

/* Compare [lo, hi) of nw against old (n: the output's length; lo a multiple of g and of 8),
 * in g-byte blocks counted from byte 0 (the last block clipped at n); changed blocks copied
 * into old and added to r. 0, or -1 when r is over cap. Whole 64-byte chunks that are equal
 * are skipped at once; g in {1, 2, 4, 8} is compared a word at a time (lane masks). */
static int compare_range(const uint8_t *nw, uint8_t *old, int64_t lo, int64_t hi, int64_t n, int64_t g,
                         runs_t *r) {
    int64_t i = lo;
#if defined(__SSE2__)
    if (g == 1 || g == 2 || g == 4 || g == 8) {
        for (; i + 64 <= hi; i += 64) {
            uint64_t m = chunk_mask(nw + i, old + i);
            if (!m) continue;
            memcpy(old + i, nw + i, 64);
            if (g > 1) m = widen(m, g);
            while (m) { /* one step per run of changed blocks in the chunk, not per block */
                int s = __builtin_ctzll(m);
                uint64_t t = ~(m >> s);
                int e = s + (t ? __builtin_ctzll(t) : 64 - s);
                if (block(r, i + s, i + e) < 0) return -1;
                m = e >= 64 ? 0 : m & (~0ull << e);
            }
        }
    }
#endif
    if (WT_LANES && (g == 1 || g == 2 || g == 4 || g == 8)) {
        for (; i + 64 <= hi; i += 64) {
            uint64_t d = 0;
            for (int k = 0; k < 64; k += 8) d |= ld64(nw + i + k) ^ ld64(old + i + k);
            if (!d) continue;
            for (int k = 0; k < 64; k += 8)
                if (word(nw, old, i + k, g, r) < 0) return -1;
        }
        for (; i + 8 <= hi; i += 8)
            if (word(nw, old, i, g, r) < 0) return -1;
    } else if (g <= 64 && 64 % g == 0) {
        for (; i + 64 <= hi; i += 64) {
            uint64_t d = 0;
            for (int k = 0; k < 64; k += 8) d |= ld64(nw + i + k) ^ ld64(old + i + k);
            if (!d) continue;
            for (int64_t b = i; b < i + 64; b += g) {
                if (!differs(nw + b, old + b, g)) continue;
                memcpy(old + b, nw + b, (size_t)g);
                if (block(r, b, b + g) < 0) return -1;
            }
        }
    }
    for (int64_t b = i; b < hi; b += g) {
        int64_t e = b + g < n ? b + g : n;
        if (!differs(nw + b, old + b, e - b)) continue;
        memcpy(old + b, nw + b, (size_t)(e - b));
        if (block(r, b, e) < 0) return -1;
    }
    return 0;
}

/* Returns the number of runs (<= cap), or -1 when there would be more than cap (then the
 * shadow holds an unspecified mix of old and new bytes: the caller refreshes it whole).
 * *changed: bytes covered by the runs (including merged gaps); *ixb: their packed index's
 * bytes in units of g (wt_index_bytes); vals (NULL: not wanted): per run of at most 8 bytes
 * its bytes, for wt_pack_runs_v. */
int64_t wt_delta_runs(const uint8_t *nw, uint8_t *old, int64_t n, int64_t g, int64_t gap, int64_t *starts,
                      int64_t *lens, int64_t cap, int64_t *changed, int64_t *vals, int64_t *ixb) {
    runs_t r = {starts, lens, cap, 0, -1, 0, 0, gap, nw, vals, g, 0, 0};
    if (compare_range(nw, old, 0, n, n, g, &r) < 0) return -1;
    if (r.cs >= 0 && emit_run(&r) < 0) return -1;
    *changed = r.tot;
    *ixb = r.ix;
    return r.nr;
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
 * A packed record's index (format 2) holds two LEB128 varints per run, in units of q bytes (the
 * record's unit, the compare granularity): the gap since the previous run's end (the first from
 * the span's first byte) and the run's length. A run's end is clipped to the span: only the
 * last run may end inside its last unit. Varints are minimal (no trailing 0x80 .. 0x00 bytes)
 * and at most 9 bytes (63 bits). The changed bytes follow the index back to back, in run order.
 * Bad index -> a reason code (wt_check_packed's *why). */
#define WT_PK_TRUNC 1 /* a varint runs past the end of the index */
#define WT_PK_LONG 2  /* a varint longer than 9 bytes, or not minimal */
#define WT_PK_EMPTY 3 /* a run of length 0 */
#define WT_PK_SPAN 4  /* a run not inside its span */
#define WT_PK_TRAIL 5 /* index bytes left after the last run */

static inline int vlen(uint64_t v) { /* LEB128 bytes of v: ceil(bits / 7), at least 1 */
    return (70 - __builtin_clzll(v | 1)) / 7;
}

static inline uint8_t *vput(uint8_t *p, uint64_t v) {
    while (v >= 0x80) *p++ = (uint8_t)(v | 0x80), v >>= 7;
    *p++ = (uint8_t)v;
    return p;
}

static inline int vget(const uint8_t **pp, const uint8_t *pe, uint64_t *v) {
    const uint8_t *p = *pp;
    if (p < pe && *p < 0x80) { /* the common one-byte varint */
        *v = *p;
        *pp = p + 1;
        return 0;
    }
    uint64_t x = 0;
    for (int k = 0;; k++) {
        if (p + k >= pe) return WT_PK_TRUNC;
        uint8_t b = p[k];
        x |= (uint64_t)(b & 0x7f) << (7 * k);
        if (!(b & 0x80)) {
            if (k > 0 && b == 0) return WT_PK_LONG;
            *v = x;
            *pp = p + k + 1;
            return 0;
        }
        if (k == 8) return WT_PK_LONG;
    }
}

/* Copy l bytes; runs of a packed record are mostly 1-2 bytes: no memcpy call for those. */
static inline void copy_run(uint8_t *d, const uint8_t *s, int64_t l) {
    if (l <= 8) {
        for (int64_t i = 0; i < l; i++) d[i] = s[i];
    } else {
        memcpy(d, s, (size_t)l);
    }
}

/* Decode the next run after *end (bytes from the span's start): 0 and its [*s, *end), or a
 * reason code. span <= 2^62, q >= 1. */
static inline int run_next(const uint8_t **p, const uint8_t *pe, int64_t span, int64_t q, int64_t *end, int64_t *s) {
    uint64_t gp, ln;
    int w;
    if ((w = vget(p, pe, &gp)) || (w = vget(p, pe, &ln))) return w;
    if (!ln) return WT_PK_EMPTY;
    int64_t left = span - *end;
    if (left <= 0 || gp > (uint64_t)qdiv(left - 1, q)) return WT_PK_SPAN;
    int64_t st = *end + (int64_t)gp * q, rest = span - st;
    if (ln > (uint64_t)qdiv(rest - 1, q) + 1) return WT_PK_SPAN;
    int64_t e = st + (int64_t)ln * q;
    *s = st;
    *end = e < span ? e : span;
    return 0;
}

/* Index bytes of runs (starts/lens: ascending, disjoint, non-empty, inside [0, span)) in units
 * of q, or -1 when a run does not start on a unit boundary or is not whole units (the last may
 * end at span), or the runs are not ascending and inside the span. */
int64_t wt_index_bytes(const int64_t *starts, const int64_t *lens, int64_t m, int64_t span, int64_t q) {
    int64_t end = 0, t = 0;
    for (int64_t k = 0; k < m; k++) {
        int64_t s = starts[k], l = lens[k];
        if (s < end || l <= 0 || s > span - l || (s - end) % q || (l % q && s + l != span)) return -1;
        t += vlen((uint64_t)qdiv(s - end, q)) + vlen((uint64_t)qdiv(l + q - 1, q));
        end = s + l;
    }
    return t;
}

/* Pack runs of src (as wt_index_bytes accepted them, for the same q) into index (the varints)
 * and data (the bytes); returns the index bytes written. vals (NULL: none): the bytes of every
 * run of at most 8 bytes as the comparison took them (wt_delta_runs), so that src is read only
 * for longer runs: the output is not read again at random places after it left the cache. */
int64_t wt_pack_runs_v(const uint8_t *src, const int64_t *starts, const int64_t *lens, const int64_t *vals,
                       int64_t m, int64_t q, uint8_t *index, uint8_t *data) {
    int64_t end = 0, at = 0;
    uint8_t *p = index;
    for (int64_t k = 0; k < m; k++) {
        int64_t l = lens[k];
        p = vput(p, (uint64_t)qdiv(starts[k] - end, q));
        p = vput(p, (uint64_t)qdiv(l + q - 1, q));
        if (vals && l <= 8) {
            uint64_t v = (uint64_t)vals[k];
            copy_run(data + at, (const uint8_t *)&v, l);
        } else {
            copy_run(data + at, src + starts[k], l);
        }
        at += l;
        end = starts[k] + l;
    }
    return (int64_t)(p - index);
}

int64_t wt_pack_runs(const uint8_t *src, const int64_t *starts, const int64_t *lens, int64_t m, int64_t q,
                     uint8_t *index, uint8_t *data) {
    return wt_pack_runs_v(src, starts, lens, NULL, m, q, index, data);
}

/* Check a packed index of nix bytes holding m runs against a span of `span` bytes in units of
 * q: every varint whole and minimal, every run non-empty and inside [0, span), the index
 * consumed exactly. Returns -1 when all is fine (then *tot is the data bytes the runs carry),
 * else the index of the first bad run (m: bytes left after the last) and *why its reason. */
int64_t wt_check_packed(const uint8_t *index, int64_t nix, int64_t m, int64_t span, int64_t q, int64_t *tot,
                        int64_t *why) {
    const uint8_t *p = index, *pe = index + nix;
    int64_t end = 0, t = 0, s;
    for (int64_t k = 0; k < m; k++) {
        int w = run_next(&p, pe, span, q, &end, &s);
        if (w) {
            *why = w;
            return k;
        }
        t += end - s;
    }
    if (p != pe) {
        *why = WT_PK_TRAIL;
        return m;
    }
    *tot = t;
    *why = 0;
    return -1;
}

/* Scatter a checked packed record: run k's bytes from data to dst + its start. Returns the
 * bytes, or -1 at a bad index (nothing past that run is copied: check first). */
int64_t wt_unpack(uint8_t *dst, const uint8_t *index, int64_t nix, const uint8_t *data, int64_t m, int64_t span,
                  int64_t q) {
    const uint8_t *p = index, *pe = index + nix;
    int64_t end = 0, at = 0, s;
    for (int64_t k = 0; k < m; k++) {
        if (run_next(&p, pe, span, q, &end, &s)) return -1;
        copy_run(dst + s, data + at, end - s);
        at += end - s;
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
 * refreshes the shadow whole). g must divide 4096. vals, *ixb: as wt_delta_runs. */
int64_t wt_cast_bf16_delta(const uint32_t *src, int64_t n_el, uint16_t *out, uint16_t *shadow, int64_t g, int64_t gap,
                           int64_t *starts, int64_t *lens, int64_t cap, int64_t *changed, int64_t *vals,
                           int64_t *ixb) {
    const int64_t n = n_el * 2, CH = 4096;
    const uint8_t *nw = (const uint8_t *)out;
    uint8_t *old = (uint8_t *)shadow;
    runs_t r = {starts, lens, cap, 0, -1, 0, 0, gap, nw, vals, g, 0, 0};
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
        if (!over && compare_range(nw, old, lo, hi, n, g, &r) < 0) over = 1;
        if (over) memcpy(old + lo, nw + lo, (size_t)(hi - lo));
    }
    if (over) return -1;
    if (r.cs >= 0 && emit_run(&r) < 0) return -1;
    *changed = r.tot;
    *ixb = r.ix;
    return r.nr;
}

/* As wt_cast_bf16_delta for a source already in the output's dtype (n bytes: a bf16 replay, a
 * bf16 training copy): copied into out and compared with the shadow 4 KiB at a time, in the
 * same pass. Returns the runs or -1 (more than cap: the copy completes, the shadow is refreshed
 * whole). */
int64_t wt_copy_delta(const uint8_t *src, int64_t n, uint8_t *out, uint8_t *old, int64_t g, int64_t gap,
                      int64_t *starts, int64_t *lens, int64_t cap, int64_t *changed, int64_t *vals, int64_t *ixb) {
    const int64_t CH = 4096;
    runs_t r = {starts, lens, cap, 0, -1, 0, 0, gap, out, vals, g, 0, 0};
    int over = 0;
    for (int64_t lo = 0; lo < n; lo += CH) {
        int64_t hi = lo + CH < n ? lo + CH : n;
        memcpy(out + lo, src + lo, (size_t)(hi - lo));
        if (!over && compare_range(out, old, lo, hi, n, g, &r) < 0) over = 1;
        if (over) memcpy(old + lo, out + lo, (size_t)(hi - lo));
    }
    if (over) return -1;
    if (r.cs >= 0 && emit_run(&r) < 0) return -1;
    *changed = r.tot;
    *ixb = r.ix;
    return r.nr;
}

/* ---- masked deltas (packed format 3, weight_transfer.delta_packed) ---------------------------
 * An output as 64-byte chunks counted from its first byte (the last one clipped at n); a changed
 * chunk is its index (uint32), a 64-bit mask of its changed bytes (bit j: byte j) and those bytes
 * in order, appended to one values buffer. Compared with the runs of format 2 there is no run
 * extraction, no varint and no branch per changed byte: one vector compare per 64 bytes, and on
 * AVX-512 VBMI2 one compress (sender) or expand (receiver) per changed chunk. The price is 12
 * bytes of index per changed chunk instead of ~2 per run: worth it where the wire is memory,
 * not on a slow link (weight_transfer.delta_cost chooses). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI2__)
#include <immintrin.h>
#define WT_MASKS_512 1
#else
#define WT_MASKS_512 0
#endif

/* The low n bits set (none for n <= 0, all for n >= 64): the lanes of a partial load. */
static inline uint64_t low_bits(int64_t n) { return n <= 0 ? 0 : n >= 64 ? ~0ull : (1ull << n) - 1; }

#if WT_MASKS_512
/* The next up to 64 value bytes at vals + nv of nvals (lanes past nvals zero, never read). */
static inline __m512i vals_at(const uint8_t *vals, int64_t nv, int64_t nvals) {
    return nvals - nv >= 64 ? _mm512_loadu_si512(vals + nv) : _mm512_maskz_expandloadu_epi8(low_bits(nvals - nv), vals + nv);
}
#endif

#define WT_MASKS_PF 1024

/* Which code path the masked kernels were built with: "avx512-vbmi2" or "portable". */
const char *wt_masks_isa(void) { return WT_MASKS_512 ? "avx512-vbmi2" : "portable"; }

/* One chunk of nb <= 64 new bytes o against old (portable): its changed-byte mask. */
static inline uint64_t chunk_diff(const uint8_t *o, const uint8_t *old, int64_t nb) {
    uint64_t m = 0;
    if (nb == 64) {
        for (int k = 0; k < 64; k += 8) {
            uint64_t x = ld64(o + k) ^ ld64(old + k);
            if (!x) continue;
            for (int j = 0; j < 8; j++)
                m |= (uint64_t)(((x >> (8 * j)) & 0xff) != 0) << (k + j);
        }
        return m;
    }
    for (int64_t j = 0; j < nb; j++) m |= (uint64_t)(o[j] != old[j]) << j;
    return m;
}

/* fp32 -> bf16 of n_el <= 32 elements into o (torch's rounding); returns nonzero at a NaN. */
static inline uint32_t cast_chunk(const uint32_t *src, int64_t n_el, uint8_t *o) {
    uint32_t nan = 0;
    for (int64_t e = 0; e < n_el; e++) {
        uint32_t u = src[e];
        nan |= (u & 0x7fffffffu) > 0x7f800000u;
        uint16_t h = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        memcpy(o + 2 * e, &h, 2);
    }
    return nan;
}

/* The new bytes of an output of n bytes compared with its shadow old in 64-byte chunks, in one
 * pass: kind 0, src holds the output's bytes (copied into out unless out is NULL or src); kind
 * 1, src is float32 and the output its bf16 cast (n = 2 x elements; written into out unless
 * NULL). Changed bytes are copied into old; each changed chunk's mask goes to masks[k], its
 * index to chunks[k], its bytes to vals. masks and chunks hold cap + 1 entries, vals 64 x (cap
 * + 2) bytes. Returns the changed chunks (*nvals: their bytes, *nruns: their runs of adjacent
 * changed bytes, counted within chunks), -1 when there would be more than cap (the pass still
 * completes and old then equals the output), or -2 at a NaN in a cast (nothing defined: the
 * caller casts with torch and refreshes old whole). */
int64_t wt_masks(const void *src, int64_t n, int64_t kind, uint8_t *out, uint8_t *old, uint64_t *masks,
                 uint32_t *chunks, int64_t cap, uint8_t *vals, int64_t *nvals, int64_t *nruns) {
    const uint8_t *sb = (const uint8_t *)src;
    const uint32_t *sf = (const uint32_t *)src;
    if (out == sb) out = NULL;
    int64_t k = 0, nv = 0, nr = 0, i = 0;
    int over = 0;
    uint32_t nan = 0;
#if WT_MASKS_512
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1),
                  absm = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000),
                  perm = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
    __mmask16 vnan = 0;
    for (; i + 64 <= n; i += 64) {
        __m512i o;
        /* two read streams (the source and the shadow) and up to four write streams: the
         * hardware prefetcher alone left the pass slower than torch's plain cast; prefetching
         * WT_MASKS_PF bytes of shadow ahead, and the source's matching bytes, measured 10-15%
         * faster here (past the end it is a hint: no fault) */
        const char *pf = (const char *)sb + (kind == 1 ? 2 : 1) * (i + WT_MASKS_PF);  /* the source's matching bytes */
        _mm_prefetch((const char *)(old + i) + WT_MASKS_PF, _MM_HINT_T0);
        _mm_prefetch(pf, _MM_HINT_T0);
        if (kind == 1) {
            _mm_prefetch(pf + 64, _MM_HINT_T0);                  /* a cast reads 128 source bytes per chunk */
            __m512i a = _mm512_loadu_si512(sf + i / 2), b = _mm512_loadu_si512(sf + i / 2 + 16);
            vnan |= _mm512_cmpgt_epu32_mask(_mm512_and_si512(a, absm), inf) |
                    _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, absm), inf);
            a = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, bias),
                                                   _mm512_and_si512(_mm512_srli_epi32(a, 16), one)), 16);
            b = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, bias),
                                                   _mm512_and_si512(_mm512_srli_epi32(b, 16), one)), 16);
            o = _mm512_permutexvar_epi64(perm, _mm512_packus_epi32(a, b));
        } else {
            o = _mm512_loadu_si512(sb + i);
        }
        if (out) _mm512_storeu_si512(out + i, o);
        uint64_t m = _mm512_cmpneq_epi8_mask(o, _mm512_loadu_si512(old + i));
        /* branchless: at ~1% of elements changed about 40% of chunks change, at random, and a
         * branch on m mispredicted often enough to cost ~20% of the pass; the shadow takes the
         * changed bytes (a masked store: none when m is 0), and slot k (k <= cap: inside the
         * cap + 1 entries and 64 x (cap + 2) bytes) is written whether or not the chunk changed */
        _mm512_mask_storeu_epi8(old + i, m, o);
        if (over) continue;
        masks[k] = m;
        chunks[k] = (uint32_t)(i >> 6);
        _mm512_storeu_si512(vals + nv, _mm512_maskz_compress_epi8(m, o));
        nv += __builtin_popcountll(m);
        nr += __builtin_popcountll(m & ~(m << 1));
        k += m != 0;
        if (k > cap) over = 1;
    }
    nan = vnan != 0;
#endif
    uint8_t buf[64];
    for (; i < n; i += 64) { /* portable path, and the last partial chunk of the vector one */
        int64_t nb = n - i < 64 ? n - i : 64;
        const uint8_t *o = sb + i;
        if (kind == 1) {
            nan |= cast_chunk(sf + i / 2, nb / 2, buf);
            o = buf;
        }
        if (out) memcpy(out + i, o, (size_t)nb);
        uint64_t m = chunk_diff(o, old + i, nb);
        if (!m) continue;
        memcpy(old + i, o, (size_t)nb);
        if (over) continue;
        if (k + 1 > cap) { over = 1; continue; }
        masks[k] = m;
        chunks[k] = (uint32_t)(i >> 6);
        for (uint64_t t = m; t; t &= t - 1) vals[nv++] = o[__builtin_ctzll(t)];
        nr += __builtin_popcountll(m & ~(m << 1));
        k++;
    }
    if (nan) return -2;
    if (over) return -1;
    *nvals = nv;
    *nruns = nr;
    return k;
}

/* Check a format-3 index of m chunks against a span of span bytes: -1 when every chunk index is
 * inside the span and above the one before it and every mask is non-empty with no bit past the
 * span's end (*tot: the bytes the masks select), else the first bad chunk and *why (6: indices
 * not increasing, 7: a chunk leaves its span, 8: an empty mask). */
int64_t wt_check_masks(const uint64_t *masks, const uint32_t *chunks, int64_t m, int64_t span, int64_t *tot,
                       int64_t *why) {
    int64_t nch = (span + 63) / 64, t = 0, last = span - 64 * (nch - 1);
    uint64_t tail = last >= 64 ? ~0ull : (1ull << last) - 1;
    for (int64_t k = 0; k < m; k++) {
        int64_t c = chunks[k];
        if (k && c <= (int64_t)chunks[k - 1]) { *why = 6; return k; }
        if (c >= nch || (c == nch - 1 && (masks[k] & ~tail))) { *why = 7; return k; }
        if (!masks[k]) { *why = 8; return k; }
        t += __builtin_popcountll(masks[k]);
    }
    *tot = t;
    *why = 0;
    return -1;
}

/* Scatter a checked format-3 record of nvals value bytes over a span of span bytes: chunk k's
 * masked bytes from vals into dst + 64 x its index. A chunk wholly inside the span is loaded,
 * blended and stored back whole (its unselected bytes rewritten with what they hold: faster
 * than a byte-masked store); the span's last partial chunk gets a byte-masked store, so nothing
 * outside the span is touched, and vals is never read past nvals. The record must have passed
 * wt_check_masks (its masks select exactly nvals bytes inside the span). Returns the bytes taken. */
int64_t wt_unpack_masks(uint8_t *dst, const uint64_t *masks, const uint32_t *chunks, int64_t m, const uint8_t *vals,
                        int64_t nvals, int64_t span) {
    int64_t nv = 0;
    for (int64_t k = 0; k < m; k++) {
        uint64_t mk = masks[k];
        int64_t at = 64 * (int64_t)chunks[k];
        uint8_t *d = dst + at;
#if WT_MASKS_512
        __m512i v = vals_at(vals, nv, nvals);
        if (at + 64 <= span)
            _mm512_storeu_si512(d, _mm512_mask_expand_epi8(_mm512_loadu_si512(d), mk, v));
        else
            _mm512_mask_storeu_epi8(d, mk, _mm512_maskz_expand_epi8(mk, v));
        nv += __builtin_popcountll(mk);
#else
        (void)span; /* the record is checked: its masks select exactly nvals bytes inside the span */
        for (; mk; mk &= mk - 1) d[__builtin_ctzll(mk)] = vals[nv++];
#endif
    }
    (void)nvals;
    return nv;
}

/* Every page of [p, p + n) resident in this process (mincore; n at most 256 KiB): a
 * streaming store to a page that is not would fault the page in only to bypass the cache. */
static int resident(const uint8_t *p, int64_t n) {
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)4095, e = ((uintptr_t)p + (uintptr_t)n + 4095) & ~(uintptr_t)4095;
    unsigned char vec[80];
    size_t np = (e - a) / 4096;
    if (np > sizeof vec || mincore((void *)a, e - a, vec))
        return 0;
    for (size_t i = 0; i < np; i++)
        if (!(vec[i] & 1))
            return 0;
    return 1;
}

/* Copy a staging span into the tensor vLLM's post-processing reads, applying a checked format-3
 * record on the way: every 64-byte line of src (span bytes, the record's target) is copied to
 * dst, and the record's changed chunks are blended into the line first and written back to src
 * too. One pass over src instead of a scatter and then a copy (the commit's copy of a staged
 * layer, weight_transfer.delta_packed.Landing.copy_in). The lines go to dst with streaming
 * (non-temporal) stores in each 256 KiB block whose pages are all resident (dst 64-byte aligned):
 * a regular store first reads the line it overwrites, so a plain loop moves ~1.4x the bytes of
 * memcpy; streamed, the copy measured 0.87x memcpy's time on a cold 12 MiB span, and where
 * dst's pages still fault (a fresh allocation) regular stores are kept (streaming into faulting
 * pages measured 1.8x slower). Returns the bytes taken from vals. */
int64_t wt_copy_unpack_masks(uint8_t *dst, uint8_t *src, const uint64_t *masks, const uint32_t *chunks, int64_t m,
                             const uint8_t *vals, int64_t nvals, int64_t span) {
#if WT_MASKS_512
    int64_t nv = 0, k = 0, whole = span / 64;
    int64_t next = m ? (int64_t)chunks[0] : -1;
    int aligned = ((uintptr_t)dst & 63) == 0, streamed = 0;
    const int64_t block = 4096; /* chunks: 256 KiB */
    for (int64_t c0 = 0; c0 < whole; c0 += block) {
        int64_t c1 = c0 + block < whole ? c0 + block : whole;
        int nt = aligned && resident(dst + 64 * c0, 64 * (c1 - c0));
        streamed |= nt;
        for (int64_t c = c0; c < c1; c++) {
            __m512i x = _mm512_loadu_si512(src + 64 * c);
            if (c == next) {
                uint64_t mk = masks[k];
                x = _mm512_mask_expand_epi8(x, mk, vals_at(vals, nv, nvals));
                _mm512_storeu_si512(src + 64 * c, x);
                nv += __builtin_popcountll(mk);
                next = ++k < m ? (int64_t)chunks[k] : -1;
            }
            if (nt)
                _mm512_stream_si512((void *)(dst + 64 * c), x);
            else
                _mm512_storeu_si512(dst + 64 * c, x);
        }
    }
    if (streamed)
        _mm_sfence(); /* the streamed lines are visible before the caller reads dst */
    int64_t rest = span - 64 * whole;
    if (rest) {
        if (whole == next) {
            uint64_t mk = masks[k];
            _mm512_mask_storeu_epi8(src + 64 * whole, mk, _mm512_maskz_expand_epi8(mk, vals_at(vals, nv, nvals)));
            nv += __builtin_popcountll(mk);
        }
        memcpy(dst + 64 * whole, src + 64 * whole, (size_t)rest);
    }
    return nv;
#else
    int64_t nv = wt_unpack_masks(src, masks, chunks, m, vals, nvals, span);
    memcpy(dst, src, (size_t)span);
    return nv;
#endif
}

/* Lay out a format-3 record's body at rec (its header written by the caller): m masks, m chunk
 * indices, zero padding to 8 bytes, then nvals value bytes (weight_transfer.delta_packed's
 * Packer.pack_masks; one call instead of three tensor copies). Returns the body's bytes. */
int64_t wt_pack_masks(uint8_t *rec, const uint64_t *masks, const uint32_t *chunks, int64_t m, const uint8_t *vals,
                      int64_t nvals) {
    int64_t ix = 8 * m + (4 * m + 7) / 8 * 8;
    memcpy(rec, masks, (size_t)(8 * m));
    memcpy(rec + 8 * m, chunks, (size_t)(4 * m));
    memset(rec + 12 * m, 0, (size_t)(ix - 12 * m));
    memcpy(rec + ix, vals, (size_t)nvals);
    return ix + nvals;
}
