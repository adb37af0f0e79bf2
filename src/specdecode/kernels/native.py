"""The C kernels' build and load (csrc/*.c): carried compiled by a wheel, or compiled on first
use; loaded with ctypes.

A package installed from a wheel carries each kernel built for each instruction set
(builds.py, setup.py), and loads the one for this CPU. Elsewhere (a source checkout, or a wheel
built without a compiler) a shared library is compiled with gcc for this CPU (-march=native)
into a per-user cache directory, named by a hash of the source (and the csrc files it
includes), the compiler, its flags and the CPU's flags, so that a binary built for one CPU never
runs on another sharing the disk. The int8 kernels are built for one instruction set of
cpu.KERNEL_ISAS (builds.ISA_FLAGS: its flags, part of that hash), each into a library of its
own; cpu.kernel_isa chooses one at run time. Beside each library lies its SHA-256
(`<name>.so.sha256`): ctypes would load any file at that name, and one cut short by a crash or a
full disk kills the process with SIGBUS rather than raising, so a cached library is loaded only
where its bytes match the digest, and is compiled again into place where they do not. The
kernels' modules (tree_attention.py, int8_kernel.py, int8_layer.py) turn a failure into one
warning and their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from specdecode.cpu import cpu_flags, runnable_kernel_isas
from specdecode.kernels import builds

log = logging.getLogger(__name__)

CSRC = builds.CSRC
sources = builds.sources
source_hash = builds.source_hash


@functools.cache
def build_key(source: Path, isa: str = "native") -> str:
    """The sources as this process first read them, with what compiles them (the instruction
    set's flags included) and the CPU they run on."""
    compiler = shutil.which("gcc")
    parts = [builds.source_bytes(source).hex(), " ".join(flags(isa)), " ".join(sorted(cpu_flags())), str(compiler)]
    if compiler is not None:
        parts.append(_compiler_version(compiler))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def flags(isa: str = "native") -> tuple[str, ...]:
    """The compiler's flags for a build on first use (what the key names)."""
    return builds.compile_flags(builds.ISA_FLAGS[isa], _torch_runs_libgomp())


def _torch_runs_libgomp() -> bool:
    """Whether torch parallelises with GNU OpenMP and has loaded its libgomp (another runtime,
    such as Intel's, would start a second pool of threads beside torch's)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def open_library(path: Path, abi_version: int) -> ctypes.CDLL:
    """Loads a built library; OSError if it is another ABI or brought a second OpenMP runtime."""
    library = ctypes.CDLL(str(path))
    try:
        version = library.sd_abi_version()
    except AttributeError as error:  # another library at that path: the callers' fallback is for OSError
        raise OSError(f"{path} is not a specdecode kernel (no sd_abi_version)") from error
    if version != abi_version:
        raise OSError(f"{path} is not ABI version {abi_version}")
    if len(_libgomp_files()) > 1:
        raise OSError(f"loading {path} brought a second OpenMP runtime beside torch's")
    return library


def _libgomp_files() -> set[str]:
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps if "libgomp" in line}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdecode"


def library_path(source: Path, key: str) -> Path:
    return cache_dir() / f"{source.stem}-{key}.so"


def digest_path(library: Path) -> Path:
    """Where a library's SHA-256 is recorded, as `sha256sum` writes it (so `sha256sum -c` checks it)."""
    return library.with_name(library.name + ".sha256")


def build(source: Path, key: str, isa: str = "native") -> Path:
    """The shared library of a source for this key (build_key's for that instruction set): the
    one an installed wheel carries, else the cached one where its bytes match their recorded
    digest, else compiled (again) into place."""
    carried = prebuilt(source, isa)
    if carried is not None:
        return carried
    target = library_path(source, key)
    if _verified(target):
        return target
    return _compile(source, target, isa)


def prebuilt(source: Path, isa: str = "native") -> Path | None:
    """The library a wheel carries for this source and instruction set ("native": the fastest
    this CPU runs), where the package was installed from a wheel (setup.py compiles them), and
    where torch runs GNU OpenMP, which they were compiled for; None elsewhere, as in a source
    checkout. pip checks an installed file's digest against the wheel's record."""
    chosen = runnable_kernel_isas()[0] if isa == "native" else isa
    library = builds.PREBUILT / builds.prebuilt_name(source, chosen)
    return library if library.is_file() and _torch_runs_libgomp() else None


def _verified(library: Path) -> bool:
    """Whether the library's bytes are those its digest names. The file is read, never mapped,
    so a truncated one cannot fault here. Quiet when it does not match: it is compiled again,
    and only a failed build is the callers' one warning."""
    try:
        recorded = digest_path(library).read_text().split()[:1]
        actual = _sha256(library)
    except FileNotFoundError:
        return False
    except OSError as error:
        log.info("compiling %s again: it cannot be verified (%s)", library, error)
        return False
    if recorded != [actual]:
        log.info("compiling %s again: its bytes do not match their recorded digest", library)
        return False
    return True


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _compile(source: Path, target: Path, isa: str) -> Path:
    compiler = shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no gcc on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside its final name and renamed: another process never loads a half-written file
    fd, partial = tempfile.mkstemp(prefix=target.stem + ".", suffix=".so.partial", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            builds.compile_command(compiler, source, partial, flags(isa)),
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(f"gcc failed: {result.stderr.strip()[:500]}")
        _install(Path(partial), target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


def _install(partial: Path, target: Path) -> None:
    """Renames a compiled library into place with its digest, each durable before its rename.
    The digest goes first: whatever a crash leaves, the library at the target is either the one
    its digest names, complete on disk, or one that does not verify and is compiled again."""
    _fsync(partial)
    _write_durably(digest_path(target), f"{_sha256(partial)}  {target.name}\n")
    os.replace(partial, target)
    _fsync_directory(target.parent)


def _write_durably(path: Path, text: str) -> None:
    fd, temporary = tempfile.mkstemp(prefix=path.name + ".", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    """Makes the renames durable. Some filesystems refuse fsync on a directory: the files are
    already durable there, and a lost rename only means compiling again."""
    try:
        _fsync(directory)
    except OSError as error:
        log.debug("fsync of %s refused (%s)", directory, error)
