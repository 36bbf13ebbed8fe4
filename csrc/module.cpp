// The Python module megatron_lite._C. Kernels and helpers live in their own
// files and register ops under the `megatron_lite` namespace with
// TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL; importing this module loads the
// shared library, which runs those registrations (torch.ops.megatron_lite.*).
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_lite compiled ops; call them through torch.ops.megatron_lite";
  m.attr("with_cuda") =
#ifdef MEGATRON_LITE_WITH_CUDA
      true;
#else
      false;
#endif
}
