"""Compile a kernel for sm_90 without a GPU and report registers, spills and tensor-core ops.

Triton ships ptxas and cuobjdump, so a CPU machine can answer the first questions about a
Hopper kernel (does it spill? are the matrix instructions HGMMA?) before any device time:

    python bench/sass_report.py lse_forward --block 128,256,64 --warps 8 --stages 3
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

POINTER_TYPES = {  # parameter name -> element type; the rest are i32 ints or fp32 floats
    "hidden": "bf16",
    "classifier": "bf16",
    "bias": "bf16",
    "class_weights": "fp32",
    "targets": "i64",
    "partial_lse": "fp32",
    "partial_wsum": "fp32",
    "target_logit": "fp32",
    "lse": "fp32",
    "coef_p": "fp32",
    "coef_t": "fp32",
    "coef_w": "fp32",
    "slab": "bf16",
    "logits": "bf16",
    "p_base": "fp32",
    "p_per_lse": "fp32",
    "lse_row": "fp32",
    "target_out": "fp32",
    "wsum_out": "fp32",
    "out": "fp32",
}
FLOATS = {"logit_scale", "softcap"}
DTYPE = ["bf16"]  # operand element type of the report (--dtype)
UNIT_STRIDES = {"stride_tt"}


def kernel_by_name(name):
    from cce_compile.kernels import chunk_softmax_grad, logit_grad, lse_forward

    return {
        "lse_forward": lse_forward._lse_forward_kernel,
        "logit_grad": logit_grad._logit_grad_kernel,
        "chunk_softmax_grad": chunk_softmax_grad._chunk_softmax_grad_kernel,
    }[name]


def compile_report(kernel, constexprs, num_warps, num_stages):
    params = list(inspect.signature(kernel.fn).parameters)
    signature, attrs = {}, {}
    for i, p in enumerate(params):
        if p in constexprs:
            signature[p] = "constexpr"
        elif p in ("hidden", "classifier", "slab") and constexprs.get("USE_TMA"):
            block = {
                "hidden": [constexprs["BLOCK_N"], constexprs["BLOCK_D"]],
                "classifier": [constexprs["BLOCK_V"], constexprs["BLOCK_D"]],
                "slab": [constexprs["BLOCK_N"], constexprs["BLOCK_V"]],
            }[p]
            signature[p] = f"tensordesc<{DTYPE[0]}{block}>"
        elif p in POINTER_TYPES:
            signature[p] = "*" + POINTER_TYPES[p]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif p in FLOATS:
            signature[p] = "fp32"
        elif p in UNIT_STRIDES:
            signature[p] = "constexpr"
            constexprs = {**constexprs, p: 1}
        else:
            signature[p] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 128),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()

        def cuobjdump(flag: str) -> str:
            command = [os.path.join(tools, "cuobjdump"), flag, f.name]
            return subprocess.run(command, capture_output=True, text=True).stdout

        sass = cuobjdump("-sass")
        # Registers and spills as ptxas reports them in the cubin's resource usage.
        usage = cuobjdump("-res-usage")
    counts = {
        op: len(re.findall(rf"\b{op}\b", sass))
        for op in ("HGMMA", "HMMA", "LDL", "STL", "LDGSTS", "UTMALDG", "MUFU.EX2", "BAR.SYNC")
    }
    ptx = compiled.asm["ptx"]
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return {
        "regs": int(regs.group(1)) if regs else None,
        "stack": int(stack.group(1)) if stack else None,
        "shared": compiled.metadata.shared,
        "sass": counts,
        "wgmma_ptx": len(re.findall(r"wgmma.mma_async", ptx)),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("kernel")
    parser.add_argument("--block", default="128,256,64")
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--flags", default="", help="comma list of constexpr flags set True")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--precision", default="ieee", help="DOT_PRECISION for float32 dots")
    args = parser.parse_args()
    bn, bv, bd = (int(x) for x in args.block.split(","))
    DTYPE[0] = args.dtype
    for name in ("hidden", "classifier", "bias", "slab", "logits"):
        POINTER_TYPES[name] = args.dtype
    kernel = kernel_by_name(args.kernel)
    params = inspect.signature(kernel.fn).parameters
    constexprs = {p: False for p in params if p.isupper()}
    constexprs.update(
        {
            "BLOCK_N": bn,
            "BLOCK_V": bv,
            "BLOCK_D": bd,
            "GROUP_N": 8,
            "DOT_PRECISION": args.precision,
            "EVEN_D": True,
            "BLOCK": bv,
            "TILES": 4,
        }
    )
    constexprs = {k: v for k, v in constexprs.items() if k in params}
    for flag in filter(None, args.flags.split(",")):
        constexprs[flag] = True
    print(compile_report(kernel, constexprs, args.warps, args.stages))


if __name__ == "__main__":
    main()
