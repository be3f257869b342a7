"""`specdec eval`: acceptance-rate and speed evaluation of several decoding methods in one run.

Every prompt is decoded by every method, methods alternating per prompt (prompt 1: all methods,
prompt 2: all methods, ...) so that machine drift hits all of them alike, after warm-up
generations. Methods (`--methods`, comma-separated):

    plain            specdec.generate(target, ids)                      (this runtime, no draft)
    a drafter spec   specdec.generate(target, ids, draft=SPEC)          (specdec.methods)
                     ngram[@K], suffix[@N], draft:X[@K[:pP]], hybrid:X[@K] (= ngram+draft:X),
                     A+B[@K] (chain drafters tried in order), A|B (the best proposal per step),
                     medusa:PATH[@N], eagle:PATH[@N[:DxK]] / @auto[:DxK]
    hf               transformers generate() on the same checkpoint and dtype
    hf-assisted:X    transformers assisted generation, assistant_model = X
    hf-pld           transformers prompt lookup (prompt_lookup_num_tokens)
    llamacpp         llama.cpp's plain decoding of the target's GGUF (specdec.evaluation.llamacpp; `make llamacpp`)
    llamacpp-spec:X  llama.cpp's speculative decoding, draft X (catalogue name or .gguf), @K drafts at most
    llamacpp-eagle3:H  llama.cpp's EAGLE-3 decoding, head H a .gguf (`specdec export gguf HEAD --target T`),
                     a greedy chain of exactly @K drafts (no confidence cut-off: as eagle:HEAD@K:Kx1)

X is a catalogue name or checkpoint directory. `@K` is a drafter's own draft length (an integer
or auto) in place of `--num-draft-tokens` (llamacpp-spec and llamacpp-eagle3 an integer only; default: the run's k,
or 4 when that is auto): `draft:X@3,draft:X@7,draft:X@auto` compares draft lengths in one
alternating run. For medusa, `@N` rebuilds the heads' tree with N nodes. For eagle, `@N` is the
number of nodes the dynamic tree keeps (default: specdec.drafters.eagle.drafter.EagleTreeConfig's),
`@N:DxK` also its depth D and top-k K (e.g. `@96:8x10`; a deeper, wider tree drafts longer runs
for a larger verification forward), and `@auto` (or `@auto:DxK`) times tree sizes on this
machine before the run (specdec.tuning.eagle_tree, on the first prompt that fits) and writes the
measurement to `tree_auto.json`.

Every method counts the new tokens after the prompt, up to and including eos, and is timed
around the whole call (prefill included); tokens/s per prompt = new tokens / wall seconds.
`--weights` (auto, gguf, dense) says how the runtime's models hold a GGUF's weights
(`runtime.load_model`); the transformers baselines always run the dequantized checkpoint, and
the llama.cpp ones the GGUF files themselves.

Output directory (`--out`): `run.json` (the settings), `generations.jsonl` (one line per prompt x
method, appended and flushed line by line), then `report.json`, `report.md`, `acceptance.png`,
`speedup.png` rebuilt from the jsonl (see specdec.evaluation.report). Re-running with the same `--out` and
settings resumes: (prompt, method) pairs already in the jsonl are skipped, and the cache of earlier
answers of a method with a `suffix` drafter starts with that method's answers in the jsonl (as the
interrupted run held them), so its later prompts draft as in a run never interrupted. Different settings
fail unless `--overwrite`, which deletes only those files. `--out` must be new, empty or an
evaluation run (run.json / report.json / generations.jsonl): a file or another directory is refused
(runtime.output_paths). A run holds `--out/.lock` while it runs: a second run on the same `--out`
fails at once (a lock left by a killed run is taken over). A generations line holds: id, category,
method, turns (user texts), outputs (answer texts, one per turn), output_ids (token ids per turn),
new_tokens, wall_s, tokens_per_second, stats (AcceptanceStats.to_dict(), null for transformers
methods).

A prompt that does not fit the context (prompt + max_new_tokens beyond a model's positions:
runtime.errors.ContextLengthError) is skipped, not fatal: a line {id, category, method, skipped:
reason} records it, the report leaves it out of every method (report.json "skipped", a line in
report.md), and a resumed run does not try it again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

import runtime
from runtime import hardware
from runtime.argtypes import seed_number
from runtime.atomic import atomic_write_text
from runtime.errors import ContextLengthError, SpecdecError
from runtime.invariant import unsupported_reason
from runtime.loading import WEIGHTS, gguf_source, resolve_weights
from runtime.output_paths import created_output, output_lock, prepare_output_dir
from runtime.progress import keep_alive, still
from runtime.progress import progress as progress_bar
from specdec.drafters.draft_vocab import ALIGN as DRAFT_VOCAB_ALIGN
from specdec.drafters.draft_vocab import frequent_tokens, restrict_vocab
from specdec.drafters.model import check_token_strings
from specdec.evaluation.baselines import HFGenerator, load_hf_model, new_tokens
from specdec.evaluation.llamacpp import LlamaServer, server_binary, stats_from_timings
from specdec.evaluation.prompts import DATASETS, Prompt, encode, eos_ids, load_prompts
from specdec.evaluation.report import build_report, render_markdown, write_report
from specdec.generate import generate
from specdec.loader import DrafterLoader
from specdec.methods import LLAMACPP, RUNTIME, TRANSFORMERS, DrafterSpec, Method, parse_methods
from specdec.options import DEFAULT_NUM_DRAFT_TOKENS, parse_draft_length
from specdec.sampling import SamplingParams
from specdec.stats import AcceptanceStats
from specdec.tuning.eagle_tree import TreeTuner
from specdec.tuning.state import TuningState
from specdec.tuning.warmup import warm_up

LLAMACPP_DRAFT_MAX = 4  # llamacpp-spec's drafts when neither @K nor an integer --num-draft-tokens says
DTYPES = {name: hardware.DTYPES[name] for name in ("bfloat16", "float32")}  # the dtypes runs are measured in
GENERATIONS, RUN_FILE = "generations.jsonl", "run.json"
_OUTPUTS = (GENERATIONS, RUN_FILE, "report.json", "report.md", "acceptance.png", "speedup.png", "tree_auto.json")
MARKERS = (RUN_FILE, "report.json", GENERATIONS)  # any of them: the directory holds an evaluation run
WHAT = "evaluation run"
# settings that change what a generation line holds: a resumed run must share them
_RESUME_KEYS = ("target", "prompts", "dataset", "raw", "all_turns", "dtype", "device", "max_new_tokens",
                "num_draft_tokens", "temperature", "top_p", "top_k", "seed", "hf_pld_tokens", "compile")
# later options, part of the resume settings only when set (runs made before them still resume)
_RESUME_IF_SET = ("draft_vocab", "no_row_invariant")


@dataclass(frozen=True)
class EvalConfig:
    """Settings of one evaluation run (the CLI's defaults are these)."""

    out: str
    methods: str = "plain,ngram,hf"
    target: str = "qwen2.5-coder-1.5b-instruct"
    prompts: str | None = None
    dataset: str | None = None
    limit: int | None = None
    raw: bool = False
    all_turns: bool = False
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_new_tokens: int = SamplingParams.max_new_tokens  # the sampling defaults live on SamplingParams
    num_draft_tokens: int | str = DEFAULT_NUM_DRAFT_TOKENS
    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    top_k: int = SamplingParams.top_k
    seed: int = 0
    warmup: int = 1
    hf_pld_tokens: int = 10
    threads: int | None = None
    compile: bool = False
    draft_vocab: int = 0
    weights: str = "auto"
    no_row_invariant: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        parse_methods(self.methods)
        if (self.prompts is None) == (self.dataset is None):
            raise ValueError("pass exactly one prompt source: --prompts FILE.jsonl or --dataset "
                             f"({', '.join(DATASETS)})")
        if self.dataset is not None and self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(DATASETS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        hardware.check_device(self.device)  # 'tpu' was a RuntimeError from torch.device
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "num_draft_tokens", parse_draft_length(self.num_draft_tokens))
        self.sampling  # noqa: B018 (checks temperature, top_p, top_k and max_new_tokens)
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.hf_pld_tokens < 1:
            raise ValueError(f"hf_pld_tokens must be >= 1, got {self.hf_pld_tokens}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 (or None for torch's default), got {self.threads}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.draft_vocab < 0 or self.draft_vocab % DRAFT_VOCAB_ALIGN:
            raise ValueError(f"draft_vocab must be 0 (the full vocabulary) or a multiple of "
                             f"{DRAFT_VOCAB_ALIGN}, got {self.draft_vocab}")

    @property
    def method_list(self) -> list[Method]:
        return parse_methods(self.methods)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def sampling(self) -> SamplingParams:
        """The run's sampling settings (each prompt's seed comes from `seed_for`)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k)


def command_line(subcommand: str, cfg) -> str:
    """The `specdec SUBCOMMAND ...` line that reproduces a config dataclass, every option spelled out."""
    parts = ["specdec", subcommand]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value is not None and value is not False:
            parts += [flag, str(value)]
    return shlex.join(parts)


class SettingsMismatchError(ValueError):
    """--out holds a run made with different settings."""


class CorruptRunError(SpecdecError, ValueError):
    """A file of the run in --out (run.json, a line of generations.jsonl) that cannot be read back."""


# what to do about a corrupt file of a run, for the messages
_START_OVER = "start over with a new --out (or --overwrite, which discards this run)"


def run_settings(cfg: EvalConfig, eos: list[int], prompt_format: str) -> dict:
    """The settings that a resumed run must share, plus what they imply (eos ids, prompt format)."""
    settings = {k: getattr(cfg, k) for k in _RESUME_KEYS}
    settings.update({k: getattr(cfg, k) for k in _RESUME_IF_SET if getattr(cfg, k)})
    settings["prompts"] = str(Path(cfg.prompts).resolve()) if cfg.prompts else None
    settings["weights"] = resolve_weights(cfg.weights, cfg.target, cfg.device)  # what the runtime's target holds
    dense = settings["weights"] not in ("gguf", "blocks")  # else every linear runs the block kernels
    settings["row_invariant"] = (not cfg.no_row_invariant
                                 and unsupported_reason(torch.device(cfg.device), cfg.torch_dtype, dense) is None)
    settings.update(eos_token_id=eos, prompt_format=prompt_format)
    return settings


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def check_out_dir(out: str | Path, overwrite: bool = False) -> Path:
    """Fail (runtime.output_paths.OutputPathError) unless `out` is new, empty or an evaluation run."""
    return prepare_output_dir(out, MARKERS, overwrite, what=WHAT, resume=True)


def prepare_out_dir(out: Path, settings: dict, overwrite: bool) -> None:
    """Create `out`, or check that the run it holds used `settings` (or clear it with overwrite:
    the run's own files only). A file or a directory that holds no evaluation run is refused."""
    out = check_out_dir(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    run_file = out / RUN_FILE
    if overwrite:
        for name in _OUTPUTS:
            (out / name).unlink(missing_ok=True)
    if run_file.is_file():
        old = _read_run_settings(run_file)
        if old != settings:
            diff = [f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in sorted(set(old) | set(settings))
                    if old.get(k) != settings.get(k)]
            raise SettingsMismatchError(f"{out} holds a run with different settings ({'; '.join(diff)}); "
                                        "use a new --out, or --overwrite to discard that run")
    elif (out / GENERATIONS).is_file():
        raise SettingsMismatchError(f"{out / GENERATIONS} exists without {RUN_FILE}, so its settings "
                                    "are unknown; use a new --out, or --overwrite to discard it")
    atomic_write_text(run_file, json.dumps({"settings": settings, "settings_hash": settings_hash(settings)},
                                       indent=2) + "\n")


def _read_run_settings(run_file: Path) -> dict:
    """The settings recorded in a run's run.json; CorruptRunError naming the file when it is not the
    JSON object prepare_out_dir writes."""
    try:
        settings = json.loads(run_file.read_text(encoding="utf-8")).get("settings")
    except (ValueError, AttributeError) as err:  # not JSON (JSONDecodeError, UnicodeDecodeError), or not an object
        raise CorruptRunError(f"{run_file} cannot be read back ({type(err).__name__}: {err}); the file is corrupt: "
                              f"{_START_OVER}") from err
    if not isinstance(settings, dict):
        raise CorruptRunError(f"{run_file} holds no 'settings' object; the file is corrupt: {_START_OVER}")
    return settings


def _read_record(path: Path, number: int, line: str) -> dict:
    """One generations.jsonl line as a record; CorruptRunError naming the file and the 1-based line."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as err:  # JSONDecodeError; RecursionError: nested too deeply
        problem = (f"not JSON ({err.msg.removesuffix(' at')} at column {err.colno})"
                   if isinstance(err, json.JSONDecodeError)
                   else f"not JSON ({type(err).__name__})")
    else:
        if isinstance(record, dict) and isinstance(record.get("id"), str) and isinstance(record.get("method"), str):
            return record
        problem = "not a generation record (a JSON object with an 'id' and a 'method')"
    raise CorruptRunError(f"{path}, line {number}: {problem}; the file is corrupt: delete that line to resume (its "
                          f"generation is made again), or {_START_OVER}")


def read_generations(path: Path, digest: str | None = None) -> list[dict]:
    """Complete lines of a generations.jsonl (of one settings hash when given).

    A run killed while writing leaves a partial last line; it is dropped from the file here, so
    that appending continues on a fresh line. Any other line that is not a record fails as a
    CorruptRunError naming the file and its 1-based line number.
    """
    if not path.is_file():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[:err.start].count(b"\n") + 1
        raise CorruptRunError(f"{path}, line {line}: not UTF-8 text ({err.reason}); the file is corrupt: delete that "
                              f"line to resume (its generation is made again), or {_START_OVER}") from err
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
        atomic_write_text(path, text)
    records = [_read_record(path, n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    return [r for r in records if digest is None or r.get("settings_hash") == digest]


def earlier_answers(records: list[dict]) -> dict[str, list[list[int]]]:
    """Method -> the token ids of its answers in `records` (generations.jsonl lines), in the order
    they were generated, one list per turn: what a resumed run puts back into each method's suffix
    cache, so a `suffix` method drafts from the answers it would have had without the interrupt.
    Lines without usable output_ids (skipped prompts) add nothing."""
    answers: dict[str, list[list[int]]] = {}
    for r in records:
        turns = r.get("output_ids")
        if isinstance(turns, list) and all(isinstance(t, list) and all(isinstance(i, int) for i in t) for t in turns):
            answers.setdefault(r["method"], []).extend(turns)
    return answers


def seed_for(seed: int, prompt_id: str, turn: int) -> int:
    """Per-(prompt, turn) seed, independent of method order and of resuming."""
    return (seed * 1_000_003 + zlib.crc32(prompt_id.encode()) * 64 + turn) % (2**63 - 1)


class _RunLoader(DrafterLoader):
    """What a run's drafter specs name, loaded once per run: draft models as the runner loads them
    (--draft-vocab, --compile, sharing the target's copy when they name it), each method's drafters
    sharing that method's tuning state, @auto trees timed on the run's prompts."""

    def __init__(self, runner: Runner) -> None:
        super().__init__(log=runner.log, tuner=TreeTuner(runner.calibration_prompts, log=runner.log))
        self.runner = runner

    def model(self, name: str, target):
        return self.runner._draft_model(name)

    @property
    def state(self) -> TuningState:
        """The tuning state of the method whose drafter is loading (`runner.method`): one cache of
        earlier responses per method, so no method drafts from another's answers, starting with the
        method's answers already written (`runner.answers`: a resumed run's, as the interrupted run
        held them); composite records learnt from the warm-up on."""
        r = self.runner
        if r.method not in r.states:
            r.states[r.method] = TuningState(r.answers.get(r.method, ()))
        return r.states[r.method]

    def forget_answers(self) -> None:
        """Forget the warm-up's answers: each method's caches keep its earlier answers only."""
        for state in self.runner.states.values():
            state.forget_answers()


class Runner:
    """Loads each model once and decodes one prompt with one method. `log` (a callable taking a line)
    is told of every load and server start before it begins."""

    def __init__(self, cfg: EvalConfig, tokenizer, eos: list[int], log: Callable[[str], None] | None = None) -> None:
        self.cfg, self.tokenizer, self.eos = cfg, tokenizer, eos
        self.log = log if log is not None else _quiet
        self._models: dict[tuple[str, str], object] = {}
        self.calibration: list[Prompt] = []  # prompts an `@auto` EAGLE-3 tree is measured on (the first that fits)
        self.method = ""  # the method whose drafter is loading (its tuning state is its own)
        self.states: dict[str, TuningState] = {}  # method -> its drafters' tuning state
        # method -> token ids of its answers already in generations.jsonl (a resumed run), in order
        self.answers: dict[str, list[list[int]]] = {}
        self.loader = _RunLoader(self)  # loads what the drafter specs name, each once per run

    @property
    def tree_auto(self) -> dict[str, dict]:
        """method name -> specdec.tuning.eagle_tree's record of its @auto tree."""
        return dict(self.loader.tuner.records)

    def calibration_prompts(self):
        """(label, 1-D token tensor) pairs an @auto tree is timed on, in order."""
        return ((p.id, torch.tensor(encode(self.tokenizer, [p.turns[0]], [], self.cfg.raw))) for p in self.calibration)

    def _cached(self, key: tuple[str, str], load):
        if key not in self._models:
            self._models[key] = load()
        return self._models[key]

    @property
    def target(self):
        return self._runtime_model(self.cfg.target)

    def _runtime_model(self, name: str):
        def load():
            cfg = self.cfg
            self.log(f"loading {name} ({cfg.dtype}, {cfg.device}{', compiled' if cfg.compile else ''})")
            return runtime.load_model(name, dtype=cfg.torch_dtype, device=cfg.device, compile=cfg.compile,
                                      weights=cfg.weights, row_invariant=not cfg.no_row_invariant)

        return self._cached(("runtime", name), load)

    def _draft_model(self, name: str):
        """The draft model `name`: with --draft-vocab N a copy of its own (the target never takes
        it), the vocabulary restricted before the model is compiled."""
        cfg = self.cfg
        if not cfg.draft_vocab:
            return self._runtime_model(name)

        def load():
            self.log(f"loading draft model {name} ({cfg.dtype}, {cfg.device}, its vocabulary cut to {cfg.draft_vocab})")
            model = runtime.load_model(name, dtype=cfg.torch_dtype, device=cfg.device, weights=cfg.weights,
                                       row_invariant=not cfg.no_row_invariant)
            restrict_vocab(model, self._frequent_tokens(model.config.vocab_size))
            return runtime.compile_decode(model) if cfg.compile else model

        return self._cached(("draft", name), load)

    def _frequent_tokens(self, vocab_size: int) -> torch.Tensor:
        return self._cached(("draft-vocab", str(vocab_size)), lambda: frequent_tokens(
            self.tokenizer, self.cfg.draft_vocab, vocab_size))

    def _hf_model(self, name: str):
        pad = self.tokenizer.pad_token_id
        if pad is None and self.eos:
            pad = self.eos[0]
        def load():
            self.log(f"loading the transformers baseline {name} ({self.cfg.dtype}, {self.cfg.device})")
            with still("loading the transformers baseline", self.log):
                return load_hf_model(name, self.cfg.torch_dtype, self.cfg.device, eos_token_id=self.eos or None,
                                     pad_token_id=pad)

        return self._cached(("hf", name), load)

    def draft_for(self, method: Method):
        """The `draft=` argument of specdec.generate for a method this runtime decodes."""
        if method.engine != RUNTIME:
            raise ValueError(f"{method.name} is not a specdec method")
        if method.drafter is None:
            return None
        self.method = method.name
        return method.drafter.load(self.target, self.loader)

    def llama_server(self, spec: Method):
        """The running llama-server of a llamacpp method (started on first use, stopped by `close`)."""
        def start():
            server_binary()  # a clear error before anything else when llama.cpp is not built
            target = gguf_source(self.cfg.target)
            if target is None:
                raise ValueError(f"{spec.name}: llama.cpp runs GGUF files, and the target {self.cfg.target!r} is "
                                 "neither a catalogue name nor a .gguf file")
            draft = None
            if spec.kind == "llamacpp-eagle3":
                draft = Path(spec.spec.arg).expanduser()
                if draft.suffix != ".gguf" or not draft.is_file():
                    raise ValueError(f"{spec.name}: llama.cpp reads an EAGLE-3 head as a .gguf file; write one with "
                                     f"`specdec export gguf HEAD_DIR --target {self.cfg.target} --out HEAD.gguf`")
            if spec.kind == "llamacpp-spec":
                draft = gguf_source(spec.spec.arg)
                if draft is None:
                    raise ValueError(f"{spec.name}: the draft {spec.spec.arg!r} is neither a catalogue name nor a "
                                     ".gguf file")
                if str(spec.spec.arg) != str(self.cfg.target):  # the check `draft:` methods get from generate()
                    check_token_strings(spec.spec.arg, self.cfg.target, sample=64)
            k = spec.draft_length or self.cfg.num_draft_tokens
            server = LlamaServer(target, draft, k if isinstance(k, int) else LLAMACPP_DRAFT_MAX,
                                 threads=self.cfg.threads or torch.get_num_threads(),
                                 eagle3=spec.kind == "llamacpp-eagle3")
            self.log(f"starting llama.cpp's server for {spec.name} (it loads {target.name})")
            with still("starting llama.cpp's server", self.log):
                server.start()
            return server

        return self._cached(("llamacpp", spec.name), start)

    def close(self) -> None:
        """Stop the llama.cpp servers this runner started."""
        for key, value in self._models.items():
            if key[0] == "llamacpp":
                value.stop()

    def hf_generator(self, spec: Method) -> HFGenerator:
        assistant = self._hf_model(spec.spec.arg) if spec.kind == "hf-assisted" else None
        return self._cached(("hfgen", spec.name), lambda: HFGenerator(
            self._hf_model(self.cfg.target), spec.kind, assistant, self.cfg.hf_pld_tokens))

    def decode(self, method: Method, ids: list[int], seed: int) -> tuple[list[int], dict | None, float]:
        """(new tokens, stats dict or None, wall seconds) for one prompt, by the engine that runs the method."""
        decoders = {RUNTIME: self._decode_runtime, TRANSFORMERS: self._decode_transformers,
                    LLAMACPP: self._decode_llamacpp}
        return decoders[method.engine](method, ids, seed)

    def _decode_llamacpp(self, method: Method, ids: list[int], seed: int) -> tuple[list[int], dict, float]:
        cfg = self.cfg
        server = self.llama_server(method)
        start = time.perf_counter()
        new, timings = server.complete(ids, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, seed)
        wall = time.perf_counter() - start
        new = new_tokens(new, frozenset(self.eos))
        return new, stats_from_timings(timings, len(new), wall), wall

    def _decode_transformers(self, method: Method, ids: list[int], seed: int) -> tuple[list[int], None, float]:
        cfg = self.cfg
        gen = self.hf_generator(method)
        if cfg.temperature > 0:
            torch.manual_seed(seed)  # transformers samples from the global generator
        start = time.perf_counter()
        new = gen.generate(ids, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
        return new, None, time.perf_counter() - start

    def _decode_runtime(self, method: Method, ids: list[int], seed: int) -> tuple[list[int], dict, float]:
        cfg = self.cfg
        target, draft = self.target, self.draft_for(method)
        generator = torch.Generator(device=cfg.device).manual_seed(seed)
        own = method.draft_length  # medusa's and eagle's @N sized their tree (k unused)
        sampling = cfg.sampling
        start = time.perf_counter()
        out = generate(target, [torch.tensor(ids)], draft=draft, max_new_tokens=sampling.max_new_tokens,
                               temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                               num_draft_tokens=own or cfg.num_draft_tokens,
                               eos_token_id=self.eos or None,
                               generator=generator)
        wall = time.perf_counter() - start
        return new_tokens(out.sequences[0][len(ids):].tolist(), frozenset(self.eos)), out.stats.to_dict(), wall

    def run_prompt(self, spec: Method, prompt: Prompt) -> dict:
        """Decode every turn of a prompt (later turns follow the method's own answers)."""
        answers, output_ids, tokens, wall, stats = [], [], 0, 0.0, None
        for turn in range(len(prompt.turns)):
            ids = encode(self.tokenizer, list(prompt.turns[:turn + 1]), answers, self.cfg.raw)
            new, st, secs = self.decode(spec, ids, seed_for(self.cfg.seed, prompt.id, turn))
            answers.append(self.tokenizer.decode(new, skip_special_tokens=True))
            output_ids.append(new)
            tokens, wall = tokens + len(new), wall + secs
            if st is not None:
                stats = AcceptanceStats.from_dict(st) if stats is None else stats.merge(AcceptanceStats.from_dict(st))
        return {"id": prompt.id, "category": prompt.category, "method": spec.name, "turns": list(prompt.turns),
                "outputs": answers, "output_ids": output_ids, "new_tokens": tokens, "wall_s": wall,
                "tokens_per_second": tokens / wall if wall > 0 else 0.0,
                "stats": stats.to_dict() if stats is not None else None}


def versions() -> dict:
    """Software and machine the run used."""
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "specdec": importlib.metadata.version("specdec"), "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cpu": hardware.cpu_summary()}


def run_eval(cfg: EvalConfig, command: str | None = None, progress: bool = True) -> dict:
    """Run (or resume) an evaluation; writes the files in `cfg.out` and returns the report dict.

    Fails at once (runtime.output_paths.OutputPathError) when `cfg.out` is a file, a directory that
    holds no evaluation run, or the directory of a run still going on (its lock). A run that fails
    before its first generations line (bad input, a model that raises) leaves a new or empty
    `cfg.out` as it was: its run.json goes again (`created_output`); once a line is written the
    directory stays, to be resumed."""
    out = check_out_dir(cfg.out, cfg.overwrite)
    with created_output(out, own=(RUN_FILE,)), output_lock(out, "specdec eval"):
        return _run_locked(cfg, out, command, progress)


def _run_locked(cfg: EvalConfig, out: Path, command: str | None, progress: bool) -> dict:
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    specs = cfg.method_list
    if any(s.engine == LLAMACPP for s in specs):
        server_binary()  # not built: say how, before any model loads
    if progress and cfg.dataset is not None:
        _status(f"loading the {cfg.dataset} prompts")
    prompts = load_prompts(cfg.prompts, cfg.dataset, cfg.limit, cfg.all_turns, raw=cfg.raw)
    tokenizer = runtime.load_tokenizer(cfg.target)
    eos = eos_ids(cfg.target, tokenizer)
    settings = run_settings(cfg, eos, "raw" if cfg.raw else "chat")
    if not cfg.raw:
        encode(tokenizer, [prompts[0].turns[0]], [], raw=False)  # fails early without a chat template
    prepare_out_dir(out, settings, cfg.overwrite)
    digest = settings_hash(settings)
    path = out / GENERATIONS
    previous = read_generations(path, digest)
    skipped = {r["id"] for r in previous if r.get("skipped")}  # prompts that did not fit: never retried
    done = {(r["id"], r["method"]) for r in previous}
    todo = [(p, s) for p in prompts if p.id not in skipped for s in specs if (p.id, s.name) not in done]
    runner = Runner(cfg, tokenizer, eos, log=_status if progress else None)
    runner.answers = earlier_answers(previous)
    try:
        _generate_all(runner, cfg, specs, prompts, todo, skipped, path, digest, progress)
    finally:
        runner.close()
    if runner.tree_auto:
        atomic_write_text(out / "tree_auto.json", json.dumps(runner.tree_auto, indent=1))
    records = read_generations(path, digest)
    report = build_report(records, settings, [s.name for s in specs], [p.id for p in prompts],
                          command=command if command is not None else command_line("eval", cfg),
                          versions=versions())
    write_report(out, report)
    return report


def _status(line: str) -> None:
    """A status line on stderr (above a progress bar when one is drawn)."""
    tqdm.write(line, file=sys.stderr)


def _quiet(line: str) -> None:
    """No status line (run_eval with progress=False)."""


def _generate_all(runner: Runner, cfg: EvalConfig, specs: list[Method], prompts: list[Prompt],
                  todo: list[tuple[Prompt, Method]], skipped: set[str], path: Path, digest: str,
                  progress: bool) -> None:
    """Warm every pending method up, then decode `todo` prompt-major, appending each line to `path`
    (opened with the first line: a run that fails before it creates no empty file)."""
    runner.calibration = [p for p in prompts if p.id not in skipped]
    pending = {s.name for _, s in todo}
    for spec in specs:  # warm-up: untimed, unrecorded generations on the first prompt that fits
        if spec.name in pending and cfg.warmup:
            runner.log(f"warming up {spec.name}" + (" (compiling its decode steps: minutes on a CPU the first time)"
                                                    if cfg.compile and spec.engine == RUNTIME else ""))
            with still(f"warming up {spec.name}", runner.log):
                for _ in range(cfg.warmup):
                    _warm_up(runner, spec, [p for p in prompts if p.id not in skipped])
    runner.loader.forget_answers()  # the timed prompts draft only from earlier timed answers
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(progress_bar(total=len(todo), desc="eval", unit="gen", disable=not progress))
        stack.enter_context(keep_alive(bar))  # a long generation redraws the bar: its elapsed time moves
        fh = None
        for prompt, spec in todo:  # prompt-major: all methods on prompt 1, then prompt 2, ...
            bar.set_postfix_str(f"{prompt.id} {spec.name}", refresh=False)
            if prompt.id in skipped:  # an earlier method found it too long
                bar.update()
                continue
            try:
                rec = runner.run_prompt(spec, prompt)
            except ContextLengthError as err:
                skipped.add(prompt.id)
                rec = {"id": prompt.id, "category": prompt.category, "method": spec.name, "skipped": str(err)}
                bar.write(f"specdec eval: skipping prompt {prompt.id}: {err}", file=sys.stderr)
            rec["settings_hash"] = digest
            if fh is None:
                fh = stack.enter_context(path.open("a", encoding="utf-8"))
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            bar.update()


def _warm_up(runner: Runner, spec: Method, prompts: list[Prompt]) -> None:
    """Untimed generations of `spec` on the first of `prompts` whose first turn fits the context: one,
    and with --compile what specdec.tuning.warmup adds for its drafter."""
    for prompt in prompts:
        ids = encode(runner.tokenizer, [prompt.turns[0]], [], runner.cfg.raw)

        def run(drafter: DrafterSpec | None, k: int | None) -> None:
            method = spec if drafter is None or drafter == spec.drafter else Method(str(drafter), drafter)
            runner.decode(method if k is None else dataclasses.replace(method, k=k), ids, runner.cfg.seed)

        try:
            if spec.drafter is None:
                run(None, None)
            else:
                warm_up(run, spec.drafter, runner.target, runner.cfg.compile)
        except ContextLengthError:
            continue
        return


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `eval` subcommand to an argparse subparsers object."""
    d = {f.name: f.default for f in dataclasses.fields(EvalConfig)}
    p = subparsers.add_parser(
        "eval", help="compare decoding methods: acceptance (tau) and speed on a prompt set",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory: new, empty, or an earlier run's (re-running "
                   "with it resumes; a directory specdec did not write is refused)")
    p.add_argument("--methods", default=d["methods"],
                   help="comma-separated methods: plain, hf, hf-assisted:X, hf-pld, llamacpp, llamacpp-spec:X@K, "
                        "llamacpp-eagle3:HEAD.gguf@K "
                        "(`make llamacpp` first), and drafter specs (the grammar of specdec serve --draft and "
                        "generate(draft=...)): draft:X, ngram, suffix, hybrid:X, A+B (chain drafters tried in "
                        "order), A|B (each step the best member's proposal; quote it in a shell), "
                        "medusa:PATH, eagle:PATH; draft/ngram/hybrid take @K for their own draft length, "
                        "e.g. ngram@3, draft:X@auto, medusa @N its tree's nodes, and eagle @N for its tree's nodes "
                        "(@N:DxK also its depth and top-k, e.g. @96:8x10) or @auto to time tree sizes first "
                        "(default: %(default)s)")
    p.add_argument("--target", default=d["target"], help="target model: catalogue name, checkpoint dir, "
                   ".gguf or hub id (default: %(default)s)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", default=d["prompts"], help="jsonl prompt file: {\"prompt\"} or "
                     "MT-bench style {\"question_id\", \"category\", \"turns\"} lines")
    src.add_argument("--dataset", default=d["dataset"], choices=DATASETS, help="a built-in prompt set: "
                     "humaneval (HumanEval chat), humaneval-edit (code edits whose answer copies the function in "
                     "the prompt; chat only, no --raw), sharegpt (held-out conversations, opening turns)")
    p.add_argument("--limit", type=int, default=d["limit"], help="use the first N prompts (default: all)")
    p.add_argument("--raw", action="store_true", help="feed prompts as plain completions instead of "
                   "applying the chat template")
    p.add_argument("--all-turns", action="store_true", help="MT-bench files and --dataset sharegpt: answer "
                   "every turn, each after the method's own previous answers; sharegpt then keeps the conversations "
                   "with 2 or more user turns, up to 4 each (default: first turn only)")
    p.add_argument("--dtype", default=d["dtype"], choices=list(DTYPES), help="(default: %(default)s)")
    p.add_argument("--device", default=d["device"], help="cpu or cuda (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=d["max_new_tokens"], help="(default: %(default)s)")
    p.add_argument("--num-draft-tokens", default=d["num_draft_tokens"],
                   help="draft tokens per step k, an integer or 'auto' (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=d["temperature"], help="0 = greedy (default: "
                   "%(default)s)")
    p.add_argument("--top-p", type=float, default=d["top_p"], help="(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=d["top_k"], help="0 = off (default: %(default)s)")
    p.add_argument("--seed", type=seed_number, default=d["seed"], help="seed of the per-prompt generators "
                   "(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d["warmup"], help="untimed warm-up generations per "
                   "method before timing (default: %(default)s)")
    p.add_argument("--hf-pld-tokens", type=int, default=d["hf_pld_tokens"],
                   help="prompt_lookup_num_tokens of the hf-pld baseline (default: %(default)s)")
    p.add_argument("--threads", type=int, default=d["threads"], help="torch.set_num_threads for the run "
                   "(default: torch's default, one per core)")
    p.add_argument("--compile", action="store_true", help="runtime.compile_decode the target and the "
                   "draft models of the specdec methods (torch.compile; transformers baselines stay "
                   "as transformers runs them); compiling happens in the untimed warm-up")
    p.add_argument("--draft-vocab", type=int, default=d["draft_vocab"], metavar="N",
                   help="draft models score only the N most frequent tokens (FR-Spec; a multiple of "
                   "16, e.g. 65536 of qwen's 151936): a cheaper LM head for the draft, output still "
                   "lossless (default: 0 = the full vocabulary)")
    p.add_argument("--weights", default=d["weights"], choices=list(WEIGHTS),
                   help="how the runtime holds a GGUF model's weights (catalogue names, .gguf files): gguf = its "
                        "4-bit blocks (CPU kernels), dense = dequantized to --dtype, auto = gguf where the CPU "
                        "has the AVX-512 VNNI kernels (default: %(default)s)")
    p.add_argument("--no-row-invariant", action="store_true",
                   help="the batch-dependent kernels instead of the row-invariant ones (bf16 on the CPU), as a "
                        "speed baseline: greedy speculative output may then differ from plain decoding at "
                        "near-tied tokens")
    p.add_argument("--overwrite", action="store_true", help="discard a run already in --out (its own files "
                   "only; other files there are never deleted)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Entry point of `specdec eval`: runs, prints the Markdown report, returns the exit code."""
    names = {f.name for f in dataclasses.fields(EvalConfig)}
    cfg = EvalConfig(**{k: v for k, v in vars(args).items() if k in names})
    report = run_eval(cfg)
    print(render_markdown(report))
    print(f"wrote {cfg.out}/report.json, report.md, acceptance.png, speedup.png, {GENERATIONS}")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m specdec.evaluation.evaluate")
    register(_parser.add_subparsers(dest="command", required=True))
    _args = _parser.parse_args(["eval", *sys.argv[1:]])
    sys.exit(_args.func(_args))
