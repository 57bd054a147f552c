"""The bench* sections: defaults declared once (train/config/bench.py), validated with the key's name, set by
YAML, ``section.key=value`` overrides and the commands' flags alike."""

from pathlib import Path

import pytest

from train.cli import build_parser, load_cfg
from train.config import load_config
from train.config.bench import BenchCompileConfig, BenchConfig, BenchPrecisionConfig, BenchTrackingConfig
from train.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def cfg_from(*argv: str):
    return load_cfg(build_parser().parse_args(list(argv)))


def test_defaults_are_the_commands_defaults() -> None:
    cfg = load_config(None)
    assert (cfg.bench.warmup_steps, cfg.bench.rounds, cfg.bench.window, cfg.bench.requests) == (3, 4, 5, 200)
    assert (cfg.bench.inference_batch_size, cfg.bench.skip_inference, cfg.bench.configs) == (32, False, None)
    assert (cfg.bench_precision.steps, cfg.bench_precision.bf16_cpu_steps, cfg.bench_precision.warmup) == (150, 4, 3)
    assert (cfg.bench_compile.steps, cfg.bench_compile.rounds) == (8, 5)
    assert (cfg.bench_tracking.rounds, cfg.bench_tracking.block_steps,
            cfg.bench_tracking.online_check) == (5, 100, False)
    assert cfg.bench_batching.num_buckets == 16 and cfg.bench_batching.windows == 3


def test_flags_only_set_their_keys() -> None:
    assert cfg_from("bench").bench == BenchConfig()  # no flag given: the config's values, untouched
    cfg = cfg_from("bench", "--rounds", "8", "--skip-inference", "--configs", "naive, optimized",
                   "--checkpoint", "a b.pt")
    assert cfg.bench.rounds == 8 and cfg.bench.skip_inference is True and cfg.bench.checkpoint == "a b.pt"
    assert cfg.bench.config_names() == ["naive", "optimized"]
    assert cfg_from("bench", "bench.rounds=7").bench.rounds == 7
    assert cfg_from("bench", "bench.rounds=7", "--rounds", "9").bench.rounds == 9  # the flag wins
    assert cfg_from("bench-tracking", "--rounds", "2", "--out", "x.json").bench_tracking == BenchTrackingConfig(
        2, out="x.json")
    assert cfg_from("bench-compile", "--steps", "3").bench_compile == BenchCompileConfig(steps=3)
    assert cfg_from("bench-precision", "--steps", "9", "--warmup", "2").bench_precision == BenchPrecisionConfig(9, 4, 2)
    assert cfg_from("bench-batching", "--windows", "2").bench_batching.windows == 2


def test_flag_help_names_the_key_and_its_default(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(sets bench.rounds; default 4)" in text and "(sets bench.skip_inference; default false)" in text


@pytest.mark.parametrize(("override", "message"), [
    ("bench.rounds=0", "bench.rounds=0 is out of range: it must be ≥ 1"),
    ("bench.configs=' , '", "bench.configs must name at least one"),
    ("bench_precision.steps=1", "bench_precision.steps=1 is out of range: it must be ≥ 2"),
    ("bench_precision.warmup=150", "bench_precision.warmup=150 must be < bench_precision.steps=150"),
    ("bench_compile.steps=1", "bench_compile.steps=1 is out of range: it must be ≥ 2"),
    ("bench_tracking.block_steps=1", "bench_tracking.block_steps=1 is out of range: it must be ≥ 2"),
    ("bench_batching.warmup_windows=-1", "bench_batching.warmup_windows=-1 is out of range: it must be ≥ 0"),
    ("bench.round=3", "Did you mean 'bench.rounds'?"),
])
def test_bad_values_name_the_key(override: str, message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("?", r"\?")):
        load_config(None, [override])


def test_yaml_block(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("bench:\n  rounds: 6\nbench_tracking:\n  online_check: true\n", encoding="utf-8")
    cfg = load_config(str(path))
    assert cfg.bench.rounds == 6 and cfg.bench_tracking.online_check is True
    assert load_config(str(ROOT / "configs" / "bench-cpu.yaml")).bench.rounds == 4


def test_importing_the_config_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, train.config, train.config.bench; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.strip() == "False"
