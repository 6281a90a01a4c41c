/*
 * The per-type half of the GGUF block kernels (gguf_matmul.c): how each block type is
 * read, the only code that differs from type to type.
 *
 * Every type supported reduces to sub-blocks of 32 values, each holding small integers
 * u (stored unsigned: the quant q plus the type's offset, q = u - off), a float scale s
 * per 32 and, by the type's kind, a float min m per 32 or integer sub-scales per 16:
 *
 *   KIND_PLAIN      value = s * q                         Q4_0 Q5_0 Q8_0 IQ4_NL IQ4_XS
 *   KIND_MIN        value = s * q + m                     Q4_1 Q5_1 Q4_K Q5_K
 *   KIND_SPLIT      value = (s * sc16) * q                Q3_K Q6_K (s = d, sc16 an integer)
 *   KIND_SPLIT_MIN  value = (s * sc16) * q + m * mn16     Q2_K (s = d, m = -dmin, sc16 and mn16 integers)
 *
 * s and m are exact in float32 from the file's fields (an fp16 times an integer of at
 * most 8 bits), which is what lets the int8 kernels fold the per-16 integer sub-scales
 * into a block's integer dot product (see gguf_matmul.c). The decoders below are plain
 * C, the reference for the vector paths; the values they give are what gguf.quants
 * dequantizes (the same float operations in the same order).
 */
#ifndef BARGEIN_GGUF_TYPES_H
#define BARGEIN_GGUF_TYPES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

enum {
    T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23
};
enum { KIND_PLAIN = 0, KIND_MIN = 1, KIND_SPLIT = 2, KIND_SPLIT_MIN = 3 };

typedef struct {
    int qk;    /* values per block: 32 or 256 */
    int bytes; /* bytes per block */
    int off;   /* q = u - off */
    int kind;
} qinfo_t;

/* A block decoded: up to 256 values as u, with the per-32 and per-16 parameters
 * (sc = 1 and mn = 0 for types without per-16 integers). */
typedef struct {
    uint8_t u[256];
    float s[8], m[8];
    int32_t sc[16], mn[16];
} dblock_t;

static const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* 0 and the type's facts, or -1 for a type without kernels. */
static inline int gguf_qinfo(int type, qinfo_t *info) {
    switch (type) {
    case T_Q4_0: *info = (qinfo_t){32, 18, 8, KIND_PLAIN}; return 0;
    case T_Q4_1: *info = (qinfo_t){32, 20, 0, KIND_MIN}; return 0;
    case T_Q5_0: *info = (qinfo_t){32, 22, 16, KIND_PLAIN}; return 0;
    case T_Q5_1: *info = (qinfo_t){32, 24, 0, KIND_MIN}; return 0;
    case T_Q8_0: *info = (qinfo_t){32, 34, 128, KIND_PLAIN}; return 0;
    case T_Q2_K: *info = (qinfo_t){256, 84, 0, KIND_SPLIT_MIN}; return 0;
    case T_Q3_K: *info = (qinfo_t){256, 110, 4, KIND_SPLIT}; return 0;
    case T_Q4_K: *info = (qinfo_t){256, 144, 0, KIND_MIN}; return 0;
    case T_Q5_K: *info = (qinfo_t){256, 176, 0, KIND_MIN}; return 0;
    case T_Q6_K: *info = (qinfo_t){256, 210, 32, KIND_SPLIT}; return 0;
    case T_IQ4_NL: *info = (qinfo_t){32, 18, 128, KIND_PLAIN}; return 0;
    case T_IQ4_XS: *info = (qinfo_t){256, 136, 128, KIND_PLAIN}; return 0;
    default: return -1;
    }
}

/* The little-endian IEEE half at p, widened (exactly). */
static inline float gguf_f16(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) {
        const float v = ldexpf((float)man, -24); /* zero or subnormal: exact */
        return sign ? -v : v;
    }
    if (exp == 31) bits = sign | 0x7F800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Four- and five-bit blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL): byte i of qs holds
 * element i in its low nibble and element i + 16 in its high one. */
static inline void unpack_nibbles32(const uint8_t *qs, uint8_t *u) {
    for (int i = 0; i < 16; i++) {
        u[i] = qs[i] & 0x0F;
        u[i + 16] = qs[i] >> 4;
    }
}

static inline void high_bits32(const uint8_t *qh4, uint8_t *u) {
    uint32_t qh;
    memcpy(&qh, qh4, 4); /* little-endian hosts only, as the kernels' users are */
    for (int i = 0; i < 32; i++) u[i] |= (uint8_t)(((qh >> i) & 1) << 4);
}

/* The 12 packed bytes of Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins. */
static inline void k_scale_min(const uint8_t *p, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = p[j] & 63;
        *mn = p[j + 4] & 63;
    } else {
        *sc = (p[j + 4] & 0x0F) | ((p[j - 4] >> 6) << 4);
        *mn = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
    }
}

static inline void no_split(dblock_t *o, int subs16) {
    for (int i = 0; i < subs16; i++) {
        o->sc[i] = 1;
        o->mn[i] = 0;
    }
}

/* The parameters of block b of the type (s, m per 32; sc, mn per 16) into o (plain C). */
static inline void gguf_params_c(int type, const uint8_t *b, dblock_t *o) {
    switch (type) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0: case T_IQ4_NL:
        o->s[0] = gguf_f16(b), o->m[0] = 0.0f;
        no_split(o, 2);
        return;
    case T_Q4_1: case T_Q5_1:
        o->s[0] = gguf_f16(b), o->m[0] = gguf_f16(b + 2);
        no_split(o, 2);
        return;
    case T_Q2_K: { /* scales[16], qs[64], d, dmin */
        const float d = gguf_f16(b + 80), dmin = gguf_f16(b + 82);
        for (int i = 0; i < 16; i++) o->sc[i] = b[i] & 0x0F, o->mn[i] = b[i] >> 4;
        for (int i = 0; i < 8; i++) o->s[i] = d, o->m[i] = -dmin;
        return;
    }
    case T_Q3_K: { /* hmask[32], qs[64], scales[12], d */
        const uint8_t *scales = b + 96;
        const float d = gguf_f16(b + 108);
        for (int i = 0; i < 16; i++) {
            const int lo = i < 8 ? scales[i] & 0x0F : scales[i - 8] >> 4;
            const int hi = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
            o->sc[i] = (lo | (hi << 4)) - 32;
            o->mn[i] = 0;
        }
        for (int i = 0; i < 8; i++) o->s[i] = d, o->m[i] = 0.0f;
        return;
    }
    case T_Q4_K: case T_Q5_K: { /* d, dmin, scales[12], ... */
        const float d = gguf_f16(b), dmin = gguf_f16(b + 2);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            k_scale_min(b + 4, j, &sc, &mn);
            o->s[j] = d * (float)sc;
            o->m[j] = -(dmin * (float)mn);
        }
        no_split(o, 16);
        return;
    }
    case T_Q6_K: { /* ql[128], qh[64], scales[16] (int8), d */
        const float d = gguf_f16(b + 208);
        for (int i = 0; i < 16; i++) o->sc[i] = (int8_t)b[192 + i], o->mn[i] = 0;
        for (int i = 0; i < 8; i++) o->s[i] = d, o->m[i] = 0.0f;
        return;
    }
    case T_IQ4_XS: { /* d, scales_h (u16), scales_l[4], qs[128] */
        const float d = gguf_f16(b);
        const int scales_h = b[2] | (b[3] << 8);
        for (int ib = 0; ib < 8; ib++) {
            const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((scales_h >> (2 * ib)) & 3) << 4);
            o->s[ib] = d * (float)(ls - 32);
            o->m[ib] = 0.0f;
        }
        no_split(o, 16);
        return;
    }
    }
}

/* The quants of block b of the type, as u = q + off, into u[qk] (plain C). */
static inline void gguf_quants_c(int type, const uint8_t *b, uint8_t *u) {
    switch (type) {
    case T_Q4_0: unpack_nibbles32(b + 2, u); return;
    case T_Q4_1: unpack_nibbles32(b + 4, u); return;
    case T_Q5_0: unpack_nibbles32(b + 6, u), high_bits32(b + 2, u); return;
    case T_Q5_1: unpack_nibbles32(b + 8, u), high_bits32(b + 4, u); return;
    case T_Q8_0:
        for (int i = 0; i < 32; i++) u[i] = b[2 + i] ^ 0x80; /* q + 128 */
        return;
    case T_IQ4_NL:
        unpack_nibbles32(b + 2, u);
        for (int i = 0; i < 32; i++) u[i] = (uint8_t)(KVALUES_IQ4NL[u[i]] + 128);
        return;
    case T_Q2_K: /* value h * 128 + s * 32 + l: bits 2s of qs[h * 32 + l] */
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int l = 0; l < 32; l++) u[h * 128 + s * 32 + l] = (b[16 + h * 32 + l] >> (2 * s)) & 3;
        return;
    case T_Q3_K: /* and bit idx / 32 of hmask[l] set adds 4 (q = u - 4) */
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int l = 0; l < 32; l++) {
                    const int idx = h * 128 + s * 32 + l;
                    u[idx] = (uint8_t)(((b[32 + h * 32 + l] >> (2 * s)) & 3) | (((b[l] >> (idx / 32)) & 1) << 2));
                }
        return;
    case T_Q4_K: case T_Q5_K: {
        const uint8_t *qs = b + (type == T_Q4_K ? 16 : 48);
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) {
                u[64 * g + l] = qs[32 * g + l] & 0x0F;
                u[64 * g + 32 + l] = qs[32 * g + l] >> 4;
            }
        if (type == T_Q5_K)
            for (int j = 0; j < 8; j++)
                for (int l = 0; l < 32; l++) u[32 * j + l] |= (uint8_t)(((b[16 + l] >> j) & 1) << 4);
        return;
    }
    case T_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                uint8_t *o = u + h * 128;
                const uint8_t a = ql[h * 64 + l], c = ql[h * 64 + 32 + l], hb = qh[h * 32 + l];
                o[l] = (uint8_t)((a & 0x0F) | ((hb & 3) << 4));
                o[32 + l] = (uint8_t)((c & 0x0F) | (((hb >> 2) & 3) << 4));
                o[64 + l] = (uint8_t)((a >> 4) | (((hb >> 4) & 3) << 4));
                o[96 + l] = (uint8_t)((c >> 4) | (((hb >> 6) & 3) << 4));
            }
        return;
    }
    case T_IQ4_XS:
        for (int ib = 0; ib < 8; ib++) unpack_nibbles32(b + 8 + 16 * ib, u + 32 * ib);
        for (int i = 0; i < 256; i++) u[i] = (uint8_t)(KVALUES_IQ4NL[u[i]] + 128);
        return;
    }
}

/* Block b of the type into o (plain C): the reference for every vector path. */
static inline void gguf_decode_c(int type, const uint8_t *b, dblock_t *o) {
    gguf_params_c(type, b, o);
    gguf_quants_c(type, b, o->u);
}

/* The float scale and min of 16 values i (0..qk/16-1) of a decoded block: the values are
 * es * q (+ em where the kind has a min), as gguf.quants computes them. */
static inline void gguf_half_params(const qinfo_t *info, const dblock_t *o, int i, float *es, float *em) {
    const float s = o->s[i / 2], m = o->m[i / 2];
    switch (info->kind) {
    case KIND_PLAIN: *es = s, *em = 0.0f; return;
    case KIND_MIN: *es = s, *em = m; return;
    case KIND_SPLIT: *es = s * (float)o->sc[i], *em = 0.0f; return;
    default: *es = s * (float)o->sc[i], *em = m * (float)o->mn[i]; return;
    }
}

#endif
