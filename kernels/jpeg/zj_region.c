/* The rows and columns of one rectangle of a JPEG, at a DCT scale, through libjpeg's
 * partial-decode API (libjpeg-turbo >= 1.5): jpeg_crop_scanline() decodes only the
 * columns of the rectangle (widened to iMCU edges), jpeg_skip_scanlines() passes the
 * rows above it without inverse DCT, upsampling or colour conversion, and the decode
 * is abandoned after its last row, so nothing below it is decoded. The entropy data of
 * the rows above and beside it is still read: it is one sequential stream.
 *
 * Errors never reach exit(): libjpeg's error handler jumps back here and the message is
 * returned. Warnings (corrupt data libjpeg decodes through) are counted, not printed: the
 * caller decides what they mean.
 */
#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

#include "zj_region.h"

/* The partial-decode API has known bugs before libjpeg-turbo 2.1.3: jpeg_skip_scanlines
 * crashes with non-fancy upsampling before 2.0.6 (CVE-2020-35538), and the merged 4:2:0
 * upsampler writes a whole uncropped row into a cropped output before 2.1.3. Building
 * against an older library fails here, and setup.py then builds zephon without this
 * optional kernel. */
#if !defined(LIBJPEG_TURBO_VERSION_NUMBER) || LIBJPEG_TURBO_VERSION_NUMBER < 2001003
#error "zj_region needs libjpeg-turbo >= 2.1.3"
#endif

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    zj_result *result;
    int cut; /* the caller cut the frame height: the scans' data past it is expected */
} zj_error;

static void zj_on_error(j_common_ptr cinfo) {
    zj_error *err = (zj_error *)cinfo->err;
    char text[JMSG_LENGTH_MAX];
    (*cinfo->err->format_message)(cinfo, text);
    snprintf(err->result->message, ZJ_MSG_MAX, "%s", text);
    longjmp(err->jump, 1);
}

static void zj_on_message(j_common_ptr cinfo, int level) {
    zj_error *err = (zj_error *)cinfo->err;
    if (level < 0) {
        if (err->cut && cinfo->err->msg_code == JWRN_EXTRANEOUS_DATA)
            return; /* the rows below the cut height, skipped as the caller meant */
        err->result->warnings++;
        if (err->result->message[0] == '\0') {
            char text[JMSG_LENGTH_MAX];
            (*cinfo->err->format_message)(cinfo, text);
            snprintf(err->result->message, ZJ_MSG_MAX, "%s", text);
        }
    }
}

int zj_decode_region(const unsigned char *data, size_t size, int scale, int x, int y,
                     int w, int h, int gray, int fast_idct, int fast_upsample, int cut,
                     unsigned char *out, size_t out_size, zj_result *result) {
    struct jpeg_decompress_struct cinfo;
    zj_error err;
    /* volatile: read after a longjmp */
    volatile int started = 0;
    volatile int status = 0;

    memset(result, 0, sizeof(*result));
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = zj_on_error;
    err.pub.emit_message = zj_on_message;
    err.result = result;
    err.cut = cut;
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        return 1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, (unsigned long)size);
    jpeg_read_header(&cinfo, TRUE);
    for (int c = 0; c < cinfo.num_components; c++) {
        /* jpeg_crop_scanline misplaces the columns of 4x2 and 2x4 sampling with DCT
         * scaling before libjpeg-turbo 3.0: only the usual factors (1 and 2) are taken */
        jpeg_component_info *comp = &cinfo.comp_info[c];
        if (comp->h_samp_factor > 2 || comp->v_samp_factor > 2) {
            snprintf(result->message, ZJ_MSG_MAX, "sampling %dx%d: declined",
                     comp->h_samp_factor, comp->v_samp_factor);
            jpeg_destroy_decompress(&cinfo);
            return 3;
        }
    }
    cinfo.out_color_space = gray ? JCS_GRAYSCALE : JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)scale;
    cinfo.dct_method = fast_idct ? JDCT_IFAST : JDCT_ISLOW;
    cinfo.do_fancy_upsampling = fast_upsample ? FALSE : TRUE;
    jpeg_start_decompress(&cinfo);
    started = 1;
    if (x < 0 || y < 0 || w <= 0 || h <= 0 || (JDIMENSION)(x + w) > cinfo.output_width ||
            (JDIMENSION)(y + h) > cinfo.output_height) {
        snprintf(result->message, ZJ_MSG_MAX, "region %d,%d %dx%d outside %ux%u", x, y, w,
                 h, cinfo.output_width, cinfo.output_height);
        status = 1;
    } else {
        JDIMENSION xoff = (JDIMENSION)x, width = (JDIMENSION)w;
        jpeg_crop_scanline(&cinfo, &xoff, &width);
        result->x = (int)xoff;
        result->width = (int)width;
        result->components = cinfo.output_components;
        size_t stride = (size_t)width * (size_t)cinfo.output_components;
        if (stride * (size_t)h > out_size) {
            status = 2;
        } else {
            if (y > 0)
                jpeg_skip_scanlines(&cinfo, (JDIMENSION)y);
            for (int row = 0; row < h;) {
                JSAMPROW rows[16];
                int want = h - row < 16 ? h - row : 16;
                for (int i = 0; i < want; i++)
                    rows[i] = out + (size_t)(row + i) * stride;
                JDIMENSION got = jpeg_read_scanlines(&cinfo, rows, (JDIMENSION)want);
                if (got == 0) {
                    snprintf(result->message, ZJ_MSG_MAX, "no scanline at row %d", y + row);
                    status = 1;
                    break;
                }
                row += (int)got;
            }
        }
    }
    (void)started;
    jpeg_abort_decompress(&cinfo); /* the rows below are never decoded */
    jpeg_destroy_decompress(&cinfo);
    return status;
}
