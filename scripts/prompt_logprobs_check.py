"""Prompt log-probabilities (SamplingParams.prompt_logprobs, the server's echo) of the
embedded model on the built-in ~4K-token document, against transformers' forward of the
same weights in the same dtype on the same device. Prints the mean / max difference, the
summed log-probability of both and the top-1 agreement.

    python3 scripts/prompt_logprobs_check.py          # CUDA + bf16 when present, else CPU + fp32
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.engine import LLMEngine, SamplingParams  # noqa: E402
from kvsieve.model.cli import DEFAULT_QUESTION  # noqa: E402
from kvsieve.model.loader import EMBEDDED_DIR, cache_root  # noqa: E402
from kvsieve.prompts import document_prompt  # noqa: E402


def main() -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    from transformers import AutoModelForCausalLM

    eng = LLMEngine.load(method="tactic")
    tok, model = eng.tokenizer, eng.runner.model
    doc, _, _ = document_prompt(lambda s: len(tok.encode(s, add_special_tokens=False)))
    ids = tok.encode(doc + DEFAULT_QUESTION)
    eng.warmup()
    t = time.perf_counter()
    out = eng.generate([ids], SamplingParams(0, prompt_logprobs=1))[0]
    dt = time.perf_counter() - t
    got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]], dtype=torch.float64)
    hf = AutoModelForCausalLM.from_pretrained(cache_root() / EMBEDDED_DIR, dtype=model.dtype).to(model.device)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids], device=model.device)).logits[0].float(), -1).double().cpu()
    want = lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    top1 = torch.tensor([e.top[0][0] for e in out.prompt_logprobs[1:]])
    print(f"{model.device} {model.dtype}: prompt {len(ids)} tokens scored in {dt:.3f} s; |engine - HF| mean "
          f"{(got - want).abs().mean():.4f} max {(got - want).abs().max():.4f}; sum engine {got.sum():.1f} HF "
          f"{want.sum():.1f}; top-1 agreement {(top1 == lp[:-1].argmax(-1)).float().mean():.4f}; generated "
          f"{out.tokens}; pages in use {eng.scheduler.used_pages}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
