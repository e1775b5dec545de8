"""The converted-model cache: under concurrent first use, commands started together (a server and
a generate, parallel eval jobs) convert a GGUF once, and none of them sees a half-written model
(a GPU run of four processes at once crashed on the old shared staging directory); a cache kvsieve
cannot use is one clear error; GGUF files whose metadata would give another model are refused
before anything is cached."""
import errno
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("filelock")

from kvsieve.model import gguf as gguf_reader, loader  # noqa: E402
from kvsieve.model.cache import CONVERSION_FORMAT  # noqa: E402

CONFIG = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2, max_position_embeddings=64)
META = {"general.architecture": "llama", "llama.context_length": 64, "llama.embedding_length": 8,
        "llama.block_count": 1, "llama.feed_forward_length": 16, "llama.attention.head_count": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5}


class FakeModel:
    """Stands in for the de-quantised model: saving takes a while, as the real 30 s do; its
    weights are written 0600, as safetensors writes them."""

    hf_quantizer = None

    def __init__(self):
        self.config = SimpleNamespace(**CONFIG, eos_token_id=[2, 5])

    def save_pretrained(self, d):
        time.sleep(0.2)
        (Path(d) / "config.json").write_text(json.dumps(CONFIG))
        with open(os.open(Path(d) / "model.safetensors", os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(b"weights")


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
        return FakeModel(), {"missing_keys": set(), "mismatched_keys": set()}

    tensors = dict.fromkeys(["token_embd.weight", "blk.0.attn_q.weight"])
    monkeypatch.setattr(gguf_reader, "read_gguf", lambda p: (META, tensors))
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
    assert reads == ["model.gguf"]  # (read once, through a private folder holding only the file)
    assert sorted(p.name for p in out.parent.iterdir()) == ["m", "m.lock"]
    assert (out / "model.safetensors").read_bytes() == b"weights"
    # converted: later calls read nothing and take no lock
    assert loader.convert_gguf(path, out) == out and reads == ["model.gguf"]
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


def test_entries_get_the_umask_permissions_and_stale_staging_is_swept(tmp_path, fake_gguf):
    """A converted entry is as readable as any directory made under the user's umask (mkdtemp's
    0700 / safetensors' 0600 kept a shared cache private to its converter); staging directories
    of this entry left by killed conversions (SIGTERM, SIGKILL skip the cleanup) are removed by the
    next conversion, those of other entries are not."""
    path, reads = fake_gguf
    cache = tmp_path / "cache"
    cache.mkdir()
    for stale in ("m.k2s0g_9x.tmp", "m.865k2sog.tmp", "mm.865k2sog.tmp", "m.x.865k2sog.tmp"):
        (cache / stale).mkdir()
        (cache / stale / "model.safetensors").write_bytes(b"half")
    old = os.umask(0o002)
    try:
        out = loader.convert_gguf(path, cache / "m")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o775
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == {
        "config.json": 0o664, "model.safetensors": 0o664, "tokenizer_config.json": 0o664, "kvsieve-entry.json": 0o664}
    assert sorted(p.name for p in cache.iterdir()) == ["m", "m.lock", "m.x.865k2sog.tmp", "mm.865k2sog.tmp"]


def test_cache_dir_expands_tilde_and_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KVSIEVE_CACHE_DIR", "~/kvcache")
    assert loader.cache_root() == tmp_path / "kvcache"  # (was a directory named ~ in the working directory)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVSIEVE_CACHE_DIR", "rel/../cache")
    assert loader.cache_root() == tmp_path / "cache"
    monkeypatch.delenv("KVSIEVE_CACHE_DIR")
    assert loader.cache_root() == tmp_path / ".cache" / "kvsieve"


def test_a_cache_kvsieve_cannot_use_is_one_error_naming_it(tmp_path, fake_gguf, monkeypatch, capsys):
    """A cache below a file, a file, a read-only or another user's cache: one line naming the
    directory and KVSIEVE_CACHE_DIR, exit code 2 (OSError tracebacks before)."""
    import filelock

    from kvsieve.cli import main

    path, _ = fake_gguf
    (tmp_path / "file").write_text("")
    for root, message in ((tmp_path / "file" / "x", "Not a directory"), (tmp_path / "file", "is not a directory")):
        monkeypatch.setenv("KVSIEVE_CACHE_DIR", str(root))
        with pytest.raises(ValueError, match=f"{root}.*{message}|{message}.*{root}") as e:
            loader.convert_gguf(path, loader.cache_root() / "m")
        assert "KVSIEVE_CACHE_DIR" in str(e.value)
    monkeypatch.setenv("KVSIEVE_CACHE_DIR", str(tmp_path / "ro"))

    def read_only(lock_file, *a, **kw):
        raise OSError(errno.EROFS, "Read-only file system", lock_file)
    with monkeypatch.context() as mp:
        mp.setattr(filelock, "FileLock", read_only)
        capsys.readouterr()
        rc = main(["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"model cache {tmp_path / 'ro'} (Read-only file system" in err
    assert "set KVSIEVE_CACHE_DIR to a directory you can read and write" in err

    def private(self, *a, **kw):  # another user's entry converted with mode 0700
        raise PermissionError(errno.EACCES, "Permission denied", str(self))
    (tmp_path / "ro" / "m").mkdir(parents=True)
    monkeypatch.setattr(Path, "is_file", private)
    with pytest.raises(ValueError, match="Permission denied: .*/ro/m/config.json.*KVSIEVE_CACHE_DIR"):
        loader.convert_gguf(path, loader.cache_root() / "m")


def test_missing_install_hints_name_the_extra(monkeypatch):
    """A Hub id without huggingface_hub names kvsieve[model] (the message blamed the network)."""
    import sys

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(FileNotFoundError, match="needs huggingface_hub: run `pip install 'kvsieve\\[model\\]'`"):
        loader.resolve_model_dir("org/some-model")


@pytest.mark.parametrize("keys, drop, message", [
    ({"block_count": None}, (), "lacks the metadata key llama.block_count, which the model needs"),
    ({"attention.head_count": None}, (), "lacks the metadata key llama.attention.head_count"),
    ({"block_count": 1}, (), "has llama.block_count = 1, but tensors of 2 layers"),
    ({"rope.dimension_count": 8}, (), "rope.dimension_count = 8 for heads of 16 .*RoPE on part of each head"),
    ({"attention.head_count": 8, "attention.key_length": None, "rope.dimension_count": None}, (),
     "the tensor for model.layers.0.self_attn.k_proj.weight has shape \\[32, 64\\], but its metadata needs "
     "\\[16, 64\\]"),
    ({}, ("blk.1.ffn_up.weight",), "has no tensor for model.layers.1.mlp.up_proj.weight \\(1 weights missing\\)"),
])
def test_gguf_metadata_that_would_give_another_model_is_refused_uncached(tmp_path, keys, drop, message):
    """A GGUF without block_count became a 32-layer model with 30 random layers (cached, exit
    code 0); one without a head count a transformers table and its internals. Now: one error
    naming the key or tensor, before anything reaches the cache."""
    from test_architectures import tiny_gguf, tiny_hf

    gguf = tiny_gguf(tmp_path / "m.gguf", tiny_hf("llama", tmp_path / "hf"), keys=keys, drop=drop)
    with pytest.raises(ValueError, match=message):
        loader.convert_gguf(gguf, tmp_path / "cache" / "m")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["m.lock"]


def test_a_gguf_without_block_count_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    from kvsieve.cli import main
    from test_architectures import tiny_gguf, tiny_hf

    monkeypatch.setenv("KVSIEVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tiny_gguf(tmp_path / "m.gguf", tiny_hf("llama", tmp_path / "hf"), keys={"block_count": None})
    capsys.readouterr()
    assert main(["generate", "--model", str(gguf), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lacks the metadata key llama.block_count" in err


def test_a_conversion_never_replaces_what_kvsieve_did_not_write(tmp_path, fake_gguf):
    """A user's folder at the entry's name (KVSIEVE_CACHE_DIR=~/models holding their own
    smollm2-135m-instruct) was deleted and replaced; a file or a link there failed after the
    whole conversion, naming a staging directory already gone. Each is now refused at once; a
    damaged entry of kvsieve's own files is converted again."""
    path, reads = fake_gguf
    cache = tmp_path / "cache"
    mine = cache / "m"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"is not a model kvsieve converted \(it holds 'notes.txt'\)"):
        loader.convert_gguf(path, mine)
    assert (mine / "notes.txt").read_text() == "mine" and reads == []
    for name, make in (("file", lambda p: p.write_text("junk")), ("link", lambda p: p.symlink_to("/nonexistent"))):
        make(cache / name)
        with pytest.raises(ValueError, match="is in the place of the model cache's entry but is not a directory"):
            loader.convert_gguf(path, cache / name)
    assert reads == []
    damaged = cache / "d"
    damaged.mkdir()
    (damaged / "config.json").write_text("{}")  # ours, its weights lost
    assert loader.is_converted(loader.convert_gguf(path, damaged)) and len(reads) == 1


def test_a_full_disk_while_converting_is_one_error(tmp_path, fake_gguf, monkeypatch):
    """safetensors reports a failed write as its own error, not an OSError: it escaped as a
    traceback (exit 1) where a full disk should be one line naming the cache."""
    from safetensors import SafetensorError

    path, _ = fake_gguf

    def full(self, d):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                              "\"No space left on device\" }) (os error 28)")
    monkeypatch.setattr(FakeModel, "save_pretrained", full)
    monkeypatch.setenv("KVSIEVE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"cannot use the model cache .*cache \(.*No space left on device.*\); "
                                         "free some space"):
        loader.convert_gguf(path, tmp_path / "cache" / "m")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m.lock"]


def test_the_embedded_model_by_any_spelling_of_its_directory_gets_its_heads(tmp_path, monkeypatch):
    """`--model .` (or a link of another name) to the converted embedded model lost its shipped
    streaming and dense heads: the directory's name was read unresolved ("." has none)."""
    from kvsieve.patterns import EMBEDDED_PATTERN, default_pattern

    d = tmp_path / "smollm2-135m-instruct"
    d.mkdir()
    (tmp_path / "other-name").symlink_to(d)
    monkeypatch.chdir(d)
    for spelling in (".", "./", str(d), str(tmp_path / "other-name"), "../smollm2-135m-instruct"):
        assert default_pattern(spelling, 30, 3) == EMBEDDED_PATTERN, spelling
    assert default_pattern(str(tmp_path), 30, 3) is None


def test_environment_variables_are_read_as_documented(monkeypatch):
    """KVSIEVE_DEBUG=0 meant debug on; a misspelt KVSIEVE_KERNELS was silently auto; a blank
    KVSIEVE_CACHE_DIR put the cache in './ '."""
    import torch

    from kvsieve.cli import _debug
    from kvsieve.kernels import use_triton
    from kvsieve.model.cache import cache_root

    for value, on in (("", False), ("0", False), ("false", False), ("No", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("KVSIEVE_DEBUG", value)
        assert _debug() == on, value
    monkeypatch.setenv("KVSIEVE_KERNELS", "refernce")
    with pytest.raises(ValueError, match="KVSIEVE_KERNELS='refernce': give auto .* or reference"):
        use_triton(torch.zeros(1))
    monkeypatch.setenv("KVSIEVE_KERNELS", "Reference")
    assert use_triton(torch.zeros(1)) is False
    monkeypatch.setenv("KVSIEVE_CACHE_DIR", "  ")
    assert cache_root() == Path(os.path.expanduser("~/.cache/kvsieve")).absolute()
    from kvsieve.kernels.pdl import pdl_on

    for value, on in (("1", True), ("on", True), ("0", False), ("off", False), ("False", False), ("no", False)):
        monkeypatch.setenv("KVSIEVE_PDL", value)  # (off/false/no left PDL on: only "0" turned it off)
        assert pdl_on() == on, value
    monkeypatch.setenv("KVSIEVE_PDL", "of")
    with pytest.raises(ValueError, match="KVSIEVE_PDL='of' is not 0 or 1"):
        pdl_on()


def test_an_entry_damaged_later_is_converted_again_and_other_damage_names_the_fix(tmp_path, fake_gguf, monkeypatch):
    """An entry whose files were later cut short or deleted (its manifest's sizes no longer
    match), or one an earlier version wrote (an older manifest format, or none), is converted
    again, not loaded half; where a damaged file keeps its size, the error says to delete the
    entry (not to download the model); an unreadable weights file is named as unreadable, not
    as missing."""
    path, reads = fake_gguf
    monkeypatch.setenv("KVSIEVE_CACHE_DIR", str(tmp_path / "cache"))
    out = loader.convert_gguf(path, tmp_path / "cache" / "m")
    assert json.loads((out / "kvsieve-entry.json").read_text())["files"]["model.safetensors"] == len(b"weights")
    for damage in (lambda: (out / "model.safetensors").write_bytes(b"cut"),
                   lambda: (out / "tokenizer_config.json").unlink()):
        damage()
        assert not loader.is_converted(out)
        assert loader.convert_gguf(path, out) == out and loader.is_converted(out)
    assert len(reads) == 3 and (out / "model.safetensors").read_bytes() == b"weights"
    (out / "config.json").write_text("x" * len(json.dumps(CONFIG)))  # same size: not seen by the manifest
    with pytest.raises(ValueError, match=f"entry {out} is damaged: delete it, and kvsieve converts the model again"):
        loader.load_weights(out)
    manifest = json.loads((out / "kvsieve-entry.json").read_text())
    assert manifest["format"] == CONVERSION_FORMAT
    for older in ({"files": manifest["files"]}, None):  # entries earlier versions wrote: converted again, once
        if older is None:
            (out / "kvsieve-entry.json").unlink()
        else:
            (out / "kvsieve-entry.json").write_text(json.dumps(older))
        assert not loader.is_converted(out)
        assert loader.convert_gguf(path, out) == out and loader.is_converted(out)
        assert loader.convert_gguf(path, out) == out
    assert len(reads) == 5 and json.loads((out / "config.json").read_text()) == CONFIG
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="pass a Llama-family or Gemma 3") as e:
        loader.load_weights(mine)
    assert "delete" not in str(e.value)


def test_unreadable_weights_and_a_directory_of_ggufs_are_named(tmp_path, monkeypatch):
    """A weights file without read permission is called unreadable (safetensors says 'no such
    file'); a directory holding a .gguf and no config names the file to pass."""
    from safetensors.torch import save_file
    import torch

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    save_file({"x": torch.zeros(1)}, str(d / "model.safetensors"))
    monkeypatch.setattr(loader.os, "access", lambda p, mode: Path(p).name != "model.safetensors")
    with pytest.raises(ValueError, match="cannot read weights file .*model.safetensors: permission denied"):
        loader.load_weights(d)
    g = tmp_path / "g"
    g.mkdir()
    (g / "Model.Q4.gguf").write_bytes(b"GGUF")
    (g / "config.json").write_text("{}")  # (GGUF repositories often ship one beside the file)
    with pytest.raises(ValueError, match=r"holding Model.Q4.gguf: pass the file itself \(--model .*g/Model.Q4.gguf\)"):
        loader.resolve_model_dir(str(g))


def test_a_tokenizer_transformers_cannot_build_is_one_line_naming_the_directory(tmp_path, monkeypatch):
    """tokenizer_config.json without tokenizer.json (a partial download): one line naming the
    directory, not transformers' several-line message that names none."""
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(ValueError, match=f"could not load the tokenizer in {d} .*copy the model's tokenizer files") as e:
        loader.load_tokenizer(d)
    assert "\n" not in str(e.value)

    def needs_package(*a, **kw):
        raise ValueError("`sentencepiece` is required to read this tokenizer: pip install sentencepiece\nmore")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", needs_package)
    with pytest.raises(ValueError, match="in .*tok: `sentencepiece` is required .*pip install sentencepiece$") as e:
        loader.load_tokenizer(d)
    assert "copy the model's" not in str(e.value)


def test_a_long_gguf_name_fits_the_cache_and_a_missing_dir_gguf_is_not_a_hub_id(tmp_path, fake_gguf, monkeypatch):
    """A legal 240-byte file name converts (its entry and staging names kept under the 255-byte
    limit); `models/x.gguf` that does not exist is a missing path, not a Hub repository."""
    path, reads = fake_gguf
    monkeypatch.setenv("KVSIEVE_CACHE_DIR", str(tmp_path / "cache"))
    long = tmp_path / ("é" * 118 + ".gguf")  # 236 bytes + 5
    long.write_bytes(b"GGUF")
    out = loader.resolve_model_dir(str(long))
    assert loader.is_converted(out) and len(out.name.encode()) <= 120 and out.name.startswith("é" * 50)
    with pytest.raises(FileNotFoundError, match="model path 'models/x.gguf' does not exist"):
        loader.resolve_model_dir("models/x.gguf")
