"""torch.compile for a run: options, cache directory and recompile accounting (``session``), and the
per-shape warm-up with a bit-exact restore (``warmup``)."""
