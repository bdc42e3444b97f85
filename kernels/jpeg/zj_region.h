/* Decode one rectangle of a JPEG with libjpeg's partial-decode API (see zj_region.c). */
#ifndef ZJ_REGION_H
#define ZJ_REGION_H
#include <stddef.h>

#define ZJ_MSG_MAX 200

typedef struct {
    int x;          /* first column written (the region's x, moved left to an iMCU edge) */
    int width;      /* columns written per row (the row stride is width * components) */
    int components; /* 3 (RGB) or 1 (grayscale) */
    int warnings;   /* libjpeg's corrupt-data warnings during the decode */
    char message[ZJ_MSG_MAX];
} zj_result;

/* 0: done; 1: libjpeg failed (message set); 2: the output buffer is too small
   (width set to what one row needs); 3: declined (sampling factors above 2). ``cut``:
   the caller cut the frame's height, so libjpeg's "extraneous data" warning (the
   scans' rows past that height) is not counted. */
int zj_decode_region(const unsigned char *data, size_t size, int scale, int x, int y,
                     int w, int h, int gray, int fast_idct, int fast_upsample, int cut,
                     unsigned char *out, size_t out_size, zj_result *result);
#endif
