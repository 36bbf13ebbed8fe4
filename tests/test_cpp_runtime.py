"""The built extension loads the shared C++ runtime torch loads (megatron_lite/cpp_runtime.py says why:
on a GPU image whose compiler linked libstdc++ statically, C++ checks crashed the process instead of raising)."""
import shutil
import subprocess

import pytest

from megatron_lite.cpp_runtime import MARKER, check_shared_cpp_runtime, needed_libraries

needs_tools = pytest.mark.skipif(shutil.which("g++") is None or needed_libraries(shutil.which("g++")) is None,
                                 reason="needs g++ and readelf on Linux")

SOURCE = "#include <sstream>\n#include <string>\nstd::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n"


def _module(tmp_path, name, *flags):
    (tmp_path / "m.cpp").write_text(SOURCE)
    path = tmp_path / name
    subprocess.run(["g++", "-shared", "-fPIC", *flags, str(tmp_path / "m.cpp"), "-o", str(path)], check=True)
    return str(path)


@needs_tools
def test_a_module_with_a_static_cpp_runtime_is_refused_naming_the_compiler_and_what_works(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/opt/gcc/bin/g++")
    with pytest.raises(RuntimeError) as e:
        check_shared_cpp_runtime(_module(tmp_path, "static.so", "-static-libstdc++"))
    assert MARKER in str(e.value) and "/opt/gcc/bin/g++" in str(e.value) and "CXX=/usr/bin/g++" in str(e.value)


@needs_tools
def test_a_module_linking_libstdcxx_so_passes(tmp_path):
    check_shared_cpp_runtime(_module(tmp_path, "shared.so"))


@needs_tools
def test_the_installed_extension_loads_the_shared_cpp_runtime():
    import megatron_lite._C as extension  # torch, which loads libc10 for it, is imported by conftest.py

    assert any(name.startswith("libstdc++") for name in needed_libraries(extension.__file__))
    check_shared_cpp_runtime(extension.__file__)
