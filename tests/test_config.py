from pathlib import Path

import pytest

from train.config import dump_config, load_config
from train.errors import UserError


def test_defaults_and_overrides_are_typed() -> None:
    cfg = load_config(None, ["train.max_steps=200", "optim.lr=0.01", "data.max_samples=null",
                             "batching.method=quantile"])
    assert cfg.train.max_steps == 200 and cfg.optim.lr == 0.01 and cfg.data.max_samples is None
    assert cfg.batching.method == "quantile"
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0  # int → float is lossless


def test_unknown_key_suggests_the_nearest() -> None:
    with pytest.raises(UserError, match=r"unknown key 'train.max_step'.*Did you mean 'train.max_steps'"):
        load_config(None, ["train.max_step=3"])
    with pytest.raises(UserError, match=r"unknown section 'trian'.*Did you mean 'train'"):
        load_config(None, ["trian.max_steps=3"])


def test_wrong_type_and_invalid_value() -> None:
    with pytest.raises(UserError, match=r"'train.max_steps': 'many' is not a valid int or null"):
        load_config(None, ["train.max_steps=many"])
    with pytest.raises(UserError, match="batching.method='fastest' is not one of"):
        load_config(None, ["batching.method=fastest"])
    with pytest.raises(UserError, match="must look like section.key=value"):
        load_config(None, ["max_steps"])


def test_config_files_in_repo_load_and_roundtrip(tmp_path: Path, monkeypatch) -> None:
    """Every shipped config loads and round-trips, on a fresh clone too: the configs of the real models
    (``model.source=hf:.cache/.../models/<name>``) are read from a copy of the repository's configs in a directory
    where a stand-in of each model directory (its tokenizer.json) exists, so the test needs no ``make models``."""
    import shutil

    configs = sorted(Path("configs").resolve().glob("*.yaml"))
    monkeypatch.chdir(tmp_path)
    from train.models.pretrained import MODELS
    for name in MODELS:
        d = Path(".cache/deep-model-perf/models") / name
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "tokenizer.json").write_text("{}")
    assert configs
    real = 0
    for path in configs:
        local = tmp_path / path.name
        shutil.copy(path, local)
        cfg = load_config(str(local))
        real += cfg.model.source.startswith("hf:.cache/deep-model-perf/models/")
        (tmp_path / "c.yaml").write_text(dump_config(cfg))
        assert load_config(str(tmp_path / "c.yaml")) == cfg
    assert real >= 3  # the SmolLM2 and MiniLM configs were read, not skipped


def test_a_shipped_real_model_config_on_a_fresh_clone_says_make_models(tmp_path: Path, monkeypatch) -> None:
    cfg = Path("configs/smollm2-lora-cpu.yaml").resolve()
    monkeypatch.chdir(tmp_path)  # no .cache/deep-model-perf/models here
    with pytest.raises(UserError, match=r"no such directory .*smollm2-135m-instruct: run `make models` first"):
        load_config(str(cfg))


def test_yaml_errors_name_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_steps: [1,\n")
    with pytest.raises(UserError, match=r"bad\.yaml:\d+: not valid YAML"):
        load_config(str(bad))
    with pytest.raises(UserError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))


def test_a_key_given_twice_is_one_error_naming_the_file_line_and_key(tmp_path: Path, capsys) -> None:
    from train.cli import main

    nested = tmp_path / "nested.yaml"  # once the second max_steps won silently
    nested.write_text("data:\n  source: wordnet\ntrain:\n  max_steps: 3\n  eval_every: 1\n  max_steps: 5\n")
    with pytest.raises(UserError) as err:
        load_config(str(nested))
    assert str(err.value) == f"{nested}:6: duplicate key train.max_steps (first at line 4); keep one"
    section = tmp_path / "section.yaml"  # once the second train: section silently dropped the first
    section.write_text("train:\n  max_steps: 3\nmodel:\n  preset: tiny\ntrain:\n  eval_every: 4\n")
    with pytest.raises(UserError, match=r"section\.yaml:5: duplicate key train \(first at line 1\); keep one$"):
        load_config(str(section))
    deeper = tmp_path / "deeper.yaml"
    deeper.write_text("model:\n  hf_overrides:\n    a: 1\n    b: 2\n    a: 3\n")
    with pytest.raises(UserError, match=r"deeper\.yaml:5: duplicate key model\.hf_overrides\.a \(first at line 3\)"):
        load_config(str(deeper))
    capsys.readouterr()
    assert main(["train", "--config", str(nested)]) == 2  # the CLI's UserError path: one line, exit 2
    out = capsys.readouterr()
    assert out.err == f"error: {nested}:6: duplicate key train.max_steps (first at line 4); keep one\n"


def test_merged_keys_may_be_overridden_and_overrides_are_checked_too() -> None:
    from train.config import strict_load

    assert strict_load("a: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\n") == {"a": {"x": 1, "y": 2}, "c": {"x": 3, "y": 2}}
    assert strict_load("- {a: 1}\n- {a: 2}\n") == [{"a": 1}, {"a": 2}]  # one key in each of two mappings
    with pytest.raises(UserError, match=r"duplicate key a \(first at line 1\) in the value; keep one"):
        load_config(None, ["model.hf_overrides={a: 1, a: 2}"])
