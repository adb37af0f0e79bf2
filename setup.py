"""The C kernels compiled into the wheel (pyproject.toml holds everything else).

`pip wheel .` or `pip install .` compiles every kernel for each instruction set the wheel's
architecture has (src/specdecode/kernels/builds.py says which, with which flags) into
specdecode/kernels/prebuilt/, so an installed package runs them on a machine without a
compiler. An editable install (`make setup`) compiles nothing here: a source checkout builds
each kernel for its own CPU on first use. Without a C compiler the wheel is built without them,
with a warning, and the package builds them on first use where it finds one.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

KERNELS = Path(__file__).parent / "src" / "specdecode" / "kernels"


def _builds():
    """builds.py, loaded by its path: importing the package would need torch."""
    spec = importlib.util.spec_from_file_location("specdecode_kernel_builds", KERNELS / "builds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _openmp(compiler: str) -> bool:
    """Whether the compiler links OpenMP (gcc does; clang needs libomp)."""
    with tempfile.TemporaryDirectory() as scratch:
        probe = Path(scratch) / "probe.c"
        probe.write_text("int main(void) { return 0; }\n")
        command = [compiler, "-fopenmp", "-o", str(Path(scratch) / "probe"), str(probe)]
        return subprocess.run(command, capture_output=True).returncode == 0


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self._compile_kernels(Path(self.build_lib) / "specdecode" / "kernels" / "prebuilt")

    def _compile_kernels(self, folder: Path) -> None:
        compiler = os.environ.get("CC") or shutil.which("gcc")
        if compiler is None:
            self.warn("no C compiler (gcc, or CC): the wheel carries no kernels; they build on first use")
            return
        builds = _builds()
        openmp = _openmp(compiler)
        folder.mkdir(parents=True, exist_ok=True)
        for isa, isa_flags in builds.wheel_builds(platform.machine()).items():
            for name in builds.SOURCES:
                source = builds.CSRC / name
                output = folder / builds.prebuilt_name(source, isa)
                self.announce(f"compiling {name} for {isa} into {output}", level=2)
                flags = builds.compile_flags(isa_flags, openmp)
                subprocess.run(builds.compile_command(compiler, source, str(output), flags), check=True)


class KernelDistribution(Distribution):
    """A wheel for one platform: it carries compiled libraries."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=KernelDistribution)
