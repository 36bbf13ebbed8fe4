"""Build and install megatron_lite.

The compiled extension `megatron_lite._C` holds every C++ source under csrc/
(CPU kernels and dataset helpers), and the CUDA sources too when torch was
built with CUDA and nvcc is found. Sources register their ops with
TORCH_LIBRARY_FRAGMENT(megatron_lite, ...), so adding a kernel means adding a
file, not editing a list. Install with `pip install --no-build-isolation -e .`
so the build uses the torch already installed instead of fetching another
(pyproject.toml deliberately does not list torch as a build requirement).
"""
import glob
import importlib.util
import os

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError as e:  # pragma: no cover - only reached when torch is missing
    raise SystemExit(
        "megatron_lite builds its C++ kernels against torch: install torch first "
        "(pip install torch==2.13.0 on a CPU machine), then pip install --no-build-isolation -e ."
    ) from e

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpp_runtime():
    """megatron_lite/cpp_runtime.py by its path (stdlib only; the package is not installed yet)."""
    spec = importlib.util.spec_from_file_location("_cpp_runtime", os.path.join(HERE, "megatron_lite", "cpp_runtime.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildChecked(BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension, then: the built module must load the shared C++ runtime torch loads
    (megatron_lite/cpp_runtime.py says what happened on a GPU image where it did not). A module that
    fails the check is removed, so that nothing imports it."""

    def build_extensions(self):
        super().build_extensions()
        check = _cpp_runtime().check_shared_cpp_runtime
        for ext in self.extensions:
            path = self.get_ext_fullpath(ext.name)
            try:
                check(path)
            except RuntimeError as e:
                os.remove(path)
                raise SystemExit(f"setup.py: error: {e}") from None


def extension():
    cpp = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    cu = sorted(glob.glob("csrc/**/*.cu", recursive=True))
    # No -std here: torch's BuildExtension passes the standard torch's headers need (C++20 since torch 2.10);
    # forcing -std=c++17, as this file did, compiles its headers in another dialect than libtorch was built in.
    cxx = ["-O3", "-fopenmp"]
    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None and os.environ.get("MEGATRON_LITE_NO_CUDA") != "1"
    include_dirs = [os.path.join(HERE, "csrc")]
    if with_cuda and cu:
        return CUDAExtension(
            "megatron_lite._C", cpp + cu, include_dirs=include_dirs,
            define_macros=[("MEGATRON_LITE_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--use_fast_math"]},
            extra_link_args=["-fopenmp"],
        )
    return CppExtension("megatron_lite._C", cpp, include_dirs=include_dirs,
                        extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])


# Name, version, packages, dependencies and extras are in pyproject.toml; only the extension is built here.
setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildChecked},
    zip_safe=False,
)
