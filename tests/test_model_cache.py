"""The converted-model cache under concurrent first use: commands started together (a server and
a generate, parallel eval jobs) convert a GGUF once, and none of them sees a half-written model
(a GPU run of four processes at once crashed on the old shared staging directory)."""
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("filelock")

from kvsieve.model import loader  # noqa: E402


class FakeModel:
    """Stands in for the de-quantised model: saving takes a while, as the real 30 s do."""

    hf_quantizer = None

    def __init__(self):
        self.config = type("Config", (), {"eos_token_id": [2, 5]})()

    def save_pretrained(self, d):
        time.sleep(0.2)
        (Path(d) / "config.json").write_text("{}")
        (Path(d) / "model.safetensors").write_bytes(b"weights")


class FakeTokenizer:
    pad_token = None  # as transformers 5.17 reads SmolLM2's GGUF: no pad token, the wrong EOS
    eos_token, eos_token_id = "<1>", 1

    def convert_ids_to_tokens(self, i):
        return f"<{i}>"

    def save_pretrained(self, d):
        (Path(d) / "tokenizer_config.json").write_text(json.dumps({"pad_token": self.pad_token,
                                                                  "eos_token": self.eos_token}))


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A GGUF path whose reading is faked (architecture llama); returns the list of reads."""
    reads = []
    lock = threading.Lock()

    def read_model(*a, **kw):
        with lock:
            reads.append(kw.get("gguf_file"))
        return FakeModel()

    monkeypatch.setattr(loader, "gguf_architecture", lambda p: "llama")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", read_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **kw: FakeTokenizer())
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return path, reads


def test_concurrent_first_uses_convert_once(tmp_path, fake_gguf):
    """Six callers at once: one converts, the others wait and get the finished directory;
    an unfinished leftover of a killed run (config, no weights) is replaced; no staging
    directory is left behind."""
    path, reads = fake_gguf
    out = tmp_path / "cache" / "m"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")  # a killed conversion's leftover
    assert not loader.is_converted(out)

    def convert(_):
        got = loader.convert_gguf(path, out)
        return got, loader.is_converted(got)  # what the caller sees at once

    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(convert, range(6)))
    assert results == [(out, True)] * 6
    assert reads == ["m.gguf"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["m", "m.lock"]
    assert (out / "model.safetensors").read_bytes() == b"weights"
    # converted: later calls read nothing and take no lock
    assert loader.convert_gguf(path, out) == out and reads == ["m.gguf"]
    # a tokenizer read without a pad token gets the model's EOS (padded batches need one), and an
    # EOS that is not the config's becomes the config's
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert saved["pad_token"] == "<2>" and saved["eos_token"] == "<2>"


def test_a_failed_conversion_leaves_no_entry(tmp_path, fake_gguf, monkeypatch):
    """A GGUF transformers cannot read raises the one-line error and leaves neither a
    half-written entry nor a staging directory; the next call converts afresh."""
    path, reads = fake_gguf

    def broken(*a, **kw):
        raise OSError("truncated file")

    with monkeypatch.context() as mp:
        mp.setattr(transformers.AutoModelForCausalLM, "from_pretrained", broken)
        with pytest.raises(ValueError, match="could not read GGUF file .*m.gguf: OSError: truncated file"):
            loader.convert_gguf(path, tmp_path / "cache" / "m")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m.lock"]
    assert loader.is_converted(loader.convert_gguf(path, tmp_path / "cache" / "m")) and len(reads) == 1
