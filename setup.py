"""Build of the kvevict Python package (pyproject.toml holds the metadata).

The compiled module ``kvevict._C`` is the project's own CMake target ``kvevict_python``
(python/CMakeLists.txt): build_ext configures this checkout with the tests, examples and benchmarks
off, builds that one target for the interpreter that runs pip, and copies it into the package.
Environment: ``JOBS`` (parallel compile jobs, default: all cores), ``KVEVICT_ENABLE_CUDA=ON`` (the
CUDA backend too; needs nvcc), ``KVEVICT_CMAKE_ARGS`` (extra CMake arguments, split on spaces), ``KVEVICT_NATIVE=0`` (portable
code instead of -march=native, e.g. for a wheel that runs on other CPUs), ``KVEVICT_BLAS`` (``auto``,
the default: the scorers' products on BLIS when libblis-dev is installed; ``BLIS``; empty: Eigen).
ccache is used when it is on PATH. docs/python.md, "Install".
"""
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def version() -> str:
    """MAJOR.MINOR.PATCH from include/kvevict/version.hpp, the library's one version."""
    with open(os.path.join(ROOT, "include", "kvevict", "version.hpp")) as f:
        text = f.read()
    parts = [re.search(rf"#define KVEVICT_VERSION_{k} (\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise RuntimeError("setup.py: include/kvevict/version.hpp lacks KVEVICT_VERSION_MAJOR/MINOR/PATCH")
    return ".".join(p.group(1) for p in parts)


class CMakeBuild(build_ext):
    """Builds kvevict._C with CMake (the target kvevict_python) instead of compiling sources itself."""

    def build_extension(self, ext: Extension) -> None:
        try:
            import pybind11
            pybind11_dir = ["-Dpybind11_DIR=" + pybind11.get_cmake_dir()]
        except ImportError:  # Debian's pybind11-dev config is found by CMake itself
            pybind11_dir = []
        build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        args = ["-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release", "-DKVEVICT_BUILD_PYTHON=ON",
                "-DKVEVICT_BUILD_TESTS=OFF", "-DKVEVICT_BUILD_EXAMPLES=OFF", "-DKVEVICT_BUILD_BENCH=OFF",
                "-DKVEVICT_ENABLE_CUDA=" + os.environ.get("KVEVICT_ENABLE_CUDA", "OFF"),
                "-DKVEVICT_BLAS=" + os.environ.get("KVEVICT_BLAS", "auto"),
                "-DKVEVICT_NATIVE=" + ("OFF" if os.environ.get("KVEVICT_NATIVE", "1") in ("0", "OFF", "off") else "ON"),
                "-DKVEVICT_PYTHON=" + sys.executable] + pybind11_dir
        if shutil.which("ccache"):
            args.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
        args += os.environ.get("KVEVICT_CMAKE_ARGS", "").split()
        subprocess.run(["cmake"] + args, check=True)
        if not os.path.isdir(os.path.join(build_dir, "python", "CMakeFiles", "kvevict_python.dir")):
            raise RuntimeError("setup.py: CMake did not configure the binding (kvevict_python): pybind11, the Python headers, "
                               "libdlpack-dev or Eigen 3.4 is missing (the CMake output above says which; scripts/setup.sh "
                               "python installs them)")
        jobs = os.environ.get("JOBS") or str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", build_dir, "--target", "kvevict_python", "-j", jobs], check=True)
        built = glob.glob(os.path.join(build_dir, "python", "kvevict", "_C*.so"))
        if len(built) != 1:
            raise RuntimeError(f"setup.py: expected one kvevict/_C*.so in {build_dir}/python, found {built}")
        dest = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(built[0], dest)


setup(
    version=version(),
    ext_modules=[Extension("kvevict._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    options={"build": {"build_base": "build-pip"}},  # not build/, the CMake build tree of scripts/test.sh
)
