"""A wheel carries its C kernels compiled (setup.py, builds.py): installed from it, the package
runs every kernel on a machine without gcc, and each build gives the bits of the build this
source checkout compiles on first use.

The wheel is built from a copy of the sources (`pip wheel`, no build isolation: the packages are
here) and unpacked, as pip would install it; each child process imports the package from there
with no gcc on its PATH and an empty kernel cache, runs every kind of forward of a w8a8 model
(the products, the C decoder layers, the tree attention kernel) on one forced instruction set,
and saves the results for this process to compare bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import head64_llama, same_bits
from helpers.bits import every_kind_of_forward, forced_kernel_isa, kernel_isas
from specdecode import cpu
from specdecode.kernels import int8_layer, tree_attention
from specdecode.runners.fast_llama import FastLlamaRunner, Int8Recipe

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
EVERY_PRODUCT = Int8Recipe(keep_float=(), smoothing=0.0)

CHILD = """
import shutil, sys
from pathlib import Path
import torch
import specdecode
from helpers import head64_llama
from helpers.bits import every_kind_of_forward
from specdecode.kernels import int8_kernel, int8_layer, tree_attention
from specdecode.runners.fast_llama import FastLlamaRunner, Int8Recipe

assert shutil.which("gcc") is None and shutil.which("cc") is None
assert int8_kernel.load() is not None and int8_layer.load() is not None and tree_attention.load() is not None
runner = FastLlamaRunner(head64_llama(0, torch.bfloat16), "w8a8", Int8Recipe(keep_float=(), smoothing=0.0))
assert runner.layer_kernel is not None and runner.verifies_trees
torch.save(every_kind_of_forward(runner, 2), sys.argv[1])
maps = Path("/proc/self/maps").read_text().splitlines()
print(specdecode.__file__)
kernels = {line.split()[-1] for line in maps if line.endswith(".so")}  # the kernels' files, wherever they came from
print("\\n".join(sorted(k for k in kernels if Path(k).name.startswith(("w8a8-", "int8_layer-", "tree_attention-")))))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel's files, unpacked as pip installs them."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc: the wheel would carry no kernels")
    work = tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, work / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "prebuilt")
    shutil.copytree(ROOT / "src" / "specdecode", work / "src" / "specdecode", ignore=ignore)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", "out", "."]
    result = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = (work / "out").glob("specdecode-*.whl")
    assert not wheel.name.endswith("-none-any.whl")  # a platform wheel: it carries libraries
    zipfile.ZipFile(wheel).extractall(work / "site")
    return work / "site"


def run_from_wheel(site: Path, isa: str, tmp_path: Path) -> tuple[list[torch.Tensor], list[str]]:
    """Every kind of forward, from the installed wheel with no compiler, and the kernel files it mapped."""
    no_compiler = tmp_path / "bin"
    no_compiler.mkdir()
    (no_compiler / "python").symlink_to(sys.executable)
    env = dict(
        os.environ,
        PATH=str(no_compiler),
        PYTHONPATH=os.pathsep.join([str(site), str(TESTS)]),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        **{cpu.KERNEL_ISA_VARIABLE: isa},
    )
    out = tmp_path / "forward.pt"
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning" not in result.stderr.lower(), result.stderr
    module, *libraries = result.stdout.split()
    assert module.startswith(str(site))  # the wheel's package, not this checkout's
    assert not (tmp_path / "cache" / "specdecode").exists()  # nothing compiled, nothing cached
    return torch.load(out), libraries


@pytest.mark.parametrize("isa", kernel_isas())
def test_an_installed_wheel_runs_its_kernels_without_gcc(installed, isa, tmp_path):
    from_wheel, libraries = run_from_wheel(installed, isa, tmp_path)
    prebuilt = installed / "specdecode" / "kernels" / "prebuilt"
    assert all(Path(library).parent == prebuilt for library in libraries)
    builds = sorted(Path(library).name.rsplit("-", 1)[0] for library in libraries)  # less the sources' hash
    assert builds == [f"int8_layer-{isa}", f"tree_attention-{kernel_isas()[0]}", f"w8a8-{isa}"]
    with forced_kernel_isa(isa):
        assert int8_layer.load() is not None and tree_attention.load() is not None
        runner = FastLlamaRunner(head64_llama(0, torch.bfloat16), "w8a8", EVERY_PRODUCT)
        here = every_kind_of_forward(runner, 2)
    assert len(here) == len(from_wheel)
    assert all(same_bits(a, b) for a, b in zip(here, from_wheel, strict=True))
