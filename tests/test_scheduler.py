"""The scheduler alone: plain Python, no torch, no model."""
import importlib.util
import pathlib
import subprocess
import sys

import pytest

PATH = pathlib.Path(__file__).parents[1] / "src" / "kvsieve" / "engine" / "scheduler.py"


def load():
    spec = importlib.util.spec_from_file_location("kvsieve_scheduler_alone", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


S = load()


def test_module_imports_no_torch():
    code = (f"import importlib.util, sys; s = importlib.util.spec_from_file_location('x', {str(PATH)!r}); "
            "m = importlib.util.module_from_spec(s); sys.modules['x'] = m; s.loader.exec_module(m); "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def drive(sched, steps=1000):
    """Pretend to be the engine: prefill chunks, decode rows, token 1 always (never eos)."""
    log = []
    for _ in range(steps):
        if not sched.has_unfinished:
            return log
        plan = sched.schedule()
        assert sum(e - s for _, s, e in plan.chunks) + len(plan.decode) <= sched.step_tokens
        log.append(plan)
        for r in plan.decode:
            assert len(r.pages) * sched.page_size >= r.num_cached + 1  # room for the token it writes
            sched.append_token(r, 1)
        for r, s, e in plan.chunks:
            assert s == r.num_cached
            sched.prefilled(r, e)
            if e == r.prefill_target and not r.output:
                sched.append_token(r, 1)
        used = sum(len(r.pages) for r in sched.running)
        assert used == sched.num_pages - len(sched.free_pages)  # no page lost or shared
    raise AssertionError("did not finish")


def test_chunked_prefill_interleaves_with_decode_under_the_token_budget():
    sched = S.Scheduler(num_pages=100, page_size=16, max_num_seqs=8, step_tokens=64, max_model_len=1000)
    a = sched.add(list(range(40)), S.SamplingParams(max_new_tokens=5))
    b = sched.add(list(range(150)), S.SamplingParams(max_new_tokens=3))
    log = drive(sched)
    assert a.finished and b.finished and len(a.output) == 5 and len(b.output) == 3
    assert a.finish_reason == b.finish_reason == "length"
    # b's 150-token prompt went in chunks while a decoded
    b_chunks = [(s, e) for p in log for r, s, e in p.chunks if r is b]
    assert len(b_chunks) >= 3 and b_chunks[0][0] == 0 and b_chunks[-1][1] == 150
    assert any(a in p.decode and any(r is b for r, _, _ in p.chunks) for p in log)
    assert len(sched.free_pages) == 100


def test_requests_join_and_leave_at_every_step():
    sched = S.Scheduler(num_pages=200, page_size=16, max_num_seqs=3, step_tokens=256, max_model_len=1000)
    reqs = [sched.add(list(range(20 + 7 * i)), S.SamplingParams(max_new_tokens=2 + i)) for i in range(6)]
    log = drive(sched)
    assert all(r.finished and len(r.output) == r.params.max_new_tokens for r in reqs)
    assert max(len(p.decode) + len(p.chunks) for p in log) <= 3  # max_num_seqs
    sizes = [len(p.decode) for p in log]
    assert len(set(sizes)) > 1


def test_joining_soon_names_the_next_requests_to_decode():
    """Per method key: how many requests join the decode batch next (admitted ones still
    prefilling, then waiting ones the free pages admit now, in order, up to max_num_seqs
    running) and the longest prefill of every request not yet decoding."""
    sched = S.Scheduler(num_pages=400, page_size=16, max_num_seqs=4, step_tokens=64, max_model_len=1000)
    a = sched.add(list(range(30)), S.SamplingParams(max_new_tokens=50))
    sched.add(list(range(200)), S.SamplingParams(max_new_tokens=50), "quest")
    sched.add(list(range(90)), S.SamplingParams(max_new_tokens=50))
    sched.add(list(range(70)), S.SamplingParams(max_new_tokens=50), "quest")
    sched.add(list(range(500)), S.SamplingParams(max_new_tokens=50))
    assert sched.joining_soon() == {"default": (2, 90), "quest": (2, 200)}  # the fifth is past max_num_seqs
    plan = sched.schedule()  # a (30 tokens) and the first 34 of the 200-token prompt
    for r, s, e in plan.chunks:
        sched.prefilled(r, e)
        if e == r.prefill_target:
            sched.append_token(r, 1)
    assert not a.prefilling and a.output == [1]
    assert sched.joining_soon() == {"quest": (2, 200), "default": (1, 500)}  # a decodes: 3 rows left
    sched.abort(a.id)
    assert sched.joining_soon() == {"quest": (2, 200), "default": (2, 500)}
    tight = S.Scheduler(num_pages=20, page_size=16, max_num_seqs=8, step_tokens=64, max_model_len=1000)
    for n in (100, 150, 60, 30):  # 7 + 10 pages fit the 20 free, the third (4) waits, and (FCFS) so does the 30
        tight.add(list(range(n)), S.SamplingParams(max_new_tokens=4))
    assert tight.joining_soon() == {"default": (2, 150)}  # rows only for what the pool admits now


def test_full_pool_preempts_and_recomputes_without_losing_a_request():
    # 10 pages of 4 tokens: two requests of 12 + 20 tokens cannot both hold their pages
    sched = S.Scheduler(num_pages=10, page_size=4, max_num_seqs=4, step_tokens=64, max_model_len=100)
    a = sched.add(list(range(12)), S.SamplingParams(max_new_tokens=20))
    b = sched.add(list(range(12)), S.SamplingParams(max_new_tokens=20))
    drive(sched)
    assert a.finished and b.finished and len(a.output) == len(b.output) == 20
    assert a.preemptions + b.preemptions >= 1
    assert len(sched.free_pages) == 10


def test_preemption_takes_the_newest_running_and_requeues_it_ahead_of_later_arrivals():
    """Pins the preemption order the Scheduler documents ("preemption by recomputation (newest
    request first)", FCFS admission): when a decode row needs a page, the victim is the most
    recently admitted running request, and it goes back to the *front* of the waiting queue,
    so a request that arrived after it cannot take its freed pages first. Pool of 6 pages of
    4: a and b (8-token prompts, 3 pages each) fill it; c (3 tokens, 1 page) arrives later
    and waits; when a crosses a page boundary, b is preempted; c would fit the pages left but
    must keep waiting behind b, and b restarts before c starts."""
    sched = S.Scheduler(num_pages=6, page_size=4, max_num_seqs=4, step_tokens=64, max_model_len=100)
    a = sched.add([1] * 8, S.SamplingParams(max_new_tokens=12))
    b = sched.add([2] * 8, S.SamplingParams(max_new_tokens=12))
    starts = []  # (step, request) of every prefill from position 0: admissions and re-admissions
    c = None
    for step in range(100):
        if not sched.has_unfinished:
            break
        plan = sched.schedule()
        starts += [(step, r) for r, s, _ in plan.chunks if s == 0]
        if step == 0:
            assert [r for _, r in starts] == [a, b] and sched.used_pages == 6
            c = sched.add([3] * 3, S.SamplingParams(max_new_tokens=2))  # after a and b; no free page
        if plan.preempted:
            assert b.preemptions == 1 and a.preemptions == 0
            assert plan.preempted == [b] and sched.running == [a] and plan.decode == [a]  # the newest went
            assert list(sched.waiting) == [b, c]  # ahead of c, which arrived after it
            assert len(sched.free_pages) >= sched.pages_for(c.admit_tokens) and not plan.chunks  # c fits, yet waits
        for r in plan.decode:
            sched.append_token(r, 1)
        for r, s, e in plan.chunks:
            sched.prefilled(r, e)
            if e == r.prefill_target and not r.output:
                sched.append_token(r, 1)
    assert a.finished and b.finished and c.finished and b.preemptions == 1
    assert len(a.output) == len(b.output) == 12 and len(c.output) == 2
    order = [r for _, r in starts]
    assert order == [a, b, b, c], [r.id for r in order]  # b restarted before c ever started
    assert len(sched.free_pages) == 6


def test_waiting_when_the_pool_is_full_then_admitted():
    sched = S.Scheduler(num_pages=8, page_size=4, max_num_seqs=4, step_tokens=64, max_model_len=100)
    a = sched.add(list(range(20)), S.SamplingParams(max_new_tokens=4))
    b = sched.add(list(range(20)), S.SamplingParams(max_new_tokens=4))
    p = sched.schedule()
    assert [r for r, _, _ in p.chunks] == [a] and list(sched.waiting) == [b]  # b waits for pages
    drive(sched)
    assert a.finished and b.finished


def test_a_scored_prompt_that_fills_the_pool_is_admitted():
    """max_new_tokens 0 (score the prompt): its pages hold the prompt only; admission asked
    for one more token's room too, so a prompt of exactly the pool waited forever."""
    sched = S.Scheduler(num_pages=8, page_size=4, max_num_seqs=4, step_tokens=64, max_model_len=100)
    a = sched.add(list(range(32)), S.SamplingParams(max_new_tokens=0, prompt_logprobs=0))
    assert sched.admissible() == [a]
    p = sched.schedule()
    assert [(r, s, e) for r, s, e in p.chunks] == [(a, 0, 32)] and len(a.pages) == 8


def test_cancel_frees_pages_at_once():
    sched = S.Scheduler(num_pages=50, page_size=16, max_num_seqs=4, step_tokens=512, max_model_len=1000)
    a = sched.add(list(range(100)), S.SamplingParams(max_new_tokens=50))
    waiting = sched.add(list(range(10)), S.SamplingParams(max_new_tokens=5))
    sched.schedule()
    assert sched.used_pages > 0
    sched.abort(a.id)
    assert a.finish_reason == "abort" and a.pages == []
    sched.abort(waiting.id)
    assert sched.used_pages == 0 and not sched.has_unfinished


def test_stop_tokens_and_eos():
    sched = S.Scheduler(num_pages=50, page_size=16, step_tokens=512, max_model_len=1000)
    r = sched.add([1, 2, 3], S.SamplingParams(max_new_tokens=9, stop_token_ids=(7,)))
    sched.schedule()
    sched.prefilled(r, 3)
    assert not sched.append_token(r, 5, eos_ids=(2,))
    assert sched.append_token(r, 7) and r.finish_reason == "stop"
    r2 = sched.add([1, 2, 3], S.SamplingParams(max_new_tokens=9))
    sched.schedule()
    sched.prefilled(r2, 3)
    assert sched.append_token(r2, 2, eos_ids=(2,))
    r3 = sched.add([1, 2, 3], S.SamplingParams(max_new_tokens=9, ignore_eos=True))
    sched.schedule()
    sched.prefilled(r3, 3)
    assert not sched.append_token(r3, 2, eos_ids=(2,))


@pytest.mark.parametrize("prompt,new,msg", [([], 4, "empty"), (list(range(990)), 20, "allows 1000 positions"),
                                            (list(range(500)), 400, "KV pages")])
def test_requests_that_can_never_run_are_refused(prompt, new, msg):
    sched = S.Scheduler(num_pages=40, page_size=16, max_model_len=1000)
    with pytest.raises(ValueError, match=msg):
        sched.add(prompt, S.SamplingParams(max_new_tokens=new))
    assert not sched.has_unfinished


@pytest.mark.parametrize("prompt,new", [(60, 5), (64, 1), (63, 2), (48, 17)])
def test_a_request_that_just_fits_the_pool_runs(prompt, new):
    """The last new token is never fed back, so a request caches prompt + max_new_tokens - 1
    tokens: one that fills the pool exactly runs (it was refused as one page too large; with
    max_new_tokens 1, admission waited for a decode token that never comes); one page more
    is refused."""
    sched = S.Scheduler(num_pages=4, page_size=16, max_num_seqs=2, step_tokens=64, max_model_len=1000)
    r = sched.add(list(range(prompt)), S.SamplingParams(max_new_tokens=new))
    assert sched.admissible() == [r]
    drive(sched, steps=100)
    assert r.finished and len(r.output) == new and r.finish_reason == "length" and len(sched.free_pages) == 4
    with pytest.raises(ValueError, match=f"caches up to {prompt + new} tokens: 5 KV pages of 16 tokens, but the "
                                         "pool has 4"):
        sched.add(list(range(prompt)), S.SamplingParams(max_new_tokens=new + 1))


def test_admissible_agrees_with_schedule_at_the_page_boundary():
    """admissible() names exactly the requests schedule() admits next (the crossover reads
    it): a prompt of whole pages needs one page more for its first decode token."""
    sched = S.Scheduler(num_pages=3, page_size=16, max_num_seqs=4, step_tokens=256, max_model_len=1000)
    a = sched.add(list(range(16)), S.SamplingParams(max_new_tokens=30))
    sched.schedule()
    sched.prefilled(a, 16)
    sched.append_token(a, 1)  # a decodes from now on
    assert len(a.pages) == 2  # 16 prompt tokens + the first decode token
    b = sched.add(list(range(16)), S.SamplingParams(max_new_tokens=2))  # 1 page + its decode token's: 1 free
    c = sched.add(list(range(16)), S.SamplingParams(max_new_tokens=1))  # its one new token needs no decode
    assert sched.admissible() == []  # b is first in line and does not fit
    assert [r for r, _, _ in sched.schedule().chunks] == []
    sched.append_token(a, 1)
    sched.abort(b.id)
    assert sched.admissible() == [c]
    assert [r for r, _, _ in sched.schedule().chunks] == [c]


@pytest.mark.parametrize("step_tokens", [1, 7, 64])
def test_prefill_chunks_use_the_whole_step_budget(step_tokens):
    """Each step prefills as many prompt tokens as its budget leaves (the last chunk what
    remains): a chunk one token short would have stalled at step_tokens 1 (empty chunks)."""
    sched = S.Scheduler(num_pages=100, page_size=16, max_num_seqs=1, step_tokens=step_tokens, max_model_len=1000)
    r = sched.add(list(range(150)), S.SamplingParams(max_new_tokens=2))
    log = drive(sched, steps=400)
    chunks = [(s, e) for p in log for q, s, e in p.chunks if q is r]
    assert chunks == [(s, min(s + step_tokens, 150)) for s in range(0, 150, step_tokens)]
    assert r.finished and len(r.output) == 2


def test_queue_limit():
    """max_waiting requests wait beyond those the free running slots take at the next step (a
    burst to an idle server was cut at max_waiting with every slot free)."""
    sched = S.Scheduler(num_pages=40, page_size=16, max_num_seqs=2, max_model_len=1000, max_waiting=2)
    for _ in range(4):  # 2 free slots + 2 waiting
        sched.add([1], S.SamplingParams(max_new_tokens=5))
    with pytest.raises(S.SchedulerFullError):
        sched.add([1], S.SamplingParams(max_new_tokens=5))
    sched.schedule()  # two of them run; two still wait, the limit
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    with pytest.raises(S.SchedulerFullError):
        sched.add([1], S.SamplingParams(max_new_tokens=5))
    for bad in (0, -1, 2.5, True):  # every request waits a step first: a limit of 0 refused them all
        with pytest.raises(ValueError, match="max_waiting must be None .* or an integer >= 1"):
            S.Scheduler(num_pages=40, page_size=16, max_waiting=bad)


@pytest.mark.parametrize("field,value", [("max_new_tokens", 0), ("temperature", -1.0), ("top_p", -0.1), ("top_p", 1.5),
                                         ("top_k", -2), ("seed", 1.5), ("seed", 2 ** 64), ("seed", -2 ** 63 - 1)])
def test_sampling_params_validated(field, value):
    with pytest.raises(ValueError, match=field):
        S.SamplingParams(**{field: value})


def test_last_token_and_token_slice_match_the_token_list():
    """The decode step reads last_token and prefill reads token_slice instead of building
    prompt + output (a copy of the whole context per request per step)."""
    for prompt, output in (([5], []), ([1, 2, 3], []), ([1, 2, 3], [7]), ([4], [8, 9, 10])):
        r = S.Request(0, list(prompt), S.SamplingParams(4), output=list(output))
        toks = prompt + output
        assert r.last_token == toks[-1]
        for a in range(len(toks) + 1):
            for b in range(a, len(toks) + 2):
                assert r.token_slice(a, b) == toks[a:b], (prompt, output, a, b)


def test_too_long_requests_say_how_to_fit():
    sched = S.Scheduler(num_pages=100, page_size=16, max_num_seqs=4, step_tokens=64, max_model_len=100)
    for prompt, new, fix in [(50, 60, "shorten the prompt to at most 40 tokens"), (50, 100, "at most 50 new tokens"),
                             (120, 100, "shorten the prompt below 100 tokens")]:
        with pytest.raises(ValueError, match=fix):
            sched.add(list(range(prompt)), S.SamplingParams(max_new_tokens=new))
