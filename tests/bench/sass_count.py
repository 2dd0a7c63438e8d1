"""Instructions per 16x256 unit of an mm_tc instantiation, from its SASS: the main loop's stretch
from the stage wait (SYNCS...TRYWAIT) to the last MMA, counted by opcode. Compiles with nvcc (the GPU
machine has it) or, with --nvrtc, with the NVRTC library of the `nvidia-cuda-nvrtc` wheel, which
needs neither nvcc nor a GPU (the same compiler CuPy runs, so the same SASS as the step's);
disassembles with nvdisasm (elsewhere `pip download nvidia-cuda-nvdisasm` holds the binary).

    python3 tests/bench/sass_count.py QT NT MODE [-DMM_...]     e.g. 12 1 2  (Q4_K, T <= 8, SwiGLU)
    python3 tests/bench/sass_count.py --nvrtc .../nvidia/cu13/lib/libnvrtc.so.13 12 3 2 [-arch=sm_90a]
"""
from __future__ import annotations

import collections
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels")


def nvrtc_cubin(lib_path: str, options: list[str]) -> bytes:
    """mma_matmul.cu compiled by NVRTC to a cubin (options: -D..., -arch=...; default sm_90)."""
    sys.path.insert(0, os.path.dirname(KERNELS))
    from kernels.cuda_backend import _inline_includes   # the source CuPy compiles (imports no CuPy)

    lib = ctypes.CDLL(lib_path)
    with open(os.path.join(KERNELS, "mma_matmul.cu")) as f:
        code = _inline_includes(f.read()).encode()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), code, b"mma_matmul.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = ["--std=c++17"] + options + ([] if any(o.startswith("-arch") for o in options) else ["-arch=sm_90"])
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    if rc:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(log.value.decode(errors="replace")[-4000:])
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    return buf.raw


def main() -> None:
    args = sys.argv[1:]
    nvrtc = None
    if args[:1] == ["--nvrtc"]:
        nvrtc, args = args[1], args[2:]
    if len(args) < 3:
        sys.exit(__doc__)
    qt, nt, mode, extra = args[0], args[1], args[2], args[3:]
    defines = [f"-DMM_QT={qt}", f"-DMM_NT={nt}", f"-DMM_MODE={mode}"]
    disasm = shutil.which("nvdisasm") or "/usr/local/cuda/bin/nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "mm.cubin")
        if nvrtc:
            with open(cubin, "wb") as f:
                f.write(nvrtc_cubin(nvrtc, defines + extra))
        else:
            r = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", cubin, "-std=c++17", "-I", KERNELS, *defines,
                                "-Xptxas", "-v", *extra, os.path.join(KERNELS, "mma_matmul.cu")],
                               capture_output=True, text=True)
            if r.returncode:
                sys.exit(r.stderr)
            print(" ".join(l.split(":", 1)[-1].strip() for l in r.stderr.splitlines() if "registers" in l or "spill" in l))
        sass = subprocess.run([disasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    ins = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(.*?);", sass)]
    mma = [i for i, t in enumerate(ins) if "HMMA" in t or "HGMMA" in t]
    if not mma:
        sys.exit("no MMA in the kernel")
    j = mma[0]
    while j > 0 and "TRYWAIT" not in ins[j]:
        j -= 1
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in ins[j:mma[-1] + 1])
    print(f"stage wait -> last MMA: {mma[-1] + 1 - j} instructions, {len(mma)} HMMA / HGMMA")
    print(", ".join(f"{k} {v}" for k, v in ops.most_common()))


if __name__ == "__main__":
    main()
