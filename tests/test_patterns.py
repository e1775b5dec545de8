"""Streaming-head patterns: choice by Λ mass, file round trip, validation, calibration on a
tiny model against the float64 oracle, and the CLI's errors."""
import json

import pytest
import torch

from kvsieve.patterns import (EMBEDDED_PATTERN, choose_streaming, default_pattern, load_pattern, pattern_for,
                              save_pattern)

from conftest import oracle
from test_eval import error_lines


def test_choose_streaming_takes_the_highest_lambda_mass_over_all_layers():
    scores = [[0.9, 0.1, 0.5], [0.2, 0.95, 0.3]]
    assert choose_streaming(scores, 0.5) == ((True, False, True), (False, True, False))
    assert choose_streaming(scores, 0.0) == ((False,) * 3,) * 2
    assert choose_streaming(scores, 1.0) == ((True,) * 3,) * 2
    assert sum(map(sum, choose_streaming(scores, 1 / 3))) == 2
    for bad in (-0.1, 1.5, True):
        with pytest.raises(ValueError, match=r"--ratio must be a fraction of KV heads in \[0, 1\]"):
            choose_streaming(scores, bad)


def test_pattern_file_round_trip_and_errors(tmp_path):
    pat = ((True, False), (False, False), (True, True))
    path = tmp_path / "p.json"
    save_pattern(path, pat, {"lambda_mass": [[0.9, 0.1], [0.2, 0.3], [0.8, 0.7]]}, {"model": "m", "ratio": 0.5})
    assert '  "10",' in path.read_text()  # one human-readable row per layer
    assert load_pattern(path, 3, 2) == pat
    with pytest.raises(ValueError, match=r"is for a model with 3 layers x 2 KV heads .* but this model has 30 x 3"):
        load_pattern(path, 30, 3)
    doc = json.loads(path.read_text())
    for mutate, msg in [(lambda d: d.pop("streaming"), "malformed"), (lambda d: d.update(streaming=["12"]), "0/1"),
                        (lambda d: d.update(streaming=["10", "1"]), "same number"),
                        (lambda d: d.update(format="x"), "format")]:
        d = json.loads(json.dumps(doc))
        mutate(d)
        path.write_text(json.dumps(d))
        with pytest.raises(ValueError, match=msg):
            load_pattern(path, 3, 2)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="malformed streaming-heads file"):
        load_pattern(path)
    with pytest.raises(FileNotFoundError, match="kvsieve calibrate"):
        load_pattern(tmp_path / "missing.json")


def test_pattern_for_methods_and_the_shipped_default(tmp_path):
    with pytest.raises(ValueError, match="--streaming-heads applies to lserve and hybrid only, not 'tactic'"):
        pattern_for("tactic", "x.json", tmp_path, 30, 3)
    assert pattern_for("tactic", None, tmp_path, 30, 3) is None
    assert pattern_for("lserve", "none", tmp_path / "smollm2-135m-instruct", 30, 3) is None
    assert pattern_for("hybrid", None, tmp_path / "other-model", 30, 3) is None
    assert default_pattern(tmp_path / "other-model") is None
    if EMBEDDED_PATTERN.is_file():  # shipped once calibrated for the embedded model
        assert default_pattern(tmp_path / "smollm2-135m-instruct") == EMBEDDED_PATTERN
        doc = json.loads(EMBEDDED_PATTERN.read_text())
        shipped = load_pattern(EMBEDDED_PATTERN, 30, 3)
        assert sum(map(sum, shipped)) == round(doc["ratio"] * 90)
        assert shipped == choose_streaming(doc["score"], doc["ratio"])  # the file's own scores and ratio
        assert pattern_for("lserve", None, tmp_path / "smollm2-135m-instruct", 30, 3) == shipped
        hybrid = pattern_for("hybrid", None, tmp_path / "smollm2-135m-instruct", 30, 3)
        assert hybrid == choose_streaming(doc["score"], doc["method_ratios"]["hybrid"]) != shipped
        assert sum(map(sum, hybrid)) == round(doc["method_ratios"]["hybrid"] * 90)


def test_method_ratios_rechoose_the_heads_of_one_method(tmp_path):
    """A pattern file's method_ratios gives a method its own share of the highest-scoring
    heads (window layers always streaming); other methods keep the file's pattern."""
    score = [[0.9, 0.1], [0.2, 0.3], [0.8, 0.7]]
    pat = choose_streaming(score, 0.5)
    path = tmp_path / "p.json"
    save_pattern(path, pat, {"score": score}, {"model": "m", "ratio": 0.5, "method_ratios": {"hybrid": 1 / 6}})
    assert load_pattern(path, 3, 2) == load_pattern(path, 3, 2, "lserve") == pat
    assert load_pattern(path, 3, 2, "hybrid") == ((True, False), (False, False), (False, False))
    assert pattern_for("hybrid", str(path), tmp_path, 3, 2) == load_pattern(path, 3, 2, "hybrid")
    doc = json.loads(path.read_text())
    doc["window_layers"] = [1]
    path.write_text(json.dumps(doc))
    assert load_pattern(path, 3, 2, "hybrid") == ((True, False), (True, True), (False, False))  # 1 of 4 global heads
    for bad, msg in [({"method_ratios": {"hybrid": 2}}, r"method_ratios\['hybrid'\] must be a fraction in \[0, 1\], got 2"),
                     ({"score": [[0.9, 0.1]]}, "'score' must have one value per layer and KV head")]:
        path.write_text(json.dumps({**doc, **bad}))
        with pytest.raises(ValueError, match="malformed streaming-heads file .*" + msg):
            load_pattern(path, 3, 2, "hybrid")


def test_lambda_mass_matches_the_float64_oracle():
    from kvsieve.eval.calibrate import LambdaMass
    from kvsieve.methods import Selection

    from conftest import clustered_qkv

    q, k, v = clustered_qkv(2, 6, 2, 97, 64, seed=5, dtype=torch.float32)
    lengths = torch.tensor([97, 54])
    obs = LambdaMass(1, 2, sink=4, local=16)
    obs(0, q, k, v, Selection(torch.ones(2, 2, 97, dtype=torch.bool)), lengths, None)
    mass, err = obs.means()
    _, p = oracle(q, k, v, lengths)
    pos = torch.arange(97)
    lam = (pos[None] < 4) | (pos[None] >= lengths[:, None] - 16)
    want = (p.view(2, 2, 3, 97) * lam[:, None, None]).sum(-1).mean(2).mean(0)
    assert torch.allclose(mass[0], want, atol=1e-10)
    o_dense, _ = oracle(q, k, v, lengths)
    o_lam, _ = oracle(q, k, v, lengths, mask=lam[:, None].expand(2, 2, 97))
    want_err = ((o_lam - o_dense).norm(dim=-1) / o_dense.norm(dim=-1)).view(2, 2, 3).mean(2).mean(0)
    assert torch.allclose(err[0], want_err, rtol=1e-4)


def test_calibrate_cli_bad_input(capsys, tmp_path):
    from kvsieve.cli import main

    for argv, msg in [(["--ratio", "1.5"], "--ratio must be a fraction of KV heads in [0, 1], got 1.5"),
                      (["--text-file", str(tmp_path / "nope.txt")], "not found"),
                      (["--out", str(tmp_path / "no" / "dir" / "p.json")], "does not exist"),
                      (["--length", "100000"], "--length must exceed sink + local"),
                      (["--method-ratios", "tactic=0.1"], "--method-ratios takes METHOD=RATIO pairs")]:
        assert main(["calibrate", *argv]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(error_lines(err)) == 1, err


def test_generate_rejects_a_pattern_for_another_model(capsys, tmp_path):
    from kvsieve.cli import main

    path = tmp_path / "p.json"
    save_pattern(path, ((True, False),) * 4, {"lambda_mass": [[1, 0]] * 4}, {"model": "tiny"})
    assert main(["generate", "--method", "lserve", "--streaming-heads", str(path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "is for a model with 4 layers x 2 KV heads" in err and len(error_lines(err)) == 1


def test_local_layers_stream_by_construction_and_the_ratio_applies_to_global_layers():
    from kvsieve.patterns import choose_streaming

    scores = [[0.1, 0.2], [0.99, 0.98], [0.5, 0.7], [0.3, 0.9]]
    # layer 1 is a sliding-window layer: all of it streams, the top half of the 6 global heads too
    assert choose_streaming(scores, 0.5, local_layers=[1]) == ((False, False), (True, True), (True, True),
                                                               (False, True))
    # without it, layer 1's two heads use up two of the four places
    assert choose_streaming(scores, 0.5) == ((False, False), (True, True), (False, True), (False, True))
