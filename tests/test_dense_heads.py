"""Tactic's (and a hybrid's tactic part's) calibrated dense heads: the calibration's
needle-loss measure (against a float64 oracle), the choice of heads, the pattern file's
`dense_heads`, and how every entry point (generate, serve, eval, the HF drop-in) resolves
them: the shipped ones by default, the user's instead, none in the fixed-budget mode."""
import json

import pytest
import torch

from conftest import clustered_qkv, oracle
from kvsieve.cli import parse_heads
from kvsieve.eval.calibrate import NeedleLoss, choose_dense_heads
from kvsieve.eval.harness import cell_id
from kvsieve.eval.sweep import MethodPoint
from kvsieve.methods import Selection, config_for, merge_options
from kvsieve.patterns import (EMBEDDED_PATTERN, dense_heads_for, dense_heads_of, heads_for, load_dense_heads,
                              model_head_options, model_heads, save_pattern, unstreamed)

EMBEDDED_DIR = "/models/smollm2-135m-instruct"  # default_pattern goes by the directory's name


@pytest.mark.parametrize("G", [1, 3])
def test_needle_loss_matches_the_float64_oracle(G):
    Hkv = 2
    q, k, v = clustered_qkv(2, Hkv * G, Hkv, 97, 64, seed=11, dtype=torch.float32)
    lengths = torch.tensor([97, 54])
    span = torch.zeros(60, dtype=torch.bool)
    span[20:31] = True  # the needle: prompt positions 20..30 (the prompt is shorter than the cache)
    mask = torch.rand(2, Hkv, 97, generator=torch.Generator().manual_seed(3)) < 0.5
    obs = NeedleLoss(2, Hkv)
    obs.span = span
    obs(0, q, k, v, Selection(mask), lengths, q)  # out: any [B, Hq, D] (the loss does not read it)
    obs(1, q, k, v, Selection(torch.ones_like(mask)), lengths, q)  # reads everything: loses nothing
    _, p = oracle(q, k, v, lengths)  # [B, Hq, S] float64
    full = torch.zeros(97, dtype=torch.bool)
    full[20:31] = True
    lost = (p * (full & ~mask.repeat_interleave(G, 1))).sum(-1).view(2, Hkv, G).amax(-1).sum(0)
    assert obs.steps == 2
    assert torch.allclose(obs.lost[0], lost, atol=1e-10) and lost.min() > 0
    assert obs.lost[1].abs().max() < 1e-12


def test_choose_dense_heads_takes_the_largest_losses_never_a_lossless_head():
    lost = torch.tensor([[0.0, 0.02, 0.0], [0.3, 0.0, 0.01]])
    assert choose_dense_heads(lost, 1) == [(1, 0)]
    assert choose_dense_heads(lost, 2) == [(0, 1), (1, 0)]
    assert choose_dense_heads(lost, 5) == [(0, 1), (1, 0), (1, 2)]
    assert choose_dense_heads(lost, 0) == []
    # a sliding-window layer (1 here) attends its window: no method runs there to protect
    assert choose_dense_heads(lost, 2, window_layers=[1]) == [(0, 1)]
    assert choose_dense_heads(lost, 2, window_layers=[0, 1]) == []


def test_pattern_file_dense_heads_are_read_and_checked(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"dense_heads": [[7, 2], [3, 0], [7, 2]]}))
    assert load_dense_heads(path, 30, 3) == ((3, 0), (7, 2))
    path.write_text(json.dumps({"streaming": ["000"]}))
    assert load_dense_heads(path, 30, 3) == ()  # a model's shipped file without them: none
    with pytest.raises(ValueError, match="holds no dense_heads"):  # --dense-heads FILE must hold them
        parse_heads(str(path))
    with pytest.raises(ValueError, match=r"dense head 7:2, but this model has 4 layers x 3 KV heads"):
        load_dense_heads(_write(tmp_path, [[7, 2]]), 4, 3)
    with pytest.raises(ValueError, match="malformed 'dense_heads'"):
        load_dense_heads(_write(tmp_path, [[1, -1]]))
    with pytest.raises(ValueError, match="malformed 'dense_heads'"):
        load_dense_heads(_write(tmp_path, [["a", 1]]))
    with pytest.raises(FileNotFoundError, match="kvsieve calibrate"):
        load_dense_heads(tmp_path / "missing.json")
    assert parse_heads("none") == () and parse_heads(" 7:2, 1:0 ") == ((7, 2), (1, 0))
    with pytest.raises(ValueError, match="--dense-heads is empty.*'none'"):
        parse_heads(" ")
    assert parse_heads(str(_write(tmp_path, [[5, 1]]))) == ((5, 1),)


def _write(tmp_path, heads):
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({"dense_heads": heads}))
    return path


@pytest.mark.skipif(not EMBEDDED_PATTERN.is_file(), reason="no shipped pattern")
def test_the_embedded_model_ships_dense_heads_that_tactic_and_hybrid_take_by_default():
    shipped = load_dense_heads(EMBEDDED_PATTERN, 30, 3)
    assert shipped, "the shipped file names tactic's calibrated dense heads"
    assert dense_heads_for("tactic", {}, EMBEDDED_DIR, 30, 3) == shipped
    assert dense_heads_for("tactic", {"threshold": 0.8}, EMBEDDED_DIR, 30, 3) == shipped
    assert dense_heads_for("tactic", {"budget": 256}, EMBEDDED_DIR, 30, 3) is None  # fixed budget: none
    assert dense_heads_for("tactic", {"dense_heads": ()}, EMBEDDED_DIR, 30, 3) is None  # the user's win
    assert dense_heads_for("quest", {}, EMBEDDED_DIR, 30, 3) == shipped
    assert dense_heads_for("quest", {"budget": 4096}, EMBEDDED_DIR, 30, 3) == shipped  # its only mode
    assert dense_heads_for("streaming", {}, EMBEDDED_DIR, 30, 3) is None
    assert dense_heads_for("tactic", {}, "/models/another-model", 30, 3) is None
    with pytest.raises(ValueError, match="dense head 31:0, but this model has 30 layers"):
        dense_heads_for("tactic", {"dense_heads": ((31, 0),)}, EMBEDDED_DIR, 30, 3)
    opts = model_head_options("tactic", {}, EMBEDDED_DIR, 30, 3)
    assert opts == {"dense_heads": shipped}
    hybrid = model_head_options("hybrid", {}, EMBEDDED_DIR, 30, 3)
    assert hybrid["dense_heads"] == shipped == unstreamed(shipped, hybrid["streaming_heads"])
    lserve = model_head_options("lserve", {"budget": 4096}, EMBEDDED_DIR, 30, 3)
    assert lserve["dense_heads"] == unstreamed(shipped, lserve["streaming_heads"]) == shipped
    assert model_head_options("quest", {"budget": 512}, EMBEDDED_DIR, 30, 3) == {"dense_heads": shipped}
    assert "dense_heads" not in model_head_options("hybrid", {"budget": 64}, EMBEDDED_DIR, 30, 3)
    heads = model_heads(EMBEDDED_DIR, 30, 3)
    assert dense_heads_of(heads, "tactic") == shipped == dense_heads_of(heads, "hybrid")
    assert heads_for(heads, "tactic") is None and heads["lserve"] is not None
    assert dense_heads_of(heads, "lserve") == shipped == dense_heads_of(heads, "quest")
    assert dense_heads_of(heads, "streaming") == () and dense_heads_of(heads, "dense") == ()
    assert dense_heads_of(model_heads(EMBEDDED_DIR, 30, 3, dense_heads=()), "tactic") == ()
    assert dense_heads_of(model_heads("/models/another-model", 30, 3), "hybrid") == ()


def test_a_hybrid_drops_dense_heads_that_its_pattern_streams(tmp_path):
    """Dense heads from the model's file (or the user's) that a hybrid's pattern streams are
    left out for the hybrid (a streaming head sees only its window) and kept for tactic."""
    pattern = ((True, False, False), (False, False, True))
    assert unstreamed(((0, 0), (0, 1), (1, 2), (1, 0)), pattern) == ((0, 1), (1, 0))
    assert unstreamed(((0, 0), (1, 1)), ((True, False),)) == ((1, 1),)  # one row shared by every layer
    assert unstreamed(((0, 0),), None) == ((0, 0),)
    path = tmp_path / "p.json"
    save_pattern(path, [[layer == 7 and h == 2 for h in range(3)] for layer in range(30)], {}, {"model": "m"})
    heads = model_heads(EMBEDDED_DIR, 30, 3, str(path), dense_heads=((7, 2), (18, 2)))
    assert dense_heads_of(heads, "hybrid") == ((18, 2),) and dense_heads_of(heads, "tactic") == ((7, 2), (18, 2))
    assert dense_heads_of(heads, "lserve") == ((18, 2),) and dense_heads_of(heads, "quest") == ((7, 2), (18, 2))
    assert model_head_options("hybrid", {}, EMBEDDED_DIR, 30, 3, str(path))["dense_heads"] == ((18, 2),)


def test_eval_points_and_cells_carry_dense_heads():
    heads = {"lserve": None, "hybrid": None, "dense": {"tactic": ((7, 2),), "hybrid": ((7, 2),)}}
    assert MethodPoint("tactic", None).options(2048, heads) == {"dense_heads": ((7, 2),)}
    assert MethodPoint("tactic", 0.9).options(2048, heads) == {"threshold": 0.9, "dense_heads": ((7, 2),)}
    assert MethodPoint("tactic", None, (("budget", 64),)).options(2048, heads) == {"budget": 64}
    assert MethodPoint("quest", 0.1).options(2048, heads) == {"budget": 208}
    pages = {**heads, "dense": {"quest": ((7, 2),), "lserve": ((18, 2),)}}
    assert MethodPoint("quest", 0.1).options(2048, pages) == {"budget": 208, "dense_heads": ((7, 2),)}
    assert MethodPoint("quest", None, (("budget", 64),)).options(2048, pages) == {"budget": 64, "dense_heads": ((7, 2),)}
    assert MethodPoint("lserve", 0.1).options(2048, pages) == {"budget": 192, "dense_heads": ((18, 2),)}
    assert " heads=" in cell_id(("suite", 1024), MethodPoint("quest", None), pages)
    assert " heads=" in cell_id(("suite", 1024), MethodPoint("tactic", None), heads)
    assert " heads=" not in cell_id(("suite", 1024), MethodPoint("tactic", None), {"dense": {"tactic": ()}})
    assert MethodPoint("hybrid", 0.9).options(2048, heads) == {"threshold": 0.9, "dense_heads": ((7, 2),)}
    pattern = ((False, True, False),) * 30
    both = {**heads, "hybrid": pattern}
    assert MethodPoint("hybrid", None).options(2048, both) == {"streaming_heads": pattern, "dense_heads": ((7, 2),)}
    tags = {cell_id(("suite", 1024), MethodPoint("hybrid", None), h) for h in (heads, both, {"hybrid": pattern})}
    assert len(tags) == 3 and all(" heads=" in t for t in tags)  # the pattern and the dense heads both name a cell
    assert heads_for(((True, False),), "tactic") is None  # one shared streaming pattern is not tactic's
    assert heads_for(((True, False),), "hybrid") == ((True, False),)


def test_a_request_for_a_fixed_budget_drops_the_default_dense_heads():
    defaults = {"dense_heads": ((7, 2),)}
    assert merge_options(defaults, {"budget": 64}) == {"budget": 64}
    for method in ("quest", "lserve"):  # a budget is their only mode: the dense heads stay
        assert merge_options(defaults, {"budget": 64}, method) == {"dense_heads": ((7, 2),), "budget": 64}
        config_for(method, **merge_options(defaults, {"budget": 64}, method))
    config_for("tactic", **merge_options(defaults, {"budget": 64}))
    assert merge_options(defaults, {"threshold": 0.8}) == {"dense_heads": ((7, 2),), "threshold": 0.8}
    given = {"budget": 64, "dense_heads": ((1, 0),)}  # named by the request: kept, and refused
    with pytest.raises(ValueError, match="dense_heads set tactic's threshold mode, which a fixed budget replaces"):
        config_for("tactic", **merge_options(defaults, given))


def test_a_protect_bound_with_nothing_protected_is_refused_and_a_default_one_dropped():
    """protect_bound ranks the protected clusters: with protect = 0 it was accepted unused."""
    for method in ("tactic", "hybrid"):
        with pytest.raises(ValueError, match=r"protect=0 protects none.*drop protect_bound \('radius'\)"):
            config_for(method, protect=0, protect_bound="radius")
        assert config_for(method, protect=0) and config_for(method, protect_bound="radius")
    merged = merge_options({"protect_bound": "radius"}, {"protect": 0})  # the engine's default, a request's 0
    assert merged == {"protect": 0} and config_for("tactic", **merged).protect == 0
    assert merge_options({"protect_bound": "radius"}, {"protect": 8}) == {"protect_bound": "radius", "protect": 8}


def test_calibrate_writes_the_head_losing_the_most_needle_mass(tmp_path, capsys):
    """`kvsieve calibrate` (small: 2 suite cases each of 500 and 600 tokens) writes tactic's dense heads
    beside the streaming pattern: the largest entry of its needle-loss table."""
    from kvsieve.cli import main

    out = tmp_path / "p.json"
    assert main(["calibrate", "--length", "600", "--windows", "1", "--steps", "2", "--retrieval", "1",
                 "--dense-cases", "2", "--dense-lengths", "500,600", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["dense_heads_calibration"]["lengths"] == [500, 600]
    lost = torch.tensor(doc["tactic_needle_lost"])
    assert lost.shape == (30, 3) and lost.max() > 0
    best = divmod(int(lost.argmax()), 3)
    assert load_dense_heads(out, 30, 3) == (best,)
    assert "tactic's dense heads (layer:KV head, needle mass lost): " f"{best[0]}:{best[1]}" in capsys.readouterr().out
    assert main(["calibrate", "--dense-heads", "-1"]) == 2
    assert "--dense-heads must be >= 0" in capsys.readouterr().err
    assert main(["calibrate", "--length", "600", "--dense-lengths", "9000"]) == 2
    assert "--dense-lengths must be in [64, 8176]" in capsys.readouterr().err
    assert main(["calibrate", "--steps", "9000"]) == 2  # (it blamed --sink/--local, and its advice failed again)
    assert "--steps 9000 leaves no room for a prompt in this model's 8192 positions; give at most 8189" in \
        capsys.readouterr().err
    assert main(["calibrate", "--sink", "4", "--local", "60", "--length", "128", "--steps", "2", "--retrieval", "2",
                 "--retrieval-data", "suite", "--dense-heads", "0", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err  # before any measurement, naming the flags
    assert "--retrieval-data suite at --length 128" in err and "give a longer --length, or --retrieval 0" in err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(not EMBEDDED_PATTERN.is_file(), reason="no shipped pattern")
def test_generate_refuses_a_dense_head_that_the_hybrid_streams(capsys):
    from kvsieve.cli import main
    from kvsieve.patterns import load_pattern

    pattern = load_pattern(EMBEDDED_PATTERN, 30, 3, "hybrid")
    layer, head = next((i, j) for i, row in enumerate(pattern) for j, f in enumerate(row) if f)
    rc = main(["generate", "--method", "hybrid", "--dense-heads", f"{layer}:{head}", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and f"dense head {layer}:{head} is one of this method's streaming heads" in err


@pytest.mark.skipif(not EMBEDDED_PATTERN.is_file(), reason="no shipped pattern")
def test_a_dense_heads_file_loses_the_heads_its_pattern_streams_in_generate(tmp_path, capsys):
    """README's calibrate recipe (--streaming-heads FILE --dense-heads FILE): an lserve drops
    the file's dense heads that the file streams, in generate and serve as in eval; heads
    typed one by one stay the user's (a streamed one is refused, test above)."""
    from kvsieve.cli import main

    path = tmp_path / "mine.streaming.json"
    save_pattern(path, [[layer == 7 and h == 2 for h in range(3)] for layer in range(30)], {},
                 {"model": "m", "dense_heads": [[7, 2], [18, 2]]})
    given = load_dense_heads(path, 30, 3)
    assert model_head_options("lserve", {"dense_heads": given}, EMBEDDED_DIR, 30, 3, str(path))["dense_heads"] \
        == ((18, 2),)
    assert "dense_heads" not in model_head_options("lserve", {"dense_heads": ((7, 2), (18, 2))}, EMBEDDED_DIR, 30,
                                                   3, str(path))
    assert dense_heads_of(model_heads(EMBEDDED_DIR, 30, 3, str(path), given), "lserve") == ((18, 2),)
    rc = main(["generate", "--method", "lserve", "--streaming-heads", str(path), "--dense-heads", str(path),
               "--prompt", "hi", "--max-new-tokens", "2", "--json", "--no-progress"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert json.loads(out.out)["generated_tokens"] == 2


def test_the_report_names_each_method_dense_heads():
    from kvsieve.eval.report import _dense_heads_note

    one = {m: [[7, 2], [18, 2]] for m in ("tactic", "hybrid", "quest", "lserve")}
    assert _dense_heads_note({"dense_heads": {**one, "file": "shipped pattern"}}) == [
        "- dense KV heads of tactic, hybrid, quest and lserve (layer:head, attended densely): 7:2, 18:2 "
        "(shipped pattern)"]
    two = {"tactic": [[7, 2]], "hybrid": [], "quest": [[7, 2]], "file": "f.json"}
    assert _dense_heads_note({"dense_heads": two}) == [
        "- dense KV heads of tactic and quest (layer:head, attended densely): 7:2 (f.json)",
        "- dense KV heads of hybrid (layer:head, attended densely): none (f.json)"]
    assert _dense_heads_note({"dense_heads": {"tactic": [[7, 2]], "file": "f"}}) == [
        "- dense KV heads of tactic (layer:head, attended densely): 7:2 (f)"]  # results before hybrid took them
    assert _dense_heads_note({"dense_heads": {"file": "f"}}) == [] and _dense_heads_note({}) == []


def test_a_server_of_any_method_streams_its_streaming_file_in_per_request_lserve_and_hybrid(tmp_path):
    """serve --method tactic --streaming-heads FILE: the server's tactic takes no streaming
    heads, and a request for lserve or hybrid streams FILE at its own ratio (README: they
    stream the server's --streaming-heads); generate, which runs one method, still refuses it."""
    from kvsieve.patterns import load_pattern
    from kvsieve.server.cli import server_heads

    doc = json.loads(EMBEDDED_PATTERN.read_text())
    doc["method_ratios"] = {"hybrid": 0.5}
    path = tmp_path / "mine.streaming.json"
    path.write_text(json.dumps(doc))
    opts = {}
    heads = server_heads("tactic", opts, str(path), EMBEDDED_DIR, 30, 3)
    assert "streaming_heads" not in opts and opts["dense_heads"] == load_dense_heads(EMBEDDED_PATTERN, 30, 3)
    for method in ("lserve", "hybrid"):
        assert heads_for(heads, method) == load_pattern(path, 30, 3, method)
    lserve = {}
    assert heads_for(server_heads("lserve", lserve, str(path), EMBEDDED_DIR, 30, 3), "hybrid") == \
        load_pattern(path, 30, 3, "hybrid") and lserve["streaming_heads"] == load_pattern(path, 30, 3, "lserve")
    with pytest.raises(ValueError, match="--streaming-heads applies to lserve and hybrid only"):
        model_head_options("tactic", {}, EMBEDDED_DIR, 30, 3, str(path))


def test_a_pattern_files_method_ratios_name_streaming_methods(tmp_path):
    """A misspelled method in method_ratios is refused, not silently ignored."""
    from kvsieve.patterns import load_pattern

    doc = json.loads(EMBEDDED_PATTERN.read_text())
    doc["method_ratios"] = {"hybird": 0.5}
    path = tmp_path / "typo.streaming.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"'method_ratios' must map a streaming method \(lserve, hybrid\)"):
        load_pattern(path, 30, 3, "hybrid")


def test_a_dense_heads_file_naming_a_head_the_model_lacks_is_named_in_the_error(tmp_path):
    path = tmp_path / "oob.streaming.json"
    path.write_text(json.dumps({"format": "kvsieve-streaming-heads/1", "dense_heads": [[30, 0]]}))
    with pytest.raises(ValueError, match=r"file '.*oob.streaming.json' names the dense head 30:0, but this model has "
                                         r"30 layers x 3 KV heads"):
        dense_heads_for("tactic", {"dense_heads": parse_heads(str(path))}, EMBEDDED_DIR, 30, 3)
