"""kvsieve.hf on the embedded model through transformers' own generate()."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvsieve.hf as khf
from kvsieve.model.loader import resolve_model_dir
from kvsieve.prompts import passkey_prompt


@pytest.fixture(scope="module")
def hf_model():
    d = resolve_model_dir(None)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return model, tok


def greedy(model, enc, n=10):
    with torch.no_grad():
        return model.generate(**enc, max_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("method,opts", [("tactic", {"threshold": 1.0}), ("quest", {"budget": 100_000}),
                                         ("lserve", {"budget": 100_000, "streaming_heads": [0, 0, 0]})])
def test_full_budget_generation_equals_hf_on_a_padded_batch(hf_model, method, opts):
    model, tok = hf_model
    from pydoc_data.topics import topics

    long = topics["assert"][:1500]
    enc = tok(["The capital of France is", long + "\nIn one sentence, assert"], return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any(), "the batch must be padded for this test to mean something"
    ref = greedy(model, enc)
    state = khf.enable(model, method, **opts)
    try:
        out = greedy(model, enc)
    finally:
        khf.disable(model)
    assert state.kv_read_steps > 0, "decode steps must have gone through kvsieve"
    assert torch.equal(out, ref)


def test_tactic_retrieves_passkey_through_hf_generate(hf_model):
    """K-means' random init decides borderline cases at this length: seed 0 answers 4199
    for 41190 (since the local window is kept out of the index), seeds 1 and 2 retrieve.
    We require 2 of 3 seeds, reading under half the cache."""
    model, tok = hf_model
    text, key = passkey_prompt(lambda s: len(tok.encode(s, add_special_tokens=False)), 1500, 0.4, seed=3)
    enc = tok([text], return_tensors="pt")
    hits = 0
    for seed in range(3):
        state = khf.enable(model, "tactic", threshold=0.9, seed=seed)
        try:
            out = greedy(model, enc, 8)
        finally:
            khf.disable(model)
        hits += key in tok.decode(out[0, enc.input_ids.shape[1]:])
        assert state.kv_fraction < 0.5, state.kv_fraction
    assert hits >= 2, hits


def test_disable_restores_the_model(hf_model):
    model, tok = hf_model
    enc = tok(["Hello, my name is"], return_tensors="pt")
    before = model.config._attn_implementation
    ref = greedy(model, enc)
    khf.enable(model, "streaming", sink=1, local=2)
    sparse = greedy(model, enc)
    khf.disable(model)
    assert model.config._attn_implementation == before
    assert torch.equal(greedy(model, enc), ref)
    assert not torch.equal(sparse, ref), "a 3-token window must change the output"


def test_right_padding_is_refused_with_a_clear_error(hf_model):
    model, tok = hf_model
    tok.padding_side = "right"
    try:
        enc = tok(["Hi", "A much longer prompt than the first"], return_tensors="pt", padding=True)
    finally:
        tok.padding_side = "left"
    khf.enable(model, "tactic")
    try:
        with pytest.raises(ValueError, match="left-padded"):
            greedy(model, enc, 2)
    finally:
        khf.disable(model)


def test_enable_rejects_bad_options(hf_model):
    with pytest.raises(ValueError, match="threshold"):
        khf.enable(hf_model[0], "tactic", threshold=2.0)
