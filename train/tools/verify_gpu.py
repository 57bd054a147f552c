"""``make verify-gpu``: is this machine (or container) ready to train and profile on a GPU?

    python -m train.tools.verify_gpu [--json PATH]

Prints a table of checks — driver and ``nvidia-smi``, ``torch.cuda.is_available()``, torch/CUDA/cuDNN/
Triton versions, device name and compute capability, a matmul checked against the CPU result, bf16
support, NCCL, ``/dev/shm`` size, cache directory writable, py-spy ptrace permission, Nsight Systems —
each PASS / WARN / FAIL / SKIP / INFO with advice for anything not PASS.

Exit codes: 0 all hard checks pass; 1 a hard check failed (a GPU is there but unusable, wrong results,
cache not writable); 77 no GPU on this host (nothing GPU-related can be verified; the host-side checks are
still printed). 77 is the automake/ctest convention for "skipped", distinct from a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

EXIT_OK, EXIT_FAIL, EXIT_NO_GPU = 0, 1, 77
SHM_MIN_BYTES = 1 << 30  # below this, DataLoader workers die with "bus error" on real batches


@dataclass
class Check:
    """One row of the table. ``status``: PASS, WARN (soft), FAIL (hard), SKIP, INFO, NO-GPU."""

    name: str
    status: str
    detail: str
    advice: str = ""


def _run(cmd: list[str], timeout: float = 30) -> tuple[int, str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, f"{exc.__class__.__name__}: {exc}"
    return out.returncode, (out.stdout + out.stderr).strip()


def check_nvidia_smi() -> Check:
    if shutil.which("nvidia-smi") is None:
        return Check("driver / nvidia-smi", "NO-GPU", "nvidia-smi not found",
                     "on a GPU host: install the NVIDIA driver; in a container: run with --gpus all "
                     "(NVIDIA container toolkit)")
    rc, out = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if rc != 0:
        return Check("driver / nvidia-smi", "NO-GPU", out.splitlines()[-1] if out else f"exit {rc}",
                     "nvidia-smi cannot talk to the driver: check `nvidia-smi` on the host, reload the driver "
                     "or reboot")
    return Check("driver / nvidia-smi", "PASS", "; ".join(out.splitlines()))


def torch_checks(have_smi: bool) -> list[Check]:
    import torch

    rows = [Check("torch", "INFO", f"{torch.__version__} (CUDA build {torch.version.cuda or 'none'})")]
    try:
        import triton

        rows.append(Check("triton", "INFO", triton.__version__))
    except ImportError:
        rows.append(Check("triton", "WARN" if torch.version.cuda else "INFO", "not installed",
                          "torch.compile on CUDA needs triton; the image pins it (docker/requirements.lock)"))
    if not torch.cuda.is_available():
        if have_smi:
            return rows + [Check("torch.cuda.is_available()", "FAIL", "False although nvidia-smi sees a GPU",
                                 "driver too old for this CUDA build (see nvidia-smi 'CUDA Version'), "
                                 "a CPU-only torch, or CUDA_VISIBLE_DEVICES hides the GPUs")]
        return rows + [Check("torch.cuda.is_available()", "NO-GPU", "False (no GPU on this host)", "")]
    rows.append(Check("torch.cuda.is_available()", "PASS", f"True, {torch.cuda.device_count()} device(s)"))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    rows.append(Check("cuDNN", "INFO" if cudnn else "WARN", str(cudnn),
                      "" if cudnn else "cuDNN not available to torch"))
    major, minor = torch.cuda.get_device_capability(0)
    rows.append(Check("device", "INFO", f"{torch.cuda.get_device_name(0)}, compute capability {major}.{minor}"))
    rows.append(check_matmul(torch))
    bf16 = torch.cuda.is_bf16_supported()
    rows.append(Check("bf16", "PASS" if bf16 else "WARN", str(bf16),
                      "" if bf16 else
                      "no bf16 (compute capability < 8.0): precision=auto falls back to fp16 + GradScaler"))
    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    version = ".".join(map(str, torch.cuda.nccl.version())) if nccl else "unavailable"
    rows.append(Check("NCCL", "PASS" if nccl else "WARN", version, "" if nccl else "multi-GPU (DDP) needs NCCL"))
    return rows


def check_matmul(torch) -> Check:
    """A 1024×1024 fp32 matmul on the GPU (TF32 off) against the CPU result; |Δ| ≤ 1e-3 relative."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 1024, generator=gen)
    b = torch.randn(1024, 1024, generator=gen)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        t0 = time.perf_counter()
        got = (a.cuda() @ b.cuda()).cpu()  # .cpu() is a host-device sync point
        ms = (time.perf_counter() - t0) * 1e3
    except RuntimeError as exc:
        return Check("matmul vs CPU", "FAIL", str(exc).splitlines()[0],
                     "the GPU cannot run a kernel: check driver/toolkit versions")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    want = a @ b
    err = ((got - want).abs().max() / want.abs().max()).item()
    if err > 1e-3:
        return Check("matmul vs CPU", "FAIL", f"max relative error {err:.2e}", "wrong results: hardware/driver problem")
    return Check("matmul vs CPU", "PASS", f"max relative error {err:.1e} (first call {ms:.0f} ms incl. init)")


def check_shm(path: str = "/dev/shm") -> Check:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return Check("/dev/shm", "WARN", f"not available ({exc.strerror})", "DataLoader workers need /dev/shm")
    size = st.f_frsize * st.f_blocks
    detail = f"{size / 2**30:.1f} GiB"
    if size < SHM_MIN_BYTES:
        return Check("/dev/shm", "WARN", detail, "under 1 GiB: data.num_workers > 0 crashes with 'bus error'; "
                     "run the container with --ipc=host (the Makefile does) or --shm-size=8g")
    return Check("/dev/shm", "PASS", detail)


def cache_dir() -> Path:
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return Path(env)
    return Path(tempfile.gettempdir()) / f"torchinductor_{os.environ.get('USER', 'user')}"


def check_cache() -> Check:
    path = cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".verify-"):
            pass
    except OSError as exc:
        return Check("cache dir writable", "FAIL", f"{path}: {exc.strerror}",
                     "the inductor cache volume is not writable by this user: `make clean-cache`, or chown the volume; "
                     "set TORCHINDUCTOR_CACHE_DIR to a writable directory")
    return Check("cache dir writable", "PASS", str(path))


def check_pyspy() -> Check:
    exe = shutil.which("py-spy")
    if exe is None:
        return Check("py-spy ptrace", "WARN", "py-spy not installed", "make profile-pyspy needs it (the image has it)")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        rc, out = _run([exe, "dump", "--pid", str(child.pid)], timeout=20)
    finally:
        child.kill()
        child.wait()
    if rc != 0:
        return Check("py-spy ptrace", "WARN", (out.splitlines() or [f"exit {rc}"])[-1],
                     "py-spy cannot attach: run the container with --cap-add SYS_PTRACE (the Makefile does), "
                     "or on the host `sudo sysctl kernel.yama.ptrace_scope=0`")
    return Check("py-spy ptrace", "PASS", "py-spy dump of a child process works")


def check_nsys() -> Check:
    exe = shutil.which("nsys")
    if exe is None:
        return Check("nsys", "WARN", "not found",
                     "make profile-nsys needs Nsight Systems (in the image; on a host: nsight-systems-cli)")
    rc, out = _run([exe, "--version"])
    return Check("nsys", "PASS" if rc == 0 else "WARN", out.splitlines()[0] if out else f"exit {rc}")


def run_checks() -> list[Check]:
    smi = check_nvidia_smi()
    rows = [smi]
    rows += torch_checks(have_smi=smi.status == "PASS")
    rows += [check_shm(), check_cache(), check_pyspy(), check_nsys()]
    return rows


def exit_code(rows: Sequence[Check]) -> int:
    """1 on any FAIL; else 77 when no GPU was found; else 0."""
    if any(r.status == "FAIL" for r in rows):
        return EXIT_FAIL
    if any(r.status == "NO-GPU" for r in rows):
        return EXIT_NO_GPU
    return EXIT_OK


def format_table(rows: Sequence[Check]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'check':<{width}}  status  detail", f"{'-' * width}  ------  ------"]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {r.status:<6}  {r.detail}")
        if r.advice and r.status in ("FAIL", "WARN", "NO-GPU"):
            lines.append(f"{'':<{width}}          → {r.advice}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.tools.verify_gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None, help="also write the checks and the verdict to this JSON file")
    args = parser.parse_args(argv)
    rows = run_checks()
    code = exit_code(rows)
    print(format_table(rows))
    verdict = {EXIT_OK: "PASS: GPU ready", EXIT_FAIL: "FAIL: see the advice above",
               EXIT_NO_GPU: "NO GPU: nothing GPU-related to verify on this host (exit 77)"}[code]
    print(verdict)
    if args.json:
        from train.errors import atomic_write_text

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.json), json.dumps({"checks": [asdict(r) for r in rows], "exit_code": code,
                                                       "verdict": verdict}, indent=2) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
