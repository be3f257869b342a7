"""What choosing a drafter per step can reach: the members replayed over plain greedy output.

Greedy speculative decoding emits plain decoding's tokens whatever the drafter, so one plain pass
per prompt fixes what every drafter would propose at every position and how much of it would be
accepted:

- `suffix` and `ngram`: their real drafters (`SuffixDrafter` with a cache that fills prompt after
  prompt as in `specdec eval`, `NgramDrafter`) asked at each position of the plain output;
- the draft model: one teacher-forced forward over prompt + output gives its greedy token and
  probability at each position; a chain of k from position i is accepted for as long as those
  tokens equal the output (min(k, run)), and with `:pP` it stops at the first probability below P.

What a step costs is measured on the same compiled target and draft (`tree_cost.decode_cost`): a
verification of n rows (a probe drafter proposing n - 1 tokens), the draft model's drafting per
step at each k, the suffix drafter's own time per call; the prefill is each prompt's measured
time to first token. Each policy is then replayed on these figures, in tokens/s with the prefill
as `specdec eval` reports them:

  suffix, ngram@k, draft@k         one member alone (k fixed, the best k shown)
  hybrid@k, suffix>draft@k         fixed order: the cheap member's proposal if it has one, else the draft
  suffix cut                       the suffix tree cut as `specdec.tuning.costs` cuts it
  composite@k                      the CompositeDrafter's rule beside the cut suffix (its records and
                                   gate kept across prompts, as in `specdec eval`)
  oracle                           the fastest sequence of steps, each verifying one member's proposal
                                   (any cut of it; shortest path over positions, knowing every acceptance
                                   in advance): no per-step choice among these members can beat it
  oracle+merged, oracle M          the same with trees that join the suffix proposal and a draft chain,
                                   and with only the members M

The replay approximates the real run in three ways: the draft's teacher-forced forward rounds like a
prefill, not like its incremental steps (an argmax may differ where two tokens tie in bf16); a tree
costs what a chain of as many rows costs; a draft that skipped steps catches up at the cost of an
ordinary step. `specdec eval` stays the figure BENCHMARKS.md reports; this bounds what a better
choice rule could add.

    python benchmarks/composite_replay.py --dataset humaneval --limit 20 --draft-vocab 32768 --out runs/replay_he
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import runtime
from specdec.drafter import Drafter, DraftTree
from specdec.drafters.composite import AskGate, MemberRecord
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixCache, SuffixConfig, SuffixDrafter
from specdec.evaluation.prompts import encode, eos_ids, load_prompts
from specdec.generate import generate
from specdec.tuning.costs import BlockCosts, NodeCalibration, best_cut
from specdec.tuning.tree_cost import decode_cost, warm_up

KS = range(1, 8)  # draft lengths replayed (the compiled 8-row program holds 7 drafts and the root)
MEMBERS = ("suffix", "ngram", "draft")


class ProbeDrafter(Drafter):
    """Proposes k copies of each row's last token: a chain whose verification is timed (its
    acceptance does not matter)."""

    name = "probe"

    def propose(self, seqs: list[torch.Tensor], k: int, rows: list[int]) -> DraftTree:
        tokens = torch.stack([s[-1:].repeat(k) for s in seqs])  # (B, k)
        lens = torch.tensor([k if b in rows else 0 for b in range(len(seqs))])
        return DraftTree.chain(tokens, lens)


def node_matches(tree: DraftTree, truth: list[int]) -> list[bool]:
    """Per node of row 0: whether its path spells the start of `truth` (it would be accepted)."""
    n = int(tree.lens[0])
    depth = [0] * n
    ok = [False] * n
    for i in range(n):
        p = int(tree.parents[0, i])
        depth[i] = 1 if p < 0 else depth[p] + 1
        ok[i] = (p < 0 or ok[p]) and depth[i] <= len(truth) and int(tree.tokens[0, i]) == truth[depth[i] - 1]
    return ok


def depths(tree: DraftTree) -> list[int]:
    """Per node of row 0: its depth (1 = a child of the root)."""
    out: list[int] = []
    for i in range(int(tree.lens[0])):
        p = int(tree.parents[0, i])
        out.append(1 if p < 0 else out[p] + 1)
    return out


def tree_accepted(tree: DraftTree, truth: list[int], nodes: int | None = None) -> int:
    """Row 0's accepted length: the depth of the deepest of its first `nodes` nodes (default: all)
    whose path spells the start of `truth` (a matching node's ancestors match: its depth is the count)."""
    return max((d for d, good in zip(depths(tree), node_matches(tree, truth)[:nodes]) if good), default=0)


def runs_of(pred: list[int], out: list[int]) -> list[int]:
    """run[i]: how many of pred[i], pred[i+1], ... equal out[i], out[i+1], ... in a row."""
    run = [0] * (len(out) + 1)
    for i in range(len(out) - 1, -1, -1):
        run[i] = run[i + 1] + 1 if pred[i] == out[i] else 0
    return run[:-1]


def below(probs: list[float], p: float) -> list[int]:
    """stop[i]: how many of probs[i], probs[i+1], ... are >= p in a row (a `:pP` chain's length)."""
    stop = [0] * (len(probs) + 1)
    for i in range(len(probs) - 1, -1, -1):
        stop[i] = stop[i + 1] + 1 if probs[i] >= p else 0
    return stop[:-1]


def plain_pass(target, draft, prompts: list[tuple[str, torch.Tensor]], max_new: int, eos: list[int]) -> list[dict]:
    """Per prompt (id, 1-D ids): its plain output, time to first token, and the draft's teacher-forced guesses."""
    records = []
    for pid, ids in prompts:
        res = generate(target, [ids], max_new_tokens=max_new, eos_token_id=eos or None)
        out = res.sequences[0][ids.numel():].tolist()
        full = torch.cat([ids, torch.tensor(out, dtype=torch.long)])
        with torch.no_grad():
            logits = draft(full[None], torch.arange(full.numel())[None], None).logits[0].float()  # (T, Vd)
        probs, cols = logits[ids.numel() - 1:-1].softmax(-1).max(-1)  # (N,): the draft's guess for out[i]
        pred = draft.output_ids[cols] if getattr(draft, "output_ids", None) is not None else cols
        records.append({"id": pid, "ids": ids.tolist(), "out": out, "ttft_s": res.stats.ttft_s,
                        "wall_s": res.stats.wall_s, "draft_run": runs_of(pred.tolist(), out),
                        "draft_p": probs.tolist()})
        print(f"{pid}: {len(out)} tokens, plain {len(out) / res.stats.wall_s:.1f} tok/s", flush=True)
    return records


def replay_drafters(records: list[dict], config: SuffixConfig) -> None:
    """Add to each record what `suffix` (its cache filling prompt after prompt, as in `specdec eval`) and
    `ngram` propose at each position of its output: nodes, their path probabilities, what each prefix
    of the suffix tree (its best n nodes) gets accepted, and the suffix drafter's seconds per call."""
    suffix = SuffixDrafter(config, cache=SuffixCache())
    ngram = NgramDrafter()
    for rec in records:
        ids, out = torch.tensor(rec["ids"]), rec["out"]
        full = torch.cat([ids, torch.tensor(out, dtype=torch.long)])
        suffix.begin([ids], full.numel(), None)
        rec.update(suffix=[], suffix_p=[], suffix_acc=[], suffix_ok=[], suffix_depth=[], ngram=[], ngram_acc=[])
        spent = 0.0
        for i in range(len(out)):
            seq = full[:ids.numel() + i]
            start = time.perf_counter()
            tree = suffix.propose([seq], 7, [0])
            spent += time.perf_counter() - start
            n = int(tree.lens[0])
            rec["suffix"].append(n)
            rec["suffix_p"].append(tree.scores[0, :n].tolist())
            rec["suffix_acc"].append([tree_accepted(tree, out[i:], m) for m in range(n + 1)])
            rec["suffix_ok"].append(node_matches(tree, out[i:]))
            rec["suffix_depth"].append(depths(tree))
            chain = ngram.propose([seq], 7, [0])
            rec["ngram"].append(int(chain.lens[0]))
            rec["ngram_acc"].append(tree_accepted(chain, out[i:]))
        rec["suffix_s"] = spent / max(len(out), 1)


def measure_costs(target, draft, rows: list[torch.Tensor], tokens: int) -> dict:
    """Seconds per step: verification of n rows (probe chains), and the draft model's drafting at each k."""
    costs = {"verify": {}, "draft": {}}
    for n in range(1, 9):
        probe = None if n == 1 else ProbeDrafter()
        warm_up(target, rows, tokens, probe)
        step, _, _ = decode_cost(target, rows, tokens, probe, num_draft_tokens=max(n - 1, 1))
        costs["verify"][n] = step
        print(f"verify {n} rows: {step * 1e3:.1f} ms", flush=True)
    for k in KS:
        warm_up(target, rows, tokens, draft)
        step, drafting, per = decode_cost(target, rows, tokens, draft, num_draft_tokens=k)
        costs["draft"][k] = drafting
        print(f"draft k={k}: {drafting * 1e3:.1f} ms drafting a step, {per:.2f} tokens a step", flush=True)
    return costs


class Replay:
    """Policies replayed on one prompt's member records and the measured costs. A step at position i
    (i tokens emitted) costs seconds and emits tokens (1 + accepted, at most what is left)."""

    def __init__(self, rec: dict, costs: dict, pmin: float | None = None) -> None:
        self.rec, self.N = rec, len(rec["out"])
        self.verify = {int(n): s for n, s in costs["verify"].items()}
        self.costs = BlockCosts()  # the same, as the drafters' cut reads them
        for n, seconds in self.verify.items():
            self.costs.observe(n, seconds)
        self.draft_s = {int(k): s for k, s in costs["draft"].items()}
        self.suffix_s = rec["suffix_s"]
        self.stop = below(rec["draft_p"], pmin) if pmin else [self.N] * self.N

    def rows_cost(self, n: int) -> float:
        """A verification of n rows (past 8, scaled from the 8-row block)."""
        return self.verify[min(n, 8)] * max(1.0, n / 8)

    def plain(self) -> tuple[float, int]:
        return self.verify[1], 1

    def suffix(self, i: int, n: int | None = None) -> tuple[float, int] | None:
        """(seconds, tokens) of verifying the best n nodes of the suffix tree (default: all of them)."""
        n = self.rec["suffix"][i] if n is None else n
        return (self.rows_cost(n + 1) + self.suffix_s, min(1 + self.rec["suffix_acc"][i][n], self.N - i)) if n else None

    def ngram(self, i: int, k: int) -> tuple[float, int] | None:
        m = min(k, self.rec["ngram"][i])
        return (self.verify[m + 1], min(1 + min(m, self.rec["ngram_acc"][i]), self.N - i)) if m else None

    def draft(self, i: int, k: int) -> tuple[float, int, float]:
        """(seconds, tokens, the draft's own estimate) of a chain of at most k (fewer under :pP: it
        stops at the first probability below P, having run the forward that found it)."""
        m = min(k, self.stop[i])
        forwards = max(m if m == k else m + 1, 1)
        p, raw = 1.0, 0.0
        for q in self.rec["draft_p"][i:i + m]:
            p *= q
            raw += p
        tokens = min(1 + min(m, self.rec["draft_run"][i]), self.N - i)
        return self.rows_cost(m + 1) + self.draft_s[forwards], tokens, raw

    def actions(self, i: int, merged: bool = False):
        """(member, seconds, tokens) of every step possible at position i."""
        yield ("plain", *self.plain())
        sfx = self.suffix(i)
        for n in range(1, self.rec["suffix"][i] + 1):  # the oracle may verify any best-n part of the tree
            yield ("suffix", *self.suffix(i, n))
        for k in KS:
            ng = self.ngram(i, k)
            if ng and self.rec["ngram"][i] >= k:
                yield ("ngram", *ng)
            s, t, _ = self.draft(i, k)
            yield "draft", s, t
            if merged and sfx:  # one tree: the suffix proposal beside the chain
                n = self.rec["suffix"][i] + min(k, self.stop[i]) + 1
                yield "merged", s - self.rows_cost(min(k, self.stop[i]) + 1) + self.rows_cost(n) + self.suffix_s, \
                    max(t, sfx[1])

    def oracle(self, merged: bool = False, members: tuple[str, ...] = MEMBERS) -> tuple[float, dict]:
        """The fastest decoding of positions 1..N (token 0 is the prefill's), knowing every acceptance, with
        `members` (and plain steps): (seconds, steps per member)."""
        allowed = {"plain", "merged", *members}
        best = [0.0] * (self.N + 1)
        pick: list[tuple[str, int] | None] = [None] * (self.N + 1)
        for i in range(self.N - 1, 0, -1):
            best[i], pick[i] = min((s + best[i + t], (name, t)) for name, s, t in self.actions(i, merged)
                                   if name in allowed)
        used: dict[str, int] = {}
        i = 1
        while i < self.N:
            name, t = pick[i]
            used[name] = used.get(name, 0) + 1
            i += t
        return (best[1] if self.N > 1 else 0.0), used

    def fixed(self, order: list[str], k: int) -> float:
        """Seconds when each step takes the first member of `order` with a proposal (plain if none)."""
        i, total = 1, 0.0
        while i < self.N:
            s, t = next(filter(None, (self._proposal(name, i, k) for name in order)), self.plain())
            total += s
            i += t
        return total

    def _proposal(self, name: str, i: int, k: int) -> tuple[float, int] | None:
        """(seconds, tokens) of verifying member `name`'s proposal at position i (None: it has none)."""
        if name == "suffix":
            return self.suffix(i)
        return self.ngram(i, k) if name == "ngram" else self.draft(i, k)[:2]

    def composite(self, cal: NodeCalibration, records: list[MemberRecord] | None, k: int) -> float:
        """Seconds with the suffix tree cut as `specdec.tuning.costs` cuts it (its nodes valued by `cal`,
        learnt as decoding goes) and, with `records` (suffix, draft: kept across prompts, as `specdec
        eval` keeps a method's), the CompositeDrafter's rule beside the draft model: each proposal
        valued at (1 + its calibrated estimate) per second of verifying it, the draft run where its
        gate measured that steps which ran it emitted more per second, started on the prompt as the
        record's rows with and without it decoded (the replay has no start-up cost: the draft's prompt
        prefill is not in its costs), the best proposal verified (a plain step when there is none)."""
        plain_rate = 1.0 / self.verify[1]
        i, total = 1, 0.0
        state, row = "new", None  # the draft on this prompt: new, started or declined; the record's row
        while i < self.N:
            probs = self.rec["suffix_p"][i]
            n = best_cut([cal.value(p) for p in probs], self.costs)
            seconds = self.suffix_s if self.rec["suffix"][i] else 0.0
            options = []  # (rate, member, nodes, raw estimate): members in order, ties to the first
            if n:
                raw = sum(probs[:n])
                calibration = records[0].calibration() if records else 1.0
                options.append(((1 + raw * calibration) / self.rows_cost(n + 1), 0, n, raw))
            gate_bin = AskGate.bin(max([plain_rate] + [o[0] for o in options]) / plain_rate)
            ran = records is not None and state != "declined" and records[1].gate.ask(gate_bin)
            starting = ran and state == "new"
            if starting:
                state = "started" if records[1].should_start() else "declined"
                ran = state == "started"
                row = records[1].new_row(ran)
            if ran:
                m = min(k, self.stop[i])
                drafting, _, raw = self.draft(i, k)
                seconds += drafting - self.rows_cost(m + 1)
                if m:
                    options.append(((1 + raw * records[1].calibration()) / self.rows_cost(m + 1), 1, m, raw))
            _, member, n, raw = max(options, key=lambda o: o[0]) if options else (0.0, -1, 0, 0.0)
            if member == 0:
                acc = self.rec["suffix_acc"][i][n]
                cal.observe(probs[:n], self.rec["suffix_ok"][i][:n])
            else:
                acc = min(n, self.rec["draft_run"][i]) if member == 1 else 0
            if member >= 0 and records:
                records[member].observe(raw, acc)
            seconds += self.rows_cost(n + 1)
            tokens = min(1 + acc, self.N - i)
            if records is not None and not starting:
                records[1].gate.observe(gate_bin, ran, tokens, seconds)
            total += seconds
            i += tokens
        if row is not None:
            row[:] = [self.N - 1, total]
        return total


def policies(records: list[dict], costs: dict, pmin: float | None) -> dict:
    """tokens/s with the prefill (median over prompts, as `specdec eval`) of each policy."""
    def rate(seconds: list[float]) -> float:
        return statistics.median(len(r["out"]) / (r["ttft_s"] + s) for r, s in zip(records, seconds))

    plays = [Replay(r, costs, pmin) for r in records]
    out = {"plain": rate([p.verify[1] * (p.N - 1) for p in plays])}
    out["suffix"] = rate([p.fixed(["suffix"], 7) for p in plays])
    for name, order in (("ngram", ["ngram"]), ("draft", ["draft"]), ("hybrid", ["ngram", "draft"]),
                        ("suffix>draft", ["suffix", "draft"])):
        by_k = {k: rate([p.fixed(order, k) for p in plays]) for k in KS}
        k = max(by_k, key=by_k.get)
        out[f"{name}@{k}"] = by_k[k]
    out["suffix cut"] = rate([p.composite(NodeCalibration(), None, 1) for p in plays])
    by_k = {}
    for k in KS:
        kept = [MemberRecord(), MemberRecord()]  # kept across prompts, as `specdec eval` keeps a method's
        by_k[k] = rate([p.composite(NodeCalibration(), kept, k) for p in plays])
    k = max(by_k, key=by_k.get)
    out[f"composite@{k}"] = by_k[k]
    seconds, used = zip(*(p.oracle() for p in plays))
    out["oracle"] = rate(list(seconds))
    steps: dict[str, int] = {}
    for u in used:
        for name, n in u.items():
            steps[name] = steps.get(name, 0) + n
    out["oracle_steps"] = steps
    out["oracle+merged"] = rate([p.oracle(merged=True)[0] for p in plays])
    for members in (("suffix",), ("ngram",), ("draft",), ("suffix", "draft")):
        out[f"oracle {'+'.join(members)}"] = rate([p.oracle(members=members)[0] for p in plays])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-vocab", type=int, default=32768, help="the draft scores this many frequent tokens")
    p.add_argument("--weights", default="gguf", choices=["gguf", "dense", "auto"])
    p.add_argument("--no-compile", action="store_true", help="time eager steps (default: compiled, as the targets)")
    p.add_argument("--pmin", type=float, default=None, help="replay the draft as `:pP` too")
    p.add_argument("--records", type=Path, default=None, help="reuse a replay's members.json (skips the models' "
                   "plain pass); costs are still measured unless --costs names a costs.json")
    p.add_argument("--costs", type=Path, default=None)
    p.add_argument("--suffix-factor", type=float, default=SuffixConfig.max_factor,
                   help="the suffix tree's nodes per matched token (SuffixConfig.max_factor)")
    p.add_argument("--suffix-min-prob", type=float, default=SuffixConfig.min_prob)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    records = json.loads(args.records.read_text()) if args.records else None
    if records is None or args.costs is None:
        from specdec.drafters.draft_vocab import frequent_tokens, restrict_vocab

        tok = runtime.load_tokenizer(args.target)
        target = runtime.load_model(args.target, weights=args.weights, compile=not args.no_compile)
        draft = runtime.load_model(args.draft, weights=args.weights)
        if args.draft_vocab:
            restrict_vocab(draft, frequent_tokens(tok, args.draft_vocab, draft.config.vocab_size))
        prompts = load_prompts(dataset=args.dataset, limit=args.limit)
        if records is None:
            rows = [(q.id, torch.tensor(encode(tok, [q.turns[0]], [], False))) for q in prompts]
            records = plain_pass(target, draft, rows, args.max_new_tokens, eos_ids(args.target, tok))
            (args.out / "members.json").write_text(json.dumps(records))
        if args.costs is None:
            if not args.no_compile:
                runtime.compile_decode(draft)
            rows = [torch.tensor(encode(tok, [q.turns[0]], [], False)) for q in prompts[:2]]
            costs = measure_costs(target, draft, rows, 32)
            # each prompt's prefill timed again, alone on the machine (the plain pass may have shared it)
            costs["ttft_s"] = {r["id"]: generate(target, [torch.tensor(r["ids"])], max_new_tokens=1).stats.ttft_s
                               for r in records}
            (args.out / "costs.json").write_text(json.dumps(costs))
    costs = json.loads((args.costs or args.out / "costs.json").read_text())
    for rec in records:
        rec["ttft_s"] = costs.get("ttft_s", {}).get(rec["id"], rec["ttft_s"])
    replay_drafters(records, SuffixConfig(max_factor=args.suffix_factor, min_prob=args.suffix_min_prob, cut=False))
    (args.out / "replayed.json").write_text(json.dumps(records))
    result = {p: policies(records, costs, p) for p in ([None, args.pmin] if args.pmin else [None])}
    (args.out / "policies.json").write_text(json.dumps(result, indent=1))
    for pmin, res in result.items():
        plain = res["plain"]
        print(f"\n{args.dataset}, {len(records)} prompts" + (f", draft :p{pmin}" if pmin else ""))
        for name, value in res.items():
            if isinstance(value, float):
                print(f"  {name:16s} {value:6.2f} tok/s  {value / plain:5.2f}x plain")
        print(f"  oracle steps: {res['oracle_steps']}")


if __name__ == "__main__":
    main()
