"""What the op's dispatcher runs, behind one interface (``interface.Implementation``).

* ``triton_path``: CUDA, the Triton kernels of ``cce_compile.kernels`` and cuBLAS (lean mode
  here, fast mode in ``triton_fast``, what both share in ``triton_shared``);
* ``torch_path``: any device, chunked PyTorch;
* ``autograd_fallback``: PyTorch's own autograd over chunked float32 logits, for the calls the
  op's autograd formula cannot serve (forward-mode AD, functorch transforms, a differentiable
  ``logit_scale`` or ``softcap``).
"""
