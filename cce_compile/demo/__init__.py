"""The demo: train a small language model on the Python standard library's own sources, with
and without cce_compile, and show the difference (``python -m cce_compile.demo``).

* ``corpus``: the corpus and a word-level tokenizer with byte fallback (cached on disk).
* ``models``: a nanoGPT-style GPT and a gated-linear-attention (GLA) model, plain PyTorch.
* ``train``: the two seeded training runs and the measurements.
* ``report``: the comparison table and the figure (an SVG drawn by ``svg``).
"""
