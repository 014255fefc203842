/* rowops.h's SwiGLU as a library of its own, built by tests/kernels/test_rowops.py at each
 * instruction-set level: the header's code, compiled as the kernels that include it are. */
#include "../../deepinfer/kernels/rowops.h"

void probe_swiglu(const float *gate, const float *up, float *out, int64_t dim) { swiglu_row(gate, up, out, dim); }
