/* The three products of a projected layer on the CPU, reading each large operand once.
 *
 * A projector P (d x n) is stored by columns: column j has r nonzeros at rows idx[j*r + s] with weights
 * val[j*r + s]. torch's CSR product (lsp/projector.py) reaches 1-2 GFLOP/s on these shapes, and its input must be
 * laid out feature-major, which a layer's activations are not (they are token-major: one row of n features per token),
 * so every call also paid a transpose. The kernels here work on the layouts the layer has:
 *
 *   lo_compress_tokens  Y = P X^T       X: T x n token-major (fp32 or bf16), Y: d x T fp32.   (forward B X^T, backward A D^T)
 *   lo_expand_columns   O = M P         given M^T: d x k fp32, O: k x n fp32.                 (the update's small side U B)
 *   lo_update_rows      W = W*decay + P^T H   W: rows x cols (fp32 or bf16), H: d x cols fp32. (the update itself)
 *
 * Each works on tiles of one vector of floats (TILE: 16 with AVX-512, 8 with AVX2), so that every inner loop is a
 * multiply-add of whole vectors the compiler emits for this CPU (-march=native), and the sums stay in registers: a
 * tile of tokens or output columns is gathered into a feature-major scratch once, then each output's sum runs over
 * the nonzeros of P that name it. Results do not depend on the tile: each sum adds in one fixed order.
 *
 * Every output element is computed by one thread, in one fixed order (the nonzeros in storage order), whatever the
 * number of threads, so a result never depends on the thread count. The weight update is one pass over W (each row
 * read and written once, no weight-sized temporary); bf16 weights are rounded stochastically, with the random bits a
 * hash of (seed, element index), so that the rounding too is independent of threads and reproducible from the seed.
 */

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One vector of floats: 16 with AVX-512; 8 elsewhere (AVX2's 256-bit registers: a 16-float vector would take two,
 * and the kernels' register blocks would spill to the stack). */
#ifdef __AVX512F__
#define TILE 16
#else
#define TILE 8
#endif
#define MAX_THREADS 64

/* One tile's worth of floats as one value: GCC's vector extension, lowered to one 512-bit register with AVX-512 and
 * to two 256-bit ones with AVX2, so every multiply-add below is whole vectors whatever the compiler can prove about
 * aliasing. */
typedef float vec __attribute__((vector_size(TILE * sizeof(float)), aligned(TILE * sizeof(float))));

/* ------------------------------------------------------------------------------------------------------ helpers */

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float out;
    memcpy(&out, &wide, sizeof out);
    return out;
}

static inline uint32_t float_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* Round to nearest, ties to even, as torch converts fp32 to bf16 (NaN stays a quiet NaN of the same sign). */
static inline uint16_t round_nearest_bf16(float value) {
    uint32_t bits = float_bits(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x0040u);
    uint32_t lsb = (bits >> 16) & 1u;
    return (uint16_t)((bits + 0x7fffu + lsb) >> 16);
}

/* splitmix64's finaliser: a good 64-bit mix of a counter, so element e of a call draws bits no other element shares. */
static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* Stochastic rounding to bf16: add 16 uniform random bits below the kept ones and truncate, which rounds up with
 * probability equal to the discarded fraction (unbiased). A value that would carry into infinity, or is not finite,
 * is rounded to nearest instead so it keeps its class (lsp/rounding.py's rule). */
static inline uint16_t round_stochastic_bf16(float value, uint64_t seed, uint64_t element) {
    uint32_t bits = float_bits(value);
    uint32_t noise = (uint32_t)(mix64(seed + element * 0x9e3779b97f4a7c15ull) >> 48);
    uint32_t rounded = (bits + noise) & 0xffff0000u;
    if ((bits & 0x7f800000u) == 0x7f800000u || (rounded & 0x7f800000u) == 0x7f800000u)
        return round_nearest_bf16(value);
    return (uint16_t)(rounded >> 16);
}

/* A range of work items split into equal shares; the calling thread takes the first share. */
typedef void (*share_fn)(void* args, int64_t begin, int64_t end);

typedef struct {
    share_fn fn;
    void* args;
    int64_t begin, end;
} Share;

static void* run_share(void* raw) {
    Share* share = (Share*)raw;
    share->fn(share->args, share->begin, share->end);
    return NULL;
}

static void parallel_for(share_fn fn, void* args, int64_t items, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > items) threads = (int)items;
    if (threads <= 1) {
        if (items > 0) fn(args, 0, items);
        return;
    }
    Share shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t per = (items + threads - 1) / threads;
    for (int t = 0; t < threads; t++) {
        int64_t begin = t * per, end = begin + per < items ? begin + per : items;
        shares[t] = (Share){fn, args, begin, end > begin ? end : begin};
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, run_share, &shares[t]) == 0;
    /* A share whose thread could not be started runs here: the result is the same, only slower. */
    for (int t = 0; t < threads; t++)
        if (t == 0 || !started[t]) run_share(&shares[t]);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(ids[t], NULL);
}

/* The r nonzeros of column j: indices are int16 (index_size 2) or int32 (4). */
static inline int64_t index_at(const void* idx, int index_size, int64_t at) {
    return index_size == 2 ? (int64_t)((const int16_t*)idx)[at] : (int64_t)((const int32_t*)idx)[at];
}

/* -------------------------------------------------------------------------------------------- compress tokens */

typedef struct {
    const void* x;        /* T x n, row stride x_stride elements */
    int x_bf16;
    int64_t x_stride, tokens, n, d, r;
    const void* idx;
    int index_size;
    const float* val;
    float* y;             /* d x T */
    /* P by rows, built once a call (build_rows): row k's nonzeros are row_col/row_val[row_start[k] .. row_start[k+1]),
     * their features ascending. */
    const int32_t* row_start;
    const int32_t* row_col;
    const float* row_val;
    int status;
} CompressArgs;

/* TILE x TILE floats transposed in registers: log2(TILE) stages, stage k swapping bit k of the row and the column
 * index (element (i, c + 2^k) with (i + 2^k, c) where bit k of i and c is clear), each one two-input shuffle per row.
 * The shuffles' index vectors are constants and every loop is unrolled, so the rows stay in registers: with the masks
 * computed in a loop the compiler kept the rows on the stack and the transposition took half of a compression. */
typedef int32_t lanes __attribute__((vector_size(TILE * sizeof(int32_t))));

#if TILE == 16
static const lanes KEEP1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
static const lanes TAKE1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
static const lanes KEEP2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
static const lanes TAKE2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
static const lanes KEEP4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
static const lanes TAKE4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
static const lanes KEEP8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
static const lanes TAKE8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
#else
static const lanes KEEP1 = {0, 8, 2, 10, 4, 12, 6, 14};
static const lanes TAKE1 = {1, 9, 3, 11, 5, 13, 7, 15};
static const lanes KEEP2 = {0, 1, 8, 9, 4, 5, 12, 13};
static const lanes TAKE2 = {2, 3, 10, 11, 6, 7, 14, 15};
static const lanes KEEP4 = {0, 1, 2, 3, 8, 9, 10, 11};
static const lanes TAKE4 = {4, 5, 6, 7, 12, 13, 14, 15};
#endif

#define TRANSPOSE_STAGE(k)                                   \
    do {                                                     \
        _Pragma("GCC unroll 16")                             \
        for (int i = 0; i < TILE; i++) {                     \
            if (i & (k)) continue;                           \
            vec a = rows[i], b = rows[i + (k)];              \
            rows[i] = __builtin_shuffle(a, b, KEEP##k);      \
            rows[i + (k)] = __builtin_shuffle(a, b, TAKE##k); \
        }                                                    \
    } while (0)

static inline __attribute__((always_inline)) void transpose_tile(vec* rows) {
    TRANSPOSE_STAGE(1);
    TRANSPOSE_STAGE(2);
    TRANSPOSE_STAGE(4);
#if TILE == 16
    TRANSPOSE_STAGE(8);
#endif
}

static inline vec load_row(const CompressArgs* a, int64_t token, int64_t j0) {
    vec v;
    if (a->x_bf16) {
        uint16_t half[TILE];
        memcpy(half, (const uint16_t*)a->x + token * a->x_stride + j0, sizeof half);
        for (int c = 0; c < TILE; c++) v[c] = bf16_to_float(half[c]);
    } else {
        memcpy(&v, (const float*)a->x + token * a->x_stride + j0, sizeof v);
    }
    return v;
}

/* One tile of tokens feature-major: scratch[2j] and scratch[2j + 1] hold feature j of the tile's first and second
 * TILE tokens. Whole TILE x TILE blocks are loaded a row (one token's TILE features) at a time and transposed in
 * registers; the ragged edges (a last tile of fewer tokens, a last block of fewer features) are copied element by
 * element, zero past the last token so that no loop needs a tail. */
static void gather_tile(const CompressArgs* a, int64_t t0, int64_t width, vec* scratch) {
    for (int half = 0; half < 2; half++) {
        int64_t first = t0 + half * TILE, count = width - half * TILE;
        count = count < 0 ? 0 : count > TILE ? TILE : count;
        int64_t j0 = 0;
        if (count == TILE) {
            for (; j0 + TILE <= a->n; j0 += TILE) {
                vec block[TILE];
                for (int t = 0; t < TILE; t++) block[t] = load_row(a, first + t, j0);
                transpose_tile(block);
                for (int jj = 0; jj < TILE; jj++) scratch[2 * (j0 + jj) + half] = block[jj];
            }
        }
        for (; j0 < a->n; j0++) {
            float* column = (float*)(scratch + 2 * j0 + half);
            for (int64_t t = 0; t < TILE; t++) {
                if (t >= count) {
                    column[t] = 0.0f;
                } else if (a->x_bf16) {
                    column[t] = bf16_to_float(((const uint16_t*)a->x)[(first + t) * a->x_stride + j0]);
                } else {
                    column[t] = ((const float*)a->x)[(first + t) * a->x_stride + j0];
                }
            }
        }
    }
}

/* Tiles of 32 tokens: each nonzero's index and weight, loaded once, serve two vector multiply-adds. */
#define TOKENS (2 * TILE)

/* P's nonzeros grouped by the row they land in (a counting sort of the indices; features ascending within a row,
 * the order the sums have always taken), so that each output row is summed in registers and written once: adding
 * each nonzero into an accumulator in memory instead read and wrote the accumulator at every nonzero. Returns the
 * allocation (NULL when it could not be had), which the caller frees. */
static void* build_rows(CompressArgs* a) {
    const int64_t n = a->n, d = a->d, r = a->r, nnz = n * r;
    void* block = malloc((size_t)(d + 1) * sizeof(int32_t) + (size_t)nnz * (sizeof(int32_t) + sizeof(float)));
    if (!block) return NULL;
    int32_t* start = (int32_t*)block;
    int32_t* col = start + d + 1;
    float* val = (float*)(col + nnz);
    memset(start, 0, (size_t)(d + 1) * sizeof(int32_t));
    for (int64_t e = 0; e < nnz; e++) start[index_at(a->idx, a->index_size, e) + 1]++;
    for (int64_t k = 0; k < d; k++) start[k + 1] += start[k];
    int32_t* next = (int32_t*)malloc((size_t)d * sizeof(int32_t));
    if (!next) {
        free(block);
        return NULL;
    }
    memcpy(next, start, (size_t)d * sizeof(int32_t));
    for (int64_t j = 0; j < n; j++) {
        for (int64_t s = 0; s < r; s++) {
            int32_t at = next[index_at(a->idx, a->index_size, j * r + s)]++;
            col[at] = (int32_t)j;
            val[at] = a->val[j * r + s];
        }
    }
    free(next);
    a->row_start = start;
    a->row_col = col;
    a->row_val = val;
    return block;
}

/* Writes output row k of the tile (its first `width` tokens) from its two accumulator vectors. */
static inline void store_row(const CompressArgs* a, int64_t k, int64_t t0, int64_t width, vec low, vec high) {
    vec both[2] = {low, high};
    memcpy(a->y + k * a->tokens + t0, both, (size_t)width * sizeof(float));
}

/* Output rows k0 and k0 + 1 at once (four independent sums, so the additions' latency overlaps). */
static inline void sum_two_rows(const CompressArgs* a, const vec* scratch, int64_t k0, int64_t t0, int64_t width) {
    vec low0 = {0}, high0 = {0}, low1 = {0}, high1 = {0};
    int32_t p0 = a->row_start[k0], end0 = a->row_start[k0 + 1], p1 = end0, end1 = a->row_start[k0 + 2];
    for (; p0 < end0 && p1 < end1; p0++, p1++) {
        float w0 = a->row_val[p0], w1 = a->row_val[p1];
        const vec* f0 = scratch + 2 * a->row_col[p0];
        const vec* f1 = scratch + 2 * a->row_col[p1];
        low0 += w0 * f0[0];
        high0 += w0 * f0[1];
        low1 += w1 * f1[0];
        high1 += w1 * f1[1];
    }
    for (; p0 < end0; p0++) {
        const vec* f = scratch + 2 * a->row_col[p0];
        low0 += a->row_val[p0] * f[0];
        high0 += a->row_val[p0] * f[1];
    }
    for (; p1 < end1; p1++) {
        const vec* f = scratch + 2 * a->row_col[p1];
        low1 += a->row_val[p1] * f[0];
        high1 += a->row_val[p1] * f[1];
    }
    store_row(a, k0, t0, width, low0, high0);
    store_row(a, k0 + 1, t0, width, low1, high1);
}

static void compress_share(void* raw, int64_t first_tile, int64_t end_tile) {
    CompressArgs* a = (CompressArgs*)raw;
    /* Feature-major scratch of one tile of tokens: 2n vectors. */
    vec* scratch = (vec*)aligned_alloc(64, (size_t)(2 * a->n) * sizeof(vec));
    if (!scratch) {
        a->status = 1;
        return;
    }
    for (int64_t tile = first_tile; tile < end_tile; tile++) {
        int64_t t0 = tile * TOKENS, width = a->tokens - t0 < TOKENS ? a->tokens - t0 : TOKENS;
        gather_tile(a, t0, width, scratch);
        int64_t k = 0;
        for (; k + 2 <= a->d; k += 2) sum_two_rows(a, scratch, k, t0, width);
        if (k < a->d) {
            vec low = {0}, high = {0};
            for (int32_t p = a->row_start[k]; p < a->row_start[k + 1]; p++) {
                const vec* f = scratch + 2 * a->row_col[p];
                low += a->row_val[p] * f[0];
                high += a->row_val[p] * f[1];
            }
            store_row(a, k, t0, width, low, high);
        }
    }
    free(scratch);
}

/* Y (d x T) = P X^T. Returns 0, or 1 when scratch memory could not be had (Y is then incomplete). */
int lo_compress_tokens(const void* x, int x_bf16, int64_t x_stride, int64_t tokens, int64_t n, const void* idx,
                       int index_size, const float* val, int64_t r, int64_t d, float* y, int threads) {
    CompressArgs args = {x, x_bf16, x_stride, tokens, n, d, r, idx, index_size, val, y, NULL, NULL, NULL, 0};
    void* rows = build_rows(&args);
    if (!rows) return 1;
    parallel_for(compress_share, &args, (tokens + TOKENS - 1) / TOKENS, threads);
    free(rows);
    return args.status;
}

/* ---------------------------------------------------------------------------------------------- expand columns */

typedef struct {
    const float* mt;      /* d x k: M transposed, so a nonzero's row of M^T is a contiguous vector of length k */
    int64_t k, n, d, r;
    const void* idx;
    int index_size;
    const float* val;
    float* out;           /* k x n */
    int status;
} ExpandArgs;

/* The 4 * TILE weighted sums, at column `offset`, of the r rows of `matrix` (rows of `stride` floats) that P's nonzeros
 * first .. first + r - 1 name, in registers: each sum starts at 0 and adds the nonzeros in storage order. The
 * expansion and the update sum this way (a scratch row read and written at every nonzero took up to twice as long). */
static inline void sum_named_rows(const float* matrix, int64_t stride, int64_t offset, const void* idx, int index_size,
                                  const float* val, int64_t first, int64_t r, vec sums[4]) {
    for (int q = 0; q < 4; q++) sums[q] = (vec){0};
    for (int64_t s = 0; s < r; s++) {
        float w = val[first + s];
        const float* source = matrix + index_at(idx, index_size, first + s) * stride + offset;
        for (int q = 0; q < 4; q++) {
            vec x;
            memcpy(&x, source + q * TILE, sizeof x);
            sums[q] += w * x;
        }
    }
}

/* Column j of O (k sums) into `column`, 4 * TILE rows of O at a time (sum_named_rows), then TILE, then one. */
static void expand_column(const ExpandArgs* a, int64_t j, float* column) {
    const int64_t k = a->k, r = a->r;
    int64_t e = 0;
    for (; e + 4 * TILE <= k; e += 4 * TILE) {
        vec sums[4];
        sum_named_rows(a->mt, k, e, a->idx, a->index_size, a->val, j * r, r, sums);
        memcpy(column + e, sums, sizeof sums);
    }
    for (; e + TILE <= k; e += TILE) {
        vec sum = {0};
        for (int64_t s = 0; s < r; s++) {
            vec x;
            memcpy(&x, a->mt + index_at(a->idx, a->index_size, j * r + s) * k + e, sizeof x);
            sum += a->val[j * r + s] * x;
        }
        memcpy(column + e, &sum, sizeof sum);
    }
    if (e < k) {
        memset(column + e, 0, (size_t)(k - e) * sizeof(float));
        for (int64_t s = 0; s < r; s++) {
            float w = a->val[j * r + s];
            const float* source = a->mt + index_at(a->idx, a->index_size, j * r + s) * k;
            for (int64_t i = e; i < k; i++) column[i] += w * source[i];
        }
    }
}

static void expand_share(void* raw, int64_t first_tile, int64_t end_tile) {
    ExpandArgs* a = (ExpandArgs*)raw;
    /* One tile of TILE output columns, column-major (TILE x k), transposed into O's rows when done. */
    float* acc = (float*)aligned_alloc(64, (size_t)(a->k * TILE) * sizeof(float) + 64);
    if (!acc) {
        a->status = 1;
        return;
    }
    for (int64_t tile = first_tile; tile < end_tile; tile++) {
        int64_t j0 = tile * TILE, width = a->n - j0 < TILE ? a->n - j0 : TILE;
        for (int64_t c = 0; c < width; c++) expand_column(a, j0 + c, acc + c * a->k);
        int64_t e = 0;
        if (width == TILE) {
            /* Whole TILE x TILE blocks transposed in registers into O's rows. */
            for (; e + TILE <= a->k; e += TILE) {
                vec block[TILE];
                for (int c = 0; c < TILE; c++) memcpy(&block[c], acc + c * a->k + e, sizeof(vec));
                transpose_tile(block);
                for (int i = 0; i < TILE; i++) memcpy(a->out + (e + i) * a->n + j0, &block[i], sizeof(vec));
            }
        }
        for (; e < a->k; e++) {
            float* row = a->out + e * a->n + j0;
            for (int64_t c = 0; c < width; c++) row[c] = acc[c * a->k + e];
        }
    }
    free(acc);
}

/* O (k x n) = M P, from M^T (d x k). Returns 0, or 1 when scratch memory could not be had. */
int lo_expand_columns(const float* mt, int64_t k, int64_t d, int64_t n, const void* idx, int index_size,
                      const float* val, int64_t r, float* out, int threads) {
    ExpandArgs args = {mt, k, n, d, r, idx, index_size, val, out, 0};
    parallel_for(expand_share, &args, (n + TILE - 1) / TILE, threads);
    return args.status;
}

/* ------------------------------------------------------------------------------------------------ update rows */

typedef struct {
    void* w;              /* rows x cols, contiguous */
    int w_bf16;
    int64_t rows, cols, r;
    const void* idx;
    int index_size;
    const float* val;
    const float* half;    /* d x cols */
    float decay;
    int stochastic;
    uint64_t seed;
    int status;
} UpdateArgs;

/* Columns a pass of one row sums in registers (sum_named_rows): four vectors. */
#define UPDATE_BLOCK (4 * TILE)

/* The row's update for `count` columns from column c, decayed and added into the weight: two roundings, as
 * W.mul_(decay).add_(delta) has them, then rounded into bf16 where the weight is bf16. */
static inline void apply_columns(const UpdateArgs* a, int64_t row, int64_t c, int64_t count, const float* delta) {
    if (!a->w_bf16) {
        float* target = (float*)a->w + row * a->cols + c;
        if (a->decay != 1.0f) {
            for (int64_t e = 0; e < count; e++) target[e] = target[e] * a->decay + delta[e];
        } else {
            for (int64_t e = 0; e < count; e++) target[e] += delta[e];
        }
        return;
    }
    uint16_t* target = (uint16_t*)a->w + row * a->cols + c;
    for (int64_t e = 0; e < count; e++) {
        float value = bf16_to_float(target[e]) * a->decay + delta[e];
        target[e] = a->stochastic ? round_stochastic_bf16(value, a->seed, (uint64_t)(row * a->cols + c + e))
                                  : round_nearest_bf16(value);
    }
}

static void update_share(void* raw, int64_t first_row, int64_t end_row) {
    UpdateArgs* a = (UpdateArgs*)raw;
    const int64_t cols = a->cols, r = a->r;
    for (int64_t row = first_row; row < end_row; row++) {
        /* Each column's sum starts at 0 and adds the row's nonzeros in storage order, whatever the block. */
        int64_t c = 0;
        for (; c + UPDATE_BLOCK <= cols; c += UPDATE_BLOCK) {
            vec sums[4];
            sum_named_rows(a->half, cols, c, a->idx, a->index_size, a->val, row * r, r, sums);
            apply_columns(a, row, c, UPDATE_BLOCK, (const float*)sums);
        }
        if (c < cols) {
            float tail[UPDATE_BLOCK] = {0};
            for (int64_t s = 0; s < r; s++) {
                float v = a->val[row * r + s];
                const float* source = a->half + index_at(a->idx, a->index_size, row * r + s) * cols + c;
                for (int64_t e = 0; e < cols - c; e++) tail[e] += v * source[e];
            }
            apply_columns(a, row, c, cols - c, tail);
        }
    }
}

/* W = W*decay + P^T H in place (P: d x rows). Returns 0 (it needs no scratch memory; the status stays for the
 * caller's one check of every kernel). */
int lo_update_rows(void* w, int w_bf16, int64_t rows, int64_t cols, const void* idx, int index_size,
                   const float* val, int64_t r, const float* half, float decay, int stochastic, uint64_t seed,
                   int threads) {
    UpdateArgs args = {w, w_bf16, rows, cols, r, idx, index_size, val, half, decay, stochastic, seed, 0};
    parallel_for(update_share, &args, rows, threads);
    return args.status;
}
