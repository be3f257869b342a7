"""llama.cpp as a baseline: its server on the same GGUF files, timed like every other method.

`specdec eval` methods `llamacpp` (llama.cpp's plain decoding of the target's GGUF) and
`llamacpp-spec:DRAFT@K` (its draft-model speculative decoding, `--spec-type draft-simple`, up to
K drafted tokens, DRAFT a catalogue name or a .gguf file) start `llama-server` once per method
with the run's threads and send each prompt as token ids to `/completion` (greedy = temperature
0, no prompt cache between requests); the wall time of the request, prefill included, is what
the report divides the new tokens by, as for the other methods. The build is optional: `make
llamacpp` builds it from the source that the llama-cpp-python sdist on the package index vendors
into `$SPECDEC_HOME/llama.cpp/build/bin` (or set SPECDEC_LLAMACPP to a directory holding
`llama-server`); without it these methods are refused with that hint.

That build runs ggml's llamafile GEMMs (tinyBLAS) for forwards of 2+ tokens and its own dot
products for one token, so a token's logits depend on the forward's size and llama.cpp's
speculative output leaves its plain output at near-ties. `make llamacpp-invariant` builds without
them (`-DGGML_LLAMAFILE=OFF`, into `build-invariant/bin`: point SPECDEC_LLAMACPP there), where its
speculative output equals its plain output (figures in BENCHMARKS.md); `build_options()` says
which build runs.

Nothing waits on the server without a bound: the start waits at most `start_timeout()` (more for
bigger files) and stops at once when the process exits; a request waits at most `request_timeout()`
(a constant plus an allowance per token, far above llama.cpp's speed on any CPU); the server's log
goes to a file (a pipe nobody reads would stall it once full). A reply that is not the JSON
`/completion` returns (bad JSON, no token list, bad timings, not HTTP at all) is one
`LlamaCppServerError` naming the server, the model and what was wrong.

On CPUs with AMX the server runs with weight repacking off (`--no-repack`): ggml's AMX path
crashes at the first forward on the 2-core Xeon VMs this was built on; elsewhere llama.cpp
keeps its repacked (faster) layouts.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from runtime.catalogue import cache_home
from runtime.errors import SpecdecError
from runtime.hardware import cpu_summary
from specdec.stats import AcceptanceStats

SERVER = "llama-server"
START_BASE_S = 30.0  # the server's start: this, plus START_PER_GIB_S per GiB of model and draft files
START_PER_GIB_S = 30.0
REQUEST_BASE_S = 60.0  # one request: this, plus REQUEST_PER_TOKEN_S per token to generate,
REQUEST_PER_TOKEN_S = 1.0  # plus REQUEST_PER_PROMPT_TOKEN_S per prompt token
REQUEST_PER_PROMPT_TOKEN_S = 0.05


class LlamaCppUnavailable(SpecdecError):
    """llama.cpp is not built on this machine (or the server failed to start)."""


class LlamaCppServerError(LlamaCppUnavailable):
    """A running llama-server that did not answer in time, or answered something that is not a completion."""


def start_timeout(*files: Path | None) -> float:
    """Seconds the server may take to become healthy on `files` (model, draft): START_BASE_S plus
    START_PER_GIB_S per GiB of them."""
    size = sum(Path(f).stat().st_size for f in files if f is not None and Path(f).is_file())
    return START_BASE_S + START_PER_GIB_S * size / 2**30


def request_timeout(prompt_tokens: int, max_new_tokens: int) -> float:
    """Seconds one /completion request may take: REQUEST_BASE_S plus the per-token allowances."""
    return REQUEST_BASE_S + REQUEST_PER_TOKEN_S * max_new_tokens + REQUEST_PER_PROMPT_TOKEN_S * prompt_tokens


def bin_dir() -> Path:
    """Where the llama.cpp binaries are: $SPECDEC_LLAMACPP, else `make llamacpp`'s build folder."""
    env = os.environ.get("SPECDEC_LLAMACPP")
    return Path(env).expanduser() if env else cache_home() / "llama.cpp" / "build" / "bin"


def build_options(names: tuple[str, ...] = ("GGML_LLAMAFILE", "GGML_NATIVE")) -> dict[str, str]:
    """The cmake options of the llama.cpp build in `bin_dir()` (its CMakeCache.txt), those of `names`
    that were set; {} where the build left no cache (a binary copied from elsewhere)."""
    cache = bin_dir().parent / "CMakeCache.txt"
    if not cache.is_file():
        return {}
    found = {}
    for line in cache.read_text(errors="replace").splitlines():
        key, _, value = line.partition("=")
        name = key.split(":", 1)[0]
        if name in names:
            found[name] = value
    return found


def server_binary() -> Path:
    """The llama-server binary; LlamaCppUnavailable saying how to build it when it is missing."""
    path = bin_dir() / SERVER
    if not path.is_file():
        raise LlamaCppUnavailable(f"llama.cpp is not built here ({path} does not exist): run `make llamacpp` "
                                  "(about 8 minutes on 2 cores), or set SPECDEC_LLAMACPP to a directory holding "
                                  f"{SERVER}")
    return path


def available() -> bool:
    """Whether the llama.cpp methods can run here."""
    return (bin_dir() / SERVER).is_file()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float, poll_s: float = 0.25) -> bool:
    """Poll `url`/health until it answers 200 (True); False as soon as `proc` (the server's process,
    if given) has exited, or when `timeout_s` has passed. A server that is still loading answers
    nothing or 503: polled again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, http.client.HTTPException, OSError):  # not up yet, or still loading
            pass
        time.sleep(poll_s)
    return False


def _needs_no_repack() -> bool:
    return "amx_tile" in cpu_summary()["flags"]


class LlamaServer:
    """One `llama-server` process on `model` (a .gguf), with `draft` (a .gguf) for speculative
    decoding of up to `draft_max` tokens (`eagle3`: `draft` is an EAGLE-3 head, drafting exactly
    `draft_max`); a context manager that stops the process on exit."""

    def __init__(self, model: Path, draft: Path | None = None, draft_max: int = 4, threads: int | None = None,
                 context: int = 4096, eagle3: bool = False) -> None:
        self.model, self.draft, self.draft_max, self.eagle3 = Path(model), draft, draft_max, eagle3
        self.threads = threads or os.cpu_count() or 1
        self.context = context
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._log = None  # the server's output (a temporary file) while it runs

    def command(self) -> list[str]:
        cmd = [str(server_binary()), "-m", str(self.model), "-t", str(self.threads), "-c", str(self.context),
               "--host", "127.0.0.1", "--port", str(self.port), "--no-webui", "-np", "1"]
        if _needs_no_repack():
            cmd.append("--no-repack")
        if self.draft is not None and self.eagle3:
            # a chain of exactly draft_max tokens (no probability cut-off), the shape eagle:HEAD@K:Kx1 drafts
            cmd += ["-md", str(self.draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(self.draft_max),
                    "--spec-draft-p-min", "0"]
        elif self.draft is not None:
            cmd += ["-md", str(self.draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(self.draft_max)]
        return cmd

    def __enter__(self) -> "LlamaServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until it reports healthy: LlamaCppUnavailable (with the end of its
        log) as soon as it exits, or when it is not healthy within `start_timeout()`."""
        self._log = tempfile.TemporaryFile(mode="w+", prefix="llama-server-", suffix=".log")
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, text=True)
        limit = start_timeout(self.model, self.draft)
        if wait_healthy(self.url, self.proc, limit):
            return
        if self.proc.poll() is not None:
            code = self.proc.returncode
            tail = self.log_tail()
            self.stop()
            raise LlamaCppUnavailable(f"{SERVER} exited with code {code} while loading {self.model.name}:\n" + tail)
        tail = self.log_tail()
        self.stop()
        raise LlamaCppUnavailable(f"{SERVER} on {self.model.name} did not become healthy within {limit:.0f} s; "
                                  f"its log ends:\n{tail}")

    def log_tail(self, lines: int = 8) -> str:
        """The last `lines` lines the server wrote."""
        log = self._log
        if log is None or log.closed:
            return ""
        log.flush()
        log.seek(0)
        return "\n".join(log.read()[-20000:].splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0) -> tuple[list[int], dict]:
        """(new token ids, the server's `timings`) for prompt `ids`; greedy at temperature 0.
        LlamaCppServerError when the server does not answer within `request_timeout()` or answers
        something that is not a completion."""
        body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": temperature, "top_p": top_p,
                "top_k": top_k, "seed": seed, "cache_prompt": False, "return_tokens": True}
        request = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        limit = request_timeout(len(ids), max_new_tokens)
        who = f"{SERVER} on {self.model.name} ({self.url})"
        try:
            with urllib.request.urlopen(request, timeout=limit) as r:
                raw = r.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:200].decode(errors="replace").strip()
            raise LlamaCppServerError(f"{who} answered HTTP {err.code} to a request: {detail!r}") from err
        except (TimeoutError, socket.timeout) as err:
            raise LlamaCppServerError(f"{who} did not answer a request of {max_new_tokens} new tokens within "
                                      f"{limit:.0f} s; it may be stuck (its log ends: "
                                      f"{self.log_tail(1)!r})") from err
        except urllib.error.URLError as err:
            if isinstance(err.reason, (TimeoutError, socket.timeout)):
                raise LlamaCppServerError(f"{who} did not answer a request within {limit:.0f} s") from err
            raise LlamaCppServerError(f"{who} failed a request ({ascii(str(err.reason)[:200])})") from err
        except (http.client.HTTPException, OSError) as err:  # not HTTP at all, a dropped connection
            raise LlamaCppServerError(f"{who} did not answer in HTTP ({type(err).__name__}: "
                                      f"{ascii(str(err)[:80])})") from err
        return parse_completion(raw, who)


def parse_completion(raw: bytes, who: str = SERVER) -> tuple[list[int], dict]:
    """(tokens, timings) of a /completion reply body; LlamaCppServerError naming `who` and what was
    wrong when it is not a JSON object with a list of token ids "tokens" and an object "timings"
    (whose draft counts, when there, are integers >= 0)."""
    try:
        reply = json.loads(raw)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise LlamaCppServerError(f"{who} answered a request with something that is not JSON: "
                                  f"{raw[:80]!r}") from None
    if not isinstance(reply, dict):
        raise LlamaCppServerError(f"{who} answered a request with JSON that is not an object: {str(reply)[:80]}")
    tokens = reply.get("tokens")
    if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens):
        raise LlamaCppServerError(f"{who} answered without a list of token ids in 'tokens' (got "
                                  f"{str(tokens)[:80]}); is it a llama.cpp build that takes return_tokens?")
    timings = reply.get("timings", {})
    if not isinstance(timings, dict):
        raise LlamaCppServerError(f"{who} answered with 'timings' that is not an object: {str(timings)[:80]}")
    for key in ("draft_n", "draft_n_accepted"):
        value = timings.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise LlamaCppServerError(f"{who} answered with timings.{key} = {value!r}, not a count")
    return list(tokens), timings


def stats_from_timings(timings: dict, new_tokens: int, wall_s: float) -> dict | None:
    """An AcceptanceStats dict from a speculative request's timings (None without drafts): every
    target forward emits its accepted drafts plus one token, so forwards = tokens - accepted."""
    if "draft_n" not in timings:
        return None
    accepted = int(timings.get("draft_n_accepted", 0))
    stats = AcceptanceStats(target_forwards=max(1, new_tokens - accepted), drafted_tokens=int(timings["draft_n"]),
                            accepted_tokens=accepted, generated_tokens=new_tokens, wall_s=wall_s, num_calls=1)
    return stats.to_dict()
