"""Built-in defaults in one place: the decode shape used without a tuned entry, and the sweep grids."""

# Without a tuned entry (`redrafter-mlx tune`): the best cell measured in bench/results/cpu-avx2 (W1 L3, see README;
# bench-20261125-224306 swept L 3-6 for the default mode and the drafter alone: L3 first in both; with the round-7
# drafter L3 1.34x our AR, L4 1.29x, L5 1.17x: default-shape-20261130/; after the graph-node cuts made a plain
# step cheaper, L2 1.242x, L3 1.229x, L4 1.142x, L2 and L3 within noise: graph-nodes-20261130/length_ab.txt;
# after the two-node layers, L2 1.177x, L3 1.146x: layer-after-20261130/length_ab.txt, L3 kept, see there).
DEFAULT_BEAM_WIDTH = 1
DEFAULT_BEAM_LENGTH = 3
DEFAULT_LOOKUP_WIDTH = 1
# Candidates from the model's answer table (lookup modes, where a table is shipped): off by default, because on
# our CPU it adds tokens per call (+0.03-0.11) but costs more verification than it saves
# (bench/results/cpu-avx2/answer-table.md); where verifying a few more tokens is nearly free, try 1.
DEFAULT_ANSWERS_WIDTH = 0
# Rows of the recurrent drafter's vocabulary head used when drafting, where its head is frequency-ordered and
# larger (its most frequent tokens). The shipped drafter's head has 8,192 rows; drafting from all of them rather than
# the first 4,096 decides more tokens per call at the same speed (+0.05 for the drafter alone at L4; the whole
# 49,152-token vocabulary adds nothing more and costs time: bench/results/cpu-avx512/MEASURED.md).
DEFAULT_DRAFTER_VOCAB = 8192
# Longest candidate (g0 included) a context-lookup copy grows to while every copied token keeps being accepted
# (twice as many copied tokens per fully accepted step; bench/results/cpu-avx2/lookup-growth.md).
DEFAULT_LOOKUP_MAX_LENGTH = 9
# The same for copies from a predicted output (`prediction`), which is given to be copied: 33 decided 128-token
# answers 5-12% faster than 9 with the answer, or the answer edited once, as the prediction, and ~1.5% with two edits
# (bench/results/cpu-avx2/prediction-20261129/).
PREDICTION_MAX_LENGTH = 33
DEFAULT_LOOKUP_INDEX = "ngram"  # the context index of lookup drafting (draft.lookup.INDEXES)
# Greedy drafts of the recurrent drafter end where the drafter's probability of the whole draft falls below this.
# Off (0: every draft has the full length): on our CPUs the cut saves little verification and its host reads cost
# what they save (docs/options.md, bench/results/cpu-avx512/MEASURED.md).
DEFAULT_DRAFT_CONFIDENCE = 0.0

# Sweep grids: `make bench` (full and --quick) and `redrafter-mlx tune`.
BENCH_GRID = {"widths": [1, 2, 4], "lengths": [2, 3, 4, 5], "num_prompts": 8, "max_tokens": 128, "repeats": 1}
QUICK_GRID = {"widths": [1, 2], "lengths": [3, 4], "num_prompts": 3, "max_tokens": 64, "repeats": 1}
TUNE_GRID = {"widths": [1, 2, 4], "lengths": [2, 3, 4, 5], "num_prompts": 3, "max_tokens": 64, "repeats": 1}

# Sweeps (mlx_redrafter/sweep.py; the draft modes measured by default are marked in draft/modes.py): the short
# unrecorded warm-up per configuration, and what a tuned cell must achieve to be stored instead of plain AR.
WARMUP_TOKENS = 16
TUNE_MIN_SPEEDUP = 1.03  # speedup over AR pooled over the tune prompts (`sweep.pooled_speedup`)
TUNE_MIN_TOKENS_PER_STEP = 1.1  # below this a target call barely decides more than AR: a "gain" is noise
