/* This machine's AMX tile-unit peak: every core runs dense tile products (four independent 16x16 C tiles from two
 * A and two B tiles of random bytes; int8 TDPBUSD at the full K = 64, or BF16 TDPBF16PS at K = 32) at once. As
 * fma_peak.c, each thread's rate is its operations over its own CPU time. Built and run by benchmarks/measure.py:
 *     gcc -O2 -mamx-tile -mamx-int8 -mamx-bf16 -pthread amx_peak.c -o amx_peak && ./amx_peak <threads> int8|bf16
 * Prints GOP/s (int8: 2 ops per multiply-add) or GFLOP/s summed over the threads, or "0" where the OS does not
 * grant the tile state. */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static struct config cfg; /* static: GCC 12 drops a local's stores before LDTILECFG */
static uint8_t a[2][1024] __attribute__((aligned(64))), b[2][1024] __attribute__((aligned(64)));
static int bf16;

static double thread_cpu(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define TILE_LOOP(OP)                                                                       \
  for (long k = 0; k < iters; k++) { OP(0, 4, 6); OP(1, 4, 7); OP(2, 5, 6); OP(3, 5, 7); }

static void *run(void *out) {
  _tile_loadconfig(&cfg);
  _tile_loadd(4, a[0], 64); _tile_loadd(5, a[1], 64); _tile_loadd(6, b[0], 64); _tile_loadd(7, b[1], 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const long iters = 2000000L;
  double best = 0;
  for (int rep = 0; rep < 5; rep++) {
    double start = thread_cpu();
    if (bf16) { TILE_LOOP(_tile_dpbf16ps) } else { TILE_LOOP(_tile_dpbusd) }
    double rate = (double)iters * 4 * 16 * 16 * (bf16 ? 32 : 64) * 2 / (thread_cpu() - start) / 1e9;
    if (rate > best) best = rate;
  }
  _tile_release();
  ((double *)out)[0] = best;
  return NULL;
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 1;
  bf16 = argc > 2 && strcmp(argv[2], "bf16") == 0;
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
    printf("0\n");
    return 0;
  }
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
  unsigned s = 12345; /* random bytes; for bf16, finite values in [0.5, 2) with random signs */
  for (int i = 0; i < 2048; i++) {
    s = s * 1103515245u + 12345u;
    ((uint8_t *)a)[i] = (uint8_t)(s >> 16);
    ((uint8_t *)b)[i] = (uint8_t)(s >> 24);
  }
  if (bf16)
    for (int i = 0; i < 1024; i++) {
      s = s * 1103515245u + 12345u;
      ((uint16_t *)a)[i] = (uint16_t)(0x3f00 | (s >> 16 & 0x7f) | (s >> 8 & 0x8000));
      ((uint16_t *)b)[i] = (uint16_t)(0x3f00 | (s >> 20 & 0x7f) | (s & 0x8000));
    }
  pthread_t threads[256];
  double rates[256];
  for (int i = 0; i < n; i++) pthread_create(&threads[i], NULL, run, &rates[i]);
  double total = 0;
  for (int i = 0; i < n; i++) {
    pthread_join(threads[i], NULL);
    total += rates[i];
  }
  printf("%.1f\n", total);
  return 0;
}
