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
speculative output equals its plain output (BENCHMARKS.md section 10); `build_options()` says which
build runs.

On CPUs with AMX the server runs with weight repacking off (`--no-repack`): ggml's AMX path
crashes at the first forward on the 2-core Xeon VMs this was built on; elsewhere llama.cpp
keeps its repacked (faster) layouts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from runtime.errors import SpecdecError

SERVER = "llama-server"
START_TIMEOUT_S = 180.0


class LlamaCppUnavailable(SpecdecError):
    """llama.cpp is not built on this machine (or the server failed to start)."""


def bin_dir() -> Path:
    """Where the llama.cpp binaries are: $SPECDEC_LLAMACPP, else `make llamacpp`'s build folder."""
    from runtime.catalogue import cache_home

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


def _needs_no_repack() -> bool:
    from runtime.hardware import cpu_summary

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
        self.log: list[str] = []

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
        """Start the server and wait until it reports healthy (LlamaCppUnavailable if it exits)."""
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read() if self.proc.stdout else ""
                raise LlamaCppUnavailable(f"{SERVER} exited with code {self.proc.returncode} while loading "
                                          f"{self.model.name}:\n" + "\n".join(out.splitlines()[-8:]))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.stop()
        raise LlamaCppUnavailable(f"{SERVER} did not become healthy within {START_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0) -> tuple[list[int], dict]:
        """(new token ids, the server's `timings`) for prompt `ids`; greedy at temperature 0."""
        body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": temperature, "top_p": top_p,
                "top_k": top_k, "seed": seed, "cache_prompt": False, "return_tokens": True}
        request = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=3600) as r:
                reply = json.loads(r.read())
        except urllib.error.URLError as err:
            raise LlamaCppUnavailable(f"{SERVER} on {self.model.name} failed a request ({err})") from err
        return list(reply["tokens"]), reply.get("timings", {})


def stats_from_timings(timings: dict, new_tokens: int, wall_s: float) -> dict | None:
    """An AcceptanceStats dict from a speculative request's timings (None without drafts): every
    target forward emits its accepted drafts plus one token, so forwards = tokens - accepted."""
    if "draft_n" not in timings:
        return None
    from specdec.stats import AcceptanceStats

    accepted = int(timings.get("draft_n_accepted", 0))
    stats = AcceptanceStats(target_forwards=max(1, new_tokens - accepted), drafted_tokens=int(timings["draft_n"]),
                            accepted_tokens=accepted, generated_tokens=new_tokens, wall_s=wall_s, num_calls=1)
    return stats.to_dict()
