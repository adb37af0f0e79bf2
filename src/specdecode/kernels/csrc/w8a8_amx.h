/* The AMX build's work items (w8a8.c includes this inside its AVX512-VNNI section): products of
 * AMX_MIN_ROWS rows or more as tile multiplies, fewer as that section's vpdpbusd items.
 *
 * tdpbusd C += A . B sums, for each of C's rows x 16 int32 lanes, 64 uint8 codes of A's row times
 * 64 int8 weights of B's column, in 16 quads: the sums vpdpbusd forms, 16 rows x 16 columns x 64
 * inputs in one instruction. The packed layout (w8a8.c) is already B's: in group g, quad q's 16
 * columns of block b (columns 16b .. 16b+15 of the group) are 64 contiguous bytes, the next quad's
 * GROUP * 4 bytes on; A is 64 bytes of each row's codes, the rows k bytes apart. Integer sums are
 * exact in any order, so the tiles' sums are vpdpbusd's and every later step is that section's:
 * the same bits, whichever path a product takes (tests/kernels/test_w8a8.py compares the builds).
 *
 * A work item is up to 16 rows of one group: four C tiles (the group's four blocks of 16 columns)
 * summed over k in steps of 64 inputs, then stored as the vpdpbusd items' registers; inputs past
 * the last whole step (k4 % 16 quads) are added with vpdpbusd. w8a16 sums its two byte halves as
 * two A tiles against the same B tiles, half a group (two blocks) at a time for want of tiles.
 *
 * Linux hands a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); where
 * it refuses, every product takes the vpdpbusd items. A thread's tile configuration is its own and
 * other libraries (oneDNN) set theirs: each thread configures its tiles for the items it runs and
 * releases them after.
 */

#include <sys/syscall.h>
#include <unistd.h>

#define AMX_MIN_ROWS 4 /* fewer rows run as vpdpbusd items (2 rows: forwards as fast either way) */
#define AMX_ROWS 16    /* rows of a tile, and of a work item */
#define AMX_QUADS 16   /* quads of inputs (64 bytes) a tile multiply sums */
#define AMX_STEP (AMX_QUADS * GROUP * 4) /* bytes of a group's weights a step of 16 quads reads (4 KB) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_granted;

__attribute__((constructor)) static void request_tiles(void) {
    amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* whether this process may use the tiles (the OS granted them): int8_kernel.py reports it */
int sd_tiles_granted(void) { return amx_granted; }

static int tiled(const Product *p) { return amx_granted && p->n >= AMX_MIN_ROWS; }

static int row_tile(const Product *p) { return tiled(p) ? AMX_ROWS : p->lo ? ROW_TILE16 : ROW_TILE; }

/* palette 1: tiles 0-5 C and A, the item's rows; 6-7 B, 16 quads; all 64 bytes a row */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes[16];
    uint8_t rows[16];
} TileConfig;

static __thread int configured_rows; /* this thread's tiles' rows; 0: not configured by this file */

static void configure_tiles(int rows) {
    if (rows == configured_rows) return;
    TileConfig config = {0};
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.bytes[t] = 64, config.rows[t] = (uint8_t)(t < 6 ? rows : AMX_QUADS);
    _tile_loadconfig(&config);
    configured_rows = rows;
}

static void begin_items(const Product *p) { (void)p, configured_rows = 0; }

static void end_items(void) {
    if (configured_rows) _tile_release();
    configured_rows = 0;
}

/* a step's weights into L1 ahead of its tile loads (measured: a few percent) */
static inline void prefetch_step(const int8_t *w) {
    for (int line = 0; line < AMX_STEP / 64; line++) _mm_prefetch((const char *)w + 64 * line, _MM_HINT_T0);
}

/* sums[r][b] += rows r's codes (a) times block b's weights (w) over quads q0 .. k4: vpdpbusd's tail */
static void add_quads(const Product *p, const uint8_t *a, const int8_t *w, int rows, int b0, int blocks, int64_t q0,
                      __m512i sums[][4]) {
    for (int64_t q = q0; q < p->k4; q++)
        for (int r = 0; r < rows; r++) {
            int32_t quad;
            memcpy(&quad, a + (r * p->k4 + q) * 4, sizeof quad);
            __m512i codes = _mm512_set1_epi32(quad);
            for (int b = b0; b < b0 + blocks; b++)
                sums[r][b] = _mm512_dpbusd_epi32(sums[r][b], codes, _mm512_loadu_si512(w + q * GROUP * 4 + b * 64));
        }
}

static inline void zero_sums(void) { /* tiles 0-3: the four sums of an item */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* w8a8: rows (up to 16) x the group's 64 columns; tiles 0-3 sum blocks 0-3, 4 holds A, 6-7 B (two
 * B tiles taking turns measured faster than three, or than two steps' A and B tiles in turn) */
static void tile_sums_amx(const Product *p, const int8_t *w, const uint8_t *a, int rows, __m512i sums[AMX_ROWS][4]) {
    int64_t steps = p->k4 / AMX_QUADS, stride = p->k4 * 4;
    zero_sums();
    for (int64_t s = 0; s < steps; s++) {
        const int8_t *ws = w + s * AMX_STEP;
        prefetch_step(ws + AMX_STEP);
        _tile_loadd(4, a + s * 64, stride);
        _tile_loadd(6, ws, GROUP * 4);
        _tile_dpbusd(0, 4, 6);
        _tile_loadd(7, ws + 64, GROUP * 4);
        _tile_dpbusd(1, 4, 7);
        _tile_loadd(6, ws + 128, GROUP * 4);
        _tile_dpbusd(2, 4, 6);
        _tile_loadd(7, ws + 192, GROUP * 4);
        _tile_dpbusd(3, 4, 7);
    }
    /* row r's 64 sums are sums[r][0..3], 256 bytes a row */
    _tile_stored(0, (char *)sums, 256);
    _tile_stored(1, (char *)sums + 64, 256);
    _tile_stored(2, (char *)sums + 128, 256);
    _tile_stored(3, (char *)sums + 192, 256);
    add_quads(p, a, w, rows, 0, 4, steps * AMX_QUADS, sums);
}

/* w8a16: blocks 2h and 2h+1 of both byte halves; tiles 0-1 sum the high bytes, 2-3 the low, 4-5 A */
static void tile_sums16_amx(const Product *p, const int8_t *w, const uint8_t *hi, const uint8_t *lo, int rows, int h,
                            __m512i high[AMX_ROWS][4], __m512i low[AMX_ROWS][4]) {
    int64_t steps = p->k4 / AMX_QUADS, stride = p->k4 * 4;
    zero_sums();
    for (int64_t s = 0; s < steps; s++) {
        const int8_t *ws = w + s * AMX_STEP + h * 128;
        if (!h) prefetch_step(ws + AMX_STEP); /* the second half finds the step in cache */
        _tile_loadd(4, hi + s * 64, stride);
        _tile_loadd(5, lo + s * 64, stride);
        _tile_loadd(6, ws, GROUP * 4);
        _tile_loadd(7, ws + 64, GROUP * 4);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, (char *)high + h * 128, 256);
    _tile_stored(1, (char *)high + h * 128 + 64, 256);
    _tile_stored(2, (char *)low + h * 128, 256);
    _tile_stored(3, (char *)low + h * 128 + 64, 256);
    add_quads(p, hi, w, rows, 2 * h, 2, steps * AMX_QUADS, high);
    add_quads(p, lo, w, rows, 2 * h, 2, steps * AMX_QUADS, low);
}

static void product_item_amx(const Product *p, int64_t g, int64_t r0) {
    __m512i sums[AMX_ROWS][4], low[AMX_ROWS][4];
    int rows = (int)min64(p->n - r0, AMX_ROWS);
    const int8_t *w = p->packed + g * p->k4 * GROUP * 4;
    const uint8_t *a = p->codes + r0 * p->k4 * 4;
    configure_tiles(rows);
    if (p->lo) {
        const uint8_t *lo = p->lo + r0 * p->k4 * 4;
        for (int h = 0; h < 2; h++) tile_sums16_amx(p, w, a, lo, rows, h, sums, low);
    } else {
        tile_sums_amx(p, w, a, rows, sums);
    }
    take_compensation(p, g, rows, sums, p->lo ? low : NULL);
    product_tile(p, g, r0, rows, sums);
}

static void product_item(const Product *p, int64_t g, int64_t r0) {
    if (tiled(p))
        product_item_amx(p, g, r0);
    else if (p->lo)
        product_item16(p, g, r0);
    else
        product_item8(p, g, r0);
}
