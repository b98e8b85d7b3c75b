"""What machine and software stack this process runs on: for benchmark reports and tuned-settings keys."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from functools import lru_cache
from importlib import metadata
from typing import Any

import mlx.core as mx

from mlx_redrafter.system.blas import blas_name, cpu_flags, status


def _cpu_model() -> str:
    """CPU model / Apple chip name, best effort."""
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5)
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "neon", "asimd", "sve")


def _cpu_features() -> str:
    """SIMD features that matter for CPU kernels (Linux /proc/cpuinfo flags), comma-separated."""
    have = cpu_flags()
    return ",".join(x for x in _FEATURES if x in have)


def physical_memory() -> int:
    """Physical memory in bytes (0 when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory() -> int:
    """Bytes the system can give a process now (Linux: MemAvailable), else its physical memory (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return physical_memory()


def _memory_gb() -> float:
    """Physical memory in GB (0 when unknown)."""
    return round(physical_memory() / 1e9, 1)


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def _backend() -> str:
    """'metal', 'cuda' or 'cpu': the backend of MLX's default device."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if getattr(mx, "metal", None) is not None and mx.metal.is_available():
        return "metal"
    return "cuda" if getattr(mx, "cuda", None) is not None and mx.cuda.is_available() else "gpu"


@lru_cache(maxsize=1)
def machine_info() -> dict[str, Any]:
    """Hardware, OS and library versions of this process (cached)."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpu_features": _cpu_features(),
        "cpu_cores": os.cpu_count() or 0,
        "memory_gb": _memory_gb(),
        "os": f"{platform.system()} {platform.release()}",
        "os_pretty": _os_pretty(),
        "arch": platform.machine(),
        "python": platform.python_version(),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "redrafter_mlx": _version("mlx-redrafter"),
        "backend": _backend(),
        "default_device": str(mx.default_device()),
        "blas": blas_name(),
        "blas_status": status().as_dict(),  # why the kernel is off where it was expected, if it is
    }
    if info["backend"] == "metal":
        try:
            dev = mx.metal.device_info()
            info["gpu"] = str(dev.get("device_name", ""))
            info["gpu_memory_gb"] = round(float(dev.get("memory_size", 0)) / 1e9, 1)
        except Exception:  # device_info is informational only
            pass
    return info


def _os_pretty() -> str:
    if sys.platform == "darwin":
        return f"macOS {platform.mac_ver()[0]}"
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.platform()


FINGERPRINT_FIELDS = ("cpu", "cpu_features", "cpu_cores", "memory_gb", "os", "arch", "backend", "blas", "gpu")


def fingerprint() -> str:
    """Short stable id of this machine's hardware + backend + BLAS (library versions excluded)."""
    info = machine_info()
    ident = {k: info.get(k) for k in FINGERPRINT_FIELDS}
    ident["os"] = platform.system()  # a kernel update is not a new machine
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
