"""Our Llama-family forward vs transformers on tiny random models of each supported type."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvsieve.model.loader import load_weights
from kvsieve.model.runner import Engine

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

CASES = {
    "llama3.1": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=None)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tmp_path, name):
    cls, extra = CASES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls)(**TINY, **extra)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if name == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias is not None
        for m in hf.modules():  # random (not zero) biases, so a dropped bias would show
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                torch.nn.init.normal_(m.bias, std=0.5)
    hf.save_pretrained(tmp_path)
    model = load_weights(tmp_path)
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    eng = Engine(model, "dense", prefill_chunk=64, progress=False)
    cache = eng.new_cache([ids], 1)
    cache.reserve(0, len(ids))
    ours = model.logits(eng.prefill(cache, 0, ids, all_positions=True))
    assert (ours - ref).abs().max().item() < 1e-4
