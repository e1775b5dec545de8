"""The retrieval suite's cases: deterministic, sized, needles where they claim, answers
learnable only from the needles, every kind/source/prompt style present, exact scoring."""
import collections

import pytest

from kvsieve.eval.suite import NEEDLE_KINDS, SuiteCase, build_suite, filler_sources


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
    return build_suite(tok, (1024, 2048, 4096, 7680), 50, seed=0, sources=sources)


def test_sources_are_long_real_text():
    src = filler_sources()
    for name in ("pydoc", "stdlib"):
        assert len(src[name]) >= 400_000 and "\0" not in src[name]
    assert "generated" not in src and filler_sources("x y z.")["generated"] == "x y z."


def test_suite_is_deterministic_and_covers_the_grid(tok, sources, suite):
    assert len(suite) == 200 and len({c.id for c in suite}) == 200
    again = build_suite(tok, (1024,), 50, seed=0, sources=sources)
    assert [c.prompt_ids for c in again] == [c.prompt_ids for c in suite if c.length == 1024]
    other = build_suite(tok, (1024,), 50, seed=1, sources=sources)
    assert sum(a.prompt_ids != b.prompt_ids for a, b in zip(again, other)) == 50
    grid = collections.Counter((c.kind, c.source) for c in suite)
    assert set(grid) == {(k, s) for k in NEEDLE_KINDS for s in sources}
    assert {c.chat for c in suite} == {False, True}
    depths = sorted(c.depth for c in suite if c.length == 2048)
    assert 0.05 <= depths[0] < 0.1 and 0.9 < depths[-1] <= 0.95


def test_cases_hold_their_needles_where_they_say(tok, suite):
    for c in suite:
        n = len(c.prompt_ids)
        assert 0.97 * c.length <= n <= c.length, (c.id, n)
        spans = [tok.decode(c.prompt_ids[a:b]) for a, b in c.needle_spans]
        assert all(e in spans[0] for e in c.expected), (c.id, spans[0], c.expected)
        if c.kind != "multihop":  # the asked needle is the first span; its position tracks the depth
            mid = (c.needle_spans[0][0] + c.needle_spans[0][1]) / 2 / n
            assert abs(mid - c.depth) < 0.12, (c.id, mid, c.depth)
        outside = list(c.prompt_ids)
        for a, b in sorted(c.needle_spans, reverse=True):
            del outside[a:b]
        rest = tok.decode(outside)
        assert not any(e in rest for e in c.expected + c.forbidden), c.id
        if c.kind == "distractor":
            assert len(c.forbidden) == 1 and c.forbidden[0] in spans[1]
        if c.kind in ("multi", "multihop", "distractor"):
            assert len(c.needle_spans) >= 2
        assert ("<|im_start|>assistant" in tok.decode(c.prompt_ids[-40:])) == c.chat


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


def test_too_short_a_length_is_refused(tok, sources):
    with pytest.raises(ValueError, match="suite length 97 is too short"):
        build_suite(tok, (97,), 3, sources=sources)


def test_unknown_kind_is_named():
    with pytest.raises(ValueError, match="unknown needle kind 'riddle'"):
        build_suite(None, (512,), 1, kinds=("riddle",), sources={"a": "One two three. " * 50}, chat=(False,))
