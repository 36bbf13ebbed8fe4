// The Python module megatron_lite._C. Kernels and helpers live in their own
// files and register ops under the `megatron_lite` namespace with
// TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL; importing this module loads the
// shared library, which runs those registrations (torch.ops.megatron_lite.*).
//
// Python's own C API, not pybind11 or torch/extension.h: the module only has to exist (and say whether CUDA
// was built), and torch/extension.h made this 15-line file the slowest of the build (~35 s of a ~2-minute
// install on 2 cores).
#include <Python.h>

#define MEGATRON_LITE_CONCAT(a, b) a##b
#define MEGATRON_LITE_INIT(name) MEGATRON_LITE_CONCAT(PyInit_, name)

static struct PyModuleDef megatron_lite_module = {
    PyModuleDef_HEAD_INIT, "megatron_lite._C",
    "megatron_lite compiled ops; call them through torch.ops.megatron_lite", -1, nullptr};

PyMODINIT_FUNC MEGATRON_LITE_INIT(TORCH_EXTENSION_NAME)(void) {
  PyObject* module = PyModule_Create(&megatron_lite_module);
  if (module == nullptr) {
    return nullptr;
  }
#ifdef MEGATRON_LITE_WITH_CUDA
  PyObject* with_cuda = Py_True;
#else
  PyObject* with_cuda = Py_False;
#endif
  Py_INCREF(with_cuda);
  if (PyModule_AddObject(module, "with_cuda", with_cuda) < 0) {
    Py_DECREF(with_cuda);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
