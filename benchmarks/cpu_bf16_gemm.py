"""Which bfloat16 products with a float32 result a CPU build of torch can reach, timed on
one Gram ``X^T X`` of a vocabulary-shaped matrix (median of 9):

- float32 ``X^T X`` (MKL's sgemm);
- bfloat16 ``X^T X`` (oneDNN; the result rounded to bfloat16, unusable for a Gram);
- ``torch.mm(..., out_dtype=torch.float32)`` (absent from CPU builds so far);
- MKL's ``cblas_gemm_bf16bf16f32`` where ``libtorch_cpu`` exports it (bfloat16 operands,
  float32 accumulation and result), called through ctypes.

    python benchmarks/cpu_bf16_gemm.py [--shape 32768x256] [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import os

import torch

from equiopt.bench import median_time

REPEATS, CPU = 9, torch.device("cpu")


def _mkl_gram():
    """``X^T X`` through MKL's bfloat16 GEMM with a float32 result, or None."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        fn = lib.cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    row_major, no_trans, trans = 101, 111, 112

    def gram(xb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        m, n = xb.shape  # out (n, n) = xb^T xb
        fn(row_major, trans, no_trans, n, n, m, 1.0, xb.data_ptr(), n, xb.data_ptr(), n, 0.0, out.data_ptr(), n)
        return out

    return gram


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32768x256")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m, n = (int(v) for v in args.shape.lower().split("x"))
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(0))
    xb = x.bfloat16()
    exact = xb.double().mT @ xb.double()
    print(f"Gram of {m} x {n}, {args.threads} thread(s), torch {torch.__version__}")
    print(f"  float32 sgemm:              {1e3 * median_time(lambda: x.mT @ x, REPEATS, CPU):7.1f} ms")
    print(f"  bfloat16 (bfloat16 result): {1e3 * median_time(lambda: xb.mT @ xb, REPEATS, CPU):7.1f} ms")
    try:
        torch.mm(xb.mT, xb, out_dtype=torch.float32)
        print(
            f"  mm out_dtype float32:       {1e3 * median_time(lambda: torch.mm(xb.mT, xb, out_dtype=torch.float32), REPEATS, CPU):7.1f} ms"
        )
    except (RuntimeError, TypeError, NotImplementedError):
        print("  mm out_dtype float32:       not available on this build")
    gram = _mkl_gram()
    if gram is None:
        print("  MKL gemm_bf16bf16f32:       not exported by this build")
        return
    out = torch.empty(n, n)
    err = float((gram(xb, out).double() - exact).norm() / exact.norm())
    print(
        f"  MKL gemm_bf16bf16f32:       {1e3 * median_time(lambda: gram(xb, out), REPEATS, CPU):7.1f} ms (relative error {err:.1e})"
    )


if __name__ == "__main__":
    main()
