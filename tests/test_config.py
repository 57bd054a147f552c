from pathlib import Path

import pytest

from train.config import dump_config, load_config
from train.errors import UserError


def test_defaults_and_overrides_are_typed() -> None:
    cfg = load_config(None, ["train.max_steps=200", "optim.lr=0.01", "data.max_samples=null", "batching.method=quantile"])
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


def test_config_files_in_repo_load_and_roundtrip(tmp_path: Path) -> None:
    for path in Path("configs").glob("*.yaml"):
        cfg = load_config(str(path))
        (tmp_path / "c.yaml").write_text(dump_config(cfg))
        assert load_config(str(tmp_path / "c.yaml")) == cfg


def test_yaml_errors_name_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_steps: [1,\n")
    with pytest.raises(UserError, match=r"bad\.yaml:\d+: not valid YAML"):
        load_config(str(bad))
    with pytest.raises(UserError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
