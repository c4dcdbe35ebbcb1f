"""Builds dsec's C++ extension (and the agent binaries it ships) with the project's CMake build.

pyproject.toml holds the metadata; this file only teaches setuptools' build_ext to run CMake:
the `_dsec` target builds the extension and copies dsecd, dsec-init and the dsec CLI into
<build>/python/dsec/bin, and both land in the wheel.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            "-DCMAKE_BUILD_TYPE=" + os.environ.get("DSEC_BUILD_TYPE", "Release"),
            "-DDSEC_BUILD_PYTHON=ON",
            "-DDSEC_BUILD_TESTS=OFF",
            "-DDSEC_BUILD_BENCHMARKS=OFF",
            "-DPython_EXECUTABLE=" + sys.executable,
        ]
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja"]
        try:
            import pybind11

            configure.append("-Dpybind11_DIR=" + pybind11.get_cmake_dir())
        except ImportError:
            pass  # CMake finds Debian's pybind11-dev on its own
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "_dsec", "-j", jobs], check=True)

        built = build_dir / "python" / "dsec"
        so = next(built.glob("_dsec*.so"), None)
        if so is None:
            raise RuntimeError(f"the CMake build made no _dsec extension in {built}")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, target)
        bin_dir = target.parent / "bin"
        bin_dir.mkdir(exist_ok=True)
        for tool in ("dsecd", "dsec-init", "dsec"):
            shutil.copy2(built / "bin" / tool, bin_dir / tool)


setup(ext_modules=[CMakeExtension("dsec._dsec")], cmdclass={"build_ext": CMakeBuild})
