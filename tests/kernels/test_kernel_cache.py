"""A bad file in the compiled kernels' cache never kills the process (native.py).

ctypes loads whatever sits at a kernel's cache path: a library cut short by a crash or a full
disk maps pages past its end and dies of SIGBUS on first touch, another library lacks the
kernel's symbols. So each case runs in a subprocess of its own (a signal there would kill
pytest here), with XDG_CACHE_HOME at a temporary cache holding the bad file at the kernel's
exact path: the kernel must load and give a fresh build's bits, the bad file replaced by a
build that its digest names, with at most one warning; without a compiler to rebuild it, the
process goes on with the torch path and one warning.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdecode.kernels import native

# Loads the tree attention kernel and prints a digest of its output on fixed inputs (checked
# against SDPA here too), or "unavailable" where load() fell back to torch.
CHILD = """
import hashlib, logging, os, sys
import torch
import torch.nn.functional as F
from specdecode.kernels import tree_attention

logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
if sys.argv[1] == "no-gcc":
    tree_attention._build_key()  # the key, and so the cache path, as with the compiler
    os.environ["PATH"] = "/nonexistent"
kernel = tree_attention.load()
if kernel is None:
    print("unavailable")
    sys.exit(0)
generator = torch.Generator().manual_seed(0)
q, keys, values = (torch.randn(shape, generator=generator) for shape in [(4, 3, 64), (2, 8, 64), (2, 8, 64)])
seen = [6, 7, 8]
out = torch.empty_like(q)
kernel(q, keys, values, torch.tensor(seen, dtype=torch.int32), torch.full((3, 0), -1, dtype=torch.int32), 0.125, out)
k, v = keys.repeat_interleave(2, 0), values.repeat_interleave(2, 0)
rows = [F.scaled_dot_product_attention(q[:, i : i + 1], k[:, :s], v[:, :s]) for i, s in enumerate(seen)]
torch.testing.assert_close(out, torch.cat(rows, dim=1))
print(hashlib.sha256(out.numpy().tobytes()).hexdigest())
"""


def run_child(cache: Path, mode: str = "load") -> subprocess.CompletedProcess:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    return subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=300)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def libm_file() -> Path:
    """The C math library's file, as a real library with none of the kernel's symbols."""
    ctypes.CDLL(ctypes.util.find_library("m"))
    maps = Path("/proc/self/maps").read_text().splitlines()
    return Path(next(line.split()[-1] for line in maps if "/libm" in line))


@pytest.fixture(scope="session")
def fresh_build(tmp_path_factory):
    """One build into a cache of its own: the library's bytes, its path under the cache and
    the output digest a good kernel prints. The cases copy from it rather than compile."""
    cache = tmp_path_factory.mktemp("fresh-cache")
    result = run_child(cache)
    if result.stdout.strip() == "unavailable":
        pytest.skip("no C compiler: the tree attention kernel is not built")
    assert result.returncode == 0, result.stderr
    (library,) = (cache / "specdecode").glob("tree_attention-*.so")
    return library.read_bytes(), library.relative_to(cache), result.stdout.strip()


def truncated(good: bytes) -> bytes:
    return good[:4096]


def halved(good: bytes) -> bytes:
    return good[: len(good) // 2]


def other_library(good: bytes) -> bytes:
    return libm_file().read_bytes()


def junk(good: bytes) -> bytes:
    return os.urandom(len(good))


def empty(good: bytes) -> bytes:
    return b""


# (corruption, whether the good build's digest stays beside it, as when a crash cut the
# library short after its digest was written; without one, as a cache from before digests)
CASES = [(truncated, True), (truncated, False), (halved, True), (other_library, False), (junk, True), (empty, False)]


def corrupted_cache(tmp_path: Path, fresh_build, corruption, keep_digest: bool) -> Path:
    good, relative, _ = fresh_build
    cache = tmp_path / "cache"
    library = cache / relative
    library.parent.mkdir(parents=True)
    library.write_bytes(corruption(good))
    if keep_digest:
        digest = hashlib.sha256(good).hexdigest()
        library.with_name(library.name + ".sha256").write_text(f"{digest}  {library.name}\n")
    return library


@pytest.mark.parametrize(
    "corruption, keep_digest", CASES, ids=[f"{c.__name__}-{'digest' if d else 'no-digest'}" for c, d in CASES]
)
def test_a_bad_cached_kernel_is_rebuilt_and_loads(tmp_path, fresh_build, corruption, keep_digest):
    library = corrupted_cache(tmp_path, fresh_build, corruption, keep_digest)
    result = run_child(tmp_path / "cache")
    assert result.returncode == 0, f"the process died ({result.returncode}): {result.stderr[-2000:]}"
    assert result.stdout.strip() == fresh_build[2]  # a fresh build's bits
    assert len(result.stderr.strip().splitlines()) <= 1, result.stderr
    recorded = library.with_name(library.name + ".sha256").read_text().split()[0]
    assert recorded == sha256(library)  # replaced by a build its digest names


def test_a_bad_cached_kernel_without_a_compiler_falls_back_with_one_warning(tmp_path, fresh_build):
    library = corrupted_cache(tmp_path, fresh_build, truncated, keep_digest=True)
    result = run_child(tmp_path / "cache", mode="no-gcc")
    assert result.returncode == 0, f"the process died ({result.returncode}): {result.stderr[-2000:]}"
    assert result.stdout.strip() == "unavailable"
    warnings = result.stderr.strip().splitlines()
    assert len(warnings) == 1 and "tree attention kernel unavailable" in warnings[0], result.stderr
    assert library.read_bytes() == truncated(fresh_build[0])  # left for a run with a compiler to replace


def test_a_build_records_the_digest_of_its_library(fresh_build, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    source = native.CSRC / "tree_attention.c"
    library = native.build(source, "test-key")
    assert library == native.library_path(source, "test-key")
    assert native.digest_path(library).read_text().split() == [sha256(library), library.name]
    inode = library.stat().st_ino
    assert native.build(source, "test-key") == library and library.stat().st_ino == inode  # verified, not rebuilt
    assert not list(library.parent.glob("*.partial"))


def test_another_library_is_an_os_error_not_an_attribute_error():
    with pytest.raises(OSError, match="sd_abi_version"):
        native.open_library(libm_file(), 1)


def test_each_instruction_set_has_a_key_of_its_own_and_the_key_reads_the_included_files(tmp_path):
    """The int8 kernels are built once per instruction set (builds.ISA_FLAGS, part of the key),
    and from the files their source includes: an edit of an included header builds again."""
    source = native.CSRC / "w8a8.c"
    assert native.sources(source) == (source, native.CSRC / "w8a8_scalar.h", native.CSRC / "w8a8_amx.h")
    assert native.CSRC / "tree_attention.c" in native.sources(native.CSRC / "int8_layer.c")
    keys = {isa: native.build_key(source, isa) for isa in ("native", "avx512-vnni", "avx2", "portable")}
    assert len(set(keys.values())) == 4
    assert native.build_key(source, "amx") == keys["native"]  # the same flags (the file names differ)
    copies = []
    for name in ("as-is", "edited"):
        folder = tmp_path / name
        folder.mkdir()
        for path in native.sources(source):
            (folder / path.name).write_bytes(path.read_bytes())
        copies.append(folder / source.name)
    header = copies[1].with_name("w8a8_scalar.h")
    header.write_text(header.read_text() + "/* edited */\n")
    assert native.build_key(copies[0], "avx2") == keys["avx2"]
    assert native.build_key(copies[1], "avx2") != keys["avx2"]
