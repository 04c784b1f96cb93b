"""Small C kernels (`bert_port/csrc/`), compiled on first use with the system's C compiler and
called through ctypes: `int8_rows()`, the per-row quantize and dequantize around int8 matmuls
(`quantization.Int8Linear`), `attention()`, the attention of every short sequence of a packed
batch in one call (`attention.packed_attention`), and `amx_linear()`, bf16 GEMMs on AMX tiles
(`gemm.py`). They share `csrc/vector.h` (vectors, bf16, exp) and `csrc/tasks.h` (work sharing).

Why not torch.utils.cpp_extension: it builds a Python extension against torch's C++ headers,
which takes tens of seconds and needs ninja, for plain loops over float rows that need
neither. Here one `cc` call takes under a second.

Each build is cached under `$BERT_PORT_CACHE` (default `~/.cache/bert_port`), in `native/`,
named by a hash of the source, the compiler, its flags and this CPU's flags (`-march=native`
code runs only where it was built), and by a hash of its own bytes, checked before loading. A build is written to a temporary file and renamed into
place, so that a crash or a second process building at the same time never leaves a partial
library behind. Anything that goes wrong (no compiler, a failed build, a library that does not
load) is warned about once, and the callers fall back to PyTorch ops, which compute the same
scheme. `BERT_PORT_NATIVE=0` turns the kernels off; `BERT_PORT_MARCH` builds them for another
instruction set than this CPU's (`march`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "csrc"
# No fused multiply-add (int8's PyTorch fallback rounds each product), except in attention and the
# AMX GEMM's epilogue, whose bits are their own anyway (another summation order, another erf) and
# which run faster with it.
# OpenMP when torch's own runtime is OpenMP. The library then links libgomp.so.1, which resolves
# to the copy torch loaded (the pip wheels ship it under that name): one thread pool. Each call
# passes torch.get_num_threads() as its thread count.
CFLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared")
OWN_FLAGS = {
    "attention": ("-ffp-contract=fast",),
    "amx_linear": ("-ffp-contract=fast",),
}  # after CFLAGS: the last -ffp-contract counts
Pointer, Int = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "int8_rows": {
        "quantize_rows": [
            Pointer,
            Int,
            Int,
            Int,
            Pointer,
            Pointer,
            ctypes.c_int,
            ctypes.c_float,
            Pointer,
            Pointer,
            ctypes.c_int,
        ],
        "dequantize_rows": [Pointer, Int, Int, Pointer, Pointer, Pointer, Int, Pointer, Int, Pointer, ctypes.c_int],
    },
    "attention": {
        "packed_attention": [
            Pointer,
            ctypes.c_int,
            Int,
            Pointer,
            Pointer,
            Int,
            Int,
            Int,
            Int,
            ctypes.c_float,
            Pointer,
            Int,
            ctypes.c_int,
        ]
    },
    "amx_linear": {
        "amx_ready": [],
        "amx_linear": [
            Pointer,
            Int,
            Int,
            Int,
            Pointer,
            Int,
            Pointer,
            ctypes.c_int,
            Pointer,
            Int,
            Pointer,
            Int,
            Int,
            ctypes.c_int,
        ],
    },
}


def enabled() -> bool:
    return os.environ.get("BERT_PORT_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    root = os.environ.get("BERT_PORT_CACHE") or Path.home() / ".cache" / "bert_port"
    return Path(root) / "native"


def compiler() -> list[str] | None:
    """The C compiler's command: `$CC` (which may carry arguments, `ccache gcc`), else `cc` or
    `gcc` on the PATH; None when there is none."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def march() -> str:
    """The instruction set the kernels are built for: `-march=$BERT_PORT_MARCH`, default `native`
    (this CPU's). `make test-kernels` builds them for `x86-64-v3` (AVX2 and FMA, as on the AMD
    EPYCs of the README) and `x86-64` (SSE2) too, so that code the compiler vectorises otherwise
    than here is tested on this CPU. Code built for another CPU's extensions may not run here:
    leave it unset outside such tests."""
    return os.environ.get("BERT_PORT_MARCH", "").strip() or "native"


def _flags(name: str) -> tuple[str, ...]:
    openmp = ("-fopenmp",) if torch._C.has_openmp else ()
    return (*CFLAGS, f"-march={march()}", *OWN_FLAGS.get(name, ()), *openmp)


def _cpu_id() -> str:
    """This CPU's model and flags (what -march=native compiles for), as /proc/cpuinfo has them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{sys.platform} {platform.machine()} {platform.processor()}"
    wanted = ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features")  # x86; Arm
    return "\n".join(dict.fromkeys(line for line in lines if line.split(":")[0].strip() in wanted))


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (x86 `flags`, Arm `Features`); empty
    where unknown."""
    for line in _cpu_id().splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler_id(cc: list[str]) -> str:
    """The compiler's own account of itself (`--version`): an upgrade builds again."""
    done = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60)
    return " ".join(cc) + "\n" + done.stdout


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _build(name: str, cc: list[str]) -> Path:
    """The cached library of `csrc/{name}.c` for this source, compiler, flags and CPU, built if
    absent. Its file name ends in its own content's hash: a damaged file (which `dlopen` may
    crash on rather than refuse) is found and replaced."""
    source = SOURCES / f"{name}.c"
    flags = _flags(name)
    headers = (h.read_text() for h in sorted(SOURCES.glob("*.h")))  # what `#include "..."` can reach
    identity = (source.read_text(), *headers, _compiler_id(cc), *flags, _cpu_id())
    key = hashlib.sha256("\0".join(identity).encode()).hexdigest()[:16]
    folder = cache_dir()
    for cached in folder.glob(f"{name}-{key}-*.so"):
        if cached.stem.rsplit("-", 1)[1] == _digest(cached):
            return cached
        cached.unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    # Not checkpoint.atomic_write: the final name holds the content's hash, known only once written,
    # and the model's read path (quantize when loading) must not import the checkpoint write side.
    fd, partial = tempfile.mkstemp(dir=folder, prefix=f".{name}-", suffix=".so")
    os.close(fd)
    try:
        command = [*cc, *flags, "-x", "c", str(source), "-o", partial]  # -x c: C even where $CC is a C++ compiler
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{' '.join(cc)} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        target = folder / f"{name}-{key}-{_digest(Path(partial))}.so"
        os.replace(partial, target)  # atomic: readers see no library or a whole one
    finally:
        Path(partial).unlink(missing_ok=True)
    logger.info("built %s", target)
    return target


def _load(name: str, path: Path) -> ctypes.CDLL:
    # torch, imported above, has loaded its OpenMP runtime already: the library links to that one.
    library = ctypes.CDLL(str(path))
    for function, argtypes in SIGNATURES[name].items():
        try:
            getattr(library, function).argtypes = argtypes
        except AttributeError as exc:  # e.g. built by a C++ compiler, whose names are mangled
            raise OSError(f"{path.name} has no function {function}: {exc}") from exc
    return library


@functools.cache
def kernels(name: str) -> ctypes.CDLL | None:
    """The loaded library of `csrc/{name}.c`, built on first use; None (warned once) when it cannot be had."""
    if not enabled():
        return None
    cc = compiler()
    try:
        if cc is None:
            raise OSError(f"no C compiler (cc, gcc or $CC) for its {name} kernels; install gcc")
        return _load(name, _build(name, cc))
    except (OSError, ValueError, subprocess.SubprocessError) as exc:  # ValueError: a $CC shlex cannot split
        why = str(exc) if cc is None else f"could not build its {name} kernels ({exc})"
        warnings.warn(
            f"bert_port: {why}; running the slower PyTorch equivalent. Set BERT_PORT_NATIVE=0 to silence this"
            + (f" (BERT_PORT_MARCH is {march()!r})" if march() != "native" else ""),
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def int8_rows() -> ctypes.CDLL | None:
    """`quantize_rows` and `dequantize_rows` (csrc/int8_rows.c), or None."""
    return kernels("int8_rows")


def attention() -> ctypes.CDLL | None:
    """`packed_attention` (csrc/attention.c), or None."""
    return kernels("attention")


def amx_linear() -> ctypes.CDLL | None:
    """`amx_ready` and `amx_linear` (csrc/amx_linear.c), or None."""
    return kernels("amx_linear")


def address(tensor: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a C argument (NULL for None)."""
    return None if tensor is None else tensor.data_ptr()
