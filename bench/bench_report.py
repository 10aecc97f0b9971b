"""bench/bench.py's report: the markdown table of every shape and method, and one PNG per
shape of forward+backward time against extra memory."""

from __future__ import annotations


def markdown(results):
    env = results["environment"]
    lines = [
        f"GPU: {env['gpu']} · torch {env['torch']} · triton {env['triton']} · "
        f"CUDA {env['cuda']} · cut-cross-entropy {env.get('cut_cross_entropy', '-')} · "
        f"liger-kernel {env.get('liger_kernel', '-')} · trl {env.get('trl', '-')} · "
        f"quack-kernels {env.get('quack_kernels', '-')}",
        "",
        "Times are medians (ms) of CUDA-event timings; extra memory is the peak above inputs "
        "and gradients (GiB); errors are ||g - g_fp32|| / ||g_fp32||. Floor = 3 x matmul "
        "(2 with a frozen classifier). Inputs: hidden ~ N(0, 1), classifier ~ N(0, 1)/sqrt(D), "
        "uniform targets; the scenario names the dtype, the ignored share and the frozen head.",
        "",
    ]
    for shape in results["shapes"]:
        floor = shape["floor_fwd_bwd_ms"]
        compile_ms = shape["methods"].get("torch_compile", {}).get("fwd_bwd_ms")
        compile_mem = shape["methods"].get("torch_compile", {}).get("extra_memory_gb")
        lines += [
            f"### {shape['shape']} ({shape.get('scenario', 'bf16')}): "
            f"N={shape['N']} D={shape['D']} V={shape['V']}, "
            f"{shape.get('ignored_rows', '?')} rows ignored "
            f"(matmul {shape['matmul_ms']:.2f} ms = {shape['matmul_tflops']:.0f} TFLOP/s, "
            f"floor {floor:.1f} ms)",
            "",
            "| method | fwd+bwd ms | x floor | x compile | fwd ms | x matmul | extra GiB | "
            "x compile mem | loss err | dE err | dC err |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for method, r in shape["methods"].items():
            if "error" in r:
                lines.append(f"| {method} | {r['error'][:80]} |||||||||")
                continue
            xc = f"{r['fwd_bwd_ms'] / compile_ms:.2f}" if compile_ms else "-"
            xm = f"{r['extra_memory_gb'] / compile_mem:.3f}" if compile_mem else "-"
            dc = r["grad_classifier_err"]
            lines.append(
                f"| {method} | {r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_ms'] / floor:.2f} | {xc} | "
                f"{r['fwd_ms']:.2f} | {r['fwd_ms'] / shape['matmul_ms']:.2f} | "
                f"{r['extra_memory_gb']:.3f} | {xm} | {r['loss_err']:.1e} | "
                f"{r['grad_hidden_err']:.2e} | {'-' if dc is None else f'{dc:.2e}'} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(shape, path):
    try:
        import matplotlib
    except ImportError:  # the tables still get written; the figures need the bench extra
        print(f"{path.name} not drawn: matplotlib is not installed (pip install -e '.[bench]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, r in shape["methods"].items():
        if "error" in r:
            continue
        ax.scatter(r["fwd_bwd_ms"], max(r["extra_memory_gb"], 1e-3), s=40)
        ax.annotate(
            method,
            (r["fwd_bwd_ms"], max(r["extra_memory_gb"], 1e-3)),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.axvline(shape["floor_fwd_bwd_ms"], color="gray", ls="--", lw=1, label="3 x matmul")
    ax.set_yscale("log")
    ax.set_xlabel("forward+backward time (ms)")
    ax.set_ylabel("extra memory (GiB, log)")
    ax.set_title(
        f"shape {shape['shape']} ({shape.get('scenario', 'bf16')}): "
        f"N={shape['N']} D={shape['D']} V={shape['V']}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
