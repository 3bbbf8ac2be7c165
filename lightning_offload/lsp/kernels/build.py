"""Building a C kernel of the package for this machine: once, into the cache, keyed by everything that shapes it.

The projection kernels (``lsp/kernels/native/projection.c``) and the row Adam's (``engine/rows/native/row_adam.c``) are
compiled with the machine's C compiler for its own CPU (``-march=native``) and loaded with ctypes. A library is built
once per source, compiler, flags, CPU and Python, and found again by its key; the build is atomic (a temporary file
renamed into place) so that processes starting together each find it whole.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from lightning_offload.cache import cache_root

Kernel = TypeVar("Kernel")

#: For this CPU's instructions; on x86, vectors as wide as it has (gcc's tuning for some AVX-512 CPUs prefers 256 bits:
#: 512 made the row Adam's step faster, the same bits; docs/benchmarks/2026-12-04.md, sitting E).
NATIVE_FLAGS = ["-march=native"] + (["-mprefer-vector-width=512"] if platform.machine().lower() in (
    "x86_64", "amd64") else [])


def compiler() -> str:
    """The C compiler to build with: ``$CC``, else ``cc``, ``gcc`` or ``clang``, the first found.

    Raises:
        RuntimeError: when none is found.
    """
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C compiler found (CC, cc, gcc or clang)")


def cpu_features() -> str:
    """What names this CPU's instruction set (its flags where Linux lists them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_library(source: Path, name: str, flags: Sequence[str]) -> Path:
    """The shared library built from ``source`` with ``flags`` for this CPU (found in the cache, or built there).

    Args:
        source: the C file.
        name: the library's name stem in the cache (``native/<name>-<key>.so``).
        flags: the compiler flags besides :data:`NATIVE_FLAGS` (a compiler that refuses those builds without them).

    Returns:
        The library's path.

    Raises:
        RuntimeError: when the compiler fails with and without :data:`NATIVE_FLAGS` (its last error line says why).
        OSError, subprocess.SubprocessError: when the compiler cannot be run.
    """
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    # -march=native: the library is for this CPU only, so its features are in the key (a shared home directory
    # seen from another machine builds its own).
    parts = [source.read_bytes(), version, " ".join([*NATIVE_FLAGS, *flags]), cpu_features(), platform.machine(),
             sys.version]
    key = hashlib.sha256(b"\0".join(p if isinstance(p, bytes) else p.encode() for p in parts)).hexdigest()[:16]
    path = cache_root() / "native" / f"{name}-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        errors = ""
        for attempt in ([*NATIVE_FLAGS, *flags], list(flags)):  # a compiler without -march=native still builds it
            done = subprocess.run([cc, *attempt, str(source), "-o", str(built), "-lm"], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode == 0:
                os.replace(built, path)
                return path
            lines = done.stderr.strip().splitlines()
            errors = lines[-1] if lines else f"exit status {done.returncode}"
        raise RuntimeError(f"{cc} could not build {source.name}: {errors}")


def load_checked(source: Path, name: str, flags: Sequence[str], wrap: Callable[[ctypes.CDLL, Path], Kernel],
                 check: Callable[[Kernel], str]) -> tuple[Kernel | None, str, str]:
    """Builds (or finds built), loads and checks a kernel, for a caller that then says what happened.

    Args:
        source, name, flags: as for :func:`build_library`.
        wrap: makes the kernel object of the loaded library and its path.
        check: ``""`` when the kernel gives the reference's results on this machine, else what differed.

    Returns:
        ``(kernel, "", "")`` when it is usable, else ``(None, outcome, detail)``: outcome ``"off"``
        (``LIGHTNING_OFFLOAD_NATIVE=0``), ``"unavailable"`` (no compiler, or the build or load failed: detail says
        why) or ``"mismatch"`` (the check failed: detail says how).
    """
    if os.environ.get("LIGHTNING_OFFLOAD_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "off", ""
    try:
        path = build_library(source, name, flags)
        kernel = wrap(ctypes.CDLL(str(path)), path)
        mismatch = check(kernel)
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        return None, "unavailable", str(error)
    if mismatch:
        return None, "mismatch", mismatch
    return kernel, "", str(path)
