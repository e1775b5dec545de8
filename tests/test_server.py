"""`kvsieve serve` end to end: a real uvicorn server on 127.0.0.1 (a free port, in a thread of
this process) with the embedded model on the CPU, queried with the official openai client
and httpx. Short prompts and at most 8 new tokens per request (except the cancelled
stream, which is cut after its first chunk); every wait is bounded."""
from __future__ import annotations

import asyncio
import gc
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai", "prometheus_client"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402

from kvsieve.engine import LLMEngine  # noqa: E402
from kvsieve.server.app import create_app  # noqa: E402
from kvsieve.server.text import Detokenizer, StopMatcher  # noqa: E402
from kvsieve.server.schemas import BadRequest, ChatCompletionRequest, parse  # noqa: E402

NAME = "smollm2-test"
TIMEOUT = 120.0  # per HTTP request: the shared CPU can be slow


class LiveServer:
    """uvicorn serving create_app(engine) on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, engine, **app_kwargs):
        self.app = create_app(engine, NAME, **app_kwargs)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the server did not stop"
        assert not self.app.state.server.driver._thread.is_alive(), "the driver thread did not stop"
        self.sock.close()

    def post(self, path, body, **kw):
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers={"content-type": "application/json"},
                          timeout=TIMEOUT, **kw)

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(self.url + "/metrics", timeout=TIMEOUT).text
        m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.load(device="cpu", method="dense", kv_pages=256, max_num_seqs=16, max_waiting=64)


@pytest.fixture(scope="module")
def live(engine):
    with LiveServer(engine) as s:
        yield s


@pytest.fixture(scope="module")
def alone(engine):
    """An engine of its own on the served model, for reference answers: the served engine
    belongs to the server's driver thread."""
    return LLMEngine(engine.model, engine.tokenizer, "dense", kv_pages=256)


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def chat_msgs(text):
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------- no model needed
def test_stop_matcher_holds_back_a_possible_stop_and_cuts_at_the_first():
    m = StopMatcher(["END", "xy"])
    assert m.feed("hello E", False) == ("hello ", False)  # "E" may start "END"
    assert m.feed("N", False) == ("", False)
    assert m.feed("Dafter", False) == ("", True)
    m = StopMatcher(["END"])
    assert m.feed("ab EN", True) == ("ab EN", False)  # final: nothing held back
    assert StopMatcher([]).feed("abc", False) == ("abc", False)


def test_schema_errors_name_the_field():
    with pytest.raises(BadRequest) as e:
        parse(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}')
    assert e.value.param == "temperature" and "number" in e.value.message
    with pytest.raises(BadRequest) as e:
        parse(ChatCompletionRequest, b'{"messages": [{"role": "robot", "content": "hi"}]}')
    assert e.value.param == "messages.0.role"
    with pytest.raises(BadRequest) as e:  # JSON may escape a lone surrogate; no tokenizer encodes it (was a 500)
        parse(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
    assert e.value.param == "messages.0.content" and "surrogate" in e.value.message
    for body in (b'{"messages": [{"role": "user", "content": "hi"}], "\\udc00": 1}',  # in a key (was a 500: the
                 b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"\\ud800": 1}}'):  # path unencodable)
        with pytest.raises(BadRequest) as e:
            parse(ChatCompletionRequest, body)
        assert "surrogate" in e.value.message and "\\ud" in e.value.param
        (e.value.message + e.value.param).encode("utf-8")  # the error response's JSON can be written
    parts = parse(ChatCompletionRequest, json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Line one."}, {"type": "text", "text": "Line two."}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}]}).encode())
    assert [m.text() for m in parts.messages] == ["Line one.\nLine two.", "I can't."]  # (parts ran together as one line)
    with pytest.raises(BadRequest, match="refusal"):
        parse(ChatCompletionRequest, b'{"messages": [{"role": "assistant", "content": [{"type": "refusal"}]}]}')
    with pytest.raises(BadRequest, match="part 0 has type 'refusal'"):  # only an assistant's
        parse(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]}')
    assert parse(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}') \
        .messages[0].content == "\U0001F600"  # a pair is one character


def test_detokenizer_deltas_join_to_the_full_text(engine):
    tok = engine.tokenizer
    ids = tok.encode("Grüße, 世界! naïve café ☕ done", add_special_tokens=False)
    det = Detokenizer(tok)
    text = "".join(det.add([t], i == len(ids) - 1) for i, t in enumerate(ids))
    assert text == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("chunk", [1, 3])
def test_logprobs_of_text_whose_characters_span_tokens(engine, chunk):
    """Characters split over several byte-level tokens (CJK, accents, an emoji): every
    token gets exactly one logprobs entry, handed out with the text delta that completes its
    first character; the entries' bytes join to the text; a token's text_offset is the
    character its bytes start in; echoed prompts are offset the same way."""
    from kvsieve.engine import TokenLogprob
    from kvsieve.server.logprobs import ChoiceLogprobs

    tok = engine.tokenizer
    text = "愉快！ Grüße, 世界 ☕ done"
    ids = tok.encode(text, add_special_tokens=False)
    entries = [TokenLogprob(t, -0.5, ((t, -0.5),)) for t in ids]
    det, chat, comp = Detokenizer(tok), ChoiceLogprobs(tok, 1, True), ChoiceLogprobs(tok, 1, False)
    got_chat, got_comp, sent = [], [], ""
    for a in range(0, len(ids), chunk):
        delta = det.add(ids[a:a + chunk], a + chunk >= len(ids))
        chat.add(entries[a:a + chunk])
        comp.add(entries[a:a + chunk])
        sent += delta
        if delta:
            got_chat += chat.take(delta)["content"]
            got_comp.append(comp.take(delta))
    assert sent == text and len(got_chat) == len(ids)
    assert b"".join(bytes(c["bytes"]) for c in got_chat).decode("utf-8") == text
    offsets = [o for piece in got_comp for o in piece["text_offset"]]
    starts = [len(tok.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert offsets == starts and max(offsets) < len(text)
    echoed = ChoiceLogprobs(tok, 1, False).echo(text, ids, [None] + entries[1:])
    assert echoed["text_offset"] == starts and echoed["token_logprobs"][0] is None
    assert all(t.startswith("bytes:") or "\ufffd" not in t for t in echoed["tokens"])
    chat = "<|im_start|>user\nWhat is 2+2? 世界<|im_end|>\n<|im_start|>assistant\n"  # special tokens, echoed as sent
    ids = tok.encode(chat, add_special_tokens=False)
    echoed = ChoiceLogprobs(tok, 0, False).echo(chat, ids, [None] + [TokenLogprob(t, -0.5, ()) for t in ids[1:]])
    assert all(t.startswith("bytes:") or chat[o:o + len(t)] == t for t, o in zip(echoed["tokens"], echoed["text_offset"]))
    bos = tok.convert_tokens_to_ids("<|endoftext|>")  # a tokenizer that adds a BOS (Llama 3, Gemma 3): the string
    text = "Hello world, café"  # prompt is echoed as sent, so its offsets start after the BOS's text, at 0
    ids = [bos] + tok.encode(text, add_special_tokens=False)
    echoed = ChoiceLogprobs(tok, 0, False).echo(text, ids, [None] + [TokenLogprob(t, -0.5, ()) for t in ids[1:]])
    assert echoed["text_offset"] == [0] + [len(tok.decode(ids[1:i])) for i in range(1, len(ids))]
    sampled = ChoiceLogprobs(tok, 1, False).top_with_token(TokenLogprob(ids[2], -3.0, ((ids[3], -0.1), (ids[4], -1.0))))
    assert sampled == {tok.decode([ids[3]]): -0.1, tok.decode([ids[2]]): -3.0}  # OpenAI's k + 1: the token too


# ---------------------------------------------------------------------- the live server
def test_models_health_and_openai_client(live, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    card = httpx.get(live.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]
    assert card["max_model_len"] == 256 * 16  # the KV pool's 256 pages, under the model's 8,192 positions
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.get(live.url + "/health", timeout=TIMEOUT).json()["status"] == "ok"

    r = client.chat.completions.create(model=NAME, messages=chat_msgs("Say hi"), max_tokens=6, temperature=0)
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.model == NAME and text
    assert r.choices[0].finish_reason in ("stop", "length") and 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.model_extra["kvsieve"]["method"] == "dense"
    assert r.usage.model_extra["kvsieve"]["kv_fraction"] == pytest.approx(1.0)

    parts, usage, reasons = [], None, []
    for chunk in client.chat.completions.create(model=NAME, messages=chat_msgs("Say hi"), max_tokens=6,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(parts) == text and reasons[-1] == r.choices[0].finish_reason
    assert usage.completion_tokens == r.usage.completion_tokens and usage.model_extra["kvsieve"]["method"] == "dense"

    d = client.completions.create(model=NAME, prompt="The capital of France is", temperature=0, extra_body={
        "ignore_eos": True})
    assert d.usage.completion_tokens == 16 and d.choices[0].finish_reason == "length"  # OpenAI's default there
    c = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert c.object == "text_completion" and c.choices[0].text and c.usage.completion_tokens <= 5
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=NAME, prompt=["The capital of France is"], max_tokens=5, temperature=0, stream=True) if ch.choices)
    assert streamed == c.choices[0].text


def test_n_choices_and_prompt_lists_equal_single_requests(live, client):
    """n choices (choice j draws with seed + j) and a list of prompts (choices ordered prompt by
    prompt, n each) answer as the single requests would, in one response or one stream."""
    params = dict(model=NAME, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    msgs = chat_msgs("Name a colour")
    single = [client.chat.completions.create(messages=msgs, seed=7 + j, **params) for j in range(3)]
    r = client.chat.completions.create(messages=msgs, n=3, seed=7, **params)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [s.choices[0].message.content for s in single]
    assert len({c.message.content for c in r.choices}) > 1  # the seeds differ, so do the samples
    assert r.usage.prompt_tokens == single[0].usage.prompt_tokens and r.usage.completion_tokens == 18

    parts, reasons, usage = {}, {}, None
    for ch in client.chat.completions.create(messages=msgs, n=3, seed=7, stream=True,
                                             stream_options={"include_usage": True}, **params):
        usage = ch.usage or usage
        for c in ch.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert [parts[i] for i in range(3)] == [c.message.content for c in r.choices]
    assert reasons == {0: "length", 1: "length", 2: "length"} and usage.completion_tokens == 18

    prompts = ["The capital of France is", "Two plus two is"]
    greedy = dict(model=NAME, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **greedy) for p in prompts]
    both = client.completions.create(prompt=prompts, n=2, **greedy)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    ids = [live.app.state.server.tok.encode(p) for p in prompts]  # the same prompts as token-id lists
    by_ids = client.completions.create(prompt=ids, **greedy)
    assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 4 * 4
    streamed = {}
    for ch in client.completions.create(prompt=prompts, n=2, stream=True, **greedy):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == [c.text for c in both.choices]
    wait_for(lambda: live.metric("kvsieve_kv_pages_used") == 0, "every choice's pages to be freed")


def test_logprobs_of_the_returned_tokens_in_chat_and_completions(live, alone, client):
    """logprobs: every returned token with its log-probability and top alternatives, equal to
    the engine's own; the same in a stream; tokens past a stop string left out."""
    from kvsieve.engine import SamplingParams

    msgs = chat_msgs("Name three colours")
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content and len(content) == 6
    tok = live.app.state.server.tok
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    want = alone.generate([tok.encode(ids, add_special_tokens=False)],
                           SamplingParams(6, ignore_eos=True, logprobs=3))[0].logprobs
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want], abs=1e-4)
    for c, e in zip(content, want):
        assert [t.token for t in c.top_logprobs] == [tok.decode([t]) for t, _ in e.top]
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob) and bytes(c.bytes).decode() == c.token

    streamed = []
    for ch in client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                             top_logprobs=3, stream=True, extra_body={"ignore_eos": True}):
        for c in ch.choices:
            streamed += c.logprobs.content if c.logprobs else []
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]

    params = dict(model=NAME, prompt="One, two, three,", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(logprobs=2, **params).choices[0]
    lp = full.logprobs
    assert "".join(lp.tokens) == full.text and len(lp.token_logprobs) == 8 and all(len(d) == 2 for d in lp.top_logprobs)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(8)]
    stop = full.text[lp.text_offset[5]:][:1]  # a character of the sixth token
    cut = client.completions.create(logprobs=2, stop=[stop], **params).choices[0]
    joined = "".join(cut.logprobs.tokens)
    assert cut.text == full.text[:full.text.index(stop)] and joined.startswith(cut.text)
    assert cut.logprobs.text_offset[-1] < len(cut.text) or not cut.text  # no token starts past the text


def test_echo_returns_the_prompt_with_its_log_probabilities(live, engine, client):
    """echo (lm-evaluation-harness's loglikelihood requests: token-id prompts, echo, logprobs,
    max_tokens 1 or 0): the prompt's text and tokens come first, every prompt token after the
    first with its log-probability given the ones before (the model's, checked against a
    teacher-forced forward), the completion after them; in a stream too."""
    import torch

    tok = live.app.state.server.tok
    ctx, cont = tok.encode("The capital of France is"), tok.encode(" Paris, and the capital of Italy is Rome")
    ids = ctx + cont
    r = client.completions.create(model=NAME, prompt=[ids, ctx], echo=True, logprobs=1, max_tokens=1, temperature=0)
    full, short = sorted(r.choices, key=lambda c: c.index)
    lp = full.logprobs
    assert full.text.startswith(tok.decode(ids)) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
    with torch.no_grad():  # the model's own log-probabilities of the prompt, one forward
        logits = engine.runner.model.logits(_hidden_states(engine, ids))
    want = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want.tolist(), abs=2e-3)
    greedy = [max(d.values()) == v for d, v in zip(lp.top_logprobs[1:len(ids)], lp.token_logprobs[1:len(ids)])]
    assert greedy == (logits[:-1].argmax(-1) == torch.tensor(ids[1:])).tolist()  # lm-eval's is_greedy
    assert lp.text_offset[:len(ids)] == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    assert lp.text_offset[-1] == len(tok.decode(ids))  # the completion's token follows the prompt
    assert short.text.startswith(tok.decode(ctx)) and short.logprobs.token_logprobs[:len(ctx)] == \
        pytest.approx(lp.token_logprobs[:len(ctx)], abs=1e-4)
    assert r.usage.prompt_tokens == len(ids) + len(ctx) and r.usage.completion_tokens == 2

    text = "One, two, three, four"
    only = client.completions.create(model=NAME, prompt=text, echo=True, logprobs=0, max_tokens=0)
    c = only.choices[0]
    assert c.text == text and c.finish_reason == "length" and only.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(tok.encode(text))
    assert all(d == {t: v} for t, v, d in zip(c.logprobs.tokens[1:], c.logprobs.token_logprobs[1:],
                                                c.logprobs.top_logprobs[1:]))  # logprobs 0: the token alone
    assert client.completions.create(model=NAME, prompt=text, echo=True, max_tokens=0).choices[0].text == text

    chunks = list(client.completions.create(model=NAME, prompt=text, echo=True, logprobs=0, max_tokens=3,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    whole = client.completions.create(model=NAME, prompt=text, echo=True, logprobs=0, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert chunks[0].choices[0].text == text and "".join(ch.choices[0].text for ch in chunks) == whole.text
    streamed = [v for ch in chunks if ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs and whole.logprobs.token_logprobs[0] is None


def _hidden_states(engine, ids):
    """The model's last hidden states [len(ids), hidden] of one causal forward over ids."""
    import torch
    import torch.nn.functional as F

    model = engine.runner.model

    def attend(layer, q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1)

    return model.forward(torch.tensor(ids), torch.arange(len(ids)), attend)


def test_penalties_and_logit_bias_are_the_engines(live, alone, client):
    from kvsieve.engine import SamplingParams

    tok = live.app.state.server.tok
    prompt = "Repeat after me: the the the the the"
    body = dict(model=NAME, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**body).choices[0].text
    pen = client.completions.create(presence_penalty=1.5, frequency_penalty=1.0, **body).choices[0].text
    want = alone.generate([tok.encode(prompt)], SamplingParams(8, ignore_eos=True, presence_penalty=1.5,
                                                                frequency_penalty=1.0))[0].tokens
    assert pen == tok.decode(want, skip_special_tokens=True) and pen != plain
    first = alone.generate([tok.encode(prompt)], SamplingParams(8, ignore_eos=True))[0].tokens[0]
    biased = client.completions.create(logit_bias={str(first): -100}, **body).choices[0].text
    want = alone.generate([tok.encode(prompt)], SamplingParams(8, ignore_eos=True, logit_bias={first: -100}))[0]
    assert want.tokens[0] != first and biased == tok.decode(want.tokens, skip_special_tokens=True) != plain


def test_stop_strings_cut_the_text_and_end_the_request(live, alone, client):
    from kvsieve.engine import SamplingParams

    ref = client.completions.create(model=NAME, prompt="One, two, three,", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    full = ref.choices[0].text
    assert ref.usage.completion_tokens == 8
    stop = full.strip()[len(full.strip()) // 2:][:2]  # two characters from the middle of the answer
    assert stop
    want = full[:full.index(stop)]
    r = client.completions.create(model=NAME, prompt="One, two, three,", max_tokens=8, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    many = ["Question:", "</s>", "<|im_end|>", "\n\n\n", "zzz", stop]  # an evaluation harness's list: past OpenAI's 4
    r = client.completions.create(model=NAME, prompt="One, two, three,", max_tokens=8, temperature=0,
                                  stop=many, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=NAME, prompt="One, two, three,", max_tokens=8, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices)
    assert streamed == want
    tok = live.app.state.server.tok  # vLLM's stop_token_ids: the request ends at the token, without its text
    ids = alone.generate([tok.encode("One, two, three,")], SamplingParams(8, ignore_eos=True))[0].tokens
    assert tok.decode(ids, skip_special_tokens=True) == full
    cut = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    for stream in (False, True):
        r = client.completions.create(model=NAME, prompt="One, two, three,", max_tokens=8, temperature=0,
                                      stream=stream, extra_body={"ignore_eos": True, "stop_token_ids": [ids[cut]],
                                                                 "top_k": -1})
        got = "".join(ch.choices[0].text for ch in r if ch.choices) if stream else r.choices[0].text
        assert got == tok.decode(ids[:cut]), (stream, got)
        assert stream or (r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == cut + 1)
    wait_for(lambda: live.metric("kvsieve_kv_pages_used") == 0, "the stopped requests' pages to be freed")


def test_sixteen_concurrent_streams_equal_single_runs(live, engine, client):
    prompts = [f"{w} is a word that means" for w in ("Red", "Blue", "Green", "Tree", "Fish", "Rain", "Sun", "Moon",
                                                     "River", "Stone", "Cloud", "Bread", "Music", "Snow", "Fire",
                                                     "Glass")]
    params = dict(model=NAME, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **params).choices[0].text for p in prompts]

    def stream(p):
        return "".join(ch.choices[0].text for ch in client.completions.create(prompt=p, stream=True, **params)
                       if ch.choices)

    steps = engine.stats.decode_steps
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(stream, prompts, timeout=4 * TIMEOUT))
    assert together == alone
    assert engine.stats.decode_steps - steps < len(prompts) * 3  # they decoded in shared steps
    runner = engine.runner  # the engine's batch counts, mirrored in /metrics once the driver has gauged them
    wait_for(lambda: live.metric("kvsieve_decode_batch_rebuilds_total") == runner.composes > 0,
             "the rebuild counter to reach the engine's count")
    assert live.metric("kvsieve_decode_row_joins_total") == runner.row_joins
    assert live.metric("kvsieve_decode_graph_captures_total") == runner.captures


@pytest.mark.parametrize("n", [1, 3])
def test_closing_a_stream_cancels_it_and_frees_its_pages(live, n):
    """Every choice of the stream is cancelled (n = 3: three requests in the engine)."""
    aborted = live.metric("kvsieve_requests_finished_total", '{reason="abort"}')
    body = {"prompt": "Count to one thousand: 1, 2, 3,", "max_tokens": 1000, "ignore_eos": True, "stream": True,
            "n": n}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept referenced: closing the iterator closes the connection
        for line in lines:
            if line.startswith("data: "):
                assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                break
        time.sleep(0.5)
        assert live.metric("kvsieve_kv_pages_used") > 0 and live.metric("kvsieve_requests_running") == n
    wait_for(lambda: live.metric("kvsieve_kv_pages_used") == 0 and live.metric(
        "kvsieve_requests_finished_total", '{reason="abort"}') == aborted + n, "the closed stream's pages to be freed")
    assert live.metric("kvsieve_requests_running") == 0


CHAT_PATH = "/v1/chat/completions"
BAD = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], ', None),  # malformed JSON
    ("/v1/chat/completions", b'[1, 2]', None),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 129}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p"),
    # fields that would change what the answer is: refused by name, not ignored
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "function_call": {"name": "f"}},
     "function_call"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]},
     "modalities"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "web_search_options": {}},
     "web_search_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                              "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]},
     "messages.1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                           {"role": "tool", "tool_call_id": "c", "content": "42"}]}, "messages.1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": 3}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "max_completion_tokens": 8}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0"),
    ("/v1/completions", {"prompt": "hi", "stop": [str(i) for i in range(17)]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": "high"}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"token": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": "x"}}, "logit_bias.5"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u00b2": 1}}, "logit_bias"),  # str.isdigit, not int() (a 500)
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u0665": 1}}, "logit_bias"),  # (int() read it as 5)
    ("/v1/completions", {"prompt": "hi " * 9000, "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 8192}, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 10 ** 9]]}, "prompt"),
    ("/v1/completions", {"prompt": ["a", [1, 2]]}, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * 65, "n": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),  # (OpenAI refuses best_of < n)
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    # vLLM's extensions that change the answer: refused by name, not answered as if honoured
    ("/v1/completions", {"prompt": "hi", "min_tokens": 40}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1.8}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "min_p": 0.9}, "min_p"),
    ("/v1/completions", {"prompt": "hi", "include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "[0-9]+"}, "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
                 "add_generation_prompt": False}, "add_generation_prompt"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
     "continue_final_message"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"choice": ["a"]}},
     "structured_outputs"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}], "min_tokens": True}, "min_tokens"),  # (not 1)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ["hello"]}]}, "messages.0.content"),
    ("/v1/completions", {"prompt": 12}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "kvsieve": {"method": "nope"}}, "kvsieve.method"),
    ("/v1/completions", {"prompt": "hi", "kvsieve": {"method": "tactic", "threshold": 1.5}}, "kvsieve.threshold"),
    ("/v1/completions", {"prompt": "hi", "kvsieve": {"method": "tactic", "treshold": 0.9}}, "kvsieve"),
    ("/v1/completions", {"prompt": "hi", "kvsieve": {"method": "lserve", "streaming_heads": "/etc/passwd"}},
     "kvsieve.streaming_heads"),
    ("/v1/completions", {"prompt": "hi", "kvsieve": "tactic"}, "kvsieve"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10 ** 9]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": 2}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, "top_k"),
    ("/v1/completions", b'{"prompt": "a\\udc00"}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),  # (was a 500)
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", None),
    ("/v1/completions", {"prompt": "hi", "n": 100}, "n"),  # more than the server queues: a 503 retried forever
    ("/v1/completions", {"prompt": "x" * (64 * 8192 + 1)}, "prompt"),  # refused before tokenizing
]


def test_bad_requests_get_400_naming_the_field_and_the_server_keeps_serving(live):
    for path, body, param in BAD:
        r = live.post(path, body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        past_context = isinstance(body, dict) and (body.get("max_tokens") == 8192 or len(str(body)) > 9000)
        # (OpenAI's code for those: clients trim and retry on it)
        assert err["type"] == "invalid_request_error" and err["message"], body
        assert err["code"] == ("context_length_exceeded" if past_context else None), (body, err)
        # (the length /v1/models reports: here the KV pool's 256 pages x 16 tokens, fewer than the model's 8192)
        assert not past_context or err["message"].startswith("This model's maximum context length is 4096 tokens")
        assert err["param"] == param, (body, err)
        if param:
            assert param.split(".")[-1] in err["message"], err
        if param == "best_of":  # (best_of = n is served: the message says so)
            assert err["message"].startswith("best_of must equal n (2) or be left out"), err
    r = live.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "top_k": 2 ** 63})  # off: past any vocabulary
    assert r.status_code == 200, r.text  # (it failed the engine step, and every request in flight with it)
    r = live.post("/v1/completions", {"prompt": "hi", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert live.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200
    assert httpx.get(live.url + "/health", timeout=TIMEOUT).status_code == 200
    assert live.metric("kvsieve_requests_rejected_total", '{reason="invalid"}') >= len(BAD)


def test_a_client_leaving_while_sending_its_body_is_not_a_server_error(live, caplog):
    """A client that closes after part of its body: `request.body()` raised ClientDisconnect,
    logged as an unhandled error with its traceback (twice, with uvicorn's). Now one info line."""
    host, port = live.url.removeprefix("http://").split(":")
    with caplog.at_level("INFO"):
        with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 1000\r\n\r\n{\"messages\": [")
        wait_for(lambda: any("disconnect" in r.getMessage() or r.levelname == "ERROR" for r in caplog.records),
                 "the server to notice the client leaving")
        time.sleep(0.2)  # (uvicorn's own error, if any, comes after the handler's)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert "client disconnected while sending its request to /v1/chat/completions" in caplog.text
    assert live.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200


CHAT = "/v1/chat/completions"
GOOD = [  # each limit the README states, at the limit, and what it says is accepted
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": [f"<{i}>" for i in range(16)]}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "temperature": 2, "top_p": 1, "seed": 3}),
    (CHAT, {"messages": chat_msgs("hi"), "max_tokens": 1, "logprobs": True, "top_logprobs": 20}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 20}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 2, "best_of": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "best_of": 1}),  # (n left out is 1)
    (CHAT, {"messages": chat_msgs("hi"), "max_tokens": 1, "response_format": {"type": "text"}}),
    (CHAT, {"messages": chat_msgs("hi") + [{"role": "assistant", "content": None}] + chat_msgs("and?"),
            "max_tokens": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [0]}),
    # vLLM's extensions at their neutral values change nothing, so they are served
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "min_tokens": 0, "repetition_penalty": 1.0, "min_p": 0,
                         "include_stop_str_in_output": False, "bad_words": [], "guided_regex": None}),
    (CHAT, {"messages": chat_msgs("hi"), "max_tokens": 1, "add_generation_prompt": True,
            "continue_final_message": False, "chat_template_kwargs": {}}),
]


def test_requests_at_the_documented_limits_are_served(live):
    for path, body in GOOD:
        r = live.post(path, body)
        assert r.status_code == 200, (body, r.text)
    r = live.post("/v1/completions", {"prompt": "Once upon a time", "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16  # completions' default max_tokens


def test_wrong_http_methods_name_the_allowed_ones_and_probes_may_use_head(live):
    """A 405 carries Allow (HTTP requires it); HEAD on the GET routes answers as GET does
    (health checkers probe with HEAD); a wrong-typed text part says what is wrong with it."""
    r = httpx.get(live.url + "/v1/chat/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]
    for path in ("/health", "/v1/models"):
        r = httpx.head(live.url + path, timeout=TIMEOUT)
        assert r.status_code == 200 and r.content == b"", path
    r = live.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert r.status_code == 400 and 'its "text" must be a string, got none' in r.json()["error"]["message"]
    r = live.post("/v1/completions", {"prompt": "hi", "logit_bias": {"1": "1"}})
    assert "logit_bias.1 must be a number in [-100, 100]" in r.json()["error"]["message"]
    for bad in (0, "4"):  # chat has no echo: its message does not offer one
        r = live.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": bad})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "max_tokens must be an integer >= 1" in message and "echo" not in message


def test_per_request_kvsieve_settings_are_honoured_and_reported(live, engine, client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 9 + "Question: what did the fox do?"
    fractions = {}
    for threshold in (0.95, 0.3):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, extra_body={
            "ignore_eos": True, "kvsieve": {"method": "tactic", "threshold": threshold, "local": 8,
                                            "cluster_size": 8, "protect": 0}})
        kv = r.usage.model_extra["kvsieve"]
        assert kv["method"] == "tactic" and r.usage.prompt_tokens < 100
        assert kv["attended_densely"] is False and kv["dense_reason"] is None
        fractions[threshold] = kv["kv_fraction"]
    assert 0 < fractions[0.3] < fractions[0.95] < 1  # a lower attention-mass target reads less
    configs = [getattr(m, "config", None) for m in engine.runner.methods.values()]
    assert any(getattr(c, "threshold", None) == 0.95 and getattr(c, "local", None) == 8 for c in configs)
    assert 'kvsieve_kv_fraction{method="tactic"}' in httpx.get(live.url + "/metrics", timeout=TIMEOUT).text
    r = live.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "kvsieve": {"method": "tactic",
                                                                                   "cluster_size": 0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kvsieve.cluster_size"


def test_per_request_tactic_takes_the_model_dense_heads_unless_it_names_others_or_a_budget(live):
    """A server started for a model with calibrated dense heads (patterns.model_heads) gives
    them to requests for tactic and hybrid in threshold mode and for quest and lserve; a
    request's own dense_heads wins, and so does a budget for tactic and hybrid."""
    server = live.app.state.server
    saved = server.streaming_heads
    server.streaming_heads = {"lserve": None, "hybrid": None, "dense": {"tactic": ((0, 1),), "hybrid": ((0, 2),)}}
    try:
        assert server.method({"method": "tactic"}) == ("tactic", {"dense_heads": ((0, 1),)})
        assert server.method({"method": "tactic", "threshold": 0.8})[1] == {"threshold": 0.8, "dense_heads": ((0, 1),)}
        assert server.method({"method": "tactic", "budget": 64})[1] == {"budget": 64}
        assert server.method({"method": "tactic", "dense_heads": []})[1] == {"dense_heads": []}
        assert server.method({"method": "quest"})[1] == {}
        assert server.method({"method": "hybrid"}) == ("hybrid", {"dense_heads": ((0, 2),)})
        assert server.method({"method": "hybrid", "budget": 64})[1] == {"budget": 64}
        server.streaming_heads["dense"]["quest"] = ((1, 0),)  # a page method keeps them with a budget
        assert server.method({"method": "quest", "budget": 64})[1] == {"budget": 64, "dense_heads": ((1, 0),)}
        with pytest.raises(Exception, match="dense head 99:0, but this model has 30 layers x 3 KV heads") as e:
            server.method({"method": "tactic", "dense_heads": [[99, 0]]})
        assert e.value.param == "kvsieve.dense_heads"
        with pytest.raises(ValueError, match="dense head 30:1, but this model has 30 layers"):  # the engine checks too
            server.engine.method_key("tactic", {"dense_heads": ((30, 1),)})
        # a server started with a budget: a request naming nothing of the mode keeps it (no dense heads:
        # "dense_heads applies to the threshold mode" refused them); one asking for the threshold mode gets it
        eng = server.engine
        saved_default = eng.default_method, eng.default_options
        eng.default_method, eng.default_options = "tactic", {"budget": 256}
        try:
            assert server.method({"method": "tactic"}) == ("tactic", {})
            assert server.method({"cluster_size": 8}) == (None, {"cluster_size": 8})
            assert server.method({"threshold": 0.8}) == (None, {"threshold": 0.8, "dense_heads": ((0, 1),)})
            assert server.method({"dense_heads": [[0, 2]]}) == (None, {"dense_heads": [[0, 2]]})
        finally:
            eng.default_method, eng.default_options = saved_default
    finally:
        server.streaming_heads = saved


def test_full_queue_answers_503_with_retry_after_and_admitted_requests_finish(engine):
    small = LLMEngine(engine.model, engine.tokenizer, "dense", kv_pages=8, max_num_seqs=1, max_waiting=1)
    with LiveServer(small) as s:
        r = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 200})  # bigger than the pool
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        full = list(range(1000, 1128))  # fills the pool's 128 tokens: scored (echo, max_tokens 0), no room to generate
        r = s.post("/v1/completions", {"prompt": full, "max_tokens": 0, "echo": True, "logprobs": 0})
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 128, r.text
        # the last new token is never cached, so the pool takes one more new token than it holds (as the
        # engine and generate do; the server refused it): the full pool's prompt still gets its one token
        r = s.post("/v1/completions", {"prompt": full, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
        r = s.post("/v1/completions", {"prompt": full[:100], "max_tokens": 29, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 29, r.text
        r = s.post("/v1/completions", {"prompt": full[:100], "max_tokens": 30})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "set max_tokens <= 29" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["message"].startswith("This model's maximum context length is 128 tokens")  # the pool's
        for k in (0, 1):  # scoring needs no new token, and the pool holds the prompt either way
            r = s.post("/v1/completions", {"prompt": full + [7], "max_tokens": k, "echo": True, "logprobs": 0})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert "allows at most 128 (" in r.json()["error"]["message"], r.text
        body = {"prompt": "Tell me a story about a dog.", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        for _ in range(3):  # arrivals are nearly simultaneous; retry the burst if the engine kept up
            with ThreadPoolExecutor(10) as pool:
                res = list(pool.map(lambda _: s.post("/v1/completions", body), range(10), timeout=4 * TIMEOUT))
            if any(r.status_code == 503 for r in res):
                break
        codes = sorted(r.status_code for r in res)
        assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
        for r in res:
            if r.status_code == 503:
                assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full"
            else:
                assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["finish_reason"] == \
                    "length"
        assert len({r.json()["choices"][0]["text"] for r in res if r.status_code == 200}) == 1  # greedy, same
        assert s.metric("kvsieve_requests_rejected_total", '{reason="queue_full"}') >= 1
        assert s.metric("kvsieve_kv_pages_total") == 8
        wait_for(lambda: s.metric("kvsieve_kv_pages_used") == 0, "every page back in the pool")


def test_kvsieve_settings_no_request_uses_are_released(engine):
    """--max-method-configs bounds the settings in use at once, not the settings ever seen:
    a sweep of distinct settings, one request at a time, is served past the limit, and the
    engine keeps only the methods its requests use; settings held by running requests fill
    the limit (503 naming kvsieve, with Retry-After) until those requests end."""
    eng = LLMEngine(engine.model, engine.tokenizer, "dense", kv_pages=64, max_num_seqs=4)
    with LiveServer(eng, max_method_configs=2) as s:
        for i in range(5):
            body = {"prompt": "hi", "max_tokens": 2, "kvsieve": {"method": "quest", "budget": 32 + 16 * i}}
            r = s.post("/v1/completions", body)
            assert r.status_code == 200, r.text
        assert len(eng.runner.methods) <= 2 + 2  # default, dense, at most the limit
        held = []
        for p in (0.8, 0.9):  # two long streams keep their settings in use
            cm = httpx.stream("POST", s.url + "/v1/completions", timeout=TIMEOUT, json={
                "prompt": "Tell me a long story.", "max_tokens": 400, "stream": True, "ignore_eos": True,
                "kvsieve": {"method": "tactic", "threshold": p}})
            lines = cm.__enter__().iter_lines()
            next(lines)
            held.append((cm, lines))  # (an iterator dropped would close its stream)
        assert sum(k.startswith("tactic") for k in eng.runner.methods) == 2
        r = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "kvsieve": {"method": "quest", "budget": 700}})
        assert r.status_code == 503 and r.json()["error"]["param"] == "kvsieve", r.text  # busy: retry later
        assert r.json()["error"]["code"] == "method_configs_full" and int(r.headers["Retry-After"]) >= 1
        assert s.metric("kvsieve_requests_rejected_total", '{reason="method_configs_full"}') == 1  # its own reason
        # the server's own setting, however spelled, and plain dense take no place (they were 503s)
        for kv in ({"method": None}, {"method": "dense"}):
            r = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "kvsieve": kv})
            assert r.status_code == 200, (kv, r.text)
        for cm, _ in held:
            cm.__exit__(None, None, None)
        wait_for(lambda: s.metric("kvsieve_kv_pages_used") == 0, "the closed streams' pages to be freed")
        r = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "kvsieve": {"method": "quest", "budget": 700}})
        assert r.status_code == 200, r.text


def test_a_refused_request_reads_every_choices_outcome():
    """A request of n choices refused at admission (503: settings or queue full) read only
    the first choice's error; asyncio then logged "Future exception was never retrieved" for
    every other choice. All are read now, and the first error answers."""
    from types import SimpleNamespace

    from kvsieve.engine.scheduler import SchedulerFullError
    from kvsieve.server.app import Server

    async def run():
        loop = asyncio.get_running_loop()
        unread = []
        loop.set_exception_handler(lambda _, ctx: unread.append(ctx["message"]))
        streams = [SimpleNamespace(admitted=loop.create_future()) for _ in range(3)]
        for st in streams:
            st.admitted.set_exception(SchedulerFullError("3 requests are already waiting (limit 3)"))
        aborted = []
        server = SimpleNamespace(driver=SimpleNamespace(abort=lambda st: aborted.append(id(st))), retry_after_s=2,
                                 metrics=SimpleNamespace(rejected=SimpleNamespace(
                                     labels=lambda *_: SimpleNamespace(inc=lambda: None))))
        server.refuse = lambda *a, **kw: Server.refuse(server, *a, **kw)
        response = await Server.admit(server, streams, chat=False)
        del streams, st
        gc.collect()
        return response, aborted, unread

    response, aborted, unread = asyncio.run(run())
    assert response.status_code == 503 and response.headers["Retry-After"] == "2" and len(aborted) == 3
    assert unread == [], unread


def _serve_process(*args):
    """`python -m kvsieve serve` (embedded model, CPU, a free port) as a child process, and its
    base URL once it listens."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(__import__("pathlib").Path(
        __file__).parents[1] / "src"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "kvsieve", "serve", "--device", "cpu", "--port", "0", *args],
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        found = re.search(r"(http://[\d.]+:\d+)/v1", line)
        if found:
            return proc, found.group(1)
        assert line or proc.poll() is None, "the server exited before listening"
    proc.kill()
    raise AssertionError("the server did not start")


@pytest.mark.parametrize("signals", [("SIGTERM",), ("SIGINT", "SIGINT")])
def test_serve_stops_cleanly_on_a_signal(signals):
    """SIGTERM (or Ctrl-C) drains and exits 0. A second Ctrl-C during the drain aborts the
    streams in flight: each ends with finish_reason "abort" and [DONE] (uvicorn's own force
    quit cut them mid-body and logged tracebacks); the process still exits 0."""
    import signal as sig

    proc, url = _serve_process("--shutdown-timeout", "60")
    lines, error = [], None
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=TIMEOUT) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 1:
                    for name in signals:
                        proc.send_signal(getattr(sig, name))
                        time.sleep(0.5)
                if len(signals) == 1 and len(lines) == 6:
                    break  # SIGTERM: the drain would wait for the whole answer; the client leaves
    except httpx.HTTPError as e:
        error = e
    finally:
        try:
            rc = proc.wait(120)
        finally:
            proc.kill()
    err = proc.stderr.read()
    assert rc == 0 and "Traceback" not in err, (rc, err[-2000:], lines[-3:])
    if len(signals) == 2:
        assert error is None, error
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "abort", lines[-3:]
        assert [x for x in lines if x][-1] == "data: [DONE]", lines[-3:]


def test_a_third_ctrl_c_quits_at_once(monkeypatch):
    """The second Ctrl-C aborts the requests (and says a third quits at once); the third quits
    at once instead of uvicorn's forced exit, which cancelled the handlers mid-await and logged
    a traceback for each (about 200 lines) while clients got a bare 500 or a cut stream."""
    import signal as sig
    from types import SimpleNamespace

    import uvicorn

    from kvsieve.server import cli as server_cli

    stops, quits, forced = [], [], []
    app = SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(
        draining=False, driver=SimpleNamespace(stop=lambda **kw: stops.append(kw)))))
    monkeypatch.setattr(server_cli, "_quit_now", lambda *a: quits.append(a))
    monkeypatch.setattr(uvicorn.Server, "handle_exit", lambda self, *a: forced.append(a))
    server = server_cli._make_server(uvicorn.Config(lambda *a: None), app, 30.0)
    server.handle_exit(sig.SIGINT, None)
    assert app.state.server.draining and stops == [{"drain_s": 30.0, "wait": False}] and len(forced) == 1
    server.handle_exit(sig.SIGINT, None)
    assert stops[-1] == {"drain_s": 0.0, "wait": False} and len(forced) == 1 and not quits
    server.handle_exit(sig.SIGINT, None)
    assert len(quits) == 1


def test_usage_says_why_a_choice_attended_densely():
    """usage.kvsieve.dense_reason: the reason of the first choice that attended densely
    (RequestOutput.dense_reason), None when none did."""
    from types import SimpleNamespace as NS

    from kvsieve.server.responses import Responses

    def out(dense, reason=None, kv=1.0):
        return NS(tokens=[1, 2], method="tactic", kv_fraction=kv, attended_densely=dense, dense_reason=reason)

    usage = Responses().usage(5, [out(False, kv=0.25), out(True, "plans_read_most"), out(True, "not_indexed")])
    assert usage["kvsieve"] == {"method": "tactic", "kv_fraction": 0.75, "attended_densely": True,
                                "dense_reason": "plans_read_most"}
    assert usage["completion_tokens"] == 6 and usage["total_tokens"] == 11
    assert Responses().usage(5, [out(False, kv=0.5)])["kvsieve"]["dense_reason"] is None
