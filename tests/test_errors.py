import math
import warnings

import pytest
import torch

from kvsieve import make_method, sparse_decode

from conftest import clustered_qkv


def qkv(B=1, Hq=4, Hkv=2, S=20, D=64):
    return clustered_qkv(B, Hq, Hkv, S, D, dtype=torch.float32)


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v: (q[0], k, v), r"q must have shape \[B, Hq, D\]"),
    (lambda q, k, v: (q, k[0], v), r"k must have shape \[B, Hkv, S, D\]"),
    (lambda q, k, v: (q, k, v[..., :32]), "same shape"),
    (lambda q, k, v: (q.long(), k, v), "float16, bfloat16, float32 or float64"),
    (lambda q, k, v: (q.double(), k, v), "share one dtype"),
    (lambda q, k, v: (q[..., :32], k[..., :32], v), "same shape"),
    (lambda q, k, v: (q[:, :3], k, v), r"query heads \(3\) must be a multiple of KV heads \(2\)"),
    (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), "empty input"),
    (lambda q, k, v: (q, k[:, :0], v[:, :0]), "empty input"),
    (lambda q, k, v: (q[:, :0], k, v), "empty input"),
    (lambda q, k, v: ([1.0], k, v), "must be a torch.Tensor"),
    (lambda q, k, v: (q.index_fill(2, torch.tensor([3]), float("nan")), k, v), "q holds NaN or infinite values"),
    (lambda q, k, v: (q, k.index_fill(2, torch.tensor([19]), float("nan")), v), "k holds NaN or infinite values"),
    (lambda q, k, v: (q, k, v.index_fill(3, torch.tensor([0]), float("inf"))), "v holds NaN or infinite values"),
])
def test_bad_tensors(mutate, match):
    with pytest.raises(ValueError, match=match):
        sparse_decode(*mutate(*qkv()), method="dense")


@pytest.mark.parametrize("lengths,match", [
    ([0], r"lengths must be in \[1, S=20\]"), ([21], r"lengths must be in \[1, S=20\]"),
    ([1, 2], "one per request"), (torch.tensor([1.5]), "one per request"),
    (torch.tensor([True]), "one per request"), (["a"], "one per request"), ([None], "one per request"),
])
def test_bad_lengths(lengths, match):
    with pytest.raises(ValueError, match=match):
        sparse_decode(*qkv(), method="dense", lengths=lengths)


@pytest.mark.parametrize("lengths,match", [
    (torch.tensor([21, 5]), r"lengths must lie in \[0, 20\].*got \[21, 5\]"),
    (torch.tensor([-1, 5]), r"lengths must lie in \[0, 20\]"),
    (torch.tensor([5]), r"shape \(2,\), one length per row, got \(1,\)"),
    (torch.tensor([[5, 5]]), r"shape \(2,\), one length per row, got \(1, 2\)"),
    (torch.tensor([5.0, 3.0]), r"integer tensor.*torch.float32"),
    ([5, 3], r"integer tensor.*got list"),
])
def test_reference_ops_refuse_lengths_that_do_not_fit_the_rows(lengths, match):
    """kvsieve.ops' dense_attend, kmeans and page_summaries read the first lengths[b]
    positions of each row: a length past the rows, negative, one for the whole batch or of
    another shape was taken silently (clipped, broadcast); each is now one clear error."""
    from kvsieve.ops import dense_attend, kmeans, page_summaries

    q, k, v = qkv(B=2)
    for call in (lambda: dense_attend(q, k, v, lengths), lambda: page_summaries(k, lengths, 4),
                 lambda: kmeans(k[:, 0], lengths, 4)):
        with pytest.raises(ValueError, match=match):
            call()
    ok = torch.tensor([20, 0])  # (a whole row, an empty one)
    assert torch.isneginf(dense_attend(q, k, v, ok)[1][1]).all()
    assert kmeans(k[:, 0], ok, 4).sizes.sum(1).tolist() == [20, 0]


def test_reference_ops_refuse_arguments_that_do_not_fit_together():
    """attend's mask of another dtype failed inside torch (a float mask: "~ only implemented
    on integer and Boolean tensors"); merge_attention broadcast a one-request result over the
    batch silently; page_scores failed in a reshape. Each is now one error naming the shapes."""
    from kvsieve.ops import attend, merge_attention, page_scores, page_summaries

    q, k, v = qkv(B=2)
    with pytest.raises(ValueError, match="mask must be a bool tensor.*torch.float32"):
        attend(q, k, v, torch.ones(2, 2, 20))
    out, lse = attend(q, k, v, torch.ones(2, 2, 20, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"merge_attention: out_a \(2, 4, 64\).*out_b \(1, 4, 64\)"):
        merge_attention(out, lse, out[:1], lse[:1])
    with pytest.raises(ValueError, match="do not fit together"):
        merge_attention(out, lse, out, lse[:, :2])
    merged, both = merge_attention(out, lse, out, lse)  # the same tokens twice: the same output, lse + log 2
    assert torch.allclose(merged, out, atol=1e-6) and torch.allclose(both, lse + math.log(2), atol=1e-5)
    kmin, kmax = page_summaries(k, torch.tensor([20, 20]), 4)
    assert page_scores(q, kmin, kmax).shape == (2, 4, 5)
    with pytest.raises(ValueError, match=r"page_scores: q \(2, 3, 64\)"):
        page_scores(q[:, :3], kmin, kmax)
    with pytest.raises(ValueError, match="do not fit together"):
        page_scores(q, kmin, kmax[:, :, :2])


def test_inputs_whose_logits_overflow_float32_are_refused():
    """q, k around 1e19 are finite but q.k is not in float32: NaN came back with no error."""
    q, k, v = qkv()
    with pytest.raises(ValueError, match="past float32's range"):
        sparse_decode(q * 1e19, k * 1e19, v)
    assert sparse_decode(q.double() * 1e19, k.double() * 1e19, v.double(), method="dense").out.isfinite().all()
    with pytest.raises(ValueError, match=r"q.k can reach .*past float64's range \(1.8e308\).*; scale q or k down$"):
        sparse_decode(q.double() * 1e155, k.double() * 1e155, v.double(), method="dense")  # (NaN came back)


def test_values_whose_sum_overflows_are_refused_and_large_ones_kept():
    """v at float32's maximum summed to inf in the output (each output is a weighted mean of v)."""
    q, k, v = qkv()
    top = torch.finfo(torch.float32).max
    with pytest.raises(ValueError, match=r"v holds values up to 3.4e\+38; a sum of 20 of them passes float32's"):
        sparse_decode(q, k, torch.full_like(v, top), method="dense")
    big = sparse_decode(q, k, torch.full_like(v, 1e36), method="dense").out  # 20 x 1e36 fits
    assert torch.allclose(big, torch.full_like(big, 1e36), rtol=1e-5)
    wide = sparse_decode(q.double(), k.double(), torch.full_like(v.double(), top), method="dense").out
    assert torch.allclose(wide, torch.full_like(wide, top), rtol=1e-12)


def test_inputs_that_require_grad_give_no_warning():
    q, k, v = (t.requires_grad_() for t in qkv())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sparse_decode(q, k, v, method="dense").out
    out.sum().backward()
    assert q.grad is not None and q.grad.isfinite().all()


@pytest.mark.parametrize("method,opts,match", [
    ("nope", {}, "unknown method 'nope'; choose one of: dense, streaming"),
    ("tactic", {"threshold": 0.0}, r"threshold must be a number in \(0, 1\], got 0.0"),
    ("tactic", {"threshold": 1.5}, r"threshold must be a number in \(0, 1\]"),
    ("tactic", {"cluster_size": 0}, "cluster_size must be a positive integer, got 0"),
    ("tactic", {"cluster_size": 2.5}, "cluster_size must be a positive integer"),
    ("tactic", {"max_clusters": -1}, "max_clusters must be an integer >= 0, got -1"),
    ("tactic", {"max_iters": -1}, "max_iters must be a positive integer"),
    ("tactic", {"min_budget": 10, "max_budget": 5}, r"max_budget \(5\) must be >= min_budget \(10\)"),
    ("tactic", {"segment_centers": (0.6, 0.1)}, "segment_centers"),
    ("tactic", {"segment_samples": -1}, "segment_samples must be an integer >= 0, got -1"),
    ("tactic", {"head_max_tokens": 0}, "head_max_tokens must be a positive integer, got 0"),
    ("quest", {"budget": 0}, "budget must be a positive integer, got 0"),
    ("quest", {"budget": 1 << 31}, "budget must be at most 16,777,216, got 2,147,483,648"),
    ("tactic", {"budget": 1 << 25}, "budget must be at most 16,777,216"),
    ("tactic", {"seed": 1 << 40}, None),  # a seed is not a token count
    ("streaming", {"sink": 1 << 30}, "sink must be at most 16,777,216"),
    ("quest", {"page_size": -16}, "page_size must be a positive integer"),
    ("lserve", {"physical_page_size": 40}, r"physical_page_size \(40\) must be a multiple of page_size \(16\)"),
    ("streaming", {"sink": 0, "local": 0}, "sink \\+ local > 0"),
    ("streaming", {"local": -1}, "local must be an integer >= 0"),
    ("streaming", {"threshold": 0.9}, "unknown option.*threshold.*'streaming'.*accepted options: sink, local"),
    ("pages", {"gqa_reduce": "mean"}, "gqa_reduce must be 'max' or 'sum'"),
    ("hybrid", {"streaming_heads": [1, 0, 1]}, "3 flags per layer but the keys have 2 KV heads"),
    ("hybrid", {"streaming_heads": [2, 0]}, "0/1 flags"),
    ("hybrid", {"dynamic": "lserve"}, "must not itself be hybrid"),
    ("hybrid", {"dynamic": "dense"}, "dynamic must be the method that selects.*tactic, quest or pages, got 'dense'"),
    ("hybrid", {"dynamic": "streaming"}, "got 'streaming'"),
    ("lserve", {"sparse_prefill": "no"}, "sparse_prefill must be True or False, got 'no'"),
    ("hybrid", {"streaming_heads": "heads.json"}, "streaming_heads='heads.json': give 0/1 flags"),
    ("tactic", {"segment_centers": 0.1}, "segment_centers must be two fractions.*got 0.1"),
    ("tactic", {"head_fraction": 0.5}, r"head_fraction=0.5 must be below the first segment centre \(0.1\)"),
    ("tactic", {"layer": -1}, "layer must be an integer >= 0"),
    ("hybrid", {"streaming_heads": [[1, 0], [0, 1]], "layer": 2}, "streaming_heads has 2 layers but layer 2"),
    ("tactic", {"fold_mode": "nearst"}, "fold_mode must be 'cluster' or 'nearest', got 'nearst'"),
    ("tactic", {"dense_heads": ((-1, 0),)}, "dense_heads must be .layer, kv_head. pairs of integers >= 0"),
    ("tactic", {"min_budget": 512, "max_budget": 512}, None),  # the boundaries themselves are accepted
    ("tactic", {"cluster_size": 16, "cluster_window": 16}, None),
])
def test_bad_options(method, opts, match):
    if match is None:
        assert sparse_decode(*qkv(), method=method, **opts).out.isfinite().all()
        return
    with pytest.raises(ValueError, match=match):
        sparse_decode(*qkv(), method=method, **opts)


def test_make_method_unknown_name():
    with pytest.raises(ValueError, match="unknown method"):
        make_method("Tactic")


def test_a_budget_past_the_context_reads_it_all_with_lists_of_the_context():
    """A budget far above the context (10M tokens on 100) plans lists of the context's
    bucket, not of the budget, and attends to every token."""
    from kvsieve.methods.base import capacity_bucket

    q, k, v = qkv(S=100)
    for method in ("quest", "lserve", "tactic"):
        res = sparse_decode(q, k, v, method=method, budget=10 ** 7)
        assert res.mask.all(), method
        dense = sparse_decode(q, k, v, method="dense").out
        assert torch.allclose(res.out, dense, atol=1e-5), method
    assert make_method("quest", budget=10 ** 7).plan_capacity(None, [100]) == capacity_bucket(100, least=4096)
    assert make_method("quest", budget=10 ** 7).plan_capacity(None, [10 ** 5]) == capacity_bucket(10 ** 5)
    assert make_method("quest", budget=1024).plan_capacity(None, [10 ** 5]) < 2048  # a budget below: unchanged


def test_quest_pages_follow_the_page_size():
    from kvsieve.methods import config_for

    assert config_for("quest").physical_page_size == 16
    assert config_for("quest", page_size=32).physical_page_size == 32
    assert config_for("quest", page_size=8).physical_page_size == 8
    with pytest.raises(ValueError, match=r"physical_page_size \(64\) must be a multiple of page_size \(128\).*--physical"):
        config_for("lserve", page_size=128)
    assert make_method("lserve", page_size=128, physical_page_size=256).dynamic.config.physical_page_size == 256


@pytest.mark.parametrize("argv,message", [
    (["--seed", str(10 ** 20)], "--seed must be an integer that fits in 64 bits, got 100000000000000000000"),
    (["--seq-len", str(10 ** 9)], "--seq-len 1000000000 needs about"),
    (["--seq-len", "0", "--data", "clustered"], "--seq-len must be >= 1 for --data clustered, got 0"),
    (["--seq-len", "100"], "--seq-len must be >= 520 for --data calibrated, got 100 (or use --data clustered)"),
])
def test_demo_bad_input_is_one_line(capsys, argv, message):
    """A seed past 64 bits said only 'Overflow when unpacking long long'; a context past the
    machine's memory ended in an allocator traceback."""
    from kvsieve.cli import main

    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv,line", [
    (["demo", "--bogus", "x"], "kvsieve: error: unrecognized arguments: --bogus x; see kvsieve demo --help"),
    (["demo", "--seed", "abc"], "kvsieve: error: kvsieve demo: argument --seed: invalid int value: 'abc'; see "
                                "kvsieve demo --help"),
    (["nosuch"], "kvsieve: error: argument command: invalid choice: 'nosuch'"),
])
def test_usage_errors_name_the_command_once_and_its_help(capsys, argv, line):
    """Unrecognized arguments read `kvsieve: error: kvsieve: unrecognized arguments ...; see
    kvsieve --help`: the program named twice, and the top-level help, not the command's."""
    from kvsieve.cli import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(line) and len(err.strip().splitlines()) == 1, err


def test_ctrl_c_is_one_line_and_status_130(capsys, monkeypatch):
    """Ctrl-C in any command (a long generate, a model conversion) printed a traceback of
    wherever the step was; it is one line now, with the shell's status for SIGINT."""
    import kvsieve.cli

    def interrupted(args):
        print("partial answ", end="")
        raise KeyboardInterrupt

    monkeypatch.delenv("KVSIEVE_DEBUG", raising=False)
    monkeypatch.setattr(kvsieve.cli, "cmd_demo", interrupted)
    assert kvsieve.cli.main(["demo"]) == 130
    out, err = capsys.readouterr()
    assert out == "partial answ" and err == "\nkvsieve: interrupted\n", err


def test_version_and_missing_dependency_messages(capsys, monkeypatch):
    """--version prints the package's version. A missing module gets one line naming the
    install; a message of ours that names its own extra (bench: kvsieve[triton]) is kept,
    not replaced by the generic kvsieve[model] advice."""
    import kvsieve
    import kvsieve.cli

    with pytest.raises(SystemExit) as stop:
        kvsieve.cli.main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"kvsieve {kvsieve.__version__}\n"
    monkeypatch.delenv("KVSIEVE_DEBUG", raising=False)
    for raised, want in [(ModuleNotFoundError("No module named 'gguf'", name="gguf"),
                          "kvsieve: error: missing dependency 'gguf': run `bash scripts/setup.sh` or "
                          "`pip install 'kvsieve[model]'`"),
                         (ModuleNotFoundError("kvsieve bench needs triton: pip install 'kvsieve[triton]'",
                                              name="triton"),
                          "kvsieve: error: kvsieve bench needs triton: pip install 'kvsieve[triton]'")]:
        def missing(args, raised=raised):
            raise raised

        monkeypatch.setattr(kvsieve.cli, "cmd_demo", missing)
        assert kvsieve.cli.main(["demo"]) == 2
        assert capsys.readouterr().err == want + "\n"


def test_an_os_error_is_one_line(capsys, monkeypatch, tmp_path):
    """An unreadable file in a user's model directory (PermissionError), a full disk: one line
    naming it and exit 2, not a traceback."""
    import kvsieve.cli

    def unreadable(args):
        raise PermissionError(13, "Permission denied", str(tmp_path / "model.safetensors"))

    monkeypatch.delenv("KVSIEVE_DEBUG", raising=False)
    monkeypatch.setattr(kvsieve.cli, "cmd_demo", unreadable)
    assert kvsieve.cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsieve: error: ") and "Permission denied" in err and "model.safetensors" in err
    assert len(err.strip().splitlines()) == 1


def test_a_closed_stdout_is_not_an_error(capsys, monkeypatch):
    """`kvsieve demo | head -1`: the pipe closing early printed "error: [Errno 32] Broken pipe"
    and exit 2; now nothing, and the status of a tool SIGPIPE ends."""
    import kvsieve.cli

    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.delenv("KVSIEVE_DEBUG", raising=False)
    monkeypatch.setattr(kvsieve.cli, "cmd_demo", closed)
    assert kvsieve.cli.main(["demo"]) == 141
    assert capsys.readouterr().err == ""


def test_config_errors_name_the_flags_the_user_typed():
    """A field the command has a flag for is named as the flag where it is the subject; other
    words (a mode, a path, a Python keyword beside the flag, a flag already) are left."""
    from kvsieve.cli import _as_flags

    flags = {"--cluster-size", "--threshold", "--budget", "--sink", "--local", "--streaming-heads", "--top-p"}
    assert _as_flags("cluster_size (9) must be at most cluster_window (8); give a cluster_size of at most 8", flags) \
        == "--cluster-size (9) must be at most cluster_window (8); give a --cluster-size of at most 8"
    assert _as_flags("drop budget (threshold mode) or drop threshold (budget mode)", flags) == \
        "drop --budget (threshold mode) or drop --threshold (budget mode)"
    assert _as_flags("sink=4 sets it; give heads (streaming_heads=..., --streaming-heads FILE) or drop sink/local",
                     flags) == "sink=4 sets it; give heads (streaming_heads=..., --streaming-heads FILE) or drop sink/local"
    assert _as_flags("file '/tmp/top_p.txt' and top_p.json: budget left", flags) == \
        "file '/tmp/top_p.txt' and top_p.json: budget left"
    assert _as_flags("top_k must be >= 0", flags) == "top_k must be >= 0"  # (no such flag here)
    assert _as_flags("--length must exceed sink + local (384)", flags) == "--length must exceed sink + local (384)"


def test_numpy_numbers_are_numbers():
    """Options and sampling settings swept with NumPy (np.arange, np.linspace) validate as the
    numbers they hold, as Python's do."""
    import numpy as np

    from kvsieve.engine.scheduler import SamplingParams

    q, k, v = qkv(S=300)
    for method, opts in [("quest", {"budget": np.int64(64)}), ("tactic", {"threshold": np.float32(0.75)}),
                         ("tactic", {"cluster_size": np.int32(8), "segment_centers": np.array([0.1, 0.6])})]:
        plain = {key: (val.tolist() if hasattr(val, "tolist") else val) for key, val in opts.items()}
        assert torch.equal(sparse_decode(q, k, v, method=method, **opts).mask,
                           sparse_decode(q, k, v, method=method, **plain).mask), (method, opts)
    p = SamplingParams(max_new_tokens=np.int64(4), temperature=np.float32(0.5), top_k=np.int32(3))
    assert p == SamplingParams(max_new_tokens=4, temperature=0.5, top_k=3) and type(p.max_new_tokens) is int
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        SamplingParams(max_new_tokens=np.float64(4.0))


@pytest.mark.parametrize("flag,value,match", [("--max-waiting", "0", "--max-waiting must be >= 1, got 0"),
                                              ("--max-num-seqs", "0", "--max-num-seqs must be >= 1"),
                                              ("--port", "70000", "--port must be in 0..65535"),
                                              ("--warmup-methods", "quest,qeust", "--warmup-methods names 'qeust'"),
                                              ("--served-model-name", " ", "--served-model-name is empty")])
def test_serve_refuses_bad_limits_before_loading(capsys, flag, value, match):
    """`serve --max-waiting 0` started, then refused every request (each waits a step first)."""
    from kvsieve.cli import main

    assert main(["serve", flag, value]) == 2
    assert match in capsys.readouterr().err


def test_demo_prints_every_method_at_its_defaults_with_its_error(capsys):
    """kvsieve demo: each method as generate runs it (the label read from its config) and at a
    512-token budget, on calibrated data by default; dense exact, tactic's default close."""
    from kvsieve.cli import main

    assert main(["demo", "--seq-len", "1024"]) == 0
    rows = {line[:42].strip(): line[42:].split() for line in capsys.readouterr().out.splitlines()[3:]}
    assert set(rows) == {"dense", "streaming (sink 128 + local 256, default)", "quest (budget 2048, default)",
                         "quest (budget 512)", "pages (budget 4096, default)", "pages (budget 512)",
                         "lserve (budget 6144, default)", "lserve (budget 512)",
                         "tactic (P = 0.92, default)", "tactic (budget 512)",
                         "hybrid (P = 0.92, 1 of 4 heads streaming)"}, rows
    read, err = {k: float(v[0].rstrip("%")) for k, v in rows.items()}, {k: float(v[1]) for k, v in rows.items()}
    assert read["dense"] == 100.0 and err["dense"] < 1e-5 and read["quest (budget 2048, default)"] == 100.0
    assert err["tactic (P = 0.92, default)"] < 0.1 and read["tactic (P = 0.92, default)"] < 100.0
    assert main(["demo", "--seq-len", "1024", "--data", "clustered"]) == 0
    assert "a stress case" in capsys.readouterr().out


def test_a_budget_with_threshold_mode_options_is_refused_and_a_requests_mode_wins(capsys):
    """tactic/hybrid with a fixed budget silently ignored --threshold, --protect and
    --protect-bound (the JSON echoed them as if used); a server's default mode gives way to a
    request's; out-of-range sizes and heads name the range to give."""
    from kvsieve.cli import main
    from kvsieve.methods import config_for, merge_options
    from kvsieve.patterns import check_dense_heads

    with pytest.raises(ValueError, match="threshold, protect set tactic's threshold mode.*drop budget"):
        config_for("tactic", budget=100, threshold=0.9, protect=64)
    with pytest.raises(ValueError, match="protect_bound set tactic's threshold mode"):
        config_for("hybrid", budget=100, protect_bound="radius")
    config_for("lserve", budget=100)
    config_for("tactic", budget=100, cluster_size=8, max_budget=None, dense_heads=())  # (None, none: nothing set)
    config_for("tactic", budget=100, dense_heads="none")
    assert merge_options({"threshold": 0.95, "protect": 0, "cluster_size": 8}, {"budget": 64}, "tactic") == \
        {"budget": 64, "cluster_size": 8}
    assert merge_options({"budget": 400}, {"threshold": 0.9}, "hybrid") == {"threshold": 0.9}
    assert merge_options({"budget": 400}, {"cluster_size": 16}, "tactic") == {"budget": 400, "cluster_size": 16}
    assert merge_options({"budget": 400}, {"dense_heads": ((1, 0),)}, "tactic") == {"dense_heads": ((1, 0),)}
    from kvsieve.server.cli import warmup_methods
    from kvsieve.methods import METHOD_NAMES
    assert warmup_methods("all,quest") == list(METHOD_NAMES) and warmup_methods(" quest, lserve,quest") == \
        ["quest", "lserve"]
    assert merge_options({"budget": 400, "page_size": 8}, {"threshold": 0.9}, "quest") == \
        {"budget": 400, "page_size": 8, "threshold": 0.9}  # (no threshold mode: refused by quest's config)
    assert main(["generate", "--method", "tactic", "--threshold", "0.9", "--budget", "100"]) == 2
    assert "drop --budget (threshold mode) or drop --threshold (budget mode)" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"cluster_size \(20000\) must be at most cluster_window \(16384\)"):
        config_for("tactic", cluster_size=20000)
    with pytest.raises(ValueError, match="counted from 0: name layers 0-29 and heads 0-2"):
        check_dense_heads([(30, 0)], 30, 3, "dense_heads (--dense-heads)")
    # a value that starts with '-' reaches the range check, not argparse's "expected one argument"
    for flag in ("--dense-heads", "--dense-head"):
        assert main(["generate", "--method", "tactic", flag, "-1:0", "--prompt", "hi"]) == 2
        err = capsys.readouterr().err
        assert "--dense-heads: layers and KV heads are counted from 0, got '-1:0'" in err, err


def test_python_api_odd_values_are_one_clear_error_or_work(tiny_model, tmp_path):
    """The notebook user's slips (apitypes audit): a tokenizer's output or None as the prompts,
    strings as flags, floats as sizes, an empty method name, options as a string, an abort
    of a list: each one ValueError naming the value; NumPy numbers, a uint8 `lengths`, a
    Path and torch dtypes work; the engine answers the same afterwards."""
    import numpy as np

    from kvsieve.config import TacticConfig
    from kvsieve.engine import LLMEngine, SamplingParams

    params = SamplingParams(max_new_tokens=3)
    eng = LLMEngine(tiny_model, None, "tactic")
    before = eng.generate([[5, 6, 7, 8]], params)[0].tokens
    for prompts, match in [({"input_ids": [[1, 2]]}, "got a dict .*tokenizer's output"), (None, "got NoneType"),
                           ({1, 2}, "got set")]:
        with pytest.raises(ValueError, match=match):
            eng.generate(prompts, params)
    for kw, match in [({"ignore_eos": "no"}, "ignore_eos must be True or False"),
                      ({"temperature": True}, "temperature must be a finite number"), ({"top_p": True}, "top_p must be"),
                      ({"temperature": float("inf")}, "temperature must be a finite number >= 0, got inf"),
                      ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    assert SamplingParams(logit_bias={np.int64(5): np.float32(1.0)}).logit_bias == ((5, 1.0),)
    for kw, match in [({"step_tokens": 2.5}, "step_tokens must be an integer >= 1, got 2.5"),
                      ({"max_num_seqs": True}, "max_num_seqs must be an integer >= 1"),
                      ({"max_num_seqs": None}, "max_num_seqs must be"), ({"paged": "no"}, "paged must be True, False")]:
        with pytest.raises(ValueError, match=match):
            LLMEngine(tiny_model, None, "dense", **kw)
    with pytest.raises(ValueError, match="LLMEngine.load"):
        LLMEngine("some/dir")
    with pytest.raises(ValueError, match="method must be a method name"):
        eng.generate([[5, 6]], params, method="")
    with pytest.raises(ValueError, match="method_options must be a dict"):
        eng.generate([[5, 6]], params, method="tactic", method_options="threshold=0.5")
    with pytest.raises(ValueError, match="abort.. takes a request id"):
        eng.abort([1])
    with pytest.raises(ValueError, match="score.. takes a list of prompts .*2-D Tensor"):
        eng.score(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 1, dtype=torch.long))
    for kw, match in [({"prompt_tokens": 2.5}, "prompt_tokens must be a prompt length"),
                      ({"prompt_tokens": -1}, "prompt_tokens must be"),
                      ({"prompt_tokens": 8, "decode_tokens": 0}, "decode_tokens must be an integer >= 1"),
                      ({"prompt_tokens": 8, "decode_tokens": 5000}, "decode_tokens=5000 leaves no room")]:
        with pytest.raises(ValueError, match=match):
            eng.warmup(**kw)
    eng.warmup(np.int64(8), decode_tokens=np.int32(2))
    assert eng.generate([[5, 6, 7, 8]], params)[0].tokens == before
    assert TacticConfig(threshold=np.float32(0.5), cluster_size=np.int64(8)).cluster_size == 8
    from kvsieve.methods.hybrid import HybridConfig, LServeConfig

    assert HybridConfig(sink=np.int64(4)).sink == 4 and type(LServeConfig(local=np.int32(64)).local) is int
    for one in (torch.tensor([5, 6]), np.array([5, 6]), [np.int64(5), np.int64(6)]):
        with pytest.raises(ValueError, match="got one list of token ids: wrap it in a list .a 1-D tensor"):
            eng.generate(one, params)
    eng.abort(torch.tensor(12345))  # an unknown id, as a 0-d tensor: a no-op
    heads = np.array([[0, 1]])
    assert eng.generate([[5, 6, 7, 8]], params, method="tactic", method_options={"dense_heads": heads})[0].tokens
    q, k, v = qkv(S=300)
    for lengths in (torch.tensor([50], dtype=torch.uint8), np.array([50], dtype=np.int8)):
        assert torch.equal(sparse_decode(q, k, v, method="quest", budget=32, lengths=lengths).mask,
                           sparse_decode(q, k, v, method="quest", budget=32, lengths=[50]).mask)
