"""Decoder inference (``python -m train bench-generate``): the serving paths (engines), the figures a server is
judged by (figures), what is served (source) and the plot (plots)."""
