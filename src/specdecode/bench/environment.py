"""The machine and software a benchmark ran on: numbers mean little without them."""

from __future__ import annotations

import datetime
import os
import platform
from importlib import metadata
from pathlib import Path

import torch

from specdecode.cpu import cpu_flags, kernel_isa


def describe_environment(device: torch.device, dtype: torch.dtype, target_runner: str) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "cpu_features": cpu_features(),
        "cpu_count": os.cpu_count(),
        "kernel_isa": kernel_isa(),  # which build of this package's C kernels ran
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "target_runner": target_runner,  # this engine's forward path; transformers' generate uses its own
        # other processes competing for the CPU distort timings: a load above cpu_count says so
        "load_average_1m_before": load_average(),
        "versions": {name: _version(name) for name in ("specdecode", "torch", "transformers", "numpy")},
    }


def summary_line(environment: dict) -> str:
    versions = environment["versions"]
    features = environment.get("cpu_features")
    isa = environment.get("kernel_isa")
    hardware = environment["gpu"] or (
        f"{environment['cpu']} ({environment['cpu_count']} cores{', ' + features if features else ''})"
        f"{', C kernels built for ' + isa if isa else ''}"
    )
    precision = environment.get("engine_precision")
    load = [environment.get(f"load_average_1m_{when}") for when in ("before", "after")]
    return (
        f"{hardware}, {environment['torch_threads']} torch threads, {environment['device']} "
        f"{environment['dtype']}, engine runner {environment['target_runner']}"
        f"{' (' + precision + ')' if precision else ''}; "
        f"torch {versions['torch']}, transformers {versions['transformers']}; "
        f"load average (1 min) {_fmt_load(load[0])} before timing, {_fmt_load(load[1])} after"
    )


def machine_line() -> str:
    """The machine, torch's threads, the versions, the load and the date, in one line: what a
    script in benchmarks/ writes above its table."""
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    versions = {name: _version(name) for name in ("torch", "transformers")}
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    return (
        f"{cpu_name()} ({os.cpu_count()} CPUs){gpu}, {torch.get_num_threads()} torch threads; "
        f"torch {versions['torch']}, transformers {versions['transformers']}; "
        f"load average (1 min) {_fmt_load(load_average())}; {now} UTC"
    )


def load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _fmt_load(load: float | None) -> str:
    return "unknown" if load is None else f"{load:.1f}"


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_features() -> str:
    """The extensions that decide this engine's kernels (and so its speed), as a reader compares
    machines: the CPU's model name alone often leaves them out ("AMD EPYC")."""
    flags = cpu_flags()
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")
    return " ".join(flag for flag in wanted if flag in flags)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
