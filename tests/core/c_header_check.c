/* The public header compiled as C (C99): the layout C callers see, and enum fields set the way a C
 * caller sets them (any int), for c_api_test.cpp's CHeader suite to compare with the C++ view. */
#include <stddef.h>

#include "flashport/flashport.h"

size_t fp_c_sizeof_params(void) { return sizeof(fp_attn_params); }
size_t fp_c_sizeof_bwd_params(void) { return sizeof(fp_attn_bwd_params); }
size_t fp_c_sizeof_tensor(void) { return sizeof(fp_tensor); }
size_t fp_c_sizeof_enum(void) { return sizeof(fp_dtype); }
size_t fp_c_offsetof_backend(void) { return offsetof(fp_attn_params, backend); }
size_t fp_c_offsetof_causal_align(void) { return offsetof(fp_attn_params, causal_align); }

/* Stores an arbitrary int in the enum fields, as a C caller (or an FFI writing the struct) may. */
void fp_c_set_raw_enums(fp_attn_params* p, int dtype, int causal_align, int backend) {
  p->q.dtype = (fp_dtype)dtype;
  p->causal_align = (fp_causal_align)causal_align;
  p->backend = (fp_backend)backend;
}
