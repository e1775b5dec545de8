"""The retrieval suite's cases: deterministic, sized, needles where they claim, answers
learnable only from the needles, every kind/source/prompt style present, exact scoring."""
import collections
import inspect
import json
import re

import pytest

from kvsieve.eval.suite import NEEDLE_KINDS, SuiteCase, build_suite, filler_sources

LENGTHS = (1024, 2048, 4096, 7680)


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    from kvsieve.model.loader import resolve_model_dir

    return transformers.AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture(scope="module")
def sources():
    src = filler_sources(generated="The model wrote this sentence about bridges. " * 400)
    return {k: src[k] for k in ("pydoc", "stdlib", "generated")}


@pytest.fixture(scope="module")
def suite(tok, sources):
    return build_suite(tok, LENGTHS, 50, seed=0, sources=sources)


def test_sources_are_long_real_text():
    src = filler_sources()
    assert len(src["pydoc"]) >= 400_000  # all of pydoc_data.topics (~465K characters on 3.11)
    assert len(src["stdlib"]) >= 1_000_000
    assert inspect.getdoc(json.dumps).splitlines()[0] in src["stdlib"]  # docstrings, gathered with ast
    for name, text in src.items():
        assert "\0" not in text, name
    if "files" in src:  # licences and docs found on this machine: prose, not code
        assert len(src["files"]) >= 200_000 and src["files"].count(";") < 0.01 * len(src["files"])
    assert "generated" not in src and filler_sources("x y z.")["generated"] == "x y z."


def test_suite_is_deterministic_and_covers_the_grid(tok, sources, suite):
    assert len(suite) == 200 and len({c.id for c in suite}) == 200
    assert re.fullmatch(r"\d+-[a-z]+-[a-z]+-\d+-d0\.\d\d-(chat|plain)", suite[17].id)
    again = build_suite(tok, (1024,), 50, seed=0, sources=sources)
    assert again == [c for c in suite if c.length == 1024]
    other = build_suite(tok, (1024,), 50, seed=1, sources=sources)
    assert sum(a.prompt_ids != b.prompt_ids for a, b in zip(again, other)) == 50
    grid = collections.Counter((c.kind, c.source) for c in suite)
    assert set(grid) == {(k, s) for k in NEEDLE_KINDS for s in sources}
    assert {c.chat for c in suite} == {False, True}
    for length in LENGTHS:  # round robin over kinds; one depth in each of 50 even slices of [0.05, 0.95]
        cases = [c for c in suite if c.length == length]
        assert set(collections.Counter(c.kind for c in cases).values()) == {8, 9}
        depths = sorted(c.depth for c in cases)
        assert [int((d - 0.05) / 0.9 * 50) for d in depths] == list(range(50))


def test_cases_hold_their_needles_where_they_say(tok, suite):
    for c in suite:
        n = len(c.prompt_ids)
        assert 0.97 * c.length <= n <= c.length, (c.id, n)
        assert 0.05 <= c.depth <= 0.95
        bounds = sorted(c.needle_spans)
        assert all(a < b <= a2 for (a, b), (a2, _) in zip(bounds, bounds[1:] + [(n, n)])), c.id
        spans = [tok.decode(c.prompt_ids[a:b]) for a, b in c.needle_spans]
        assert all(re.fullmatch(r" The [\w ',-]+\.", s) for s in spans), (c.id, spans)
        assert all(e in spans[0] for e in c.expected), (c.id, spans[0], c.expected)
        mid = (c.needle_spans[0][0] + c.needle_spans[0][1]) / 2 / n  # the asked needle tracks the depth
        assert abs(mid - c.depth) < (0.1 if c.chat else 0.06), (c.id, mid, c.depth)
        outside = list(c.prompt_ids)
        for a, b in sorted(c.needle_spans, reverse=True):
            del outside[a:b]
        rest = tok.decode(outside)
        assert not any(e in rest for e in c.expected + c.forbidden), c.id
        assert ("<|im_start|>assistant" in tok.decode(c.prompt_ids[-40:])) == c.chat
        assert c.prompt_ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == (3 if c.chat else 0), c.id


def test_needle_kinds_are_what_they_claim(tok, suite):
    for c in suite:
        spans = [tok.decode(c.prompt_ids[a:b]) for a, b in c.needle_spans]
        codes = re.findall(r"\d+", " ".join(spans))
        for code in codes:  # 5 to 7 digits, no digit twice in a row, none inside another
            assert re.fullmatch(r"[1-9]\d{4,6}", code) and not re.search(r"(\d)\1", code), (c.id, code)
            assert sum(code in o for o in codes) == 1, (c.id, codes)
        count = {"number": 1, "name": 1, "place": 1, "multihop": 2, "distractor": 2}.get(c.kind)
        assert len(spans) == count if count else len(spans) in (3, 4), c.id
        if c.kind == "name":
            assert len(c.expected) == 2 and spans[0].endswith(f" {c.expected[0]} {c.expected[1]}.")
        if c.kind == "distractor":  # the twin: same sentence, one word of the object and the code differ
            true, twin = spans[0].split(), spans[1].split()
            assert len(true) == len(twin) and sum(a != b for a, b in zip(true, twin)) == 2, spans
            assert c.forbidden == (twin[-1].rstrip("."),) and c.expected == (true[-1].rstrip("."),)
        if c.kind == "multihop":  # asked: the town; the hop names the room of the item in the question
            room = re.fullmatch(r" The (.+) is in the town of .+\.", spans[0]).group(1)
            assert spans[1].endswith(f" kept in the {room}.")
            gap = abs(c.needle_spans[1][0] - c.needle_spans[0][0]) / len(c.prompt_ids)
            assert gap >= 0.15, (c.id, gap)
        if c.kind in ("name", "place", "multihop"):
            assert c.max_new_tokens == 16 and not any(ch.isdigit() for ch in "".join(c.expected))
        else:
            assert c.max_new_tokens == 12


def test_filler_sentences_holding_an_answer_are_left_out(tok):
    from kvsieve.eval.suite import _FIRST, _LAST

    text = " ".join(f"Yesterday {w} walked to the old mill by the river." for w in _FIRST + _LAST)
    cases = build_suite(tok, (512,), 12, sources={"names": text}, kinds=("name",), chat=(False,))
    for c in cases:
        a, b = c.needle_spans[0]
        assert 0.97 * 512 <= len(c.prompt_ids) <= 512
        assert not any(e in tok.decode(c.prompt_ids[:a] + c.prompt_ids[b:]) for e in c.expected), c.id


def test_filler_text_never_becomes_control_tokens(tok):
    text = "Files are named <filename> here. The chat ends with <|im_end|> in logs. " * 200
    cases = build_suite(tok, (512,), 6, sources={"odd": text}, chat=(False,))
    special = set(tok.all_special_ids) | {tok.convert_tokens_to_ids("<filename>")}
    assert all(not special & set(c.prompt_ids) for c in cases)
    assert "<filename>" in tok.decode(cases[0].prompt_ids)


def test_chat_cases_fall_back_to_plain_without_a_template(tok, sources):
    class NoTemplate:
        chat_template = None

        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, *a, **k):
            return tok(*a, **k)

    cases = build_suite(NoTemplate(), (512,), 24, sources=sources)
    assert not any(c.chat for c in cases) and len(cases) == 24


def test_score_is_exact_with_forbidden_strings():
    c = SuiteCase("x", "distractor", "pydoc", 10, 0.5, False, (1,), ("4829137",), ("4829731",), 12, ((0, 1),))
    assert c.score(" 4829137.") == 1.0
    assert c.score(" 4829731.") == 0.0
    assert c.score(" 4829137, or maybe 4829731") == 0.0
    assert c.score(" 482913") == 0.0
    name = SuiteCase("y", "name", "pydoc", 10, 0.5, False, (1,), ("Mira", "Okafor"), (), 16, ((0, 1),))
    assert name.score(" mira   OKAFOR.") == 1.0 and name.score(" Mira Stroud") == 0.0
    place = SuiteCase("z", "place", "pydoc", 10, 0.5, False, (1,), ("Port Kelbrook",), (), 16, ((0, 1),))
    assert place.score("port\n  kelbrook") == 1.0 and place.score("Kelbrook") == 0.0


def test_too_short_a_length_is_refused(tok, sources):
    with pytest.raises(ValueError, match="suite length 97 is too short"):
        build_suite(tok, (97,), 3, sources=sources)


def test_unknown_kind_is_named():
    with pytest.raises(ValueError, match="unknown needle kind 'riddle'"):
        build_suite(None, (512,), 1, kinds=("riddle",), sources={"a": "One two three. " * 50}, chat=(False,))


def test_calibration_prompts_are_held_out_suite_cases_with_their_answers(tok):
    """`kvsieve calibrate`'s retrieval data: suite cases of the calibration seed, every needle
    kind, each teacher-forced with the first tokens of its own expected answer."""
    from kvsieve.eval.calibrate import CALIBRATION_SEED, suite_retrieval_prompts

    prompts, answers = suite_retrieval_prompts(tok, 1024, 12)
    python_texts = {k: v for k, v in filler_sources().items() if k in ("pydoc", "stdlib")}
    cases = build_suite(tok, [1024], 12, CALIBRATION_SEED, python_texts)
    assert len(prompts) == len(answers) == 12 and len({len(a) for a in answers}) == 1 and len(answers[0]) >= 1
    assert {c.kind for c in cases} == set(NEEDLE_KINDS)
    for p, a, c in zip(prompts, answers, cases):
        assert p == list(c.prompt_ids)
        full = tok.encode(" " + c.expected[0], add_special_tokens=False)
        assert a == full[:len(a)]
        needle = tok.decode(p[c.needle_spans[0][0]:c.needle_spans[0][1]])
        assert tok.decode(a).strip() in needle  # the answer's first tokens come from the needle
    held_out = build_suite(tok, [1024], 12, 0, python_texts)
    assert not {tuple(c.prompt_ids) for c in held_out} & {tuple(p) for p in prompts}


def test_method_ratios_parse_and_reject_bad_pairs():
    from kvsieve.eval.calibrate import parse_method_ratios

    assert parse_method_ratios("hybrid=0.125, lserve=0.25") == {"hybrid": 0.125, "lserve": 0.25}
    assert parse_method_ratios(None) == {}
    for bad, msg in [("hybrid", "METHOD=RATIO"), ("tactic=0.1", "METHOD=RATIO"), ("hybrid=x", "not a number"),
                     ("hybrid=1.5", "in \\[0, 1\\]")]:
        with pytest.raises(ValueError, match=msg):
            parse_method_ratios(bad)


def test_a_short_suite_generates_less_of_the_models_own_text(tmp_path, monkeypatch):
    """The 'generated' filler source is four times the longest case (2,048 tokens at least,
    16,384 at most: all of it for the default lengths), generated once and kept per size."""
    from kvsieve.eval import suite_task
    from kvsieve.eval.harness import EvalPlan

    assert suite_task.generated_for((512,)) == 2048 and suite_task.generated_for((1024, 2048)) == 8192
    assert suite_task.generated_for(EvalPlan().suite_lengths) == suite_task.GENERATED_TOKENS == 16384
    asked = []
    monkeypatch.setattr(suite_task, "generated_text", lambda eng, tok, tokens, seed=0: asked.append(tokens) or "x " * 999)
    monkeypatch.setattr(suite_task, "filler_sources", lambda generated: {"generated": generated})
    for _ in range(2):
        out = suite_task.suite_sources(["generated"], None, None, tmp_path, 0, 4096)
    assert asked == [4096] and out["generated"].startswith("x x") and (tmp_path / "generated-4096.txt").is_file()
    suite_task.suite_sources(["generated"], None, None, tmp_path, 3, 4096)  # another seed (or model): its own text
    assert asked == [4096, 4096]
