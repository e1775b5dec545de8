"""Frozen, validated configuration for every selection method.

Each default states where it comes from:
  [Tactic]  the Tactic paper (seeds/000): cluster size 32, <=10 K-means iterations, P=0.9,
            fit segments "e.g. 10% and 60%", exact head "1-2% of tokens";
  [LServe]  the LServe paper / code defaults (seeds/002): logical page 16, physical page 64,
            dynamic token budget 4096, decode sink 128 + local 256, selection reused 4 steps;
  [Quest]   the Quest paper: 16-token pages, one selection per step;
  [ours]    our own choice, with the reason next to it.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Optional, Tuple


# `--model` of every command that loads one (generate, serve, eval, calibrate)
MODEL_HELP = ("a Hugging Face model directory (config.json + *.safetensors), a Hub id (org/name, fetched once), "
              "a .gguf file, or gemma3-270m (default: the embedded SmolLM2-135M-Instruct)")

# Token counts and sizes beyond this are no context's (16.8M tokens): a budget or window at
# least the context's length already covers all of it, and the kernels index lists in int32
MAX_TOKENS = 1 << 24


def plain_scalar(value):
    """A NumPy number (np.int64(64), np.float32(0.9): numbers.Integral / numbers.Real) as the
    Python int or float it holds, so options swept with np.arange validate; bools, Python
    numbers and anything else unchanged."""
    if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    _at_most_max(name, value)


def _non_negative_int(name: str, value, bounded: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if bounded:
        _at_most_max(name, value)


def _at_most_max(name: str, value: int) -> None:
    if value > MAX_TOKENS:
        raise ValueError(f"{name} must be at most {MAX_TOKENS:,}, got {value:,}; a value at or above the "
                         "context's length already covers all of it")


def _fraction(name: str, value, low_open: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (0.0 < value <= 1.0 if low_open else 0.0 <= value <= 1.0)
    if not ok:
        rng = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(f"{name} must be a number in {rng}, got {value!r}")


def dense_head_pairs(value) -> Tuple[Tuple[int, int], ...]:
    """`dense_heads` as sorted, distinct (layer, KV head) pairs of integers >= 0; None and
    "none" are no pair, and a string may spell them as the CLI does ("7:2,18:2")."""
    given = value
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return ()
    if isinstance(value, str):
        try:
            value = [tuple(int(x) for x in p.split(":")) for p in value.split(",") if p.strip()]
        except ValueError:
            value = [value]  # refused below, naming the string
    try:
        pairs = tuple((int(a), int(b)) for a, b in value)
        ok = all(not isinstance(y, bool) and x >= 0 and float(x) == y
                 for pair, given in zip(pairs, value) for x, y in zip(pair, given))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"dense_heads must be (layer, kv_head) pairs of integers >= 0, e.g. ((7, 2),) or \"7:2,18:2\", "
                         f"or None / () for none, got {given!r}" + (
                             "; a `kvsieve calibrate` file's heads are read at load: LLMEngine.load(dense_heads=FILE), "
                             "kvsieve.hf.enable(model, method, dense_heads=FILE), --dense-heads FILE"
                             if isinstance(given, str) and given.strip().endswith(".json") else ""))
    return tuple(sorted(set(pairs)))


@dataclass(frozen=True)
class MethodConfig:
    """Base class: `from_options` builds a config from keyword options with clear errors."""

    @classmethod
    def option_names(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def accepted_options(cls) -> Tuple[str, ...]:
        """The option names from_options takes."""
        return cls.option_names()

    def _plain_numbers(self) -> None:
        """NumPy numbers given directly (TacticConfig(threshold=np.float32(0.9))) as the
        Python numbers they hold, as make_method's options are."""
        for f in fields(self):
            object.__setattr__(self, f.name, plain_scalar(getattr(self, f.name)))

    @classmethod
    def from_options(cls, method: str, **options):
        unknown = sorted(set(options) - set(cls.option_names()))
        if unknown:
            accepted = ", ".join(cls.option_names()) or "(none)"
            raise ValueError(
                f"unknown option(s) {', '.join(unknown)} for method {method!r}; "
                f"accepted options: {accepted}"
            )
        return cls(**options)


@dataclass(frozen=True)
class DenseConfig(MethodConfig):
    """Attend every cached token (the baseline every sparse method is checked against)."""


@dataclass(frozen=True)
class StreamingConfig(MethodConfig):
    """Sink + local window (Λ mask) on every head.

    sink: first tokens always kept. [LServe] decode default 128.
    local: most recent tokens kept. [LServe] decode default 256. The token being decoded is
        always one of them (local=0 keeps it alone), as quest keeps its page and tactic its tail.
    """

    sink: int = 128
    local: int = 256

    def __post_init__(self):
        self._plain_numbers()
        _non_negative_int("sink", self.sink)
        _non_negative_int("local", self.local)
        if self.sink + self.local == 0:
            raise ValueError("streaming needs sink + local > 0 tokens, got sink=0 and local=0")

    @property
    def decode_window(self) -> Tuple[int, int]:
        """(sink, local) a decode step attends: the token being decoded always in the local part."""
        return self.sink, max(self.local, 1)


@dataclass(frozen=True)
class PageSelectConfig(MethodConfig):
    """Page selection from per-page key min/max summaries (Quest / LServe).

    page_size: logical page (tokens) whose min/max bound is scored. [Quest, LServe] 16.
    physical_page_size: unit of selection; takes the max score of its logical pages;
        a multiple of page_size. [LServe] 64 (Quest: equal to page_size).
    budget: tokens of dynamically chosen pages, sink/local pages come on top.
        [LServe] 4096 (the `pages` method; `lserve` takes 6144, methods/hybrid.LServeConfig).
    sink, local: tokens always kept (rounded out to whole physical pages). [ours] one page
        each for quest; LServe keeps sink+local pages in its dynamic heads as well.
    reuse_steps: a selection is reused for this many decode steps; tokens appended
        since the selection are always attended. [LServe] 4, [Quest] 1.
    gqa_reduce: how query heads of one KV group combine page scores. [ours] "max":
        each head's score is an upper bound of its own logits, and the max keeps a page
        that any head of the group needs; "sum" is the alternative.
    dense_heads: (layer, KV head) pairs that take every page at every step, beside the
        budget of the others (in an lserve/hybrid, never a streaming head). [ours] none
        here; generate, serve, eval and the HF drop-in give quest and lserve the model's, as
        tactic's (TacticConfig.dense_heads; QuestConfig and LServeConfig say what they find).
    """

    page_size: int = 16
    physical_page_size: int = 64
    budget: int = 4096
    sink: int = 64
    local: int = 64
    reuse_steps: int = 4
    gqa_reduce: str = "max"
    dense_heads: Tuple[Tuple[int, int], ...] = ()

    def __post_init__(self):
        self._plain_numbers()
        _positive_int("page_size", self.page_size)
        _positive_int("physical_page_size", self.physical_page_size)
        if self.physical_page_size % self.page_size:
            raise ValueError(
                f"physical_page_size ({self.physical_page_size}) must be a multiple of "
                f"page_size ({self.page_size}); give a page size that divides it, or a physical page "
                "size that is a multiple of it (--physical-page-size)"
            )
        _positive_int("budget", self.budget)
        _non_negative_int("sink", self.sink)
        _non_negative_int("local", self.local)
        _positive_int("reuse_steps", self.reuse_steps)
        if self.gqa_reduce not in ("max", "sum"):
            raise ValueError(f"gqa_reduce must be 'max' or 'sum', got {self.gqa_reduce!r}")
        object.__setattr__(self, "dense_heads", dense_head_pairs(self.dense_heads))


@dataclass(frozen=True)
class QuestConfig(PageSelectConfig):
    """Quest: flat 16-token pages, fresh selection each step, budget 2048 tokens.

    budget [ours]: Quest evaluates 256..4096. 2048 is the smallest we ran that finds 99% of
        what dense finds on the retrieval suite (embedded SmolLM2, bf16, H100, three seeds,
        414 cases dense answers; docs/accuracy.md): 411 at 2048 tokens (27% of the KV read
        at 7.5K), 402 at 1024 (14%), 410 at 1536 with 64-token sink and local windows. On
        nine seeds in float32 it lost long needles (96.1% at 7.5K) until it took the model's
        dense heads (the command-line entry points give them, as to tactic): with 7:2 and
        18:2 it finds 99.8% of 1,251 cases, 99.6% at 7.5K, reading 28.8% there (H200).
    sink/local [ours]: 16 each (one page): the current page is always kept, as in Quest.
    """

    page_size: int = 16
    physical_page_size: Optional[int] = None  # one level: the logical page (16 by default)
    budget: int = 2048
    sink: int = 16
    local: int = 16
    reuse_steps: int = 1

    def __post_init__(self):
        self._plain_numbers()
        if self.physical_page_size is None:
            object.__setattr__(self, "physical_page_size", self.page_size)
        super().__post_init__()


@dataclass(frozen=True)
class TacticConfig(MethodConfig):
    """Tactic: clustered keys, threshold-driven budget from a fitted a/x + b curve.

    threshold: target cumulative attention mass P in (0, 1]. [Tactic] 0.9. [ours] 0.92,
        with 256 protected tokens and the model's dense heads (SmolLM2: 7:2, 18:2). On the
        retrieval suite (SmolLM2, float32, H100; docs/accuracy.md) that finds 834 of the 834
        cases dense answers on dev seeds 0-5 and 416 of 417 on held-out seeds 6-8, >= 99% at
        every length, reading 14.7-14.8% of a 7.5K cache; P = 0.93 with the same heads reads
        15.4-15.6%. Without dense heads no P up to 0.97 reached 99% of seeds 0-5 (0.93 98.6%,
        0.97 98.8% at 21.2% read).
    cluster_size: average tokens per K-means cluster. [ours] 16 (the Tactic paper: 32, "to
        balance accuracy and efficiency"; its ablation also used 16). On the retrieval suite
        (embedded SmolLM2, bf16, H100, the 139 cases dense answers; docs/accuracy-history.md) 16
        found 137 reading 24.5% of the KV where 32 found 131 reading 26.2% (8: 138 at 23.4%,
        at four times 32's K-means and centroid-scoring work); a finer cluster's centroid
        sits closer to a needle's key, so the fit takes the needle in earlier.
    max_clusters: at most this many clusters per head (never fewer than one per
        `cluster_window`); a longer head gets larger clusters (Tactic.cluster_size_for).
        0: no cap. [ours] 4096: the plan scores and sorts every cluster of a head at each
        step, and up to 4096 a row sorts in one block; at 128K tokens x batch 8 (H100, bench
        data) 8,192 clusters (size 16) cost the plan 0.51 ms against 0.29 ms at size 32,
        the step 2.3x dense's speed instead of 3.6x. The cap keeps size 16 up to 64K tokens
        per head and reaches the paper's 32 at 128K.
    max_iters: K-means iteration cap. [Tactic] 10.
    seed: seed of the random initial centroids. [ours] 0.
    head_fraction: the head of the sorted list whose scores are computed exactly.
        [Tactic] "1-2%": 0.02.
    segment_centers: where the two fitting segments sit, as fractions of the list.
        [Tactic] 0.1 and 0.6.
    segment_fraction: width of each fitting segment as a fraction of the list, at least
        min_segment_tokens. [ours] 0.01 / 16 tokens: a 4K list reads 41 keys per segment.
    segment_samples: a segment wider than this many tokens is represented by this many
        evenly strided positions inside it (the fit takes the mean exp-score and the mean
        1/x over those); 0 reads every position. [ours] 256: at 128K the two 1% segments
        cost the plan 2,622 key rows per query head, as many as the exact head; 256 samples
        cut the positions scored from 5,244 to 3,134 (-40%, -30% at 64K; H200, 128K x 8:
        plan 399 -> 330 us) and leave lists up to 25.6K tokens unchanged. Against whole
        segments (scripts/fit_fidelity.py, float64, 64K-128K synthetic) budgets move by
        0.04-6% per head on average, no more than moving the segments by 0.5% of the list
        does (0.07-11%), the mean mass by < 0.001 and the mean output error by <= 1.4%;
        64 samples (-48%) moved budgets up to 15% and lost up to 0.008 of mean mass.
    head_max_tokens: cap on the exact head, in tokens (None: head_fraction alone). [ours]
        None: the head is the plan's largest read at long contexts (2,622 key rows per
        query head at 128K), but the top of the list is where a/x + b fits worst: a cap of
        1024 (2048) moved budgets up to 26% (10%) per head on average and lost up to 0.024
        (0.006) of mean mass, 0.09 on the weakest head (scripts/fit_fidelity.py).
    min_budget, max_budget: optional floor/cap in tokens (applied at cluster granularity).
    fold_every: tokens appended after clustering are attended unconditionally; once this
        many have accumulated they are folded into the index (fold_mode). [ours] 256; 0
        disables folding (new tokens stay always-attended).
    fold_mode: how a fold indexes its tokens (methods.cluster_fold). "cluster": K-means on
        the folded tokens into new clusters, at the cluster size a prefill of the request's
        length would use; the tokens folded since the last closed region are re-clustered
        whole each time they grow by half (a region closes at cluster_window tokens, as
        prefill clusters each window alone); where max_clusters leaves no room, "nearest"
        instead. "nearest": each token joins its nearest centroid, which moves to the
        running mean. [ours] "cluster": nearest folds grow a short prompt's few clusters
        without bound; on real SmolLM2 attention at 8K tokens (P = 0.92, two seeds,
        scripts/fold_fidelity.py) an index built at 64-2,048 tokens and folded read 40-91%
        of the cache with "nearest", 14-16% with "cluster", 14% for one built at 8K (same
        mean mass; docs/accuracy.md "Long generations").
    sink: the first tokens are kept out of the index and always attended; their exact
        mass counts towards the threshold. [ours] 4: attention sinks carry 40-96% of the
        mass in layers 12-27 of SmolLM2, but the sink key is ~5x shorter than typical keys,
        so its cluster's centroid ranks low and the fit never sees that mass (measured,
        docs/methods.md).
    local: the most recent tokens are always attended and counted like sinks. [ours] 32:
        on real text several heads put >50% of their mass on the last few tokens, whose
        keys K-means mixes into low-ranked clusters (docs/methods.md). They are kept out
        of the index (prefill indexes [sink, length - local); folding stops `local`
        tokens short of the end), so the always-attended set is two ranges.
    budget: fixed token budget per KV head instead of the threshold: clusters are ranked
        by the group's max q.centroid and taken while their total stays <= budget (the
        best cluster at least); sinks and unindexed tokens come on top. [ours] None (use
        the threshold). This is the mode the GPU fast path and `kvsieve bench` time at
        1-5% budgets.
    cluster_window: K-means runs on consecutive windows of this many keys independently
        (cost linear in the context instead of quadratic; clusters are still ranked
        globally). [ours] 16384: full-context K-means at 128K costs ~6-10% of dense
        prefill, over the 5% target (docs/benchmarks.md). None: one K-means per head.
    protect: threshold mode also takes, per KV head, the clusters whose members could
        score highest (ranked by the group's max of `protect_bound`) while their total
        stays <= protect tokens (the best one at least; tied bounds in cluster order).
        [ours] 256; 0 disables. Not used with a fixed `budget`. Ranking by q.c alone hides
        a needle whose key sits far from its centroid in a wide, low-ranked cluster (retrieval suite, SmolLM2, 2K tokens:
        20/28 without, 27/28 with 256 radius-ranked tokens; docs/accuracy-history.md). On the six-seed suite in float32 (834 cases
        dense answers, H100, docs/accuracy.md), without dense heads: 512 box-ranked tokens
        find 98.9% (825) reading 15.9% of a 7.5K cache, 512 radius-ranked 99.2% (827) at
        15.6%; 256 tokens 98.4% (821, radius) and 98.2% (819, box) at 13.4-13.6%; with the
        dense heads 7:2 and 18:2, 256 box-ranked tokens find 100% (561 of seeds 0-3) at
        15.6%, 192 tokens 99.9% (833) at 15.2%.
    protect_bound: how the protected clusters are ranked. "box": sum_i max(q_i min_i,
        q_i max_i) over the channel-wise min/max of the cluster's members (Quest's page
        bound, per cluster). The index keeps the box as 8-bit offsets above and below the
        centroid in steps of the widest offset / 255, rounded outward (ops.select.quantize_box:
        the centroids' memory, half a bf16 box's; the bound is at most |q|_1 step looser and
        still bounds every member). "radius":
        q.c + |q| r (r: the cluster's radius). [ours] "box". |q| r dominates the radius
        bound, so it ranks clusters by their width: on a suite miss (docs/accuracy-history.md, seed
        2, 7,680 tokens) the cluster holding 0.94 of a head's mass ranks 228th by the
        radius bound and 10th by the box. At 256 tokens the two bounds find as many cases
        (821 / 819); 512 radius-ranked tokens were not measured on the suite.
    dense_heads: (layer, KV head) pairs attended densely, every token at every step
        (threshold mode; in a hybrid, heads of its dynamic part, never a streaming head). [ours]
        none here; the command-line entry points (generate, serve, eval) give tactic and
        hybrid the model's (patterns.dense_heads_for: `dense_heads` of the model's pattern
        file, from `kvsieve calibrate`; the embedded model ships ((7, 2), (18, 2)): 7:2
        calibrated on held-out cases, 18:2 added on the suite's dev seeds). For
        retrieval heads that put most of their mass on needle tokens in low-ranked
        clusters: over 53 suite cases at 7,680 tokens, tactic read under half of such a
        needle mass (> 0.3) in layer 7, query head 7 at 31 answer steps of 26 cases; the
        calibration, on held-out cases, ranks that KV head first by far. Each dense KV head
        of the embedded model adds up to 1/90 of the KV read (docs/accuracy.md).
    """

    threshold: float = 0.92
    cluster_size: int = 16
    max_clusters: int = 4096
    max_iters: int = 10
    seed: int = 0
    head_fraction: float = 0.02
    segment_centers: Tuple[float, float] = (0.1, 0.6)
    segment_fraction: float = 0.01
    min_segment_tokens: int = 16
    segment_samples: int = 256
    head_max_tokens: Optional[int] = None
    min_budget: int = 0
    max_budget: Optional[int] = None
    fold_every: int = 256
    fold_mode: str = "cluster"
    sink: int = 4
    local: int = 32
    budget: Optional[int] = None
    cluster_window: Optional[int] = 16384
    protect: int = 256
    protect_bound: str = "box"
    dense_heads: Tuple[Tuple[int, int], ...] = ()

    def __post_init__(self):
        self._plain_numbers()
        _fraction("threshold", self.threshold)
        _non_negative_int("sink", self.sink)
        _non_negative_int("local", self.local)
        _positive_int("cluster_size", self.cluster_size)
        _non_negative_int("max_clusters", self.max_clusters)
        _positive_int("max_iters", self.max_iters)
        _non_negative_int("seed", self.seed, bounded=False)
        _fraction("head_fraction", self.head_fraction, low_open=False)
        try:
            c = tuple(plain_scalar(x) for x in self.segment_centers)
        except TypeError:
            c = ()
        if len(c) == 2 and all(isinstance(x, (int, float)) for x in c) and c[0] < c[1] < 1.0 \
                and self.head_fraction >= c[0]:
            raise ValueError(f"head_fraction={self.head_fraction!r} must be below the first segment centre "
                             f"({c[0]!r}): the exact head ends before the fit's first segment; give a smaller "
                             "head_fraction or move segment_centers")
        if len(c) != 2 or not all(isinstance(x, (int, float)) for x in c) or not (
            self.head_fraction < c[0] < c[1] < 1.0
        ):
            raise ValueError(
                "segment_centers must be two fractions with head_fraction < first < second < 1, "
                f"got {self.segment_centers!r}"
            )
        object.__setattr__(self, "segment_centers", c)
        _fraction("segment_fraction", self.segment_fraction)
        _positive_int("min_segment_tokens", self.min_segment_tokens)
        _non_negative_int("segment_samples", self.segment_samples)
        _positive_int("head_max_tokens", self.head_max_tokens, allow_none=True)
        if self.budget is not None:
            _positive_int("budget", self.budget)
        if self.cluster_window is not None:
            _positive_int("cluster_window", self.cluster_window)
            if self.cluster_window < self.cluster_size:
                raise ValueError(f"cluster_size ({self.cluster_size}) must be at most cluster_window "
                                 f"({self.cluster_window}), the tokens K-means clusters at once; give a cluster_size "
                                 f"of at most {self.cluster_window}")
        _non_negative_int("min_budget", self.min_budget)
        _positive_int("max_budget", self.max_budget, allow_none=True)
        if self.max_budget is not None and self.max_budget < self.min_budget:
            raise ValueError(
                f"max_budget ({self.max_budget}) must be >= min_budget ({self.min_budget})"
            )
        _non_negative_int("fold_every", self.fold_every)
        if self.fold_mode not in ("cluster", "nearest"):
            raise ValueError(f"fold_mode must be 'cluster' or 'nearest', got {self.fold_mode!r}")
        _non_negative_int("protect", self.protect)
        if self.protect_bound not in ("radius", "box"):
            raise ValueError(f"protect_bound must be 'radius' or 'box', got {self.protect_bound!r}")
        pairs = dense_head_pairs(self.dense_heads)
        if pairs and self.budget is not None:
            raise ValueError("dense_heads applies to the threshold mode; drop budget or dense_heads")
        object.__setattr__(self, "dense_heads", pairs)
