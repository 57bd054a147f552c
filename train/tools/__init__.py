"""Around the run rather than in it: ``python -m train.tools.verify_gpu`` (the pass/fail table), the container
entrypoint's ``preflight``, the environment facts report.json records (``env``), the progress bars long
commands show on a terminal (``progress``), the run directory's one-writer lock (``run_lock``) and the writable
fallback for matplotlib's and W&B's directories under a read-only ``HOME`` (``home``)."""
