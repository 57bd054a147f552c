"""Environment checks: ``python -m train.tools.verify_gpu`` (the pass/fail table) and the container
entrypoint's ``preflight``."""
