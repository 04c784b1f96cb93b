"""The C kernels (bert_port/speed/csrc/), built at install as one extension per instruction set.

`bert_port.speed.kernels` picks the variant this CPU runs at import, as CTranslate2 and ggml pick
theirs: one wheel runs on AVX2, AVX-512 and AMX CPUs. Nothing is compiled at run time. Every
variant is optional: a machine whose compiler cannot build one (or `BERT_PORT_KERNELS=0`) gets
the others, or none, and the package runs the PyTorch equivalents (docs/architecture.md says
which outputs then change bits). The metadata is in pyproject.toml.
"""

import os
import platform

from setuptools import Extension, setup

CSRC = "bert_port/speed/csrc"
# -ffp-contract=off: no fused multiply-add unless a kernel asks for it (its own pragma), so that
# int8_rows.c rounds each product as its PyTorch twin does. OpenMP: the extension links
# libgomp.so.1, which resolves to the copy torch has loaded (one thread pool).
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-std=gnu11"]
X86_VARIANTS = {
    "generic": ["-march=x86-64"],  # SSE2, no FMA
    "avx2": ["-march=x86-64-v3"],  # AVX2 and FMA: AMD EPYC Zen 2/3, Intel Haswell on
    "avx512": ["-march=x86-64-v4"],  # AVX-512 F/BW/CD/DQ/VL: Zen 4, Skylake-X, Ice Lake
    "amx": ["-march=sapphirerapids"],  # AMX-BF16/INT8 and AVX512-BF16: Xeon 4th generation on
}


def variants() -> dict[str, list[str]]:
    if os.environ.get("BERT_PORT_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return {}
    if platform.machine().lower() in ("x86_64", "amd64"):
        return X86_VARIANTS
    return {"generic": []}


def extension(variant: str, march: list[str]) -> Extension:
    sources = ["module.c", "attention.c", "int8_rows.c", "amx_linear.c", "f32_linear.c", "heap.c"]
    return Extension(
        f"bert_port.speed._kernels_{variant}",
        sources=[f"{CSRC}/{name}" for name in sources],
        depends=[f"{CSRC}/vector.h", f"{CSRC}/tasks.h", f"{CSRC}/amx_emulated.h"],
        define_macros=[("VARIANT", variant)],
        extra_compile_args=FLAGS + march,
        extra_link_args=["-fopenmp"],
        optional=True,
    )


setup(ext_modules=[extension(v, march) for v, march in variants().items()])
