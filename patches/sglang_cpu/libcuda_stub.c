/* A stand-in for the NVIDIA driver library on a host without a GPU, for SGLang's CPU engine.
   sgl_kernel's CUDA extension (sgl_kernel/sm100/common_ops.abi3.so) lists libcuda.so.1 as
   NEEDED and imports one driver symbol, cuPointerGetAttribute; SGLang's CPU engine imports that
   extension unconditionally (kernels/ops/kvcache/cache_move.py:9-10). This library carries only
   that symbol, and it always answers that there is no device. Built by launch/setup_sglang.sh. */
#define CUDA_ERROR_NO_DEVICE 100

int cuPointerGetAttribute(void *data, int attribute, unsigned long long pointer) {
  (void)data;
  (void)attribute;
  (void)pointer;
  return CUDA_ERROR_NO_DEVICE;
}
