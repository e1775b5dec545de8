"""Streaming-head patterns: choice by Λ mass, file round trip, validation, calibration on a
tiny model against the float64 oracle, and the CLI's errors."""
import json
from pathlib import Path

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
        # another model in a directory of that name (a copy, a fine-tune of another shape) gets
        # no shipped heads, not an error about a file it never asked for
        assert pattern_for("lserve", None, tmp_path / "smollm2-135m-instruct", 2, 2) is None
        from kvsieve.patterns import model_head_options
        assert model_head_options("tactic", {}, tmp_path / "smollm2-135m-instruct", 2, 2) == {}
        assert model_head_options("tactic", {}, tmp_path / "smollm2-135m-instruct", 30, 3)["dense_heads"]


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


@pytest.mark.parametrize("field,value,message", [
    ("method_ratios", [0.125], "'method_ratios' must map a streaming method"),
    ("method_ratios", "hybrid=0.1", "'method_ratios' must map a streaming method"),
    ("score", [["x", 0.1], [0.2, 0.3], [0.8, 0.7]], "'score' must hold numbers"),
    ("score", [[None, 0.1], [0.2, 0.3], [0.8, 0.7]], "'score' must hold numbers"),
    ("score", "0.5", "'score' must have one value per layer"),
    ("window_layers", 1, r"'window_layers' must list layers in \[0, 3\), got 1"),
    ("window_layers", [99], r"'window_layers' must list layers in \[0, 3\), got \[99\]"),
    ("streaming", "10", "'streaming' must be a non-empty list of 0/1 strings"),
])
def test_malformed_pattern_fields_name_the_field(tmp_path, field, value, message):
    """Each used to escape as a TypeError/AttributeError traceback, or (window_layers past the
    model, 'streaming' as one string) to be read as something else."""
    path = tmp_path / "p.json"
    save_pattern(path, ((True, False), (False, False), (True, True)), {"score": [[0.9, 0.1], [0.2, 0.3], [0.8, 0.7]]},
                 {"model": "m", "ratio": 0.5, "method_ratios": {"hybrid": 0.5}})
    doc = json.loads(path.read_text())
    doc[field] = value
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="malformed streaming-heads file .*" + message):
        load_pattern(path, 3, 2, "hybrid")
    path.write_text(json.dumps([doc]))
    with pytest.raises(ValueError, match="malformed streaming-heads file .*one JSON object"):
        load_pattern(path, 3, 2)
    path.write_text(json.dumps({"foo": 1}))  # (was the KeyError's bare 'streaming')
    with pytest.raises(ValueError, match="malformed streaming-heads file .*has no 'streaming' field"):
        load_pattern(path, 3, 2)


def test_dense_heads_file_of_another_model_is_refused(tmp_path):
    """A calibrate file of a 28 x 2 model whose dense heads happen to exist in a 30 x 3 model
    was taken silently through --dense-heads FILE (only the pairs were range-checked)."""
    from kvsieve.patterns import dense_heads_for, load_dense_heads

    path = tmp_path / "other.json"
    save_pattern(path, ((False, True),) * 28, {}, {"model": "other-model", "dense_heads": [[7, 1]]})
    heads = load_dense_heads(path)  # as `--dense-heads FILE` reads it, before the model is known
    assert heads == ((7, 1),)
    with pytest.raises(ValueError, match=r"dense heads file .* are for a model with 28 layers x 2 KV heads "
                                         r"\(model 'other-model'\), but this model has 30 x 3"):
        dense_heads_for("tactic", {"dense_heads": heads}, tmp_path, 30, 3)
    with pytest.raises(ValueError, match="are for a model with 28 layers x 2"):
        load_dense_heads(path, 30, 3)
    assert dense_heads_for("tactic", {"dense_heads": heads}, tmp_path, 28, 2) is None  # its own shape: fine
    for bad in ([[7.5, 2]], "7:2", [[True, 2]], [[7]]):
        path.write_text(json.dumps({"dense_heads": bad}))
        with pytest.raises(ValueError, match=r"malformed 'dense_heads' .*list of \[layer, kv_head\] integer pairs"):
            load_dense_heads(path)


def test_calibrate_cli_refuses_more_bad_input_in_one_line(capsys, tmp_path):
    """Past these: --length 0 ran the default length, --out DIR or an unwritable --out failed
    with a traceback after the whole calibration, --device foo blamed the weights file, a bad
    --method-ratios value was reported as --ratio, and --length near the model's limit
    failed in the engine with its own wording."""
    from kvsieve.cli import main

    tiny = tmp_path / "tiny.txt"
    tiny.write_text("only a few words")
    cases = [(["--length", "0"], "--length must exceed sink + local (384)"),
             (["--length", "8190"], "(at most 8175), got 8190"),
             (["--out", str(tmp_path)], "is a directory; give a file name"),
             (["--device", "foo"], "--device 'foo' is not a device torch knows"),
             (["--method-ratios", "hybrid=2"], "--method-ratios: hybrid's ratio must be a fraction of KV heads"),
             (["--dense-lengths", ""], "give at least one"),
             (["--steps", "8000"], "--sink + --local (384) must be below --length, which can be at most 191"),
             (["--dense-lengths", "64"], "--dense-lengths 64: suite length 64 is too short"),  # before measuring
             (["--dense-heads", "99"], "--dense-heads 99 is more than this model's 90 KV heads"),
             (["--text-file", "/dev/null"], "--text-file '/dev/null' is not a regular file"),
             (["--sink", "0", "--local", "0"], "--sink and --local are both 0"),
             (["--text-file", str(tiny), "--length", "512"], "the calibration text has 4 tokens but --length 512")]
    if Path("/proc/self").is_dir():
        cases.append((["--out", "/proc/kvsieve-calibrate.json"], "cannot write --out '/proc/kvsieve-calibrate.json'"))
    for argv, msg in cases:
        assert main(["calibrate", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and len(error_lines(err)) == 1, err


def test_calibrate_prompts_are_length_tokens_then_steps_forced(monkeypatch, tmp_path):
    """--length tokens of prompt, then --steps teacher-forced steps (the windows used to be
    length - steps tokens of prompt and 2 x steps steps)."""
    from kvsieve.cli import main
    from kvsieve.eval import calibrate

    seen = []

    def measure(model, prompts, continuations, sink, local):
        seen.append((prompts, continuations))
        raise ValueError("stop here")

    monkeypatch.setattr(calibrate, "measure_lambda_mass", measure)
    assert main(["calibrate", "--length", "600", "--steps", "5", "--windows", "2", "--out",
                 str(tmp_path / "p.json")]) == 2
    (prompts, continuations), = seen
    assert [len(p) for p in prompts] == [600, 600] and [len(c) for c in continuations] == [5, 5]


def test_streaming_heads_empty_or_a_directory_is_refused(tmp_path):
    """'' used to fall back to the shipped pattern silently; a directory was 'not found'."""
    with pytest.raises(ValueError, match="--streaming-heads is empty; give a pattern file"):
        pattern_for("lserve", "", tmp_path / "smollm2-135m-instruct", 30, 3)
    with pytest.raises(ValueError, match="is a directory; give a pattern file"):
        pattern_for("hybrid", str(tmp_path), tmp_path, 30, 3)


def test_lambda_mass_is_the_same_scored_in_batches():
    """calibrate scores its prompts a few at a time (--windows 2000 used to ask for one KV pool
    of every window: 354 GiB, refused with advice about an option calibrate lacks)."""
    from kvsieve.eval.calibrate import measure_lambda_mass
    from kvsieve.model.loader import load_model

    model, _, _ = load_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (40, 33, 51)]
    continuations = [torch.randint(0, 1000, (3,), generator=g).tolist() for _ in prompts]
    together = measure_lambda_mass(model, prompts, continuations, sink=4, local=8)
    one_by_one = measure_lambda_mass(model, prompts, continuations, sink=4, local=8, batch=1)
    for a, b in zip(together, one_by_one):
        assert torch.allclose(a, b, atol=1e-5)
    assert (together[0] < 1).any() and (together[0] > 0).all()


def test_a_file_pattern_run_with_another_window_warns_once(capsys, tmp_path):
    """A pattern file records the sink + local its heads were chosen for; streaming them with
    another window warns (one `kvsieve: warning` line in the CLI), the same window does not."""
    import warnings

    from kvsieve.cli import main
    from kvsieve.patterns import warn_window

    path = tmp_path / "p.json"
    save_pattern(path, ((True, False),) * 2, {"lambda_mass": [[1, 0]] * 2}, {"model": "m", "sink": 128, "local": 256})
    pattern = load_pattern(path, 2, 2)
    assert pattern.window == (128, 256) and pattern == ((True, False),) * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_window(pattern, 128, 256)  # the file's own window: silent
        warn_window(((True, False),), 4, 64)  # not from a file: nothing to compare
        with pytest.raises(UserWarning, match=r"chosen for a sink 128 \+ local 256 window.*sink 4 \+ local 64.*"
                                              r"kvsieve calibrate --sink 4 --local 64 --out FILE` \(with --model PATH"):
            warn_window(pattern, 4, 64)
    save_pattern(path, ((True, False),) * 2, {"lambda_mass": [[1, 0]] * 2}, {"model": "m"})
    assert load_pattern(path, 2, 2).window == (None, None)

    assert main(["generate", "--method", "lserve", "--local", "64", "--prompt", "hi", "--max-new-tokens", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    warned = [line for line in err if line.startswith("kvsieve: warning:")]
    assert len(warned) == 1 and "sink 128 + local 64" in warned[0] and "UserWarning" not in "".join(err)
    assert main(["generate", "--method", "lserve", "--prompt", "hi", "--max-new-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err
    assert "no decode step (one token each, from the prefill)" in err and "0.0 tok/s" not in err  # (one token)


def test_streaming_count_leaves_out_sliding_window_layers():
    """calibrate's and eval's "N of M KV heads stream" count the global layers' heads: a
    sliding-window layer attends its own window whatever its flags say."""
    from kvsieve.patterns import streaming_count

    rows = ((True, True), (True, False), (False, False), (True, True))
    assert streaming_count(rows, 4, ()) == (5, 8)
    assert streaming_count(rows, 4, (0, 3)) == (1, 4)
    assert streaming_count(((True, False),), 3, (1,)) == (2, 4)  # one row for every layer
