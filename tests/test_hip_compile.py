"""The kernel sources build for AMD GPUs (issue 8: CUDA C++ "that also compiles for HIP").

These machines have no ROCm, so hiprtc cannot run here. A stock clang with the AMDGPU backend (the
one the `ziglang` wheel ships, a test-only dependency) compiles every kernel source as HIP device
code, the way CuPy-on-ROCm hands it to hiprtc (headers inlined by `kernels.cuda_backend`, the same
-D defines), for CDNA3 (gfx942, 64-lane wavefronts: MI300) and RDNA3 (gfx1100, 32-lane: RX 7900),
with `tests/hip/hip/hip_runtime.h` standing in for the header hiprtc provides. What this catches
before anyone has an AMD GPU: CUDA-only intrinsics or inline PTX outside the `__HIP_PLATFORM_AMD__`
branches, type errors inside them, builtins a target lacks, operations the AMDGPU backend cannot
lower, and a kernel the host launches that a build does not define. It runs nothing: whether the
HIP path computes the right numbers is for a ROCm machine (`tests/test_gpu_*.py` there).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernels import cuda_backend as cb
from kernels import fused_gpu as fg

ROOT = Path(__file__).resolve().parents[1]
SHIM_DIR = ROOT / "tests" / "hip"
ARCHS = ("gfx942", "gfx1100")


def _clang() -> tuple[list[str] | None, str]:
    """The compiler, or None and why not: ziglang missing, or its clang unable to build a trivial
    HIP kernel here (then nothing below could say anything about our sources)."""
    try:
        import ziglang  # noqa: F401
    except ImportError:
        return None, "no clang with the AMDGPU backend (pip install ziglang)"
    cmd = [sys.executable, "-m", "ziglang", "clang"]
    probe = 'extern "C" __attribute__((global)) void k(float* x) { x[0] = 1.0f; }\n'
    try:
        proc = subprocess.run(cmd + ["-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc", "--offload-arch=gfx942",
                                     "-S", "-o", os.devnull, "-"], input=probe, capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"ziglang's clang does not run here: {exc}"
    if proc.returncode != 0:
        return None, f"ziglang's clang cannot build HIP here: {proc.stderr.strip()[:300]}"
    return cmd, ""


@pytest.fixture(scope="module")
def clang() -> list[str]:
    cmd, why = _clang()      # probed here, not at import: collecting the suite should not run a compiler
    if cmd is None:
        pytest.skip(why)
    return cmd

FUSED_KERNELS = ("prep_rows", "gdn_conv", "gdn_recur_r1", "gdn_recur_r4", "gdn_recur_r8",
                 "gdn_recur_r16", "gdn_recur_r32", "gdn_recur_w1", "gdn_recur_w4", "gdn_recur_w8",
                 "gdn_recur_w16", "gdn_recur_w32", "gdn_commit_conv", "gdn_out_prep", "attn_qk_rope_kv",
                 "attn_partial_g1", "attn_partial_g2", "attn_partial_g3", "attn_partial_tc", "attn_partial_tcd",
                 "attn_combine_prep", "argmax_rows", "topk_row")
OPS_KERNELS = ("norm_rows", "silu_mul_f32", "sigmoid_mul_f32", "rope_neox_f32", "causal_conv1d_silu_f32",
               "argmax_rows_f32", "spin_wait")
REPACK_KERNELS = tuple(f"repack_{n.lower()}" for n in fg.TC_TYPE_NAMES.values())
UNITS_F16_KERNELS = tuple(f"units_f16_{n.lower()}" for n in fg.TC_TYPE_NAMES.values())

# mm_tc instantiations: every (type, width, epilogue) would be 72 builds of 4-20 s each; these six
# build every type once, every column-tile count NT 1..4 and every epilogue at least once.
MM_BUILDS = tuple((qt, 1 + i % 4, i % 3) for i, qt in enumerate(sorted(fg.TC_TYPE_NAMES)))

# (source, defines, kernels the host launches from that build)
BUILDS: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("ops.cu", (), OPS_KERNELS),
    ("attention.cu", (), ("attention_f32", "attention_combine")),
    ("deltanet.cu", (), tuple(f"deltanet_recurrent_r{r}" for r in cb._DELTANET_RPT)),
    ("fused.cu", (), FUSED_KERNELS),
    ("quant_matvec.cu", (), tuple(cb._DEQUANT_NAMES.values())),
    ("quant_matvec.cu", ("MV_T=1", "MV_R=8", "MV_U=1"), tuple(cb._MATVEC_NAMES.values())),
    ("quant_matvec.cu", ("MV_T=8", "MV_R=4", "MV_U=2"), tuple(cb._MATVEC_NAMES.values())),
    ("quant_matvec.cu", ("MV_T=2", "MV_R=2", f"MV_QTYPE={cb.GGML_Q6_K}"), ("block_matvec",)),
    ("mma_matmul.cu", (), REPACK_KERNELS + UNITS_F16_KERNELS),
] + [("mma_matmul.cu", (f"MM_QT={qt}", f"MM_NT={nt}", f"MM_MODE={mode}", "MM_ISSUER_WARP=0"), ("mm_tc",))
     for qt, nt, mode in MM_BUILDS] + [
    # a launch of two types (mm_tc_parts: Q4_K_M's Q6_K attn_qkv beside Q4_K z / alpha / beta)
    ("mma_matmul.cu", (f"MM_QT={fg.QT_Q6_K}", f"MM_QT2={fg.QT_Q4_K}", "MM_NT=1", "MM_MODE=1", "MM_ISSUER_WARP=0"),
     ("mm_tc",)),
    # decode's one-row build (fused_gpu.ONE_ROW_BUILD, every device)
    ("mma_matmul.cu", (f"MM_QT={fg.QT_Q4_K}", "MM_NT=1", "MM_MODE=2", "MM_ISSUER_WARP=0", "MM_ONE_ROW=1"), ("mm_tc",))]


def _compile(clang: list[str], source: str, defines: tuple[str, ...], arch: str, tmp: Path) -> tuple[int, str, str]:
    """Builds one module as hiprtc would see it; returns (exit status, compiler output, assembly)."""
    code = cb._inline_includes((ROOT / "kernels" / source).read_text())
    stem = f"{Path(source).stem}-{arch}-{'-'.join(d.replace('=', '') for d in defines) or 'plain'}"
    src, asm = tmp / f"{stem}.hip", tmp / f"{stem}.s"
    src.write_text(code)
    cmd = clang + ["-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc", f"--offload-arch={arch}",
                   "-std=c++17", "-O3", "-I", str(SHIM_DIR), "-include", "hip/hip_runtime.h",
                   # a header's `#pragma once` lands in the inlined main file; unroll hints on loops
                   # with run-time trip counts are hints
                   "-Wno-pragma-once-outside-header", "-Wno-pass-failed",
                   *[f"-D{d}" for d in defines], "-S", "-o", str(asm), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr, asm.read_text() if asm.exists() else ""


def _build_all(clang: list[str], arch: str, builds, tmp: Path):
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return list(pool.map(lambda b: (b, _compile(clang, b[0], b[1], arch, tmp)), builds))


def _kernels_in(asm: str) -> set[str]:
    return set(re.findall(r"^\s*\.amdhsa_kernel\s+(\w+)", asm, flags=re.M))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_source_builds_for_amd(clang, arch, tmp_path):
    # gfx1100 (32-lane) is built for everything but the mm_tc instantiations, whose HIP branches do
    # not depend on the wavefront size (a "warp" of the matmul is 32 lanes either way).
    builds = BUILDS if arch == "gfx942" else [b for b in BUILDS if "MM_QT" not in " ".join(b[1])]
    failures = []
    for (source, defines, expected), (rc, log, asm) in _build_all(clang, arch, builds, tmp_path):
        what = f"{source} {' '.join('-D' + d for d in defines)} ({arch})"
        if rc != 0 or "warning:" in log or "error:" in log:
            failures.append(f"{what}:\n{log.strip()[:3000]}")
            continue
        missing = sorted(set(expected) - _kernels_in(asm))
        if missing:
            failures.append(f"{what}: the build defines no kernel {', '.join(missing)}")
    assert not failures, "\n\n".join(failures)


def test_the_check_catches_cuda_only_code(clang, tmp_path):
    """A CUDA-only intrinsic outside the HIP branch must fail the build (else the test above could
    pass on a shim that swallows everything)."""
    src = tmp_path / "bad.hip"
    src.write_text('extern "C" __global__ void k(float* x) { x[0] = __shfl_xor_sync(0xffffffffu, x[1], 1); }\n')
    proc = subprocess.run(clang + ["-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc",
                                   "--offload-arch=gfx942", "-I", str(SHIM_DIR), "-include", "hip/hip_runtime.h",
                                   "-S", "-o", str(tmp_path / "bad.s"), str(src)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "__shfl_xor_sync" in proc.stderr
