import time

T_START = time.perf_counter()  # before torch is imported: time_to_first_step_s counts the import too

from train.cli import main  # noqa: E402

raise SystemExit(main(t_start=T_START))
