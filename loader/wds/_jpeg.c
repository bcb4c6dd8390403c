/* Region-of-interest JPEG decoding at a DCT scale, through libjpeg-turbo's libjpeg API.
 *
 * decode(data, denom, x, y, w, h) -> (pixels, width, height, x_offset)
 *
 * Decodes the image at 1/denom scale (denom in 1, 2, 4, 8: DCT scaling, the IDCT outputs
 * 8/denom pixels a block) and only the rows [y, y + h) and the columns [x, x + w) of that
 * scaled image: rows above are skipped (jpeg_skip_scanlines: entropy-decoded, no IDCT, no colour
 * conversion), rows below are never read, and each row's IDCT and colour conversion cover only
 * the columns of the crop, widened to whole iMCUs (jpeg_crop_scanline). The returned pixels are
 * RGB rows of `width` columns starting at scaled column `x_offset` (<= x); the caller slices.
 *
 * libjpeg reports errors by calling error_exit, which must not return: it longjmps back here and
 * the error becomes a ValueError. The GIL is released while decoding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <string.h>
#include <jpeglib.h>
#include <jerror.h>

struct err_mgr {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int truncated;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct err_mgr *err = (struct err_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* Warnings are not printed. One is an error: the data ended before the rows asked for (libjpeg
 * would hand on grey rows where Pillow says "image file is truncated"); the others (extraneous
 * bytes before a marker...) are ignored, as Pillow ignores them. */
static void on_warning(j_common_ptr cinfo, int level) {
    if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF)
        ((struct err_mgr *)cinfo->err)->truncated = 1;
}

static PyObject *UnsupportedJpeg;

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer buf;
    int denom;
    unsigned int x, y, w, h;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iIIII", &buf, &denom, &x, &y, &w, &h))
        return NULL;
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyBuffer_Release(&buf);
        PyErr_Format(PyExc_ValueError, "denom must be 1, 2, 4 or 8, got %d", denom);
        return NULL;
    }
    struct jpeg_decompress_struct cinfo;
    struct err_mgr err;
    PyObject *out = NULL;
    unsigned char *volatile pixels = NULL;
    int unsupported = 0, bad_region = 0;
    JDIMENSION xoff = x, width = w, out_w = 0, out_h = 0;
    memset(&cinfo, 0, sizeof(cinfo));
    err.message[0] = 0;
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_warning;
    err.truncated = 0;
    volatile int created = 0;

    Py_BEGIN_ALLOW_THREADS
    if (setjmp(err.jump)) {
        goto done;
    }
    jpeg_create_decompress(&cinfo);
    created = 1;
    jpeg_mem_src(&cinfo, (const unsigned char *)buf.buf, (unsigned long)buf.len);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE &&
        cinfo.jpeg_color_space != JCS_RGB) {
        unsupported = 1; /* CMYK / YCCK: Pillow's path converts those */
        goto done;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)denom;
    cinfo.dct_method = JDCT_ISLOW; /* what Pillow and a default decode use: same pixels at 1/1 */
    jpeg_start_decompress(&cinfo);
    out_w = cinfo.output_width;
    out_h = cinfo.output_height;
    if (w == 0 || h == 0 || x + w > out_w || y + h > out_h) {
        bad_region = 1;
        jpeg_abort_decompress(&cinfo);
        goto done;
    }
    if (x > 0 || w < out_w)
        jpeg_crop_scanline(&cinfo, &xoff, &width);
    if (y > 0 && jpeg_skip_scanlines(&cinfo, y) != y) {
        strcpy(err.message, "the stream ends before the region");
        goto done;
    }
    size_t stride = (size_t)cinfo.output_width * 3;
    pixels = (unsigned char *)malloc(stride * h);
    if (pixels == NULL) {
        strcpy(err.message, "out of memory");
        goto done;
    }
    for (unsigned int row = 0; row < h;) {
        JSAMPROW rowp = pixels + stride * row;
        JDIMENSION got = jpeg_read_scanlines(&cinfo, &rowp, 1);
        if (got == 0) {
            strcpy(err.message, "the stream ends inside the region");
            goto done;
        }
        row += got;
    }
    if (err.truncated) {
        strcpy(err.message, "image file is truncated");
        goto done;
    }
    width = cinfo.output_width;
    /* The rows below the region are not needed: stop here (no error for what was not read). */
    jpeg_abort_decompress(&cinfo);
done:
    if (created)
        jpeg_destroy_decompress(&cinfo);
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&buf);
    if (unsupported) {
        PyErr_SetString(UnsupportedJpeg, "colour space other than YCbCr, RGB or grayscale");
    } else if (bad_region) {
        PyErr_Format(PyExc_ValueError, "region x=%u y=%u w=%u h=%u is outside the %ux%u image at 1/%d",
                     x, y, w, h, out_w, out_h, denom);
    } else if (err.message[0] || pixels == NULL) {
        PyErr_Format(PyExc_ValueError, "JPEG: %s", err.message[0] ? err.message : "decode failed");
    } else {
        PyObject *bytes = PyBytes_FromStringAndSize((const char *)pixels, (Py_ssize_t)width * 3 * h);
        if (bytes != NULL)
            out = Py_BuildValue("(NIII)", bytes, (unsigned int)width, h, (unsigned int)xoff);
    }
    free(pixels);
    return out;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, denom, x, y, w, h) -> (rgb bytes, width, height, x_offset)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpeg(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    UnsupportedJpeg = PyErr_NewException("loader.wds._jpeg.UnsupportedJpeg", PyExc_ValueError, NULL);
    if (UnsupportedJpeg == NULL || PyModule_AddObject(m, "UnsupportedJpeg", UnsupportedJpeg) < 0)
        return NULL;
    PyModule_AddIntConstant(m, "LIB_VERSION", JPEG_LIB_VERSION);
    return m;
}
