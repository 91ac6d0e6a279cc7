"""Task evaluation through the engine: the generated task sets the trained `tiny` model learned
(scripts/train_tiny.py builds its training data from the same generators), greedy exact-match accuracy
and held-out text perplexity, measured with Engine.generate under any EngineConfig (cp, HiCache,
speculative decoding, index dtype).

Tasks (token-id prompts built with the checkpoint's tokenizer; no bos, answers end with eos):
  recall  `` path123 node456 ... | path`` -> the queried key's 3-digit value; the queried pair sits more
          than `index_topk` + 8 tokens before the query, so only the indexer's selection can reach it.
  arith   2-3 digit addition and subtraction (a >= b, operands zero-padded to 3 digits), GSM8K style:
          worked column by column, least significant first, then the ``#### `` line with the result
          (4 digits, zero-padded); scored on the number of the ``#### `` line (exact match of its value).
          ``347 + 085\\n`` ->
              7+5+0=12 234 +1~08
              4+8+1=13 323 +1~~0
              3+0+1=04 432 +0~~~
              #### 0432
          Each line: the column's step ``x{op}y{op}c=CD`` (its digits and the carry / borrow c coming in;
          the carry / borrow C going out and its digit D: ``4-8-0=16`` is 14 - 8 - 0 = 6, borrow 1), then
          the problem as it stands, laid out as the prompt: the first number's register (the result's
          digits so far, then its digits still to add), the sign, the carry in the prompt's space, the
          second number's digits still to add (``~`` where used up). Every token of it is a copy from a
          fixed distance back, or a sum of digits at fixed distances: what a 4-layer model learns
          (see arith_working).
  text    held-out Python standard-library source (the text corpus): perplexity of each window
          through prompt_logprobs; with speculative decoding also the draft acceptance length of
          greedy continuations."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

TASKS = ("recall", "arith", "text")
# The task formats (the shipped model's; a checkpoint's training.json may name others, which
# TaskTokenizer.from_dir applies): recall pairs `` key417`` (no separator: the value follows the key);
# arithmetic "columns" (the working above, then ``#### `` and the zero-padded result), "steps" (the
# column steps only: ``7+5+0=12 4+8+1=13 3+0+1=04\n#### 0432``), "padded" (``347 + 085\n#### 0432``,
# no working) or "plain" (``347 + 85\n#### 432``).
FORMAT = {"recall_sep": "", "arith": "columns"}
ARITH_FORMATS = ("columns", "steps", "padded", "plain")
ARITH_FILL = "~"                # a used-up digit of the second number in the "columns" working
EVAL_SEED = 1_000_003          # held-out sets: seeds the training stream never uses (it counts from 0)

# The text corpus: these standard-library modules, concatenated in this order (a public source shipped
# with every Python). The last TEXT_EVAL_FRACTION of the characters is held out for perplexity.
CORPUS_MODULES = ("argparse.py", "dataclasses.py", "functools.py", "textwrap.py", "json/decoder.py",
                  "json/encoder.py", "pathlib/_local.py", "pathlib/_abc.py", "shutil.py", "string.py", "heapq.py",
                  "bisect.py", "fractions.py", "statistics.py", "calendar.py", "difflib.py", "ast.py", "csv.py",
                  "configparser.py", "logging/__init__.py", "random.py", "copy.py", "enum.py", "typing.py",
                  "contextlib.py", "inspect.py", "tokenize.py", "subprocess.py", "tempfile.py", "zipfile/__init__.py")
TEXT_EVAL_FRACTION = 0.05


def corpus_text(modules=CORPUS_MODULES) -> str:
    """The concatenated corpus, or these standard-library modules (those missing from this Python are
    skipped)."""
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in modules:
        f = root / name
        if f.exists():
            parts.append(f.read_text(encoding="utf-8"))
    return "\n\n".join(parts)


def corpus_split(text: str | None = None) -> tuple[str, str]:
    text = corpus_text() if text is None else text
    cut = int(len(text) * (1 - TEXT_EVAL_FRACTION))
    cut = text.index("\n", cut) + 1
    return text[:cut], text[cut:]


# ---- task generators ----------------------------------------------------------------------------

class TaskTokenizer:
    """The few things the task generators need from a tokenizers.Tokenizer: encode pieces without
    special tokens, eos, and the recall keys (single-token lowercase words of the vocabulary)."""

    def __init__(self, tok, eos_id: int):
        self.tok = tok
        self.eos = eos_id
        keys = []
        for word, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
            w = word[1:] if word.startswith("Ġ") else None
            if w and len(w) >= 3 and w.isascii() and w.isalpha() and w.islower():
                if self.encode(f" {w}:") == [i] + self.encode(":"):
                    keys.append(w)
        self.keys = keys

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    @classmethod
    def from_dir(cls, path) -> "TaskTokenizer":
        from tokenizers import Tokenizer
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        eos = cfg["eos_token_id"]
        meta = path / "training.json"
        if meta.exists():
            FORMAT.update(json.loads(meta.read_text()).get("format", {}))
        return cls(Tokenizer.from_file(str(path / "tokenizer.json")), eos[0] if isinstance(eos, list) else eos)


@dataclasses.dataclass
class Example:
    prompt: list[int]
    answer: list[int]        # the expected generated tokens, eos excluded
    text: str                # prompt text, for display
    answer_text: str


def recall_example(tt: TaskTokenizer, rng: random.Random, *, n_pairs: int, min_distance: int = 0,
                   n_queries: int = 1) -> tuple[list[int], list[tuple[list[int], list[int]]], str]:
    """(context ids, [(query ids, answer ids + eos, context positions of the answer's value tokens)]
    * n_queries, context text). Queried pairs are at least `min_distance` tokens before the end of the
    context (where the first query starts)."""
    keys = rng.sample(tt.keys, n_pairs)
    vals = [f"{rng.randrange(1000):03d}" for _ in keys]
    ids, starts, vpos = [], [], []
    for k, v in zip(keys, vals):
        starts.append(len(ids))
        ids += tt.encode(f" {k}{FORMAT['recall_sep']}")
        vpos.append(list(range(len(ids), len(ids) + len(tt.encode(v)))))
        ids += tt.encode(v)
    far = [i for i, s in enumerate(starts) if len(ids) - s > min_distance] or [0]
    queries = []
    for q in range(n_queries):
        i = rng.choice(far) if q == 0 else rng.randrange(n_pairs)
        queries.append((tt.encode(f" | {keys[i]}{FORMAT['recall_sep']}"), tt.encode(vals[i]) + [tt.eos], vpos[i]))
    text = "".join(f" {k}{FORMAT['recall_sep']}{v}" for k, v in zip(keys, vals))
    return ids, queries, text


def arith_held_out(a: int, b: int, op: str) -> bool:
    """The held-out tenth of the problem space (the training stream skips it)."""
    return (a * 7919 + b * 104729 + (op == "-") * 13) % 10 == 0


def arith_working(a: int, b: int, op: str, fmt: str = "columns") -> str:
    """Column-wise working of a {op} b, least significant column first, one line per column (3 columns):
    the step ``x{op}y{op}c=CD`` (x, y: the column's digits; c: the carry / borrow in; C: out; D: the
    column's digit), then (format "columns") the problem as it stands after the step, in the prompt's
    layout (``AAA +XBBB``, 8 tokens): the first number's register shifted right with D coming in on the
    left (after 3 lines: the result's digits), the sign, the carry C where the prompt has its space
    (a space: no carry), the second number shifted right with ARITH_FILL coming in. So each line reads
    the line above (the prompt for the first) at fixed distances: the next step's x and y are the last
    digits of the two numbers, c the carry slot; the result is the last line's carry and register.
    Format "steps": the steps only, space separated."""
    A, B, X = list(f"{a:03d}"), list(f"{b:03d}"), " "
    lines = []
    for _ in range(3):
        x, y, c = int(A[2]), int(B[2]), 0 if X == " " else int(X)
        v = x + y + c if op == "+" else x - y - c
        out, d = (v // 10, v % 10) if op == "+" else ((1, v + 10) if v < 0 else (0, v))
        A, B, X = [str(d), A[0], A[1]], [ARITH_FILL, B[0], B[1]], str(out)
        step = f"{x}{op}{y}{op}{c}={out}{d}"
        lines.append(f"{step} {''.join(A)} {op}{X}{''.join(B)}" if fmt == "columns" else step)
    return ("\n" if fmt == "columns" else " ").join(lines)


def arith_problem(rng: random.Random, *, held_out: bool) -> tuple[str, str]:
    """(prompt, answer) text of one problem in FORMAT["arith"]; a >= b for subtraction."""
    while True:
        a = rng.randrange(10, 1000)
        b = rng.randrange(10, 1000)
        op = rng.choice("+-")
        if op == "-" and b > a:
            a, b = b, a
        if arith_held_out(a, b, op) == held_out:
            c = a + b if op == "+" else a - b
            fmt = FORMAT["arith"]
            if fmt in ("columns", "steps"):
                return f"{a:03d} {op} {b:03d}\n", f"{arith_working(a, b, op, fmt)}\n#### {c:04d}"
            if fmt == "padded":
                return f"{a:03d} {op} {b:03d}\n#### ", f"{c:04d}"
            if fmt == "plain":
                return f"{a} {op} {b}\n#### ", str(c)
            raise ValueError(f"arith format must be one of {ARITH_FORMATS}, got {fmt!r}")


def arith_value(problem: str) -> int:
    """The true result of a problem's prompt text (``347 + 085\n...``)."""
    a, op, b = problem.split("\n")[0].split()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def arith_answer(text: str) -> int | None:
    """The number of the ``#### `` line of a generated answer (prompt text included or not), or None."""
    line = ("\n" + text).rsplit("#### ", 1)
    if len(line) < 2:
        return None
    digits = line[1].split("\n")[0].strip()
    return int(digits) if digits.isdigit() else None


def arith_example(tt: TaskTokenizer, rng: random.Random, *, held_out: bool) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids + eos)."""
    p, a = arith_problem(rng, held_out=held_out)
    return tt.encode(p), tt.encode(a) + [tt.eos]


def eval_set(tt: TaskTokenizer, task: str, n: int, *, index_topk: int, seed: int = EVAL_SEED,
             n_pairs=(14, 20)) -> list[Example]:
    rng = random.Random(f"{task}:{seed}")
    out = []
    for _ in range(n):
        if task == "recall":
            ctx, [(q, ans, _)], text = recall_example(tt, rng, n_pairs=rng.randint(*n_pairs),
                                                   min_distance=index_topk + 8)
            prompt = ctx + q
            out.append(Example(prompt, ans[:-1], text + tt.decode(q), tt.decode(ans[:-1])))
        elif task == "arith":
            p, a = arith_problem(rng, held_out=True)
            out.append(Example(tt.encode(p), tt.encode(a), p, a))
        else:
            raise ValueError(f"no generated set for task {task!r}")
    return out


def text_windows(tt: TaskTokenizer, n: int, length: int, seed: int = EVAL_SEED) -> list[list[int]]:
    """n windows of `length` tokens from the held-out corpus text, evenly spaced."""
    _, held = corpus_split()
    ids = tt.encode(held)
    if len(ids) < length + 1:
        raise ValueError(f"the held-out corpus has {len(ids)} tokens, fewer than one window of {length}")
    step = max((len(ids) - length) // max(n, 1), 1)
    return [ids[i * step:i * step + length] for i in range(n) if i * step + length <= len(ids)]


# ---- measuring through the engine ---------------------------------------------------------------

def _model_dir(model) -> Path:
    from models.weights import resolve_model_dir
    return resolve_model_dir(model)


def run_eval(model, task: str, n: int = 100, config=None, *, batch: int = 32, text_len: int = 96,
             prompt_len: int = 48, new_tokens: int = 32, engine=None, continuations: bool | None = None) -> dict:
    """Accuracy (recall, arith) or perplexity (text) of `model` (a name or checkpoint dir) through the
    engine (`engine`, or one built with `config`), greedy. Returns a dict: task, n, accuracy (and
    correct; arith: the value of the answer's `#### ` line; `exact`: the whole answer, working included,
    token for token) or perplexity, acceptance_length / accept_rate with speculative decoding (over this call's generations), and the answers
    (token ids in set order; for text the greedy continuations of the windows' first prompt_len tokens,
    generated when `continuations` or, by default, with speculative decoding)."""
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams

    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    path = _model_dir(model)
    tt = TaskTokenizer.from_dir(path)
    cfg = json.loads((path / "config.json").read_text())
    eng = engine or Engine(str(path), config or EngineConfig())
    result: dict = {"model": str(model), "task": task}
    before = _spec_counts(eng)       # acceptance over this call's generations only (an engine may be reused)
    if task in ("recall", "arith"):
        exs = eval_set(tt, task, n, index_topk=cfg["index_topk"])
        params = SamplingParams(max_new_tokens=max(len(e.answer) for e in exs) + 1)
        answers = []
        for i in range(0, len(exs), batch):
            outs = eng.generate([e.prompt for e in exs[i:i + batch]], params)
            answers += [[t for t in o.token_ids if t != tt.eos] for o in outs]
        exact = sum(a == e.answer for a, e in zip(answers, exs))
        if task == "arith":
            # the number of the `#### ` line (the working before it may differ)
            correct = sum(arith_answer(tt.decode(a)) == arith_value(e.text) for a, e in zip(answers, exs))
        else:
            correct = exact
        result.update(n=len(exs), accuracy=correct / len(exs), correct=correct, exact=exact / len(exs),
                      answers=answers, prompt_tokens=sum(len(e.prompt) for e in exs) / len(exs))
    else:
        windows = text_windows(tt, n, text_len)
        nll, count = 0.0, 0
        for i in range(0, len(windows), batch):
            outs = eng.generate(windows[i:i + batch], SamplingParams(max_new_tokens=1, prompt_logprobs=True))
            for o in outs:
                lps = [lp for lp in o.prompt_logprobs if lp is not None]
                nll -= sum(lps)
                count += len(lps)
        result.update(n=len(windows), perplexity=math.exp(nll / count), tokens=count)
        if continuations or (continuations is None and eng.config.speculative):
            # greedy continuations of held-out prompts: the draft acceptance (the perplexity pass above
            # runs no draft: prompt_logprobs only prefills)
            prompts = [w[:prompt_len] for w in windows]
            answers = []
            for i in range(0, len(prompts), batch):
                outs = eng.generate(prompts[i:i + batch], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
                answers += [o.token_ids for o in outs]
            result["answers"] = answers
    after = _spec_counts(eng)
    if before is not None and after is not None:
        acc, rounds, drafts = (a - b for a, b in zip(after, before))
        if rounds:
            result.update(acceptance_length=(acc + rounds) / rounds, accept_rate=acc / drafts)
    else:
        stats = eng.stats()
        for k in ("spec_acceptance_length", "spec_accept_rate"):
            if k in stats:
                result[k.removeprefix("spec_")] = stats[k]
    return result


def _spec_counts(eng):
    """(accepted drafts, request rounds, drafts) of an engine's speculative decoding so far, or None."""
    m = getattr(eng, "metrics", None)
    if not isinstance(m, dict) or "spec_request_rounds" not in m:
        return None
    return m["spec_accepted"], m["spec_request_rounds"], m["spec_drafts"]
