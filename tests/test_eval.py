"""kvsieve eval: prompts, sweep points, metrics against the float64 oracle, resumable
store, shared-prefill runs against independent ones, the CLI's --quick smoke run and its
bad-input errors."""
import json
import math
import shlex

import pytest
import torch

from kvsieve.eval.metrics import AttentionFidelity, attention_fidelity, next_token_metrics, pool_next_token_metrics
from kvsieve.eval.needles import VARIANTS, make_task
from kvsieve.eval.store import ResultStore
from kvsieve.eval.sweep import MethodPoint, headline_points, parse_methods, sweep_points
from kvsieve.methods import Selection
from kvsieve.ops.attention import attend

from conftest import clustered_qkv, oracle, rel_err

words = lambda s: len(s.split())  # a stand-in tokenizer: one token per word


# ------------------------------------------------------------------ needles
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_needle_prompts_hold_their_answers_at_the_requested_depth(variant, depth):
    task = make_task(variant, words, 3000, depth, seed=3)
    n = words(task.prompt)
    assert 0.9 * 3000 <= n <= 1.05 * 3000, n
    body = task.prompt[: task.prompt.rindex("\n")]  # the question may name the key, not the answer
    first = min(body.index(e) for e in task.expected)
    if variant != "vartrack":  # a group of needles starts at depth, moved left to fit (spread 0.2)
        want = min(depth, 0.78) if variant == "multivalue" else depth
        assert abs(words(body[:first]) / n - want) < 0.08, (variant, words(body[:first]) / n)
    assert task.score(" ".join(task.expected)) == 1.0
    assert task.score("nothing here") == 0.0
    if len(task.expected) > 1:
        assert task.score(task.expected[0]) == pytest.approx(1 / len(task.expected))


def test_needle_prompts_differ_by_seed_and_reject_bad_input():
    assert make_task("single", words, 500, 0.5, seed=1).expected != make_task("single", words, 500, 0.5, seed=2).expected
    multikey = make_task("multikey", words, 800, 0.5, seed=0)
    assert multikey.prompt.count("special magic numbers for") == 4  # 3 distractor keys + the asked one
    with pytest.raises(ValueError, match="unknown retrieval variant 'nope'"):
        make_task("nope", words, 500, 0.5)
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\]"):
        make_task("passkey", words, 500, 1.5)


# ------------------------------------------------------------------ sweep points
def test_text_windows_start_with_the_tokenizers_prefix():
    from kvsieve.eval.harness import special_prefix, text_windows

    class Bos:  # a tokenizer that puts BOS (id 2) before any text, as Gemma's does
        def encode(self, s, add_special_tokens=True):
            return [2] * add_special_tokens + [ord(c) for c in s]

    assert special_prefix(Bos()) == [2]
    ids = list(range(100, 400))
    plain = text_windows(ids, 50, 5, 3)
    assert [w[0] for w in plain] == [100, 222, 345] and all(len(w) == 55 for w in plain)
    wins = text_windows(ids, 50, 5, 3, [2])
    assert all(len(w) == 55 and w[0] == 2 and w[1:] == ids[ids.index(w[1]):ids.index(w[1]) + 54] for w in wins)
    with pytest.raises(ValueError, match="has 300 tokens but length 400"):
        text_windows(ids, 400, 5, 1)


def test_points_resolve_to_budgets_of_the_context():
    assert MethodPoint("quest", 0.1).options(2048) == {"budget": 208}
    assert MethodPoint("lserve", 0.1).options(2048) == {"budget": 192}
    assert MethodPoint("streaming", 0.1).options(2048) == {"sink": 64, "local": 141}
    assert MethodPoint("tactic", 0.9).options(2048) == {"threshold": 0.9}
    assert MethodPoint("hybrid", 0.9).options(100, streaming_heads=[[1, 0, 0]]) == {
        "threshold": 0.9, "streaming_heads": [[1, 0, 0]]}
    assert MethodPoint("tactic", 0.8).index_key(2048) == MethodPoint("tactic", 0.95).index_key(2048)
    assert MethodPoint("quest", 0.1).index_key(2048) != MethodPoint("quest", 0.2).index_key(2048)
    labels = [p.label for p in sweep_points(["dense", "tactic", "quest"], [0.8, 0.9], [0.05])]
    assert labels == ["dense", "tactic P=0.8", "tactic P=0.9", "quest 5%"]
    head = [p.label for p in headline_points(["tactic", "hybrid", "lserve"], [0.8, 0.95], 0.1)]
    assert head == ["dense", "tactic P=0.8", "tactic P=0.95", "hybrid P=0.9", "lserve 10%"]
    with pytest.raises(ValueError, match="unknown method.*nope.*choose from"):
        parse_methods("tactic,nope")


# ------------------------------------------------------------------ metrics
@pytest.mark.parametrize("S,G", [(1, 1), (54, 3), (97, 4)])
def test_attention_fidelity_against_float64_oracle(S, G):
    q, k, v = clustered_qkv(2, 2 * G, 2, S, 64, seed=S, dtype=torch.float32)
    lengths = torch.tensor([S, max(1, S - 7)])
    g = torch.Generator().manual_seed(S)
    mask = (torch.rand(2, 2, S, generator=g) < 0.4) | (torch.arange(S) == 0)
    mask &= torch.arange(S)[None, None] < lengths[:, None, None]
    out = attend(q, k, v, mask)[0]
    mass, err = attention_fidelity(q, k, v, mask, lengths, out)
    _, p_dense = oracle(q, k, v, lengths)
    o_dense, _ = oracle(q, k, v, lengths)
    want_mass = (p_dense.view(2, 2, G, S) * mask[:, :, None]).sum(-1).view(2, 2 * G)
    assert torch.allclose(mass, want_mass, atol=1e-12)
    for b in range(2):
        for h in range(2 * G):
            assert err[b, h].item() == pytest.approx(rel_err(out[b, h], o_dense[b, h]), rel=1e-6)
    full = torch.ones_like(mask)
    mass_full, err_full = attention_fidelity(q, k, v, full, lengths, o_dense.float())
    assert torch.allclose(mass_full, torch.ones_like(mass_full)) and err_full.max() < 1e-6


def test_attention_fidelity_observer_averages_per_layer():
    q, k, v = clustered_qkv(1, 4, 2, 40, 64, dtype=torch.float32)
    lengths = torch.tensor([40])
    obs = AttentionFidelity(2, 4, 2)
    half = torch.arange(40)[None, None].expand(1, 2, 40) < 20
    for layer, mask in ((0, torch.ones(1, 2, 40, dtype=torch.bool)), (1, half)):
        obs(layer, q, k, v, Selection(mask), lengths, attend(q, k, v, mask)[0])
    s = obs.summary()
    assert s["layer_head"]["kv_fraction"] == [[1.0, 1.0], [0.5, 0.5]]
    assert s["layer_head"]["mass"][0] == pytest.approx([1.0] * 4)
    assert all(m < 1 for m in s["layer_head"]["mass"][1])
    assert s["kv_fraction"] == pytest.approx(0.75)
    every = torch.cat(obs.all_mass)
    assert sorted(s["mass_reaching"]) == ["0.8", "0.9", "0.95"]
    levels = obs.summary((0.92, 0.5))["mass_reaching"]  # a point's own P (the default 0.92) too
    assert sorted(levels) == ["0.5", "0.8", "0.9", "0.92", "0.95"]
    for p, share in levels.items():
        assert share == pytest.approx((every >= float(p)).double().mean().item()), p


def test_attention_fidelity_on_sliding_window_layers():
    """A windowed layer is judged against dense attention over its window: reading exactly
    the window is exact there; the summary's mass and error cover the global layers only."""
    B, Hkv, G, S, D, W = 2, 1, 4, 97, 32, 16
    q, k, v = clustered_qkv(B, Hkv * G, Hkv, S, D, seed=3)
    lengths = torch.tensor([97, 54])
    pos = torch.arange(S)[None, :]
    window = ((pos < lengths[:, None]) & (pos >= lengths[:, None] - W))[:, None, :].expand(B, Hkv, S)
    out = oracle(q, k, v, mask=window)[0]
    mass, err = attention_fidelity(q, k, v, window, lengths, out, window=W)
    assert torch.allclose(mass, torch.ones_like(mass)) and err.max() < 1e-12
    mass_full, err_full = attention_fidelity(q, k, v, window, lengths, out)
    assert mass_full.max() < 0.999 and err_full.max() > 1e-3  # against unwindowed dense it would look lossy
    stats = AttentionFidelity(2, Hkv * G, Hkv, windows=[W, None])
    stats(0, q, k, v, Selection(window), lengths, out)
    half = Selection(((pos % 2 == 0) & (pos < lengths[:, None]))[:, None, :])
    stats(1, q, k, v, half, lengths, attend(q, k, v, half.mask)[0])
    s = stats.summary()
    assert s["judged_layers"] == [1] and s["mass_mean"] == pytest.approx(stats.mass[1].mean().item() / 2)
    assert 0.2 < s["mass_mean"] < 0.8 and s["kv_fraction_judged"] == pytest.approx(0.5, abs=0.02)


def test_next_token_metrics():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    dense = torch.log_softmax(logits, -1)
    targets = torch.tensor([0, 3, 5, 7, 10])
    same = next_token_metrics(dense, dense, targets)
    assert same["kl"] == pytest.approx(0, abs=1e-7) and same["top1_agree"] == 1.0
    assert same["ppl"] == pytest.approx(math.exp(-dense.gather(1, targets[:, None]).mean().item()))
    flat = torch.full_like(dense, -math.log(11))
    m = next_token_metrics(flat, dense, targets)
    want_kl = (dense.exp() * (dense + math.log(11))).sum(-1).mean().item()
    assert m["kl"] == pytest.approx(want_kl, rel=1e-5) and m["ppl"] == pytest.approx(11, rel=1e-5)
    assert m["dense_ppl"] == pytest.approx(same["ppl"])


def test_a_cells_ppl_pools_its_windows_nll_and_kl_max_is_the_largest():
    """Two windows of 4 tokens each: the cell's ppl is exp of the mean NLL of all 8 tokens
    (the mean of the windows' perplexities is larger, by Jensen), kl_max the largest KL."""
    g = torch.Generator().manual_seed(1)
    windows = [(torch.log_softmax(3 * torch.randn(4, 7, generator=g), -1),
                torch.log_softmax(torch.randn(4, 7, generator=g), -1), torch.randint(0, 7, (4,), generator=g))
               for _ in range(2)]
    pooled = pool_next_token_metrics([next_token_metrics(*w) for w in windows])
    lp, dense, targets = (torch.cat(t) for t in zip(*windows))
    whole = next_token_metrics(lp, dense, targets)
    for key in ("nll", "ppl", "dense_nll", "dense_ppl", "kl", "kl_max", "top1_agree"):
        assert pooled[key] == pytest.approx(whole[key], rel=1e-6), key


# ------------------------------------------------------------------ store
def test_store_resumes_only_cells_of_the_same_run(tmp_path):
    s = ResultStore(tmp_path / "r", {"model": "a"})
    s.put("fidelity/2048/dense", {"x": 1})
    with open(tmp_path / "r" / "cells.jsonl", "a") as f:
        f.write('{"id": "cut sho')  # an interrupted write
    assert ResultStore(tmp_path / "r", {"model": "a"}).get("fidelity/2048/dense")["x"] == 1
    assert ResultStore(tmp_path / "r", {"model": "b"}).get("fidelity/2048/dense") is None
    s.save_tensor("t", torch.arange(3))
    assert torch.equal(ResultStore(tmp_path / "r", {"model": "a"}).load_tensor("t"), torch.arange(3))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot write to the output directory"):
        ResultStore(tmp_path / "file" / "sub", {})


# ------------------------------------------------------------------ CLI (embedded model)
def error_lines(err: str):
    """The CLI's error lines (a first run may also log the one-time model conversion)."""
    return [line for line in err.splitlines() if line.startswith("kvsieve: error")]


def run_cli(capsys, *argv):
    from kvsieve.cli import main

    code = main(list(argv))
    return code, capsys.readouterr()


@pytest.mark.parametrize("argv,message", [
    (["--tasks", "fidelity,nope"], "unknown task(s) nope for --tasks"),
    (["--methods", "tactic,magic"], "unknown method(s) magic"),
    (["--lengths", "8190"], "--lengths value 8190 plus 32 tokens for --decode-tokens exceeds the model's 8192"),
    (["--retrieval-lengths", "8180", "--tasks", "retrieval"], "exceeds the model's 8192 positions"),
    (["--thresholds", "0.9,1.5"], "--thresholds must lie in (0, 1], got 1.5"),
    (["--passkey-depths", "1.5"], "--passkey-depths must lie in [0, 1], got 1.5"),
    (["--retrieval-fraction", "0"], "--retrieval-fraction must lie in (0, 1], got 0"),
    (["--text-file", "/no/such.txt"], "--text-file '/no/such.txt' not found"),
    (["--tasks", "suite", "--suite-lengths", "8180"], "--suite-lengths value 8180 plus 16 tokens"),
    (["--tasks", "suite", "--suite-lengths", "100"], "--suite-lengths value 100 cannot hold a needle"),
    (["--tasks", "suite", "--suite-sources", "pydoc,web"], "unknown suite source(s) web for --suite-sources"),
    (["--variants", "passkey,foo"], "unknown retrieval variant(s) foo for --variants"),  # (was a KeyError traceback)
    (["--tasks", "suite", "--suite-cases", "0"], "--suite-cases must be >= 1"),
    (["--tasks", "suite", "--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--device", "tpu"], "--device 'tpu' is not a device torch knows"),
] + ([(["--device", "cuda"], "no CUDA GPU is available")] if not torch.cuda.is_available() else []))
def test_eval_bad_input_exits_2_with_one_line(capsys, tmp_path, argv, message):
    code, out = run_cli(capsys, "eval", "--out", str(tmp_path / "o"), "--no-progress", *argv)
    assert code == 2
    assert error_lines(out.err) == [error_lines(out.err)[0]] and message in out.err, out.err


def test_eval_seed_reaches_the_plan():
    """--seed picks a held-out split: the plan carries it (and so the results' fingerprint;
    test_suite checks that another seed builds other cases)."""
    from kvsieve.cli import build_parser
    from kvsieve.eval.cli import build_plan

    args = build_parser().parse_args(["eval", "--seed", "3", "--tasks", "suite"])
    plan = build_plan(args, 8192)
    assert plan.seed == 3
    assert build_plan(build_parser().parse_args(["eval"]), 8192).seed == 0


def test_eval_lists_labels_and_fingerprints_keep_settings_apart():
    """2.5% was labelled 2% (the label is part of a cell's id, so 0.025 reused 0.02's cell);
    an empty list ran nothing or crashed, a repeated value ran twice; another passkey depth,
    needle depth, suite case count or source reused cells measured at the old one."""
    from kvsieve.cli import build_parser
    from kvsieve.eval.cli import build_plan, run_fingerprint
    from kvsieve.eval.sweep import MethodPoint

    labels = [MethodPoint("quest", f).label for f in (0.02, 0.025, 0.05, 0.12, 0.125)]
    assert labels == ["quest 2%", "quest 2.5%", "quest 5%", "quest 12%", "quest 12.5%"]
    plan = lambda *argv: build_plan(build_parser().parse_args(["eval", *argv]), 8192)  # noqa: E731
    for flag in ("--lengths", "--methods", "--thresholds", "--passkey-depths", "--suite-sources"):
        with pytest.raises(ValueError, match=f"{flag} is empty"):
            plan(flag, "")
    assert plan("--suite-thresholds", "").suite_thresholds == ()  # (extra points: none is the default)
    p = plan("--lengths", "256,256", "--methods", "tactic,dense,tactic", "--thresholds", "0.9,0.9")
    assert p.lengths == (256,) and p.methods == ("tactic", "dense") and p.thresholds == (0.9,)
    small = build_plan(build_parser().parse_args(["eval", "--quick"]), 2048)  # preset lengths fit the model
    assert small.lengths == (1984,) and small.retrieval_lengths == (1024,) and small.suite_lengths == (1024,)
    small = build_plan(build_parser().parse_args(["eval", "--tasks", "suite"]), 1024)
    assert max(small.suite_lengths) == 960
    with pytest.raises(ValueError, match="--lengths value 2048"):  # the user's own lengths are not changed
        build_plan(build_parser().parse_args(["eval", "--quick", "--lengths", "2048"]), 2048)
    fp = lambda *argv: run_fingerprint(plan(*argv), "m", "t", 1, "float32", {})  # noqa: E731
    base = fp()
    for argv in (("--passkey-depths", "0.1,0.9"), ("--needle-depths", "0.2"), ("--suite-cases", "5"),
                 ("--suite-sources", "stdlib")):
        assert fp(*argv) != base, argv
    assert run_fingerprint(plan(), "m", "t", 1, "float32", {}, "NVIDIA H100 80GB HBM3") != base  # another device


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_eval_gpu_memory_fraction_out_of_range(capsys, tmp_path, value):
    code, out = run_cli(capsys, "eval", "--quick", "--out", str(tmp_path / "o"), "--gpu-memory-fraction", value)
    assert code == 2 and f"--gpu-memory-fraction must be in (0, 1], got {float(value)}" in out.err
    assert len(error_lines(out.err)) == 1 and not (tmp_path / "o").exists()


def test_eval_unwritable_output_directory(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    code, out = run_cli(capsys, "eval", "--quick", "--out", str(tmp_path / "f" / "o"))
    assert code == 2 and "cannot write to the output directory" in out.err and len(error_lines(out.err)) == 1


def test_eval_small_smoke_and_resume(capsys, tmp_path):
    """Every task end to end on the embedded model, three methods (the CI slice; the whole
    --quick preset is the slow test below), then a re-run that resumes. Fidelity at 1,024
    tokens: at 512 tactic's protected tokens and dense head would leave little to select.
    tactic and quest run with the embedded model's shipped dense heads; their cells name them."""
    out_dir = tmp_path / "small"
    argv = ["eval", "--quick", "--out", str(out_dir), "--no-progress", "--methods", "dense,tactic,quest",
            "--lengths", "1024", "--retrieval-lengths", "512", "--suite-lengths", "512", "--suite-cases", "3",
            "--variants", "passkey", "--decode-tokens", "4", "--suite-thresholds", ""]
    code, out = run_cli(capsys, *argv)
    assert code == 0, out.err
    res = json.loads((out_dir / "results.json").read_text())
    assert shlex.split(res["command"]) == ["kvsieve", *argv]  # the stored command re-runs (empty values quoted)
    from kvsieve.patterns import EMBEDDED_PATTERN, load_dense_heads, pattern_tag

    shipped = load_dense_heads(EMBEDDED_PATTERN)
    tag = f" heads={pattern_tag(shipped)}"
    assert all(c["id"].endswith(tag) == (c["method"] in ("tactic", "quest")) for c in res["cells"])
    cells = {c["id"].split(" heads=")[0]: c for c in res["cells"]}
    assert len(cells) == 5 + 5 + 3, sorted(cells)  # fidelity: dense, 3 P, quest; retrieval: the same; suite: 3
    assert res["dense_heads"]["tactic"] == [list(h) for h in shipped] and shipped
    assert cells["suite/512/tactic default"]["options"]["dense_heads"] == [list(h) for h in shipped]
    assert cells["suite/512/quest default"]["options"]["dense_heads"] == [list(h) for h in shipped]
    assert res["dense_heads"]["quest"] == res["dense_heads"]["tactic"]
    dense = cells["fidelity/1024/dense"]
    assert dense["mass_mean"] == pytest.approx(1.0) and dense["out_err_mean"] < 1e-5 and dense["kl"] < 1e-9
    tactic = [cells[f"fidelity/1024/tactic P={p}"] for p in (0.8, 0.9, 0.95)]
    assert all(0 < c["kv_fraction"] < 1 and 0.3 < c["mass_mean"] <= 1 for c in tactic), tactic
    assert tactic[0]["mass_mean"] <= tactic[1]["mass_mean"] <= tactic[2]["mass_mean"]
    assert len(tactic[1]["layer_head"]["mass"]) == 30 and len(tactic[1]["layer_head"]["mass"][0]) == 9
    assert cells["retrieval/passkey/512/dense"]["score"] == 1.0
    suite = {k.split("/")[2]: c for k, c in cells.items() if k.startswith("suite/512/")}
    assert set(suite) == {"dense", "tactic default", "quest default"}
    for c in suite.values():
        assert c["found"] == sum(s == d == 1.0 for s, d in zip(c["scores"], suite["dense"]["scores"]))
    report = (out_dir / "report.md").read_text()
    assert "tactic P=0.9" in report and "Retrieval suite" in report
    assert (out_dir / "fidelity-1024.png").stat().st_size > 10_000

    code, out = run_cli(capsys, *argv)
    assert code == 0 and "13 cells resumed" in out.out
    assert json.loads((out_dir / "results.json").read_text())["cells"] == res["cells"]

    # a run stopped while writing dense's tensor left it cut short: the re-run recomputes it
    # (it crashed on the unreadable file), and saves never leave a half file behind again
    (tensor,) = (out_dir / "dense").glob("fidelity-1024-*.pt")
    tensor.write_bytes(tensor.read_bytes()[:800])
    lines = (out_dir / "cells.jsonl").read_text().splitlines()
    (out_dir / "cells.jsonl").write_text("\n".join(ln for ln in lines if '"fidelity/1024/quest' not in ln) + "\n")
    code, out = run_cli(capsys, *argv)
    assert code == 0, out.err
    again = {c["id"]: c for c in json.loads((out_dir / "results.json").read_text())["cells"]}
    quest = next(i for i in again if i.startswith("fidelity/1024/quest"))
    assert again[quest]["kl"] == pytest.approx(cells[quest.split(" heads=")[0]]["kl"], rel=1e-6, abs=1e-12)
    assert len(torch.load(tensor)) == 1 and not list((out_dir / "dense").glob("*.tmp"))


@pytest.mark.slow
def test_eval_quick_smoke_and_resume(capsys, tmp_path):
    """The --quick preset end to end on the embedded model, then a re-run that resumes."""
    out_dir = tmp_path / "quick"
    code, out = run_cli(capsys, "eval", "--quick", "--out", str(out_dir), "--no-progress")
    assert code == 0, out.err
    res = json.loads((out_dir / "results.json").read_text())
    cells = {c["id"]: c for c in res["cells"]}
    assert len(cells) == 10 + 5 * 8 + 6  # fidelity: dense + 9 points; retrieval: 5 variants x 8; suite: 6
    dense = cells["fidelity/2048/dense"]
    assert dense["mass_mean"] == pytest.approx(1.0) and dense["out_err_mean"] < 1e-5 and dense["kl"] < 1e-9
    from kvsieve.model.loader import resolve_model_dir
    from kvsieve.patterns import pattern_for, pattern_tag

    # the shipped pattern is the default, at each method's own validated ratio
    heads, hybrid_heads = (f" heads={pattern_tag(pattern_for(m, None, resolve_model_dir(None), 30, 3))}"
                           for m in ("lserve", "hybrid"))
    cells.update({k.split(" heads=")[0]: c for k, c in cells.items() if "/tactic " in k})  # tactic's dense heads
    assert heads != hybrid_heads and f"fidelity/2048/hybrid P=0.9{hybrid_heads}" in cells
    for label in ("tactic P=0.8", "tactic P=0.9", "tactic P=0.95", "quest 10%", f"lserve 10%{heads}", "streaming 10%"):
        c = cells[f"fidelity/2048/{label}"]
        assert 0 < c["kv_fraction"] < 0.6 and 0.3 < c["mass_mean"] < 1 and c["kl"] > 0, (label, c)
        assert len(c["layer_head"]["mass"]) == 30 and len(c["layer_head"]["mass"][0]) == 9
    tactic = [cells[f"fidelity/2048/tactic P={p}"] for p in (0.8, 0.9, 0.95)]
    assert tactic[0]["kv_fraction"] < tactic[1]["kv_fraction"] < tactic[2]["kv_fraction"]
    assert tactic[0]["mass_mean"] < tactic[1]["mass_mean"] < tactic[2]["mass_mean"]
    assert cells["retrieval/passkey/1024/dense"]["score"] == 1.0
    assert cells["retrieval/passkey/1024/tactic P=0.9"]["score"] == 1.0
    suite = {k.split("/")[2].split(" heads=")[0]: c for k, c in cells.items() if k.startswith("suite/1024/")}
    assert set(suite) == {"dense", *(f"{m} default" for m in ("streaming", "quest", "lserve", "tactic", "hybrid"))}
    assert suite["dense"]["dense_correct"] >= 4 and suite["dense"]["found_of_dense"] == 1.0  # 6 cases, all kinds
    assert len(set(suite["dense"]["kinds"])) == 6 and suite["dense"]["kv_fraction"] == 1.0
    assert suite["tactic default"]["kv_fraction"] < 0.6 and suite["streaming default"]["kv_fraction"] < 0.6
    for c in suite.values():
        assert c["found"] == sum(s == d == 1.0 for s, d in zip(c["scores"], suite["dense"]["scores"]))
    assert res["versions"]["torch"] == torch.__version__ and res["model_config"]["num_layers"] == 30
    report = (out_dir / "report.md").read_text()
    assert "tactic P=0.9" in report and "Retrieval" in report and "Retrieval suite" in report
    for png in ("fidelity-2048.png", "heatmaps-2048.png", "retrieval-passkey.png", "suite-curve.png"):
        assert (out_dir / png).stat().st_size > 10_000

    code, out = run_cli(capsys, "eval", "--quick", "--out", str(out_dir), "--no-progress")
    assert code == 0 and "56 cells resumed" in out.out
    assert json.loads((out_dir / "results.json").read_text())["cells"] == res["cells"]


def test_suite_summary_counts_only_what_dense_answers(tmp_path):
    """found per length, per kind and overall are over dense's correct cases only; KV read
    overall is the mean over lengths; the table and the curve come from the same numbers."""
    from kvsieve.eval.plots import suite_curve
    from kvsieve.eval.report import suite_section, suite_summary

    def cell(L, method, label, scores, kv, kinds=("number", "name", "number")):
        return {"task": "suite", "length": L, "method": method, "label": label, "scores": scores,
                "kinds": list(kinds), "kv_fraction": kv}
    cells = [cell(1024, "dense", "dense", [1.0, 1.0, 0.0], 1.0), cell(2048, "dense", "dense", [1.0, 0.0, 1.0], 1.0),
             cell(1024, "tactic", "tactic default", [1.0, 0.0, 1.0], 0.3),
             cell(2048, "tactic", "tactic default", [1.0, 1.0, 0.0], 0.1),
             cell(1024, "tactic", "tactic P=0.8", [0.0, 0.0, 0.0], 0.2),
             cell(2048, "tactic", "tactic P=0.8", [1.0, 1.0, 1.0], 0.05)]
    rows = {r["label"]: r for r in suite_summary({"cells": cells})}
    t = rows["tactic default"]
    # dense right: 1024 cases 0, 1 (a number, a name); 2048 cases 0, 2 (two numbers)
    assert t["found"] == {"all": (2, 4), 1024: (1, 2), 2048: (1, 2), "number": (2, 3), "name": (0, 1)}
    assert t["kv"] == {1024: 0.3, 2048: 0.1, "all": pytest.approx(0.2)}
    assert rows["tactic P=0.8"]["found"]["all"] == (2, 4) and rows["dense"]["found"]["all"] == (4, 4)
    table = suite_section({"cells": cells})
    assert "| tactic default | 20.0% | 50% (2/4) | 50% (1/2) | 50% (1/2) | 66.7% (2/3) | 0% (0/1) | 30.0% | 10.0% |" in table
    assert suite_curve({"cells": cells, "model": "m"}, tmp_path / "c.png") == "c.png"
    assert (tmp_path / "c.png").stat().st_size > 10_000
    none_right = [cell(512, "dense", "dense", [0.0, 0.0, 0.0], 1.0), cell(512, "quest", "quest", [0.0, 1.0, 0.0], 0.4)]
    assert "| quest | 40.0% | — | — | — | — | 40.0% |" in suite_section({"cells": none_right})  # (divided by 0)
    assert "6 cases (" in table and "dense misses (2)" in table
    one = [cell(512, "dense", "dense", [1.0], 1.0, kinds=("name",)), cell(512, "quest", "quest", [1.0], 0.4, kinds=("name",))]
    assert "1 case (needle kinds name" in suite_section({"cells": one})
    assert suite_curve({"cells": none_right, "model": "m"}, tmp_path / "none.png") == ""  # nothing to draw
    assert not (tmp_path / "none.png").exists()


def test_pool_suite_sums_found_over_seeds_and_counts_a_point_once(tmp_path):
    """scripts/pool_suite.py: found summed over seeds on each seed's dense-correct cases, KV
    read averaged; a second run of one seed adds only points the first lacks; a point missing
    from a seed is listed but not pooled; a missing file exits 2."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "pool_suite.py"
    spec = importlib.util.spec_from_file_location("pool_suite", path)
    pool_suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pool_suite)

    def cell(method, label, scores, kv):
        return {"task": "suite", "method": method, "label": label, "length": 1024, "scores": scores,
                "kinds": ["number"] * len(scores), "kv_fraction": kv}

    runs = {"s0": [cell("dense", "dense", [1, 1, 0], 1.0), cell("tactic", "tactic default", [1, 0, 1], 0.2)],
            "s1a": [cell("dense", "dense", [1, 1], 1.0), cell("tactic", "tactic default", [1, 1], 0.3)],
            "s1b": [cell("dense", "dense", [1, 1], 1.0), cell("tactic", "tactic default", [0, 0], 0.9),
                    cell("tactic", "tactic P=0.8", [1, 0], 0.1)]}
    for name, cells in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"model": "m", "cells": cells}))
    p = lambda n: str(tmp_path / f"{n}.json")  # noqa: E731
    assert pool_suite.main([p("s0"), f"{p('s1a')}+{p('s1b')}", "--out", str(tmp_path / "out")]) == 0
    table = (tmp_path / "out" / "pooled.md").read_text()
    assert "| tactic default | 1/2 | 2/2 | 75.0% (3/4) | 25.0% | 25.0% |" in table
    assert "| tactic P=0.8 |  | 1/2 |  |  |  |" in table
    assert (tmp_path / "out" / "suite-curve-pooled.png").stat().st_size > 0
    assert pool_suite.main([p("s0"), p("nope"), "--out", str(tmp_path / "out")]) == 2
    (tmp_path / "bad.json").write_text("not json")
    (tmp_path / "empty.json").write_text(json.dumps({"model": "m", "cells": []}))
    assert pool_suite.main([p("bad"), "--out", str(tmp_path / "out")]) == 2
    assert pool_suite.main([p("empty"), "--out", str(tmp_path / "out")]) == 2


def test_pool_options_sums_cases_per_length_over_seeds(tmp_path, capsys, monkeypatch):
    """scripts/pool_options.py: suite_cases.py lines pooled per setting over seeds, per length;
    a seed counts once (first line); --defaults maps a run's `{}` onto the options it named;
    --methods filters; a file without a seed in its name exits."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "pool_options.py"
    spec = importlib.util.spec_from_file_location("pool_options", path)
    pool_options = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pool_options)

    def line(method, options, oks, kv):
        cases = {f"{i}-number-pydoc-{L}-d0.5-plain": [ok, "x"] for i, (L, ok) in enumerate(oks)}
        return json.dumps({"method": method, "options": options, "cases": cases, "kv_by_length": kv}) + "\n"

    kv = {"1024": 0.5, "2048": 0.25}
    (tmp_path / "a-float32-seed0.jsonl").write_text(
        line("tactic", {}, [(1024, True), (2048, False)], kv) + line("quest", {"method": "quest"}, [(1024, True)], kv))
    (tmp_path / "b-float32-seed1.jsonl").write_text(
        line("tactic", {"threshold": 0.93}, [(1024, True), (2048, True)], {"1024": 1.0, "2048": 0.75})
        + line("tactic", {"threshold": 0.93}, [(1024, False)], kv))  # the same seed again: not counted
    (tmp_path / "c-bf16-seed1.jsonl").write_text(line("tactic", {}, [(1024, False)], kv))
    files = sorted(str(p) for p in tmp_path.glob("*.jsonl"))
    cells = pool_options.pool(files, defaults={"tactic": {"threshold": 0.93}})
    t = cells[("float32", "tactic", '{"threshold": 0.93}')]
    assert t["seeds"] == {"0", "1"} and dict(t["by_length"]) == {1024: [2, 2], 2048: [1, 2]}
    assert dict(cells[("bfloat16", "tactic", '{"threshold": 0.93}')]["by_length"]) == {1024: [0, 1]}
    assert dict(cells[("float32", "quest", "{}")]["by_length"]) == {1024: [1, 1]}
    assert set(pool_options.pool(files, methods={"quest"})) == {("float32", "quest", "{}")}
    monkeypatch.setattr("sys.argv", ["pool_options.py", "--defaults", 'tactic={"threshold": 0.93}', *files])
    assert pool_options.main() == 0
    assert '| float32 | tactic | `{"threshold": 0.93}` | 0,1 | 75.0% (3/4) | 2/2 | 1/2 | 62.5% | 50.0% |' \
        in capsys.readouterr().out
    (tmp_path / "noseed.jsonl").write_text(line("tactic", {}, [(1024, True)], kv))
    with pytest.raises(SystemExit):
        pool_options.pool([str(tmp_path / "noseed.jsonl")])


def test_pool_options_reads_eval_results_and_plots(tmp_path, capsys, monkeypatch):
    """A `kvsieve eval --tasks suite` results.json pools like suite_cases lines: each non-dense
    cell on the cases dense answered right (its KV read averaged over those), its knob as the
    option; --plot draws the settings pooled over every seed (a PNG) and skips the others."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "pool_options.py"
    spec = importlib.util.spec_from_file_location("pool_options", path)
    pool_options = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pool_options)

    def cell(L, method, knob, scores, kv):
        return {"task": "suite", "length": L, "method": method, "knob": knob, "cases": [f"{i}-x-y-{L}" for i in
                range(len(scores))], "scores": scores, "answers": ["a"] * len(scores), "kv_fractions": kv}

    def results(seed, cells):
        return json.dumps({"dtype": "float32", "plan": {"seed": seed}, "cells": cells})

    (tmp_path / "r3.json").write_text(results(3, [
        cell(1024, "dense", None, [1.0, 1.0, 0.0], [1, 1, 1]),
        cell(1024, "tactic", None, [1.0, 0.0, 1.0], [0.2, 0.4, 0.9]),  # the third: dense missed it
        cell(1024, "tactic", 0.95, [1.0, 1.0, 0.0], [0.3, 0.5, 0.9]),
        cell(1024, "quest", 0.5, [0.0, 1.0, 1.0], [0.5, 0.5, 0.5])]))
    (tmp_path / "t-float32-seed4.jsonl").write_text(json.dumps({
        "method": "tactic", "options": {"threshold": 0.95}, "cases": {"0-x-y-1024": [True, "a"]},
        "kv_by_length": {"1024": 0.1}}) + "\n")
    files = [str(tmp_path / "r3.json"), str(tmp_path / "t-float32-seed4.jsonl")]
    cells = pool_options.pool(files, defaults={"tactic": {"threshold": 0.93}})
    t95 = cells[("float32", "tactic", '{"threshold": 0.95}')]
    assert t95["seeds"] == {"3", "4"} and dict(t95["by_length"]) == {1024: [3, 3]}
    assert t95["kv"] == [{"1024": pytest.approx(0.4)}, {"1024": 0.1}]
    assert dict(cells[("float32", "tactic", '{"threshold": 0.93}')]["by_length"]) == {1024: [1, 2]}
    assert dict(cells[("float32", "quest", '{"fraction": 0.5}')]["by_length"]) == {1024: [1, 2]}
    png = tmp_path / "curve.png"
    plotted = pool_options.plot(pool_options.summaries(cells), str(png))
    assert [(r["method"], r["opts"]) for r in plotted] == [("tactic", '{"threshold": 0.95}')]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.json").write_text(json.dumps({"cells": []}))
    with pytest.raises(SystemExit, match="not a `kvsieve eval --tasks suite` results.json"):
        pool_options.pool([str(tmp_path / "bad.json")])
    monkeypatch.setattr("sys.argv", ["pool_options.py", *files, "--plot", str(tmp_path / "c2.png")])
    assert pool_options.main() == 0 and (tmp_path / "c2.png").is_file()
    assert '| float32 | tactic | `{"threshold": 0.95}` | 3,4 | 100.0% (3/3) | 3/3 | 25.0% | 25.0% |' \
        in capsys.readouterr().out


def test_pool_options_curve_frontier_and_labels():
    """The curve's line per method joins only the settings no other beats on read and found."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "pool_options.py"
    spec = importlib.util.spec_from_file_location("pool_options", path)
    pool_options = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pool_options)
    pts = [(14.7, 99.0, "a"), (13.4, 98.6, "b"), (15.9, 98.9, "c"), (13.6, 98.2, "d"), (21.2, 98.8, "e")]
    assert pool_options.frontier(pts) == [(13.4, 98.6, "b"), (14.7, 99.0, "a")]
    assert pool_options.short_label('{"threshold": 0.95, "dense_heads": [[7, 2], [8, 0]]}') == "P0.95 dense 7:2,8:0"
    assert pool_options.short_label("{}") == "default"
