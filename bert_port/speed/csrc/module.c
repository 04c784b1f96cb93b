/* The Python module of one build variant of the kernels (setup.py builds it once per instruction
 * set: bert_port.speed._kernels_<variant>). Each function takes addresses and sizes that
 * speed/kernels.py reads off checked tensors, and calls the kernel with the GIL released.
 * Addresses are unsigned 64-bit integers (0 for NULL). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

int packed_attention(const void *qkv, int bf16, int64_t ld, const int64_t *starts, const int64_t *lens, int64_t nseq,
                     int64_t N, int64_t heads, int64_t hs, float scale, void *out, int64_t ldo, int threads);
void quantize_rows(const float *x, int64_t n, int64_t k, int64_t ld, const float *scale, const float *offset,
                   int has_floor, float floor, uint8_t *q, float *steps, int threads);
void dequantize_rows(float *acc, int64_t n, int64_t m, const float *steps, const float *bias, const float *extra,
                     int64_t ld, const float *extra_weight, int64_t f, const float *residual, int threads);
int amx_ready(void);
int amx_emulated(void);
int amx_linear(const uint16_t *x, int64_t N, int64_t K, int64_t ldx, const uint16_t *wp, int64_t M,
               const float *bias, int act, const uint16_t *res, int64_t ldr, uint16_t *out, int64_t ldo,
               int64_t cols, int threads);
int heap_trim(void);
int heap_map_above(size_t threshold);
int f32_linear_ready(void);
int f32_linear(const float *x, int64_t N, int64_t K, int64_t ldx, const float *wp, int64_t M, const float *bias,
               const float *res, int64_t ldr, float *out, int64_t ldo, int threads);

#define P(a) ((void *)(uintptr_t)(a))

static PyObject *py_packed_attention(PyObject *self, PyObject *args) {
  unsigned long long qkv, starts, lens, out;
  int bf16, threads, failed;
  long long ld, nseq, n, heads, hs, ldo;
  float scale;
  if (!PyArg_ParseTuple(args, "KiLKKLLLLfKLi", &qkv, &bf16, &ld, &starts, &lens, &nseq, &n, &heads, &hs, &scale,
                        &out, &ldo, &threads))
    return NULL;
  Py_BEGIN_ALLOW_THREADS failed = packed_attention(P(qkv), bf16, ld, P(starts), P(lens), nseq, n, heads, hs, scale,
                                                   P(out), ldo, threads);
  Py_END_ALLOW_THREADS return PyLong_FromLong(failed);
}

static PyObject *py_quantize_rows(PyObject *self, PyObject *args) {
  unsigned long long x, scale, offset, q, steps;
  long long n, k, ld;
  int has_floor, threads;
  float floor;
  if (!PyArg_ParseTuple(args, "KLLLKKifKKi", &x, &n, &k, &ld, &scale, &offset, &has_floor, &floor, &q, &steps,
                        &threads))
    return NULL;
  Py_BEGIN_ALLOW_THREADS quantize_rows(P(x), n, k, ld, P(scale), P(offset), has_floor, floor, P(q), P(steps), threads);
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_dequantize_rows(PyObject *self, PyObject *args) {
  unsigned long long acc, steps, bias, extra, extra_weight, residual;
  long long n, m, ld, f;
  int threads;
  if (!PyArg_ParseTuple(args, "KLLKKKLKLKi", &acc, &n, &m, &steps, &bias, &extra, &ld, &extra_weight, &f, &residual,
                        &threads))
    return NULL;
  Py_BEGIN_ALLOW_THREADS dequantize_rows(P(acc), n, m, P(steps), P(bias), P(extra), ld, P(extra_weight), f,
                                         P(residual), threads);
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_amx_ready(PyObject *self, PyObject *args) { return PyBool_FromLong(amx_ready()); }

static PyObject *py_amx_emulated(PyObject *self, PyObject *args) { return PyBool_FromLong(amx_emulated()); }

static PyObject *py_amx_linear(PyObject *self, PyObject *args) {
  unsigned long long x, wp, bias, res, out;
  long long n, k, ldx, m, ldr, ldo, cols;
  int act, threads, failed;
  if (!PyArg_ParseTuple(args, "KLLLKLKiKLKLLi", &x, &n, &k, &ldx, &wp, &m, &bias, &act, &res, &ldr, &out, &ldo, &cols,
                        &threads))
    return NULL;
  Py_BEGIN_ALLOW_THREADS failed =
      amx_linear(P(x), n, k, ldx, P(wp), m, P(bias), act, P(res), ldr, P(out), ldo, cols, threads);
  Py_END_ALLOW_THREADS return PyLong_FromLong(failed);
}

static PyObject *py_f32_linear_ready(PyObject *self, PyObject *args) { return PyBool_FromLong(f32_linear_ready()); }

static PyObject *py_f32_linear(PyObject *self, PyObject *args) {
  unsigned long long x, wp, bias, res, out;
  long long n, k, ldx, m, ldr, ldo;
  int threads, failed;
  if (!PyArg_ParseTuple(args, "KLLLKLKKLKLi", &x, &n, &k, &ldx, &wp, &m, &bias, &res, &ldr, &out, &ldo, &threads))
    return NULL;
  Py_BEGIN_ALLOW_THREADS failed = f32_linear(P(x), n, k, ldx, P(wp), m, P(bias), P(res), ldr, P(out), ldo, threads);
  Py_END_ALLOW_THREADS return PyLong_FromLong(failed);
}

static PyObject *py_heap_trim(PyObject *self, PyObject *args) { return PyLong_FromLong(heap_trim()); }

static PyObject *py_heap_map_above(PyObject *self, PyObject *args) {
  Py_ssize_t threshold;
  if (!PyArg_ParseTuple(args, "n", &threshold)) return NULL;
  return PyLong_FromLong(heap_map_above((size_t)threshold));
}

static PyMethodDef methods[] = {
    {"packed_attention", py_packed_attention, METH_VARARGS, "csrc/attention.c"},
    {"quantize_rows", py_quantize_rows, METH_VARARGS, "csrc/int8_rows.c"},
    {"dequantize_rows", py_dequantize_rows, METH_VARARGS, "csrc/int8_rows.c"},
    {"amx_ready", py_amx_ready, METH_NOARGS, "csrc/amx_linear.c: AMX tiles usable here"},
    {"amx_emulated", py_amx_emulated, METH_NOARGS, "csrc/amx_linear.c: its tiles emulated in C (no AMX build)"},
    {"amx_linear", py_amx_linear, METH_VARARGS, "csrc/amx_linear.c"},
    {"f32_linear_ready", py_f32_linear_ready, METH_NOARGS, "csrc/f32_linear.c: built with AVX2 and FMA"},
    {"f32_linear", py_f32_linear, METH_VARARGS, "csrc/f32_linear.c"},
    {"heap_trim", py_heap_trim, METH_NOARGS, "csrc/heap.c: glibc malloc_trim(0)"},
    {"heap_map_above", py_heap_map_above, METH_VARARGS, "csrc/heap.c: glibc mallopt(M_MMAP_THRESHOLD, n)"},
    {NULL, NULL, 0, NULL},
};

#define STR_(x) #x
#define STR(x) STR_(x)
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels_" STR(VARIANT), NULL, -1, methods};

PyMODINIT_FUNC CAT(PyInit__kernels_, VARIANT)(void) {
  PyObject *m = PyModule_Create(&module);
  if (m && PyModule_AddStringConstant(m, "variant", STR(VARIANT)) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
