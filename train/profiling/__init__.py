"""Profiling the real training job: torch.profiler window + attribution, py-spy, Nsight Systems, NVML sampling.

Entry point: ``python -m train profile`` (``make profile``, ``profile-pyspy``, ``profile-nsys``);
the orchestration is in :mod:`train.profiling.session`. Nothing here is imported by a plain
training run except :mod:`train.profiling.ranges`, whose default is a no-op.
"""
