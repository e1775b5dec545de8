"""Our Llama-family forward vs transformers on tiny random models of each supported type, and the
same models through GGUF files (RoPE scaling carried over)."""
import json
import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvsieve.model.loader import load_weights
from kvsieve.model.runner import Engine

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

CASES = {
    "llama": ("LlamaConfig", {}),
    "llama-linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama3.1": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=None)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),  # per-head q/k RMSNorm before RoPE; head_dim != hidden / heads
    # windows: Mistral's on every layer, Qwen2's from max_window_layers on (200 tokens >> 16)
    "mistral-window": ("MistralConfig", dict(head_dim=16, sliding_window=16)),
    # YaRN (Qwen2.5's long-context setting): blended frequencies and a factor on cos/sin
    "qwen2-yarn": ("Qwen2Config", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64})),
    "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    # YaRN over the whole max_position_embeddings (its config.json then may omit the original)
    "qwen2-yarn-whole": ("Qwen2Config", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 512})),
    # a head dim that is not a power of two (H2O-Danube's 80, Phi-3's 96): kernels pad the channels
    "llama-hd80": ("LlamaConfig", dict(head_dim=80)),
}


def tiny_hf(name: str, path):
    """The tiny random transformers model of CASES[name], saved to path, with its biases and
    q/k norm weights randomised (a dropped bias or norm would show)."""
    cls, extra = CASES[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**TINY, **extra)).eval()
    if name.startswith("qwen2"):
        assert hf.model.layers[0].self_attn.q_proj.bias is not None
    for n, prm in hf.named_parameters():
        if n.endswith(".bias"):
            torch.nn.init.normal_(prm, std=0.5)
        elif "q_norm" in n or "k_norm" in n:
            torch.nn.init.normal_(prm, mean=1.0, std=0.5)
    hf.save_pretrained(path)
    return hf


def byte_vocab(n: int) -> list:
    """GPT-2's 256 byte-level tokens, one merge ("Ġt"), <s>, </s>, then fillers: n tokens."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(sorted(set(range(256)) - set(keep)))}
    toks = [chars[b] for b in range(256)] + ["Ġt", "<s>", "</s>"]
    return toks + [f"<extra{i}>" for i in range(n - len(toks))]


GGUF_TENSORS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
                "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
GEMMA_TENSORS = {**GGUF_TENSORS, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def tiny_gguf(path, hf, arch="llama", keys=None, extra=None, drop=(), tokens=None):
    """hf (a tiny transformers model) as a float32 GGUF file written the way llama.cpp's converter
    writes one: its metadata (`keys` overrides a key after "<arch>."; None leaves it out), q/k
    rows permuted for llama, Gemma's norm weights + 1, a byte-level vocabulary (`tokens` replaces
    it); extra(writer) adds keys or tensors; the GGUF tensors named in `drop` are left out."""
    import gguf

    c = hf.config
    heads, head_dim = c.num_attention_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    meta = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
            "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
            "attention.head_count": heads, "attention.head_count_kv": c.num_key_value_heads,
            "attention.layer_norm_rms_epsilon": c.rms_norm_eps, "rope.freq_base": rope["rope_theta"],
            "attention.key_length": head_dim, "rope.dimension_count": head_dim,
            "attention.sliding_window": getattr(c, "sliding_window", None) if arch == "gemma3" else None}
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {**meta, **(keys or {})}.items():
        if value is not None:
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens or byte_vocab(c.vocab_size))
    w.add_token_types([1] * 257 + [3] * (c.vocab_size - 257))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    if extra:
        extra(w)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    shift = 1.0 if arch == "gemma3" else 0.0
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"],
               "output_norm.weight": sd["model.norm.weight"] + shift}
    if not c.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        for name, short in (GEMMA_TENSORS if arch == "gemma3" else GGUF_TENSORS).items():
            for kind in ("weight", "bias"):
                a = sd.get(f"model.layers.{i}.{name}.{kind}")
                if a is None:
                    continue
                if arch == "llama" and name in ("self_attn.q_proj", "self_attn.k_proj"):  # llama.cpp's rotary layout
                    n = heads if name == "self_attn.q_proj" else c.num_key_value_heads
                    a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
                tensors[f"blk.{i}.{short}.{kind}"] = a + (shift if "norm" in name else 0.0)
    for name, a in tensors.items():
        if name not in drop:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_freqs(theta, dim, factor, low, high, old):
    """The rope_freqs tensor llama.cpp's converter writes for llama3 scaling (float32)."""
    factors = []
    for f in 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / f
        smooth = (old / wavelen - low) / (high - low)
        factors.append(1.0 if wavelen < old / high else factor if wavelen > old / low
                       else 1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tmp_path, name):
    hf = tiny_hf(name, tmp_path)
    model = load_weights(tmp_path)
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    eng = Engine(model, "dense", prefill_chunk=64, progress=False)
    cache = eng.new_cache([ids], 1)
    cache.reserve(0, len(ids))
    ours = model.logits(eng.prefill(cache, 0, ids, all_positions=True))
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window", "qwen3"])
def test_decode_matches_transformers_generate(tmp_path, name, paged):
    """Greedy decode (past the window of 16 for windowed models) through the engine equals HF
    generate; sparse methods run on the global layers (Qwen2's first) and leave window-only
    models (this Mistral) to their windows."""
    from kvsieve.engine import LLMEngine, SamplingParams

    hf = tiny_hf(name, tmp_path)
    model = load_weights(tmp_path)
    ids = torch.randint(3, 300, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        x = torch.tensor([ids])
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False)[0, 70:].tolist()
    got = LLMEngine(model, None, "dense", paged=paged).generate([ids], SamplingParams(10, ignore_eos=True))[0]
    assert got.tokens == want
    windowed = name == "mistral-window"  # every layer its window: no method runs, and the output says so
    for method, opts in [("tactic", dict(cluster_size=8, local=8, sink=2, protect=0)),
                         ("quest", dict(budget=16, physical_page_size=16))]:
        out = LLMEngine(model, None, method, paged=paged, dense_below=0, **opts).generate(
            [ids], SamplingParams(6, ignore_eos=True))[0]
        assert len(out.tokens) == 6 and 0 < out.kv_fraction < 1
        assert (out.attended_densely, out.dense_reason) == ((True, "windowed_model") if windowed else (False, None))
        if windowed:
            assert out.tokens == got.tokens[:6]
    if windowed:
        from types import SimpleNamespace

        from kvsieve.model.cli import attended_densely_note

        eng = LLMEngine(model, None, "quest", budget=16)
        note = attended_densely_note(SimpleNamespace(method="quest"), eng, ["windowed_model"])
        assert note.startswith("--- attended as dense: every layer of this model attends its own sliding window of "
                               "16 tokens, so quest has no layer to run on")


def test_a_head_dim_not_a_power_of_two_decodes_as_transformers_in_every_kernel(tmp_path):
    """head_dim 80 through the engine's kernels (the interpreter here, CUDA on the GPU): the
    channels past 80 are masked, so dense decode and sparse decode at a full budget equal HF
    generate, and sparse decode at a small budget reads part of the cache."""
    from kvsieve.engine import LLMEngine, SamplingParams

    hf = tiny_hf("llama-hd80", tmp_path)
    model = load_weights(tmp_path)
    ids = torch.randint(3, 300, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        x = torch.tensor([ids])
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False)[0, 70:].tolist()
    small = dict(cluster_size=8, local=8, sink=2)
    for method, opts in [("dense", {}), ("tactic", dict(threshold=1.0, **small)), ("quest", dict(budget=4096)),
                         ("lserve", dict(budget=4096, streaming_heads=None))]:
        got = LLMEngine(model, None, method, **opts).generate([ids], SamplingParams(6, ignore_eos=True))[0]
        assert got.tokens == want, method
    for method, opts in [("tactic", dict(budget=16, **small)), ("quest", dict(budget=16, physical_page_size=16))]:
        got = LLMEngine(model, None, method, **opts).generate([ids], SamplingParams(6, ignore_eos=True))[0]
        assert len(got.tokens) == 6 and 0 < got.kv_fraction < 0.8, (method, got.kv_fraction)


def test_yarn_without_original_positions_takes_max_position_embeddings(tmp_path):
    """A YaRN config.json without original_max_position_embeddings (a KeyError before) reads as
    transformers reads it: the original is max_position_embeddings."""
    import json

    tiny_hf("qwen2-yarn-whole", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    with_original = load_weights(tmp_path)
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(cfg.get(key), dict):
            cfg[key].pop("original_max_position_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    without = load_weights(tmp_path)
    assert without.cfg.max_positions == with_original.cfg.max_positions == 2048
    pos = torch.arange(149)
    assert torch.equal(without.rope(pos)[0], with_original.rope(pos)[0])


def test_yarn_config_takes_its_scaled_positions():
    """Qwen2.5's long-context recipe adds YaRN (factor 4 over 32K) to a config whose
    max_position_embeddings stays 32K: prompts up to 128K are the model's own."""
    from kvsieve.model.config import ModelConfig

    d = dict(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768)
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert ModelConfig.from_hf(d).max_positions == 32768
    assert ModelConfig.from_hf({**d, "rope_scaling": yarn}).max_positions == 131072
    linear = {"type": "linear", "factor": 4.0}
    assert ModelConfig.from_hf({**d, "rope_scaling": linear}).max_positions == 32768
    for plain in ({"rope_type": "default"}, {"type": "default"}, {"rope_type": "default", "rope_theta": 1e6}):
        cfg = ModelConfig.from_hf({**d, "rope_scaling": plain})  # transformers reads it as plain RoPE (was refused)
        assert cfg.rope_scaling is None and cfg == ModelConfig.from_hf(d)


def test_hub_id_resolves_through_the_hub_cache(tmp_path, monkeypatch, capsys):
    """--model org/name (not a local path) is fetched from the Hugging Face Hub once (config,
    safetensors, tokenizer); a failed fetch or a repo without safetensors is one clear error,
    exit code 2 from the CLI."""
    import huggingface_hub

    from kvsieve.cli import main
    from kvsieve.model.loader import HUB_FILES, resolve_model_dir

    tiny_hf("qwen3", tmp_path / "snap")
    calls = []

    def fake(repo_id, allow_patterns=None, ignore_patterns=None, **kw):
        calls.append((repo_id, allow_patterns))
        assert ignore_patterns == ["consolidated*"]  # Mistral's second copy of the weights is not fetched
        if repo_id == "org/tiny":
            return str(tmp_path / "snap")
        if repo_id == "org/bin-only":
            (tmp_path / "bin").mkdir(exist_ok=True)
            (tmp_path / "bin" / "config.json").write_text("{}")
            return str(tmp_path / "bin")
        raise OSError("Repository Not Found for url: https://huggingface.co/api/models/" + repo_id)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_model_dir("org/tiny") == tmp_path / "snap" and calls[0] == ("org/tiny", HUB_FILES)
    assert load_weights(resolve_model_dir("org/tiny")).cfg.model_type == "qwen3"
    with pytest.raises(ValueError, match="has no config.json \\+ \\*.safetensors"):
        resolve_model_dir("org/bin-only")
    capsys.readouterr()
    rc = main(["generate", "--model", "org/missing", "--prompt", "hi", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "fetching it from the Hugging Face Hub failed (OSError: Repository Not Found" in err
    assert err.count("\n") == 1


def test_weights_that_do_not_fit_the_config_are_refused_by_name(tmp_path):
    """A config.json of another model than its weights (more layers, other KV heads) or a
    missing tensor: one ValueError naming the tensor and what the config needs."""
    import json

    from safetensors.torch import load_file, save_file

    tiny_hf("llama3.1", tmp_path)
    cfg_path, st_path = tmp_path / "config.json", next(tmp_path.glob("*.safetensors"))
    cfg = json.loads(cfg_path.read_text())
    for change, message in ((dict(num_hidden_layers=3), "have no model.layers.2.self_attn.q_proj.weight"),
                            (dict(num_key_value_heads=4), r"k_proj.weight in .* has shape \[32, 64\], but config.json")):
        cfg_path.write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=message):
            load_weights(tmp_path)
    cfg_path.write_text(json.dumps(cfg))
    w = load_file(str(st_path))
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, str(st_path))
    with pytest.raises(ValueError, match="have no model.layers.1.mlp.up_proj.weight"):
        load_weights(tmp_path)


def test_a_model_without_tokenizer_files_is_named(tmp_path):
    from kvsieve.model.loader import load_tokenizer

    tiny_hf("qwen2", tmp_path)
    with pytest.raises(ValueError, match=r"no tokenizer in .* \(none of tokenizer.json"):
        load_tokenizer(tmp_path)


def test_incomplete_or_mismatched_checkpoints_are_refused(tmp_path):
    """What loaded silently wrong: a sharded checkpoint missing the shard of its lm_head (the
    embeddings stood in for it), a config's vocabulary larger than the embeddings, a
    non-SiLU hidden_act (SiLU ran anyway), a count given as a string (a traceback). And what
    loaded too much: a consolidated.safetensors beside indexed shards is not read."""
    import json

    from safetensors.torch import save_file

    hf = tiny_hf("llama3.1", tmp_path / "m")
    d = tmp_path / "m"
    for f in d.glob("*.safetensors"):
        f.unlink()
    hf.save_pretrained(d, max_shard_size="50KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64)}, str(d / "consolidated.safetensors"))
    m = load_weights(d)
    assert not any(k.startswith("layers.") for k in m.w) and "lm_head.weight" in m.w
    (d / index["lm_head.weight"]).unlink()
    with pytest.raises(ValueError, match=index["lm_head.weight"] + ", which its model.safetensors.index.json names"):
        load_weights(d)

    tiny_hf("llama3.1", tmp_path / "u")  # one file, untied, its lm_head dropped
    from safetensors.torch import load_file
    st = next((tmp_path / "u").glob("*.safetensors"))
    w = load_file(str(st))
    del w["lm_head.weight"]
    save_file(w, str(st))
    with pytest.raises(ValueError, match="have no lm_head.weight"):
        load_weights(tmp_path / "u")

    from kvsieve.model.loader import resolve_model_dir
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text("{}")
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="holds PyTorch .bin/.pt weights; kvsieve reads safetensors: convert"):
        resolve_model_dir(str(tmp_path / "bin"))

    tiny_hf("qwen2", tmp_path / "q")
    cfg_path = tmp_path / "q" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for change, message in ((dict(vocab_size=600), r"embed_tokens.weight in .* has shape \[300, 64\].*needs \[600, 64\]"),
                            (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act 'gelu_pytorch_tanh' is not supported"),
                            (dict(num_hidden_layers="2"), "num_layers must be a positive integer, got '2'")):
        cfg_path.write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=message):
            load_weights(tmp_path / "q")


def test_generation_config_end_tokens_stop_generation_too(tmp_path):
    """Instruct checkpoints list end-of-turn tokens in generation_config.json (transformers'
    generate stops on them): they join config.json's eos_token_id."""
    import json

    tiny_hf("qwen3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 9}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 77, 78]}))
    assert load_weights(tmp_path).cfg.eos_token_ids == (9, 77, 78)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_weights(tmp_path).cfg.eos_token_ids == (9, 5)
    (tmp_path / "generation_config.json").unlink()
    assert load_weights(tmp_path).cfg.eos_token_ids == (9,)


def _gguf_rope(name, hf):
    """(GGUF architecture, extra(writer)) writing CASES[name]'s RoPE scaling as llama.cpp's converter
    does: Llama 3.1's as the rope_freqs tensor alone, linear and YaRN as rope.scaling.* keys."""
    import gguf

    sc = CASES[name][1].get("rope_scaling", {})
    if name == "llama3.1":
        freqs = llama3_rope_freqs(hf.config.rope_parameters["rope_theta"], hf.config.head_dim, sc["factor"],
                                  sc["low_freq_factor"], sc["high_freq_factor"], sc["original_max_position_embeddings"])
        return "llama", lambda w: w.add_tensor("rope_freqs.weight", freqs)

    def keys(w):
        w.add_rope_scaling_type(gguf.RopeScalingType(sc["rope_type"]))
        w.add_rope_scaling_factor(sc["factor"])
        if "original_max_position_embeddings" in sc:
            w.add_rope_scaling_orig_ctx_len(sc["original_max_position_embeddings"])
    return ("qwen2" if name.startswith("qwen2") else "llama"), keys


@pytest.mark.parametrize("name", ["llama3.1", "llama-linear", "qwen2-yarn"])
def test_gguf_rope_scaling_is_carried_over(tmp_path, name):
    """A GGUF's RoPE scaling (Llama 3.1/3.2's rope_freqs tensor; linear and YaRN metadata) reaches
    the converted model: the same frequencies, logits and greedy tokens as the safetensors
    original (it was dropped: plain RoPE, other tokens after a few). transformers reads the
    converted directory as the original too (rope_freqs: LongRoPE with equal factors)."""
    from kvsieve.engine import LLMEngine, SamplingParams
    from kvsieve.model.loader import convert_gguf

    hf = tiny_hf(name, tmp_path / "hf")
    arch, extra = _gguf_rope(name, hf)
    d = convert_gguf(tiny_gguf(tmp_path / "m.gguf", hf, arch, extra=extra), tmp_path / "cache" / "m")
    ours, original = load_weights(d), load_weights(tmp_path / "hf")
    assert torch.allclose(ours.inv_freq, original.inv_freq, rtol=1e-6, atol=0)
    assert ours.rope_mult == original.rope_mult and ours.cfg.max_positions == original.cfg.max_positions
    ids = torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        hf_converted = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        assert (hf_converted(torch.tensor([ids])).logits[0] - ref).abs().max().item() < 1e-4
    eng = Engine(ours, "dense", prefill_chunk=64, progress=False)
    cache = eng.new_cache([ids], 1)
    cache.reserve(0, len(ids))
    assert (ours.logits(eng.prefill(cache, 0, ids, all_positions=True)) - ref).abs().max().item() < 1e-4
    want = LLMEngine(original, None, "dense").generate([ids], SamplingParams(12, ignore_eos=True))[0].tokens
    assert LLMEngine(ours, None, "dense").generate([ids], SamplingParams(12, ignore_eos=True))[0].tokens == want


def test_gguf_rope_scaling_kvsieve_cannot_run_is_refused():
    """llama.cpp's RoPE metadata read as llama.cpp reads it (a factor without a type is linear;
    type none scales nothing), and what kvsieve cannot run refused by name, never dropped."""
    from kvsieve.model.gguf import gguf_rope_scaling

    meta = {"llama.context_length": 512, "llama.embedding_length": 64, "llama.attention.head_count": 4}
    sc = "llama.rope.scaling."
    assert gguf_rope_scaling("llama", meta, None, "x.gguf") is None
    assert gguf_rope_scaling("llama", {**meta, sc + "factor": 2.0}, None, "x") == {"rope_type": "linear", "factor": 2.0}
    assert gguf_rope_scaling("llama", {**meta, sc + "type": "none", sc + "factor": 2.0}, None, "x") is None
    assert gguf_rope_scaling("llama", {**meta, "llama.rope.scale_linear": 4.0}, None, "x")["factor"] == 4.0
    yarn = {**meta, sc + "type": "yarn", sc + "factor": 4.0, sc + "yarn_beta_fast": 16.0, sc + "attn_factor": 1.0}
    assert gguf_rope_scaling("llama", yarn, None, "x") == {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                                                           "original_max_position_embeddings": 512}
    assert gguf_rope_scaling("llama", meta, [1.0] * 8, "x") is None  # all ones: plain RoPE
    for change, freqs, message in (
            ({sc + "type": "longrope"}, None, "type = 'longrope', which kvsieve does not run"),
            ({sc + "type": "yarn", sc + "factor": 4.0, sc + "attn_factor": 0.5}, None,
             "sets llama.rope.scaling.attn_factor = 0.5, a RoPE scaling setting kvsieve does not run"),
            ({sc + "yarn_log_multiplier": 0.1}, None, "llama.rope.scaling.yarn_log_multiplier"),
            ({sc + "type": "linear", sc + "factor": 2.0}, [2.0] * 8, "rope_freqs tensor together with"),
            ({}, [2.0] * 4, "rope_freqs tensor with 4 factors for head_dim 16")):
        with pytest.raises(ValueError, match=message):
            gguf_rope_scaling("llama", {**meta, **change}, freqs, "x.gguf")
    with pytest.raises(ValueError, match="rope_freqs tensor on a Gemma 3 model"):
        gguf_rope_scaling("gemma3", {"gemma3.attention.key_length": 16}, [2.0] * 8, "x.gguf")


def test_rope_fields_missing_follow_transformers_or_are_named(tmp_path):
    """llama3 without original_max_position_embeddings takes max_position_embeddings (transformers'
    fallback; it was a KeyError traceback); a field a scaling type needs that is missing or not a
    positive number is one ValueError naming it (a KeyError from the forward before)."""
    import json

    from kvsieve.model.config import ModelConfig

    hf = tiny_hf("llama3.1", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {
        **{k: v for k, v in rope.items() if k != "original_max_position_embeddings"}}}))
    model = load_weights(tmp_path)
    assert model.cfg.rope_scaling["original_max_position_embeddings"] == 512
    ids = torch.randint(0, 300, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()(torch.tensor([ids])).logits[0]
    eng = Engine(model, "dense", prefill_chunk=64, progress=False)
    cache = eng.new_cache([ids], 1)
    cache.reserve(0, len(ids))
    assert (model.logits(eng.prefill(cache, 0, ids, all_positions=True)) - ref).abs().max().item() < 1e-4
    del hf
    base = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")}
    top = ModelConfig.from_hf({**base, "original_max_position_embeddings": 32, "rope_parameters": rope})
    assert top.rope_scaling["original_max_position_embeddings"] == 32  # transformers: the top level wins
    for params, message in (({"rope_type": "linear", "rope_theta": 1e4}, "rope scaling 'linear' needs factor"),
                            ({**rope, "low_freq_factor": None}, "'llama3' needs low_freq_factor"),
                            ({**rope, "factor": "8"}, "'llama3' needs factor \\(a positive number\\), got '8'"),
                            ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
                             "different short_factor and long_factor"),
                            ({"rope_type": "dynamic", "factor": 2.0}, "unsupported rope scaling 'dynamic'")):
        (tmp_path / "config.json").write_text(json.dumps({**base, "rope_parameters": params}))
        with pytest.raises(ValueError, match=message):
            load_weights(tmp_path)


def test_a_gguf_is_read_alone_with_its_end_of_turn_token_and_bad_files_are_named(tmp_path):
    """A tokenizer.json beside the .gguf (another model's) does not replace the GGUF's own
    tokenizer; the GGUF's end-of-turn token ends generation as its EOS does (llama.cpp stops on
    it; transformers' reader drops it); one shard of a split GGUF, KV heads that do not divide
    the query heads, an EOS outside the vocabulary and a file cut short are each refused by
    name before anything is cached."""
    from kvsieve.model.loader import convert_gguf, load_tokenizer

    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = tiny_hf("llama", tmp_path / "hf")
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    alone = convert_gguf(tiny_gguf(tmp_path / "a" / "m.gguf", hf, extra=lambda w: w.add_eot_token_id(7)),
                         tmp_path / "cache" / "a")
    other = Tokenizer(models.WordLevel({"hello": 0, "there": 1, "[UNK]": 2}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    other.save(str(tmp_path / "b" / "tokenizer.json"))  # another model's tokenizer, beside the file
    beside = convert_gguf(tiny_gguf(tmp_path / "b" / "m.gguf", hf), tmp_path / "cache" / "b")
    want = load_tokenizer(alone).encode("hello there")
    assert load_tokenizer(beside).encode("hello there") == want
    assert load_weights(alone).cfg.eos_token_ids == (258, 7) and load_weights(beside).cfg.eos_token_ids == (258,)
    # no end-of-turn key: the tokens llama.cpp ends generation on by their text (gemma3-270m's <end_of_turn>)
    vocab = byte_vocab(hf.config.vocab_size)
    vocab[299], vocab[290], vocab[280], vocab[270] = "<end_of_turn>", "<|endoftext|>", "end_of_turn", "<eot>"
    by_text = convert_gguf(tiny_gguf(tmp_path / "c.gguf", hf, tokens=vocab), tmp_path / "cache" / "c")
    assert load_weights(by_text).cfg.eos_token_ids == (258, 299, 290)
    both = convert_gguf(tiny_gguf(tmp_path / "d.gguf", hf, tokens=vocab, extra=lambda w: w.add_eot_token_id(299)),
                        tmp_path / "cache" / "d")
    assert load_weights(both).cfg.eos_token_ids == (258, 299, 290)
    assert json.loads((by_text / "generation_config.json").read_text())["eos_token_id"] == [258, 299, 290]
    c = hf.config
    for case, keys, extra, message in [
            ("split", None, lambda w: (w.add_uint16("split.no", 0), w.add_uint16("split.count", 2)),
             "shard 1 of a GGUF split in 2 files; merge them"),
            ("kv3", {"attention.head_count_kv": 3}, None, "head_count_kv = 3, which does not divide"),
            ("eos", None, lambda w: w.add_uint32("tokenizer.ggml.eot_token_id", c.vocab_size + 5),
             f"eot_token_id = {c.vocab_size + 5}, outside its vocabulary of {c.vocab_size} tokens")]:
        path = tiny_gguf(tmp_path / f"{case}.gguf", hf, keys=keys, extra=extra)
        with pytest.raises(ValueError, match=message):
            convert_gguf(path, tmp_path / "cache" / case)
        assert not (tmp_path / "cache" / case).exists()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((tmp_path / "a" / "m.gguf").read_bytes()[:-1000])
    with pytest.raises(ValueError, match="it is cut short or not a GGUF file; download it again"):
        convert_gguf(cut, tmp_path / "cache" / "cut")
