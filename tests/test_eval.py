"""`cpkv-jax eval` and the task sets of cpkv_jax/eval.py: held-out sets are deterministic and disjoint
from what the training stream draws, recall queries sit beyond index_topk, and the verb prints one JSON
object with the metric (and the draft acceptance under speculative decoding)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from cpkv_jax import eval as tasks
from cpkv_jax.cli import main
from models.weights import TINY_DIR, load_checkpoint


@pytest.fixture(scope="module")
def tt():
    return tasks.TaskTokenizer.from_dir(TINY_DIR)


@pytest.fixture(scope="module")
def train():
    """scripts/train_tiny.py as a module."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("train_tiny", Path(__file__).parent.parent / "scripts" / "train_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sets_are_deterministic_held_out_and_far(tt):
    a = tasks.eval_set(tt, "recall", 20, index_topk=16)
    b = tasks.eval_set(tt, "recall", 20, index_topk=16)
    assert [e.prompt for e in a] == [e.prompt for e in b]
    for e in a:
        key = e.text.rsplit("| ", 1)[1].rstrip(tasks.FORMAT["recall_sep"])
        # the queried pair's value starts more than index_topk tokens before the end of the prompt
        ctx = tt.encode(e.text.rsplit(" |", 1)[0])
        where = tt.encode(e.text.split(f" {key}", 1)[0]) if not e.text.startswith(f" {key}") else []
        assert len(ctx) - len(where) > 16, e.text
        assert tt.decode(e.answer).isdigit() and len(e.answer) == 3
    arith = tasks.eval_set(tt, "arith", 50, index_topk=16)
    for e in arith:
        a_, op, b_ = e.text.split("\n")[0].split()
        assert tasks.arith_held_out(int(a_), int(b_), op)
        c = int(a_) + int(b_) if op == "+" else int(a_) - int(b_)
        assert tasks.arith_answer(e.answer_text) == c == tasks.arith_value(e.text)
        assert len(e.prompt) == 9 and len(e.answer) == 60       # one token per digit and sign, every problem
    rng = random.Random(0)
    for _ in range(300):   # the training stream never draws a held-out problem
        p, _ = tasks.arith_problem(rng, held_out=False)
        a_, op, b_ = p.split("\n")[0].split()
        assert not tasks.arith_held_out(int(a_), int(b_), op)


@pytest.mark.parametrize("op", "+-")
def test_arith_working_reads_the_line_above(op):
    """Each line of the "columns" working: the step on the last digits of the state above it (the
    prompt for the first line) and its carry slot, then the state shifted by one column; the last
    state's carry and register are the result, which the `#### ` line holds."""
    rng = random.Random(op)
    for _ in range(300):
        a, b = sorted((rng.randrange(10, 1000), rng.randrange(10, 1000)), reverse=op == "-")
        lines = tasks.arith_working(a, b, op).split("\n")
        state = f"{a:03d} {op} {b:03d}"
        for line in lines:
            step, new = line.split(" ", 1)
            assert len(new) == len(state) == 9
            x, y, c = step[0], step[2], step[4]
            assert (x, y, c) == (state[2], state[8], "0" if state[5] == " " else state[5])
            assert step.count(op) == 2 and step[5] == "="
            v = int(x) + int(y) + int(c) if op == "+" else int(x) - int(y) - int(c)
            assert int(step[6]) * (10 if op == "+" else -10) + int(step[7]) == v
            assert new == f"{step[7]}{state[:2]} {op}{step[6]}{tasks.ARITH_FILL}{state[6:8]}"
            state = new
        result = a + b if op == "+" else a - b
        assert state[5] + state[:3] == f"{result:04d}"
        assert tasks.arith_answer(tasks.arith_working(a, b, op) + f"\n#### {result:04d}") == result
    assert tasks.arith_answer("7+5+0=12\n#### 12x") is None and tasks.arith_answer("no line") is None


@pytest.mark.parametrize("task,extra,key", [("arith", [], "accuracy"), ("text", [], "perplexity"),
                                            ("text", ["--speculative", "nextn", "--num-draft-tokens", "2"],
                                             "acceptance_length")])
def test_eval_verb_prints_one_json_object(capsys, task, extra, key):
    rc = main(["eval", "--model", "tiny", "--task", task, "--n", "4", "--json", "--page-size", "16",
               "--kv-pages", "128", *extra])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["task"] == task and out["n"] == 4 and key in out
    if key == "accuracy":
        assert 0 <= out["accuracy"] <= 1
    if key == "perplexity":
        assert 1 < out["perplexity"] < 768
    if key == "acceptance_length":
        assert 1 <= out["acceptance_length"] <= 3


def test_eval_verb_rejects_a_bad_task():
    with pytest.raises(SystemExit):
        main(["eval", "--task", "gsm8k"])


def test_training_forward_chains_the_mtp_layer_as_the_engine_drafts(monkeypatch, train):
    """scripts/train_tiny.py trains the MTP layer chained on its own output; its training forward gives,
    for a request's tokens and drafts, the engine's three draft proposals (cpkv_jax/spec.py: the draft
    cache holds depth-1 keys up to where drafting started, one key per chain step after it)."""
    import importlib.util
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import numpy as np

    from cpkv_jax import spec
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams
    from models.weights import load_model

    seen = []
    propose = spec.SpecDecoder._propose

    def record(self, chunks, live, dlogits, x_last):
        propose(self, chunks, live, dlogits, x_last)
        if not seen:
            seen.extend((list(chunks[i].req.tokens()), list(chunks[i].req.drafts)) for i in live)

    monkeypatch.setattr(spec.SpecDecoder, "_propose", record)
    eng = Engine(str(TINY_DIR), EngineConfig(page_size=16, kv_pages=64, speculative="nextn", num_draft_tokens=3,
                                             index_dtype="same"))
    rng = np.random.default_rng(0)
    eng.generate([rng.integers(3, 700, n).tolist() for n in (40, 77)], SamplingParams(max_new_tokens=2))
    model = load_model(str(TINY_DIR))
    forward = train.build_forward(model.cfg)
    # causal: padding at the end changes no earlier position (one compilation for both)
    mtp_logits = jax.jit(lambda toks: forward(model, toks, jnp.bool_(True), 3)[1])
    assert len(seen) == 2
    for tokens, drafts in seen:
        seq = tokens + drafts[:2]
        mtp = mtp_logits(jnp.asarray([seq + [0] * (96 - len(seq))]))
        L = len(tokens)
        assert [int(jnp.argmax(mtp[d][0, L - 2 + d])) for d in range(3)] == drafts


@pytest.mark.parametrize("own", [False, True])
def test_mtp_stage_keeps_the_main_model_bit_for_bit(tmp_path, own, train):
    """scripts/train_tiny.py --stage mtp (a few sequences and steps): only the MTP layer changes; every
    other part of the checkpoint is the initial one's, file for file and array for array, and the
    stage's arguments are recorded beside the main stage's record in training.json (with the record of
    the stage that trained the layer it started from). own: the layer gets its own shared_head.head and
    embed_tokens, started as copies of the main model's, trained, saved and loaded back as its own."""
    import importlib.util
    from pathlib import Path

    from models.weights import MANIFEST

    out = tmp_path / "tiny-mtp"
    assert train.main(["--stage", "mtp", "--init", str(TINY_DIR), "--out", str(out), "--draft-seqs", "6",
                       "--draft-val", "2", "--draft-steps", "2", "--draft-warmup", "1", "--draft-batch", "6",
                       "--draft-task-seqs", "4",
                       "--draft-eval-every", "2", "--draft-eval-windows", "0"]
                      + (["--draft-own-head", "--draft-own-embed"] if own else [])) == 0
    before, after = (json.loads((d / MANIFEST).read_text())["digests"] for d in (TINY_DIR, out))
    assert before.keys() == after.keys()
    assert all(after[k] == before[k] for k in after if k != "mtp") and after["mtp"] != before["mtp"]
    assert train.main_model_identical(TINY_DIR, out)
    meta, init_meta = (json.loads((d / "training.json").read_text()) for d in (out, TINY_DIR))
    assert meta["args"] == init_meta["args"] and meta["history"] == init_meta["history"]
    assert meta["mtp_stage"]["args"]["draft_steps"] == 2
    assert meta["mtp_stage"]["init_mtp_stage"] == init_meta["mtp_stage"]
    trained, base = load_checkpoint(out), load_checkpoint(TINY_DIR)
    assert (trained.mtp.head is not None, trained.mtp.embed_tokens is not None) == (own, own)
    if own:   # trained away from the copies they started as; the main model's own stay
        assert not np.array_equal(np.asarray(trained.mtp.head.kernel[...]), np.asarray(base.lm_head.kernel[...]))
        assert not np.array_equal(np.asarray(trained.mtp.embed_tokens[...]), np.asarray(base.embed_tokens[...]))
        assert np.array_equal(np.asarray(trained.lm_head.kernel[...]), np.asarray(base.lm_head.kernel[...]))


def test_mtp_stage_prompts_come_from_the_text_asked_for(tt, train):
    """--draft-text: "train" draws the prompts from the training text at the offsets it always drew
    (the shipped stage's data), "other" from standard-library modules outside the corpus (so never the
    held-out text), "both" from each in turn."""
    train_text, held = tasks.corpus_split()
    train_ids = np.asarray(tt.encode(train_text), np.int32)
    other_ids = np.asarray(tt.encode(tasks.corpus_text(train.DRAFT_PROMPT_MODULES)), np.int32)
    assert not set(train.DRAFT_PROMPT_MODULES) & set(tasks.CORPUS_MODULES)
    assert len(other_ids) > 100_000

    def inside(prompt, ids):
        p = np.asarray(prompt, np.int32)
        return any(np.array_equal(ids[o:o + len(p)], p) for o in np.flatnonzero(ids == p[0]))

    starts = np.random.default_rng([0, 41]).integers(0, len(train_ids) - 48, 6)
    got = train.draft_prompts(tt, train_ids, "train", 6, 48, np.random.default_rng([0, 41]))
    assert got == [train_ids[o:o + 48].tolist() for o in starts]
    other = train.draft_prompts(tt, train_ids, "other", 4, 48, np.random.default_rng(1))
    assert all(len(p) == 48 and inside(p, other_ids) and not inside(p, train_ids) for p in other)
    both = train.draft_prompts(tt, train_ids, "both", 4, 48, np.random.default_rng(2))
    assert [inside(p, train_ids) for p in both] == [True, False, True, False]
    assert all(inside(p, other_ids) for p in both[1::2])
