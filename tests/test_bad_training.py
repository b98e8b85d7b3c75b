"""Malformed training inputs and outputs through the real CLI: output folders that are not drafters, output paths
that cannot be written, torch tensors the converter cannot read, corpora with bad manifests or ids, and training
options out of range. One `error:` line, exit status 2, no traceback, no native crash, no lost files."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
from one_line import CLI, assert_one_line_error, run

from mlx_redrafter.train.corpus import FORMAT, shard_bytes

V = 49152  # the embedded default model's vocabulary
REPO = Path(__file__).resolve().parents[1]


def make_corpus(root: Path, mutate=None, ids=None) -> Path:
    """A tiny corpus of the default model at root/smollm2-135m (3 shards: heldout, train, train); `mutate(entries)`
    edits the manifest's shard entries, `ids` replaces the token ids of the second shard."""
    d = root / "smollm2-135m"
    d.mkdir(parents=True)
    entries = {}
    for i, split in enumerate(["heldout", "train", "train"]):
        seqs = [[100 + j + k for k in range(12)] for j in range(2)]
        if ids is not None and i == 1:
            seqs = [ids] * 2
        data = shard_bytes(seqs, [4, 4], [0, 1], 1, split, V)
        name = f"shard-{i:05d}.npz"
        (d / name).write_bytes(data)
        entries[name] = {"sha256": hashlib.sha256(data).hexdigest(), "split": split, "sequences": 2,
                         "response_tokens": 2 * (len(seqs[0]) - 4), "turn": 1, "created_unix": 1.0}
    if mutate:
        mutate(entries)
    (d / "manifest.json").write_text(json.dumps({"format": FORMAT, "source": "greedy", "shards": entries}))
    return d


def train(tmp: Path, *args: str) -> list[str]:
    """`redrafter-mlx train` with a tiny corpus, a local features cache and run folder, then ARGS."""
    corpus = make_corpus(tmp / "corpus") if not (tmp / "corpus").exists() else tmp / "corpus" / "smollm2-135m"
    return [*CLI, "train", "--corpus", str(corpus), "--features", str(tmp / "feat"), "--run-dir", str(tmp / "run"),
            "--batch", "8", "--draft-vocab", "64", "--steps", "2", *args]


# --- train --output: never delete what a drafter save did not write ---------------------------------------------

def make_project(d: Path, config: bool) -> None:
    """A folder of the user's own files (and maybe an unrelated config.json)."""
    (d / "src").mkdir(parents=True)
    (d / "notes.txt").write_text("notes")
    (d / "src" / "main.py").write_text("print(1)")
    if config:
        (d / "config.json").write_text('{"name": "my-web-app"}')


@pytest.mark.parametrize("config", [False, True], ids=["plain", "with an unrelated config.json"])
@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
def test_train_output_with_other_files_is_never_replaced(tmp_path, config, force):
    out = tmp_path / "proj"
    make_project(out, config)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    proc = run(train(tmp_path, "-o", str(out), *(["--force"] if force else [])), tmp_path)
    assert_one_line_error(proc, "holds files a drafter save does not write (notes.txt, src)")
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_train_output_with_a_config_that_is_not_a_drafter_needs_force(tmp_path):
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "config.json").write_text('{"name": "my-web-app"}')
    assert_one_line_error(run(train(tmp_path, "-o", str(out)), tmp_path), "does not hold a drafter",
                          "lacks vocab_size", "--force")
    assert (out / "config.json").read_text() == '{"name": "my-web-app"}'


def test_replacing_a_drafter_keeps_its_answer_table(tmp_path):
    """The shipped folder holds answers.npz beside the drafter: a save over it keeps that file."""
    from mlx_redrafter.draft.redrafter import random_drafter, save_drafter

    d = random_drafter(576, V, seed=0, exit_dim=64, num_draft_layers=1, draft_vocab_size=64)
    out = save_drafter(d, tmp_path / "shipped", extra_files={"MODEL_CARD.md": "old"})
    (out / "answers.npz").write_bytes(b"table")
    save_drafter(d, out, extra_files={"MODEL_CARD.md": "new"})
    assert (out / "answers.npz").read_bytes() == b"table" and (out / "MODEL_CARD.md").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shipped"]  # no temp or backup folder left


# --- output paths that cannot be written: refused before any work -----------------------------------------------

@pytest.fixture
def blocked(tmp_path):
    """tmp_path with a file `afile` and a directory `adir`."""
    (tmp_path / "afile").write_text("keep")
    (tmp_path / "adir").mkdir()
    return tmp_path


OUTPUT_CASES = {
    "answers --out DIR": (lambda t: [*CLI, "answers", "--corpus", str(make_corpus(t / "c").parent), "--out",
                                     str(t / "adir")], ["--out", "is a directory"]),
    "answers --out FILE/x": (lambda t: [*CLI, "answers", "--corpus", str(make_corpus(t / "c").parent), "--out",
                                        str(t / "afile" / "a.npz")], ["afile is a file, not a directory"]),
    "quantize SRC FILE/q": (lambda t: [*CLI, "quantize", "smollm2-135m", str(t / "afile" / "q")],
                            ["afile is a file, not a directory"]),
    "convert --out FILE/x": (lambda t: [sys.executable, "-m", "convert.from_torch",
                                        str(Path(__file__).parents[1] / "mlx_redrafter/drafters/smollm2-135m"),
                                        "--out", str(t / "afile" / "x")], ["afile is a file, not a directory"]),
    "train --run-dir FILE": (lambda t: train(t, "--run-dir", str(t / "afile")), ["--run-dir", "is a file"]),
    "train --output FILE/x": (lambda t: train(t, "-o", str(t / "afile" / "x")), ["afile is a file"]),
    "distill --corpus FILE": (lambda t: [*CLI, "distill", "--source", "text", "--corpus", str(t / "afile"),
                                         "--nice", "0"], ["--corpus", "is a file"]),
    "answers --out /dev/null": (lambda t: [*CLI, "answers", "--corpus", str(make_corpus(t / "c").parent), "--out",
                                           "/dev/null"], ["is not a regular file"]),
    "quantize SRC /proc/q": (lambda t: [*CLI, "quantize", "smollm2-135m", "/proc/q"], ["/proc/q cannot be written"]),
    "quantize SRC . --overwrite": (lambda t: [*CLI, "quantize", "smollm2-135m", ".", "--overwrite"],
                                   ["is the current directory or one above it"]),
    "quantize SRC '' --overwrite": (lambda t: [*CLI, "quantize", "smollm2-135m", "", "--overwrite"],
                                    ["is the current directory or one above it"]),
    "quantize SRC DIR --overwrite": (lambda t: (make_project(t / "proj", False),
                                                [*CLI, "quantize", "smollm2-135m", str(t / "proj"), "--overwrite"])[1],
                                     ["holds files but no model"]),
    "convert --out ''": (lambda t: [sys.executable, "-m", "convert.from_torch",
                                    str(Path(__file__).parents[1] / "mlx_redrafter/drafters/smollm2-135m"),
                                    "--out", ""], ["--out is empty"]),
    "train --run-dir /proc/run": (lambda t: train(t, "--run-dir", "/proc/run"), ["/proc/run cannot be written"]),
}


@pytest.mark.parametrize("case", list(OUTPUT_CASES))
def test_unwritable_output_paths(blocked, case):
    args, needles = OUTPUT_CASES[case]
    assert_one_line_error(run(args(blocked), blocked), *needles)
    assert (blocked / "afile").read_text() == "keep"


# --- torch tensors the converter cannot read ----------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("kind,needle", [("sparse", "layout torch.sparse_coo"), ("qint8", "is quantized"),
                                         ("meta", "on the meta device")])
def test_converter_refuses_unreadable_torch_tensors(tmp_path, kind, needle):
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 4)
    t = {"sparse": lambda: t.to_sparse(), "qint8": lambda: torch.quantize_per_tensor(t, 0.1, 0, torch.qint8),
         "meta": lambda: torch.empty(4, 4, device="meta")}[kind]()
    src = tmp_path / "ckpt"
    src.mkdir()
    torch.save({"rnn_u.weight": t}, src / "model.pt")
    proc = run([sys.executable, "-m", "convert.from_torch", str(src), "--out", str(tmp_path / "out")], tmp_path)
    assert_one_line_error(proc, "'rnn_u.weight'", needle)
    assert not (tmp_path / "out").exists()


# --- corpora: manifest entries checked when read, token ids checked when a shard is loaded ------------------------

def _set(name: str, key: str, value) -> callable:
    return lambda e: e[name].__setitem__(key, value)


MANIFEST_CASES = {
    "no sha256": (lambda e: e["shard-00001.npz"].pop("sha256"), ["shard shard-00001.npz lacks sha256"]),
    "no split": (lambda e: e["shard-00002.npz"].pop("split"), ["lacks split (one of 'train', 'heldout')"]),
    "an entry that is a string": (lambda e: e.__setitem__("shard-00001.npz", "ok"), ["is a JSON string"]),
    "an unknown split": (_set("shard-00001.npz", "split", "dev"), ["split = 'dev'"]),
    "a string for a count": (_set("shard-00001.npz", "sequences", "2"), ["sequences = '2'"]),
    "a path for a name": (lambda e: e.__setitem__("../../x.npz", e.pop("shard-00001.npz")),
                          ["'../../x.npz', not a shard file name"]),
}


@pytest.mark.parametrize("case", list(MANIFEST_CASES))
def test_malformed_corpus_manifest(tmp_path, case):
    mutate, needles = MANIFEST_CASES[case]
    root = make_corpus(tmp_path / "c", mutate).parent
    proc = run([*CLI, "answers", "--corpus", str(root), "--out", str(tmp_path / "a.npz")], tmp_path)
    assert_one_line_error(proc, "corpus manifest", *needles, "restore it")
    assert not (tmp_path / "a.npz").exists()


@pytest.mark.parametrize("command", ["answers", "features"])
def test_corpus_token_ids_outside_the_vocabulary(tmp_path, command):
    """The shard's sha256 matches its manifest entry, but it holds an id past the vocabulary: the embedding would
    read out of bounds (a native crash) and the answer table would hold it."""
    root = make_corpus(tmp_path / "c", ids=[100] * 4 + [V + 10] * 8).parent
    args = (["--out", str(tmp_path / "a.npz")] if command == "answers" else
            ["--features", str(tmp_path / "feat"), "--nice", "0"])
    proc = run([*CLI, command, "--corpus", str(root if command == "answers" else root / "smollm2-135m"), *args],
               tmp_path)
    assert_one_line_error(proc, "shard-00001.npz holds token id 49162", f"outside the vocabulary [0, {V})")
    assert not (tmp_path / "a.npz").exists()


# --- training options: every range checked before any work ---------------------------------------------------------

@pytest.mark.parametrize("option,value,needle", [
    ("--batch", "0", "--batch must be an integer from 1"), ("--steps", "0", "--steps must be an integer from 1"),
    ("--lr", "nan", "--lr must be a finite number > 0"), ("--lr", "-1", "(got -1.0)"),
    ("--draft-vocab", "-5", "--draft-vocab must be an integer from 1"), ("--layers", "-1", "--layers must be"),
    ("--dropout", "2", "--dropout must be a finite number >= 0 and <= 0.9"), ("--noise", "inf", "--noise must be"),
    ("--exit-dim", "0", "--exit-dim must be"), ("--draft-len", "0", "--draft-len must be"),
    ("--labels", "fuzzy", "--labels must be one of 'hard', 'soft'"), ("--corpus-tokens", "0", "--corpus-tokens"),
    ("--eval-prompts", "-1", "--eval-prompts must be"), ("--seed", "-3", "--seed must be"),
    ("--init-from", ".", "is not a drafter folder"),
])
def test_train_options_out_of_range(tmp_path, option, value, needle):
    out = tmp_path / "out"
    assert_one_line_error(run(train(tmp_path, "-o", str(out), option, value), tmp_path), needle)
    assert not out.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("args,needle", [
    (["distill", "--source", "text", "--shards", "-1"], "--shards must be an integer >= 1 (got -1)"),
    (["distill", "--source", "text", "--hours", "nan"], "--hours must be a finite number > 0"),
    (["distill", "--source", "text", "--hours", "-1"], "--hours must be a finite number > 0"),
    (["distill", "--source", "text", "--threads", "0"], "--threads must be an integer from 1"),
    (["features", "--threads", "0"], "--threads must be an integer from 1"),
    (["tune", "--force", "--min-speedup", "nan"], "--min-speedup must be a finite number > 0 (got nan)"),
    (["tune", "--force", "--min-speedup", "0"], "--min-speedup must be a finite number > 0 (got 0.0)"),
    (["tune", "--widths", "0"], "W = 0, L = 2 (--widths, --lengths) is not a shape"),
    (["tune", "--dtypes", "float32,int8"], "--dtypes must be one of"),
    (["tune", "--repeats", "0"], "--repeats must be an integer from 1"),
    (["features", "--shards", "0-99999999999"], "holds more than 100,000 values"),
    (["distill", "--endpoint", ""], "--endpoint is empty"),
    (["distill", "--source", "text", "--endpoint", "http://127.0.0.1:9/v1"], "--endpoint makes --source endpoint"),
    (["distill", "--endpoint", "http://127.0.0.1:99999/v1"], "a port from 1 to 65535"),
    (["distill", "--source", "text", "--nice", "1000"], "--nice must be an integer from 0 to 19"),
    (["distill", "--feature-layers", "2,x"], "--feature-layers takes comma-separated integers"),
    (["distill", "--feature-layers", "2,99"], "--feature-layers 2,99: smollm2-135m has layers 0-29"),
    (["train", "--init-from", "mlx_redrafter/drafters/smollm2-135m", "--kind", "medusa"],
     "is a redrafter drafter: leave --kind out"),
    (["eval-drafter", "--draft", "none"], "--draft none drafts nothing to measure"),
    (["eval-drafter", "--widths", "1,65"], "W = 65, L = 2 (--widths, --lengths) is not a shape"),
    (["serve", "--api-key", ""], "--api-key is empty"),
])
def test_data_and_tune_options_out_of_range(tmp_path, args, needle):
    """These used to be accepted silently (a negative count cut the plan from the end; NaN hours never stopped;
    tune measured for half a minute and stored AR)."""
    extra = ["--corpus", str(tmp_path / "c")] + ([] if "--nice" in args else ["--nice", "0"]) \
        if args[0] == "distill" else []
    args = [str(REPO / a) if a.startswith("mlx_redrafter/") else a for a in args]
    assert_one_line_error(run([*CLI, *args, *extra], tmp_path), needle)
    assert not (tmp_path / "c").exists() and not (tmp_path / "no-tuned.json").exists()


def test_features_of_shards_the_corpus_does_not_hold(tmp_path):
    corpus = make_corpus(tmp_path / "c")
    p = run([*CLI, "features", "--corpus", str(corpus), "--features", str(tmp_path / "feat"), "--nice", "0",
             "--shards", "99999"], tmp_path)
    assert_one_line_error(p, "--shards 99999: no shard of")
    assert not (tmp_path / "feat").exists()
