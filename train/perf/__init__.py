"""Measurement primitives: device-synchronised timing, peak memory, FLOPs."""
