"""One suite case, one layer and query head, under Tactic (issue 18's diagnosis of a miss).

    python3 scripts/needle_head_probe.py SEED|RUN_DIR CASE_ID ANSWER LAYER QHEAD [THRESHOLD]
    python3 scripts/needle_head_probe.py 2 45-multihop-pydoc-7680-d0.67-plain " Liskamere." 7 7 0.99
    python3 scripts/needle_head_probe.py docs/accuracy/protect-box-2026-11-25/seed5 \
        1-name-generated-7680-d0.28-plain " Wilhelmina Kettleby." 18 8

Teacher-forces dense's ANSWER (text) after the case's prompt (rebuilt from RUN_DIR's
results.json and generated.txt, or docs/accuracy/suite-2026-11-23-seedSEED) through LLMEngine's reference path, float32 on the
CPU. At every answer step prints, for that head: its five most attended tokens (needle or
not, q.k), each token's cluster (size, radius, the head's q.c) and the cluster's rank, with
the tokens ranked before it, by the group's q.c, by the radius bound and by a min/max box
bound over the cluster's members; then how many tokens the method selected for the KV head
and the share of the head's attention mass they hold.
"""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from kvsieve.engine import LLMEngine
from kvsieve.eval.suite import build_suite, filler_sources
from kvsieve.model.loader import load_model

CASE, ANSWER = sys.argv[2], sys.argv[3]
d = sys.argv[1] if os.path.isdir(sys.argv[1]) else os.path.join(  # a run's folder, or a seed of the 2026-11-23 runs
    os.path.dirname(__file__), "..", "docs", "accuracy", f"suite-2026-11-23-seed{int(sys.argv[1])}")
res = json.loads(Path(d + "/results.json").read_text()); plan = res["plan"]
model, tok, _ = load_model(None, dtype=torch.float32, device="cpu")
src = {k: v for k, v in filler_sources(Path(d + "/generated.txt").read_text()).items() if k in plan["suite_sources"]}
case = [c for c in build_suite(tok, tuple(plan["suite_lengths"]), plan["suite_cases"], plan["seed"], src)
        if c.id == CASE][0]
ans = tok.encode(ANSWER, add_special_tokens=False)
span = torch.zeros(len(case.prompt_ids), dtype=torch.bool)
for a, b in case.needle_spans:
    span[a:b] = True
LAYER, QH = int(sys.argv[4]), int(sys.argv[5])
eng = LLMEngine(model, tok, "dense", dense_below=0, paged=False, max_num_seqs=1)
step = [0]

def observe(layer, q, k, v, sel, lengths, out):
    if layer != LAYER:
        return
    st = [s for g, a, b in eng.runner.batch.groups for s in [eng.runner.batch.states[g][layer]] if g != "dense"][0]
    B, Hq, D = q.shape; Hkv = k.shape[1]; G = Hq // Hkv; kh = QH // G
    S = k.shape[2]
    qk = (q[0, QH] @ k[0, kh].T) / D ** 0.5
    p = torch.softmax(qk[: int(lengths[0])], -1)
    top = torch.topk(p, 5)
    cent = st.centroids[0, kh].float()
    C = int(st.num_clusters[0])
    qc = (q[0, kh * G:(kh + 1) * G] @ cent[:C].T)  # [G, C]
    grp = qc.amax(0)
    bound = grp + q[0, kh * G:(kh + 1) * G].norm(dim=-1).max() * st.radius[0, kh, :C].float()
    sizes = st.sizes[0, kh, :C]
    a = st.assign[0, kh, :S]; ok = a >= 0; kk = k[0, kh].float(); big = 3e38
    idx = a.clamp(min=0)[:, None].expand(S, D)
    kmin = torch.full((st.sizes.shape[-1], D), big).scatter_reduce(0, idx, kk.masked_fill(~ok[:, None], big), "amin")[:C]
    kmax = torch.full((st.sizes.shape[-1], D), -big).scatter_reduce(0, idx, kk.masked_fill(~ok[:, None], -big), "amax")[:C]
    qg = q[0, kh * G:(kh + 1) * G].float()[:, None, :]
    box = torch.maximum(qg * kmin, qg * kmax).sum(-1).amax(0)
    print(f"step {step[0]} layer {layer} qhead {QH} kvhead {kh}: C={C}, indexed={int(st.num_indexed[0])} len={int(lengths[0])}")
    for pos, pr in zip(top.indices.tolist(), top.values.tolist()):
        cl = int(st.assign[0, kh, pos]) if pos < st.assign.shape[2] else -1
        if cl < 0:
            print(f"  token {pos} p={pr:.3f} needle={bool(span[pos]) if pos < len(span) else False} not indexed"); continue
        rank_qc = int((grp > grp[cl]).sum()); rank_b = int((bound > bound[cl]).sum())
        before_b = int(sizes[bound > bound[cl]].sum()); before_qc = int(sizes[grp > grp[cl]].sum())
        print(f"  token {pos} p={pr:.3f} needle={bool(span[pos])} q.k={float(q[0,QH]@k[0,kh,pos]):.1f} cluster {cl} size {int(sizes[cl])} "
              f"q.c(own head)={float(q[0,QH]@cent[cl]):.1f} radius {float(st.radius[0,kh,cl]):.2f} "
              f"rank by q.c {rank_qc} ({before_qc} tokens before) rank by bound {rank_b} ({before_b} tokens before) "
              f"box {float(box[cl]):.1f} rank by box {int((box > box[cl]).sum())} ({int(sizes[box > box[cl]].sum())} tokens before)")
    print(f"  selected {int(sel.mask[0, kh].sum())} of {int(lengths[0])}; head mass read {float((p * sel.mask[0, kh, :len(p)]).sum()):.3f}")

def obs(layer, *a):
    observe(layer, *a)
    if layer == model.cfg.num_layers - 1:
        step[0] += 1

eng.score([list(case.prompt_ids)], [ans], "tactic", {"threshold": float(sys.argv[6])} if len(sys.argv) > 6 else {},
          observe=obs)
