"""Tests on the real embedded model (SmolLM2-135M-Instruct). Prompts <= 2K tokens; longer
ones are marked slow."""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from kvsieve.cli import main
from kvsieve.model.loader import load_model
from kvsieve.model.record import record_decode_step
from kvsieve.model.runner import Engine, SamplingConfig
from kvsieve.prompts import passkey_prompt


transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def embedded():
    model, tok, path = load_model()
    return model, tok, path


def count(tok):
    return lambda s: len(tok.encode(s, add_special_tokens=False))


def real_text_ids(tok, n):
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics)[:60])
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


def test_embedded_model_facts(embedded):
    cfg = embedded[0].cfg
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.max_positions) == (30, 9, 3, 64, 8192)


def test_logits_match_transformers_on_real_text(embedded):
    model, tok, path = embedded
    ids = real_text_ids(tok, 2000)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    eng = Engine(model, "dense", prefill_chunk=700, progress=False)
    cache = eng.new_cache([ids], 1)
    cache.reserve(0, len(ids))
    ours = model.logits(eng.prefill(cache, 0, ids, all_positions=True))
    assert (ours - ref).abs().max().item() <= 1e-3
    # decode path (paged cache + dense method) reproduces HF's greedy continuation
    prompt = ids[:300]
    res = eng.generate([prompt], 12)
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 300:].tolist()
    assert res.tokens[0] == hf_out[: len(res.tokens[0])]


@pytest.mark.parametrize("depth", [pytest.param(0.1, marks=pytest.mark.slow), 0.5,
                                   pytest.param(0.9, marks=pytest.mark.slow)])
def test_passkey_retrieved_by_sparse_methods_wherever_dense_does(embedded, depth):
    model, tok, _ = embedded
    text, key = passkey_prompt(count(tok), 1800, depth, seed=int(depth * 10))
    ids = tok.encode(text, add_special_tokens=False)
    answers = {}
    from kvsieve.patterns import EMBEDDED_PATTERN, load_pattern

    shipped = load_pattern(EMBEDDED_PATTERN, 30, 3)  # calibrated streaming heads, block-sparse prefill
    for method, opts in [("dense", {}), ("tactic", {"threshold": 0.9}), ("lserve", {"budget": 256}),
                         ("quest", {"budget": 256}), ("lserve", {"budget": 256, "streaming_heads": shipped}),
                         ("hybrid", {"streaming_heads": shipped})]:
        r = Engine(model, method, progress=False, **opts).generate([ids], 8)
        answers[method + (" heads" if "streaming_heads" in opts else "")] = (tok.decode(r.tokens[0]), r.kv_fraction)
    assert key in answers["dense"][0], answers
    for method, (text_out, frac) in answers.items():
        assert key in text_out, (method, answers)
        if method != "dense":
            assert frac < 0.6, (method, frac)  # they really skipped most of the cache


def test_batch_of_prompts_matches_single_runs(embedded):
    model, tok, _ = embedded
    a = tok.encode("The capital of France is", add_special_tokens=False)
    b = real_text_ids(tok, 400) + tok.encode(" In summary,", add_special_tokens=False)
    eng = Engine(model, "tactic", progress=False)
    both = eng.generate([a, b], 6)
    assert both.tokens[0] == eng.generate([a], 6).tokens[0]
    assert both.tokens[1] == eng.generate([b], 6).tokens[0]


@pytest.mark.parametrize("method,opts", [("dense", {}), ("quest", {"budget": 128}), ("tactic", {"budget": 200}),
                                         ("tactic", {"protect": 64}), ("tactic", {"protect": 64, "protect_bound": "box"}),
                                         ("tactic", {"protect": 64, "dense_heads": ((1, 0), (7, 2))}),
                                         ("hybrid", {"protect": 64, "dense_heads": ((1, 1), (7, 2)),
                                                     "streaming_heads": ((True, False, False),), "local": 64}),
                                         ("streaming", {"sink": 16, "local": 64})])
def test_paged_fast_path_generates_what_the_reference_path_does(embedded, method, opts):
    """Plan + paged attention straight on the cache pages (the GPU path, here with the
    torch twins) against gather + mask + attend, on a batch of two real-text prompts."""
    model, tok, _ = embedded
    prompts = [real_text_ids(tok, 700), real_text_ids(tok, 300)]
    runs = [Engine(model, method, progress=False, paged=p, **opts).generate(prompts, 6) for p in (False, True)]
    assert runs[0].tokens == runs[1].tokens
    assert abs(runs[0].kv_fraction - runs[1].kv_fraction) < 1e-9
    if method != "dense":
        assert runs[1].kv_fraction < 0.6


def test_paged_path_refused_for_a_method_without_plan(embedded, monkeypatch):
    from kvsieve.methods.tactic import Tactic

    monkeypatch.setattr(Tactic, "supports_plan", lambda self: False)
    with pytest.raises(ValueError, match="no paged fast path"):
        Engine(embedded[0], "tactic", paged=True)


def test_sampling_is_seeded(embedded):
    model, tok, _ = embedded
    ids = tok.encode("Once upon a time", add_special_tokens=False)
    eng = Engine(model, "dense", progress=False)
    s = SamplingConfig(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    assert eng.generate([ids], 10, s).tokens == eng.generate([ids], 10, s).tokens
    other = eng.generate([ids], 10, SamplingConfig(temperature=1.0, seed=8)).tokens
    assert other != eng.generate([ids], 10, s).tokens


def test_tactic_mass_on_recorded_real_attention(embedded):
    """Every layer of a real decode step reaches ~P with the mass each query head attends
    (its group's union), with whole fitting segments and with sampled ones (8 of 20
    positions, a sparser sample than segment_samples takes of 128K lists): over the 30
    layers the mass moves by 0.004 on average (moving the segments by 0.5% of the list
    moves it by 0.005) and its mean by < 0.005."""
    model, tok, _ = embedded
    rec = record_decode_step(model, real_text_ids(tok, 2000))
    from kvsieve.eval.fit_fidelity import compare

    per_layer, sampled = [], []
    for q, k, v in zip(rec.q, rec.k, rec.v):
        full, samp = compare(q, k, v, torch.tensor([k.shape[2]]), [("full", {"segment_samples": 0}),
                                                                   ("sampled", {"segment_samples": 8})],
                             {"threshold": 0.9})
        per_layer.append(full["union_mass"].mean().item())
        sampled.append(samp["union_mass"].mean().item())
        assert full["kv_fraction"] < 0.9 and (samp["reads"] < full["reads"]).all()
    assert min(per_layer) >= 0.9 - 0.02 and min(sampled) >= 0.9 - 0.02, (per_layer, sampled)
    moved = [abs(a - b) for a, b in zip(per_layer, sampled)]
    assert sum(moved) / len(moved) <= 0.01 and abs(sum(per_layer) - sum(sampled)) / len(moved) <= 0.005, moved


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_compare_dense_reports_both_answers_and_speeds(capsys):
    """--compare-dense: dense's answer (the same as --method dense gives), its own prefill and
    decode speed measured on its run alone, and the token agreement."""
    argv = ["generate", "--prompt", "Name three colors of the rainbow.", "--max-new-tokens", "6", "--json"]
    rc, out, _ = run_cli(capsys, *argv, "--method", "streaming", "--sink", "2", "--local", "4", "--compare-dense")
    rep = json.loads(out)
    rc2, out2, _ = run_cli(capsys, *argv, "--method", "dense")
    alone = json.loads(out2)
    assert rc == rc2 == 0 and rep["dense"]["text"] == alone["text"]
    assert rep["dense"]["decode_tokens_per_s"] > 0 and rep["dense"]["prefill_s"] > 0 and rep["dense"]["decode_s"] > 0
    assert rep["decode_s"] != rep["dense"]["decode_s"]  # each run timed on its own
    assert 0 <= rep["agreement"] <= 1 and (rep["agreement"] == 1.0) == (rep["text"] == alone["text"])
    assert (rep["first_divergence"] is None) == (rep["text"] == alone["text"])
    rc, _, err = run_cli(capsys, *argv[:-1], "--method", "streaming", "--compare-dense", "--no-progress")
    assert rc == 0 and "--- dense on cpu float32: prefill" in err and "decode" in err
    rates = [float(r) for r in re.findall(r"decode ([0-9.]+) tok/s", err)]  # the method's, then dense's
    note = "on the CPU a sparse plan runs as torch reference code" in err
    assert len(rates) == 2 and (rates[0] == rates[1] or note == (rates[0] < rates[1]))  # (printed to 0.1 tok/s)


def test_first_divergence_and_agreement():
    """agreement counts tokens equal at the same position (also after a divergence);
    first_divergence is where the answers part, a shorter answer parting where it ends."""
    from kvsieve.model.cli import first_divergence, token_agreement

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None and token_agreement([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    assert first_divergence([1, 2, 3, 4], [1, 9, 3, 4]) == 1 and token_agreement([[1, 2, 3, 4]], [[1, 9, 3, 4]]) == 0.75
    assert first_divergence([1, 2, 3], [1, 2]) == 2 and first_divergence([1], [1, 5]) == 1
    assert first_divergence([7], [8]) == 0


def test_streamed_answer_is_the_json_text_with_characters_over_several_tokens(capsys):
    """The streamed answer (one prompt, no --json) prints every character, those whose
    UTF-8 bytes span several tokens included, and equals --json's text."""
    argv = ["generate", "--prompt", "请用中文回答：中国的首都是哪里？", "--max-new-tokens", "12", "--method", "dense"]
    rc, out, _ = run_cli(capsys, *argv)
    rc2, out2, _ = run_cli(capsys, *argv, "--json")
    text = json.loads(out2)["text"]
    assert rc == rc2 == 0 and any(ord(c) > 0x2000 for c in text) and out == text + "\n"


def test_a_batch_answers_in_command_line_order(capsys, tmp_path):
    """--prompt and --prompt-file mixed: the answers (and their counts) come in the order the
    prompts were given, each the one it gets alone."""
    f = tmp_path / "p.txt"
    f.write_text("The capital of France is a city called")
    argv = ["generate", "--no-chat", "--max-new-tokens", "3", "--json", "--method", "dense"]
    rc, out, _ = run_cli(capsys, *argv, "--prompt-file", str(f), "--prompt", "Once upon a", "--prompt-file", str(f))
    both = json.loads(out)
    alone = [json.loads(run_cli(capsys, *argv, *a)[1]) for a in (("--prompt-file", str(f)), ("--prompt", "Once upon a"))]
    assert rc == 0 and both["text"] == [alone[0]["text"], alone[1]["text"], alone[0]["text"]]
    assert both["prompt_tokens"] == [alone[0]["prompt_tokens"], alone[1]["prompt_tokens"], alone[0]["prompt_tokens"]]
    (tmp_path / "empty.txt").write_text("\n")
    rc, _, err = run_cli(capsys, *argv, "--prompt", "hi", "--prompt-file", str(tmp_path / "empty.txt"))
    assert rc == 2 and f"--prompt-file '{tmp_path / 'empty.txt'}' is empty" in err


def test_generate_json_contract(capsys):
    rc, out, _ = run_cli(capsys, "generate", "--prompt", "Name a color.", "--max-new-tokens", "3",
                         "--method", "quest", "--budget", "64", "--json")
    assert rc == 0
    rep = json.loads(out)
    for key in ("text", "method", "prompt_tokens", "generated_tokens", "prefill_s", "decode_tokens_per_s",
                "kv_fraction", "kv_bytes"):
        assert key in rep
    assert rep["method"] == "quest" and rep["generated_tokens"] <= 3 and rep["kv_bytes"] > 0
    # the CPU never falls back below a crossover
    assert rep["attended"] == ["quest"] and rep["dense_below"] == rep["dense_step_below"] == 0
    rc, out, err = run_cli(capsys, "generate", "--prompt", "Name a color.", "--max-new-tokens", "3",
                           "--method", "quest", "--budget", "64", "--dense-below", "1000", "--json")
    rep = json.loads(out)
    assert rc == 0 and rep["attended"] == ["dense"] and rep["kv_fraction"] == 1.0 and rep["dense_below"] == 1000
    assert rep["dense_reason"] == ["not_indexed"] and "stayed below the --dense-below of 1000 tokens" in err
    assert "--- attended densely" in err and "pass --dense-below 0 to force quest" in err  # with --json too
    assert "read more than" not in err
    rc, _, err = run_cli(capsys, "generate", "--prompt", "Name a color.", "--max-new-tokens", "3",
                         "--method", "quest", "--budget", "64", "--dense-below", "1000")
    assert rc == 0 and "quest (dense attention)" in err and "pass --dense-below 0 to force quest" in err


@pytest.mark.parametrize("method", ["tactic", "hybrid"])
def test_generate_takes_the_shipped_dense_heads_in_threshold_mode_only(capsys, method):
    from kvsieve.patterns import EMBEDDED_PATTERN, load_dense_heads

    argv = ["generate", "--prompt", "Name a color.", "--max-new-tokens", "2", "--method", method, "--json"]
    shipped = [list(h) for h in load_dense_heads(EMBEDDED_PATTERN, 30, 3)]
    for extra, want in [((), shipped), (("--dense-heads", "none"), []), (("--dense-heads", "3:1"), [[3, 1]]),
                        (("--budget", "64"), None)]:
        rc, out, _ = run_cli(capsys, *argv, *extra)
        assert rc == 0 and json.loads(out)["options"].get("dense_heads") == want, extra


def test_usage_errors_are_one_line_exit_2(capsys):
    """argparse's own errors (a bad choice, a missing value, an unknown command) are one line."""
    for argv, message in ((["generate", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
                          (["generate", "--model"], "argument --model: expected one argument"),
                          (["nope"], "argument command: invalid choice: 'nope'")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("kvsieve: error:") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("argv,message", [
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--model", "tests"], "unknown model format"),
    (["--prompt", "   "], "--prompt 1 is empty (only whitespace)"),
    (["--max-new-tokens", "0", "--prompt", "hi"], "--max-new-tokens must be >= 1, got 0"),
    (["--method", "fancy", "--prompt", "hi"], "unknown method 'fancy'"),
    (["--method", "tactic", "--page-size", "100", "--prompt", "hi"],
     "--page-size does not apply to --method tactic; its options: --threshold"),
    (["--method", "tactic", "--dense-prefill", "--prompt", "hi"], "--dense-prefill does not apply to --method tactic"),
    (["--threshold", "1.5", "--prompt", "hi"], "--threshold must be a number in (0, 1]"),
    (["--cluster-size", "0", "--prompt", "hi"], "--cluster-size must be a positive integer, got 0"),  # (config
    # errors name the flag, not the dataclass field)
    (["--top-p", "1.5", "--prompt", "hi"], "--top-p must be a number in [0, 1], got 1.5"),
    (["--method", "tactic", "--budget", "64", "--threshold", "0.5", "--prompt", "hi"],
     "--threshold set tactic's threshold mode, which a fixed budget replaces, so it would be unused; drop --budget "
     "(threshold mode) or drop --threshold (budget mode)"),
    (["--model", "", "--prompt", "hi"], "the model path is empty ('')"),  # (was read as the working directory)
    (["--dense-heads", "7-2", "--prompt", "hi"], "--dense-heads must be layer:kv_head pairs separated by commas"),
    (["--dense-heads", "7:9", "--prompt", "hi"], "dense head 7:9, but this model has 30 layers x 3 KV heads"),
    (["--dense-heads", "30:0", "--prompt", "hi"], "dense head 30:0, but this model has 30 layers x 3 KV heads"),
    (["--dense-heads", "/nonexistent/heads.json", "--prompt", "hi"], "dense-heads file '/nonexistent/heads.json' "
                                                                        "not found"),
    (["--prompt-file", "/nonexistent.txt"], "prompt file '/nonexistent.txt' not found"),
    (["--prompt", "hi", "--max-new-tokens", "8200"], "--max-new-tokens is 8200, but the model allows 8192 positions; ask for at most 81"),
    (["--prompt", "hi", "--method", "quest", "--budget", "2147483648"], "--budget must be at most 16,777,216"),
    (["--prompt", "hi", "--method", "tactic", "--budget", str(1 << 63)], "--budget must be at most 16,777,216"),
    (["--prompt", "hi", "--method", "streaming", "--local", "99999999999"], "--local must be at most 16,777,216"),
    (["--prompt", "hi", "--device", "meta"], "kvsieve runs on cpu or cuda devices"),
    (["--prompt", "hi", "--kv-pages", "1000000000"], "give fewer KV pages (--kv-pages)"),
    (["--no-chat", "--prompt", "Once upon a time", "--kv-pages", "2", "--max-new-tokens", "30"],
     "a request of 4 prompt tokens and --max-new-tokens 30 caches up to 33 tokens"),  # (named max_new_tokens)
    (["--prompt", "hi", "--device", "mps"], "kvsieve runs on cpu or cuda devices"),
    # the template's tokens counted apart: "shorten the prompt to at most 2 tokens" could not be done
    (["--prompt", "Hi", "--max-new-tokens", "8190"], "--prompt 1 has 31 tokens (30 of them the chat template) and "
     "--max-new-tokens is 8190, but the model allows 8192 positions; ask for at most 8161 new tokens"),
])
def test_generate_bad_input_exits_2_with_one_line(capsys, argv, message):
    rc, out, err = run_cli(capsys, "generate", *argv)
    assert rc == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_generate_refuses_a_prompt_past_the_model_before_sizing_its_kv_pool(capsys, tmp_path):
    """A 1.2M-token prompt file was refused for the KV pool it would need ("give fewer KV pages
    (--kv-pages)", a flag the user never gave), after tokenizing it (38 s, 7 GB at 10M tokens).
    Now text no tokenizer fits in the model is refused unread, and a prompt past the model's
    positions by its length, with the fix counted in its text's tokens."""
    huge, long = tmp_path / "huge.txt", tmp_path / "long.txt"
    huge.write_text("word " * 1_200_000)
    long.write_text("word " * 10_000)
    for argv, message in [
        (["--prompt-file", str(huge)], f"--prompt-file '{huge}' has 6,000,000 characters, more than 64 a position "
                                       "could hold in the model's 8,192 positions; shorten it"),
        (["--prompt-file", str(long)], f"--prompt-file '{long}' has 10031 tokens (30 of them the chat template) and "
                                       "--max-new-tokens is 4, but the model allows 8192 positions; shorten its text "
                                       "to at most 8158 tokens"),
        (["--prompt-file", str(long), "--no-chat"], "has 10001 tokens and --max-new-tokens is 4, but the model "
                                                    "allows 8192 positions; shorten the prompt to at most 8188 tokens"),
    ]:
        rc, out, err = run_cli(capsys, "generate", *argv, "--max-new-tokens", "4")
        assert rc == 2 and message in err and err.count("\n") == 1 and "KV pages" not in err, err


def test_prompt_longer_than_model_is_refused_not_truncated(embedded, tmp_path, capsys):
    _, tok, _ = embedded
    f = tmp_path / "long.txt"
    f.write_text("word " * 9000)
    rc, _, err = run_cli(capsys, "generate", "--prompt-file", str(f), "--max-new-tokens", "4")
    assert rc == 2 and "has 9031 tokens (30 of them the chat template)" in err and "shorten its text" in err


@pytest.mark.slow
@pytest.mark.parametrize("length", [4000, 6000])
def test_passkey_long_contexts(embedded, length):
    model, tok, _ = embedded
    for depth in (0.2, 0.8):
        text, key = passkey_prompt(count(tok), length, depth)
        ids = tok.encode(text, add_special_tokens=False)
        dense = tok.decode(Engine(model, "dense", progress=False).generate([ids], 8).tokens[0])
        if key not in dense:
            continue
        for method, opts in [("tactic", {}), ("lserve", {"budget": 512})]:
            out = tok.decode(Engine(model, method, progress=False, **opts).generate([ids], 8).tokens[0])
            assert key in out, (method, length, depth, out)


def test_unreadable_weights_exit_2_naming_the_file(embedded, tmp_path, capsys):
    """A truncated or foreign .safetensors file (an interrupted download) is one clear error
    naming the file, not a traceback."""
    _, _, path = embedded
    d = tmp_path / "broken"
    d.mkdir()
    for f in Path(path).iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, d / f.name)
    (d / "model.safetensors").write_bytes(next(Path(path).glob("*.safetensors")).read_bytes()[:100000])
    rc, _, err = run_cli(capsys, "generate", "--model", str(d), "--prompt", "hi")
    assert rc == 2 and "could not read weights file" in err and "model.safetensors" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_prompt_files_that_are_not_text_exit_2(tmp_path, capsys):
    """A directory or a non-UTF-8 file is one clear error, never text decoded with
    replacement characters."""
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("Café crème brûlée".encode("latin-1"))
    for f, message in ((tmp_path, "is a directory"), (latin, "is not UTF-8 text")):
        rc, _, err = run_cli(capsys, "generate", "--prompt-file", str(f))
        assert rc == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_prompt_file_may_be_a_pipe(capsys, tmp_path):
    """<(command) and mkfifo pipes are read like files (they were refused as not regular);
    a character device such as /dev/zero still is."""
    import os
    import threading

    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("Once upon a"))
    writer.start()
    argv = ["generate", "--no-chat", "--max-new-tokens", "3", "--json", "--method", "dense"]
    rc, out, _ = run_cli(capsys, *argv, "--prompt-file", str(fifo))
    writer.join()
    assert rc == 0 and json.loads(out)["text"] == json.loads(run_cli(capsys, *argv, "--prompt", "Once upon a")[1])["text"]
    rc, _, err = run_cli(capsys, *argv, "--prompt-file", "/dev/zero")
    assert rc == 2 and "is not a regular file or a pipe" in err


def test_page_size_reaches_the_method_not_the_pool(embedded):
    """--page-size is the method's page (quest's pages follow it); the KV pool's pages are
    the engine's own (kv_page_size)."""
    from kvsieve.engine import LLMEngine

    model, tok, _ = embedded
    eng = LLMEngine(model, tok, "quest", kv_pages=8, page_size=8, budget=64)
    cfg = eng.runner.methods["default"].config
    assert (cfg.page_size, cfg.physical_page_size, eng.scheduler.page_size) == (8, 8, 16)


def test_engine_load_gets_the_shipped_heads_as_the_cli(embedded, monkeypatch):
    """LLMEngine.load gives the embedded model's methods the heads `kvsieve generate` gives
    them (patterns.model_head_options), and options the caller names win."""
    from kvsieve.engine import LLMEngine
    from kvsieve.model import loader
    from kvsieve.patterns import model_head_options

    model, tok, path = embedded
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: (model, tok, path))
    L, H = model.cfg.num_layers, model.cfg.num_kv_heads
    for method in ("tactic", "lserve", "quest"):
        cfg = LLMEngine.load(method=method, kv_pages=8).runner.methods["default"].config
        cli = model_head_options(method, {}, path, L, H)
        assert cli, method
        for name, value in cli.items():  # (lserve's dense heads are its page selector's)
            got = getattr(cfg, name) if hasattr(cfg, name) else getattr(cfg.dynamic_config, name)
            assert got == value, (method, name)
    assert LLMEngine.load(method="tactic", kv_pages=8, dense_heads=()).runner.methods["default"].config.dense_heads == ()


def test_engine_load_reads_a_dense_heads_file_for_every_method_it_runs(embedded, monkeypatch, tmp_path):
    """LLMEngine.load(dense_heads=FILE) reads a `kvsieve calibrate` file as --dense-heads FILE;
    a request for another dense-head method takes the same heads (as serve's per-request
    methods take --dense-heads), lserve and hybrid less those their pattern streams, a fixed
    budget none; the request's own dense heads win."""
    from kvsieve.engine import LLMEngine
    from kvsieve.model import loader
    from kvsieve.patterns import EMBEDDED_PATTERN, load_pattern, unstreamed

    model, tok, path = embedded
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: (model, tok, path))
    lserve_pattern = load_pattern(EMBEDDED_PATTERN, 30, 3, "lserve")
    streamed = next((a, b) for a in range(30) for b in range(3) if lserve_pattern[a][b])
    doc = json.loads(EMBEDDED_PATTERN.read_text())
    doc["dense_heads"] = [[9, 1], list(streamed)]
    file = tmp_path / "mine.streaming.json"
    file.write_text(json.dumps(doc))
    mine = tuple(sorted({(9, 1), streamed}))
    for default in ("tactic", "lserve"):
        eng = LLMEngine.load(method=default, kv_pages=8, dense_heads=str(file))
        dense = {default: eng.default_options["dense_heads"]}
        for method, opts in [("tactic", {}), ("quest", {}), ("lserve", {}), ("tactic", {"budget": 64}),
                             ("quest", {"dense_heads": "7:2"})]:
            dense[method, str(opts)] = eng.request_key(method, opts)[2].get("dense_heads")
        assert dense[default] == (mine if default == "tactic" else unstreamed(mine, lserve_pattern)), default
        assert dense["tactic", "{}"] == mine == dense["quest", "{}"], default
        assert dense["lserve", "{}"] == unstreamed(mine, lserve_pattern) == ((9, 1),), default
        assert dense["tactic", "{'budget': 64}"] is None and dense["quest", "{'dense_heads': '7:2'}"] == "7:2"
    for given, want in (("9:1,7:2", ((7, 2), (9, 1))), ("none", ())):  # pairs spelled as the CLI does
        eng = LLMEngine.load(method="tactic", kv_pages=8, dense_heads=given)
        assert tuple(eng.request_key("quest", {})[2]["dense_heads"]) == want, given


def test_the_embedded_gguf_by_its_path_is_the_embedded_model(embedded):
    """--model <the embedded GGUF's own path> is the embedded model: its converted cache (and
    with it its shipped dense and streaming heads), not a second conversion."""
    from kvsieve.model.loader import embedded_gguf, resolve_model_dir

    assert resolve_model_dir(str(embedded_gguf())) == resolve_model_dir(None) == embedded[2]


def test_a_fresh_conversion_of_the_embedded_gguf_loads(embedded, tmp_path, monkeypatch):
    """The embedded GGUF converted from scratch (a fresh machine's first run: the tokenizer
    comes from inside the GGUF) gives the same weights and tokenizer as the cached copy."""
    from kvsieve.model.loader import load_model

    monkeypatch.setenv("KVSIEVE_CACHE_DIR", str(tmp_path))
    model, tok, path = load_model()
    assert path.parent == tmp_path and tok.encode("The archive access code") == embedded[1].encode(
        "The archive access code")
    name = "model.layers.3.self_attn.k_proj.weight"
    assert torch.equal(model.w[name], embedded[0].w[name])


def test_prompt_file_dash_reads_standard_input(capsys, monkeypatch):
    import io
    import sys

    argv = ["generate", "--no-chat", "--max-new-tokens", "3", "--json", "--method", "dense"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("Once upon a".encode())))
    rc, out, _ = run_cli(capsys, *argv, "--prompt-file", "-")
    assert rc == 0 and json.loads(out)["text"] == json.loads(run_cli(capsys, *argv, "--prompt", "Once upon a")[1])["text"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe")))
    rc, _, err = run_cli(capsys, *argv, "--prompt-file", "-")
    assert rc == 2 and "--prompt-file - (standard input) is not UTF-8 text" in err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("Once upon a".encode())))
    rc, out, _ = run_cli(capsys, *argv, "--prompt", "-")  # README: - reads standard input for either flag
    assert rc == 0 and json.loads(out)["prompt_tokens"] == 3
    rc, _, err = run_cli(capsys, *argv, "--prompt", "caf\udce9")  # argv byte 0xe9 (Latin-1 é), not UTF-8
    assert rc == 2 and "--prompt 1 is not UTF-8 text (byte 0xe9" in err and "Traceback" not in err


def test_a_file_and_standard_input_give_the_same_prompt(capsys, monkeypatch, tmp_path):
    """CRLF and CR line endings are kept through --prompt-file FILE as through stdin (the file
    path turned them into "\\n"), and a leading byte-order mark is dropped by both."""
    import io
    import sys

    argv = ["generate", "--no-chat", "--max-new-tokens", "1", "--json", "--method", "dense"]
    text = "Line one.\r\nLine two.\rLine three.\n"
    expected = json.loads(run_cli(capsys, *argv, "--prompt", text)[1])["prompt_tokens"]
    assert expected != json.loads(run_cli(capsys, *argv, "--prompt", text.replace("\r\n", "\n"))[1])["prompt_tokens"]
    for raw in (text.encode(), b"\xef\xbb\xbf" + text.encode()):
        f = tmp_path / "p.txt"
        f.write_bytes(raw)
        rc, out, _ = run_cli(capsys, *argv, "--prompt-file", str(f))
        assert rc == 0 and json.loads(out)["prompt_tokens"] == expected
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw)))
        rc, out, _ = run_cli(capsys, *argv, "--prompt-file", "-")
        assert rc == 0 and json.loads(out)["prompt_tokens"] == expected


def test_output_a_terminal_cannot_encode_is_escaped_not_an_error(monkeypatch):
    """stdout in ascii or cp1252 (PYTHONIOENCODING, a Windows console): an answer with an emoji
    was lost to an encoding error reported as bad input (exit 2) after the model had run."""
    import io
    import sys

    from kvsieve.cli import _escape_unencodable_output

    for encoding in ("ascii", "cp1252"):
        raw = io.BytesIO()
        out = io.TextIOWrapper(raw, encoding=encoding)
        monkeypatch.setattr(sys, "stdout", out)
        _escape_unencodable_output()
        print("caf\u00e9 \U0001f426", end="")
        out.flush()
        assert raw.getvalue() == ("caf\u00e9 \\U0001f426" if encoding == "cp1252" else "caf\\xe9 \\U0001f426").encode(encoding)


def test_per_request_methods_of_a_loaded_engine_take_the_models_heads():
    """LLMEngine.load(): a request naming another method gets that method's shipped heads (the
    streaming heads of lserve and hybrid, the dense heads), as an engine loaded with it does."""
    from kvsieve.engine import LLMEngine

    engines = {m: LLMEngine.load(device="cpu", method=m) for m in ("tactic", "lserve", "hybrid")}
    for default, eng in engines.items():
        for m, own in engines.items():
            if m != default:
                assert eng.runner.methods[eng.method_key(m, {})].config == own.runner.methods["default"].config, \
                    (default, m)


def test_streaming_heads_of_another_shape_are_refused_and_a_file_path_is_read(embedded):
    """streaming_heads for the Python API: a pattern of another layer or head count is refused
    before any request (it failed inside the first prefill, and every later request with it);
    a `kvsieve calibrate` file's path is read like the CLI's --streaming-heads FILE."""
    from kvsieve.engine import LLMEngine
    from kvsieve.patterns import EMBEDDED_PATTERN, load_pattern

    model, tok, _ = embedded
    for bad in ([[1, 0, 0]] * 2, [[1, 0, 0]] * 31, [1, 0]):
        with pytest.raises(ValueError, match=r"streaming_heads has \d+ rows of \d flags, but this model has 30 layers"):
            LLMEngine(model, tok, "lserve", streaming_heads=bad)
        with pytest.raises(ValueError, match="streaming_heads has"):
            LLMEngine(model, tok, "dense").method_key("lserve", {"streaming_heads": bad})
    eng = LLMEngine(model, tok, "lserve", streaming_heads=str(EMBEDDED_PATTERN))
    assert eng.runner.methods["default"].config.streaming_heads == load_pattern(EMBEDDED_PATTERN, 30, 3, "lserve")
    for method in ("hybrid", "lserve"):  # a request's own method reads the path too (its characters were flags)
        key = eng.method_key(method, {"streaming_heads": str(EMBEDDED_PATTERN)})
        assert eng.runner.methods[key].config.streaming_heads == load_pattern(EMBEDDED_PATTERN, 30, 3, method)


def test_the_attended_densely_note_names_the_rule_that_applied():
    """One line on stderr naming why requests attended densely: under the crossover (or too
    few tokens to repay an index), their plans reading most of the cache, or both."""
    from types import SimpleNamespace
    from kvsieve.model.cli import attended_densely_note
    from kvsieve.methods import make_method

    args = SimpleNamespace(method="tactic", max_new_tokens=64)
    eng = SimpleNamespace(runner=SimpleNamespace(methods={"default": make_method("tactic")}), dense_below=150,
                          dense_step_below=0)
    assert attended_densely_note(args, eng, [None, None]) == ""
    under = attended_densely_note(args, eng, ["not_indexed"])
    assert "stayed below this device's dense/sparse crossover of 150 tokens" in under and "under the 256" in under
    assert "read more than" not in under
    given = attended_densely_note(SimpleNamespace(method="tactic", max_new_tokens=64, dense_below=150), eng,
                                  ["not_indexed"])
    assert "stayed below the --dense-below of 150 tokens" in given and "crossover" not in given  # (the user's own)
    most = attended_densely_note(args, eng, [None, "plans_read_most"])
    assert "plans read more than 50% of the cache for 4 steps in a row" in most and "crossover" not in most
    both = attended_densely_note(args, eng, ["plans_read_most", "not_indexed"])
    assert "crossover of 150" in both and "read more than 50%" in both and both.endswith("--dense-below 0 to force tactic")



def test_a_loaded_engines_streaming_file_serves_its_per_request_methods(tmp_path):
    """LLMEngine.load(method="lserve", streaming_heads=FILE): a request for hybrid streams
    FILE's heads at hybrid's own ratio (as `kvsieve serve --streaming-heads FILE` does), not
    the model's shipped pattern nor lserve's flags."""
    import json

    from kvsieve.engine import LLMEngine
    from kvsieve.patterns import EMBEDDED_PATTERN, load_pattern

    doc = json.loads(EMBEDDED_PATTERN.read_text())
    doc["method_ratios"] = {"hybrid": 0.5}  # (the shipped file: 0.125)
    path = tmp_path / "mine.streaming.json"
    path.write_text(json.dumps(doc))
    eng = LLMEngine.load(device="cpu", method="lserve", streaming_heads=str(path), kv_pages=8)
    mine = load_pattern(path, 30, 3, "hybrid")
    assert mine != load_pattern(EMBEDDED_PATTERN, 30, 3, "hybrid") and mine != load_pattern(path, 30, 3, "lserve")
    assert eng.runner.methods[eng.method_key("hybrid", {})].config.streaming_heads == mine
    assert eng.runner.methods[eng.method_key("hybrid", {"streaming_heads": "none"})].config.streaming_heads in ((), None)
    # an engine of a method without streaming heads takes the file too, for its lserve/hybrid requests (as
    # `kvsieve serve --method tactic --streaming-heads FILE`; it was refused as an unknown tactic option)
    tactic = LLMEngine.load(device="cpu", method="tactic", streaming_heads=str(path), kv_pages=8)
    assert "streaming_heads" not in tactic.default_options
    assert tactic.runner.methods[tactic.method_key("hybrid", {})].config.streaming_heads == mine


def test_a_streaming_file_of_another_window_warns_through_the_python_api(tmp_path):
    """LLMEngine.load (as generate and serve): heads a file chose for another window than the
    one this engine streams them with warn once, naming both windows."""
    import json
    import warnings

    from kvsieve.engine import LLMEngine
    from kvsieve.patterns import EMBEDDED_PATTERN

    doc = json.loads(EMBEDDED_PATTERN.read_text())
    doc.update(sink=4, local=63)
    path = tmp_path / "narrow.streaming.json"
    path.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match=r"chosen for a sink 4 \+ local 63 window, and this run streams them with "
                                         r"sink 128 \+ local 256"):
        LLMEngine.load(device="cpu", method="lserve", streaming_heads=str(path), kv_pages=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file's own window: no warning
        LLMEngine.load(device="cpu", method="lserve", streaming_heads=str(path), sink=4, local=63, kv_pages=8)


def test_prompts_for_a_model_without_a_chat_template_are_raw_and_stderr_says_so(capsys):
    """A model without a chat template (a base model, or an entry that lost it) gets the raw
    text with the tokenizer's special tokens, and stderr says so; --no-chat says nothing."""
    from types import SimpleNamespace

    from kvsieve.model.cli import read_prompts

    class Tok:
        chat_template = None

        def encode(self, text, add_special_tokens):
            return [1] * add_special_tokens + [ord(c) for c in text]

    args = SimpleNamespace(prompt=["hi"], prompt_file=None, no_chat=False)
    assert read_prompts(args, Tok()) == ([[1, ord("h"), ord("i")]], False)
    assert "no chat template; the prompts are sent as raw text" in capsys.readouterr().err
    assert read_prompts(SimpleNamespace(**{**vars(args), "no_chat": True}), Tok())[0] == [[1, 104, 105]]
    assert capsys.readouterr().err == ""


def test_standard_input_given_twice_is_refused_naming_both_flags():
    """`--prompt - --prompt-file -`: the second read found stdin empty and called the prompt
    empty; it is now one error saying stdin is read once."""
    from types import SimpleNamespace

    from kvsieve.model.cli import read_prompts

    args = SimpleNamespace(prompts=[("--prompt", "-"), ("--prompt-file", "-")], no_chat=True)
    with pytest.raises(ValueError, match=r"standard input \('-'\) is given 2 times \(--prompt, --prompt-file\)"):
        read_prompts(args, None)
