"""llama.cpp as a baseline of `specdec eval`: method parsing, the message when it is not built, the
stats of its speculative decoding, and (where `make llamacpp` has run) a real run on smollm2."""

import json

import pytest

from specdec.evaluation import llamacpp
from specdec.evaluation.evaluate import EvalConfig, run_eval
from specdec.evaluation.llamacpp import LlamaCppUnavailable, LlamaServer, stats_from_timings
from specdec.evaluation.report import baseline_label
from specdec.methods import BaselineSpec, Method, parse_methods
from specdec.stats import AcceptanceStats

SMOLLM2 = "smollm2-135m-instruct"


def test_methods_parse():
    assert Method.parse("llamacpp") == Method("llamacpp", BaselineSpec("llamacpp"))
    spec = Method.parse("llamacpp-spec:qwen2.5-coder-0.5b-instruct@4")
    assert (spec.kind, spec.spec.arg, spec.draft_length) == ("llamacpp-spec", "qwen2.5-coder-0.5b-instruct", 4)
    with pytest.raises(ValueError, match="integer"):
        Method.parse("llamacpp-spec:x.gguf@auto")
    with pytest.raises(ValueError, match="needs a model"):
        Method.parse("llamacpp-spec")
    with pytest.raises(ValueError, match="takes no argument"):
        Method.parse("llamacpp:x")
    assert len(parse_methods("llamacpp-spec:a@2,llamacpp-spec:a@4")) == 2  # llama.cpp's draft lengths compared
    with pytest.raises(ValueError, match="at most one method of each baseline kind"):
        parse_methods("llamacpp-spec:a@4,llamacpp-spec:b@4")


def test_eagle3_method_parses_and_drafts_a_fixed_chain(tmp_path, monkeypatch):
    spec = Method.parse("llamacpp-eagle3:out/head.gguf@5")
    assert (spec.kind, spec.spec.arg, spec.draft_length) == ("llamacpp-eagle3", "out/head.gguf", 5)
    assert baseline_label(spec.name) == "llamacpp-eagle3@5"
    with pytest.raises(ValueError, match="integer"):
        Method.parse("llamacpp-eagle3:head.gguf@auto")
    with pytest.raises(ValueError, match="needs a model"):
        Method.parse("llamacpp-eagle3")
    monkeypatch.setenv("SPECDEC_LLAMACPP", str(tmp_path))
    (tmp_path / "llama-server").write_text("")
    cmd = LlamaServer(tmp_path / "t.gguf", tmp_path / "h.gguf", draft_max=5, eagle3=True).command()
    assert cmd[cmd.index("--spec-type") + 1] == "draft-eagle3"
    assert cmd[cmd.index("--spec-draft-n-max") + 1] == "5" and cmd[cmd.index("--spec-draft-p-min") + 1] == "0"


def test_a_missing_build_is_refused_with_the_command_that_builds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_LLAMACPP", str(tmp_path / "nowhere"))
    assert not llamacpp.available()
    with pytest.raises(LlamaCppUnavailable, match="make llamacpp"):
        llamacpp.server_binary()
    cfg = EvalConfig(out=str(tmp_path / "run"), methods="plain,llamacpp", target=SMOLLM2, dataset="humaneval",
                     limit=1, max_new_tokens=4)
    with pytest.raises(LlamaCppUnavailable, match="make llamacpp"):
        run_eval(cfg, progress=False)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_build_options_come_from_the_builds_cmake_cache(tmp_path, monkeypatch):
    """The check reports how llama.cpp was built (GGML_LLAMAFILE decides whether its batched forwards
    round like its one-token ones); a build without a CMake cache reports nothing."""
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("SPECDEC_LLAMACPP", str(tmp_path / "bin"))
    assert llamacpp.build_options() == {}
    (tmp_path / "CMakeCache.txt").write_text("# comment\n//ggml: use LLAMAFILE\nGGML_LLAMAFILE:BOOL=OFF\n"
                                             "GGML_NATIVE:BOOL=ON\nGGML_LLAMAFILE_EXTRA:BOOL=1\n")
    assert llamacpp.build_options() == {"GGML_LLAMAFILE": "OFF", "GGML_NATIVE": "ON"}


def test_speculative_timings_become_acceptance_stats():
    assert stats_from_timings({"predicted_n": 10}, 10, 1.0) is None  # plain decoding drafts nothing
    stats = AcceptanceStats.from_dict(stats_from_timings({"draft_n": 12, "draft_n_accepted": 9}, 20, 2.0))
    assert stats.target_forwards == 11 and stats.acceptance_rate == 0.75
    assert stats.mean_accepted_tokens == pytest.approx(20 / 11)


@pytest.mark.real_model
@pytest.mark.skipif(not llamacpp.available(), reason="llama.cpp not built here (make llamacpp)")
def test_eval_runs_llamacpp_on_the_same_gguf(tmp_path):
    methods = f"plain,llamacpp,llamacpp-spec:{SMOLLM2}@3"
    cfg = EvalConfig(out=str(tmp_path / "run"), methods=methods, target=SMOLLM2, dataset="humaneval", limit=2,
                     raw=True, max_new_tokens=24, warmup=0)
    report = run_eval(cfg, progress=False)
    plain, spec = (report["methods"][m]["overall"] for m in ("llamacpp", f"llamacpp-spec:{SMOLLM2}@3"))
    assert plain["tokens_per_second"] > 0 and plain["tau"] is None
    assert spec["tau"] > 2.5  # the model drafting for itself: nearly every draft is accepted
    assert {"speedup_vs_llamacpp", "speedup_vs_llamacpp-spec@3"} <= set(report["methods"]["plain"]["overall"])
    lines = [json.loads(x) for x in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    outputs = {}
    for line in lines:
        outputs.setdefault(line["id"], {})[line["method"]] = line["output_ids"]
    for by_method in outputs.values():  # llama.cpp's greedy speculative decoding equals its plain decoding
        assert by_method["llamacpp"] == by_method[f"llamacpp-spec:{SMOLLM2}@3"]


@pytest.mark.real_model
@pytest.mark.skipif(not llamacpp.available(), reason="llama.cpp not built here (make llamacpp)")
def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    cfg = EvalConfig(out=str(tmp_path / "run"), methods="plain,llamacpp-spec:qwen2.5-coder-0.5b-instruct@3",
                     target=SMOLLM2, dataset="humaneval", limit=1, raw=True, max_new_tokens=8, warmup=0)
    with pytest.raises(ValueError, match="tokenizers disagree"):
        run_eval(cfg, progress=False)


@pytest.mark.real_model
@pytest.mark.skipif(not llamacpp.available(), reason="llama.cpp not built here (make llamacpp)")
def test_an_eagle3_head_that_is_not_a_gguf_is_refused_with_the_export_command(tmp_path):
    cfg = EvalConfig(out=str(tmp_path / "run"), methods=f"plain,llamacpp-eagle3:{tmp_path}@3", target=SMOLLM2,
                     dataset="humaneval", limit=1, raw=True, max_new_tokens=4, warmup=0)
    with pytest.raises(ValueError, match="specdec export gguf HEAD_DIR --target smollm2-135m-instruct"):
        run_eval(cfg, progress=False)


FAKE_SERVER = '''#!{python}
"""A fake llama-server on 127.0.0.1: healthy at once, then /completion answers as FAKE_LLAMA_MODE says."""
import http.server, json, os, sys, time

mode = os.environ["FAKE_LLAMA_MODE"]
if mode == "exit":
    print("error: failed to load model", flush=True)
    sys.exit(3)
port = int(sys.argv[sys.argv.index("--port") + 1])
REPLIES = {{"garbage": b"{{not json", "not-an-object": b"[1, 2]", "no-tokens": json.dumps({{"content": "hi"}}).encode(),
           "bad-tokens": json.dumps({{"tokens": [1, "x"]}}).encode(),
           "bad-timings": json.dumps({{"tokens": [1, 2], "timings": {{"draft_n": "many"}}}}).encode(),
           "ok": json.dumps({{"tokens": [5, 6], "timings": {{"draft_n": 4, "draft_n_accepted": 3}}}}).encode()}}


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(503 if mode == "never-healthy" else 200)
        self.end_headers()
        self.wfile.write(b"{{}}")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if mode == "hang":
            time.sleep(600)
        if mode == "binary":
            self.wfile.write(bytes(range(256)))
            return
        if mode == "http-500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"out of memory")
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(REPLIES[mode])


http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    """`start(mode) -> LlamaServer` on a fake llama-server script (SPECDEC_LLAMACPP points at it)."""
    import sys

    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text(FAKE_SERVER.format(python=sys.executable))
    binary.chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("SPECDEC_LLAMACPP", str(binary.parent))
    servers = []

    def start(mode: str) -> LlamaServer:
        monkeypatch.setenv("FAKE_LLAMA_MODE", mode)
        server = LlamaServer(model, threads=1)
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()


def test_a_fake_servers_completion_is_read(fake_server):
    assert fake_server("ok").complete([1, 2, 3], 2) == ([5, 6], {"draft_n": 4, "draft_n_accepted": 3})


@pytest.mark.parametrize("mode,match", [
    ("garbage", "something that is not JSON"),
    ("not-an-object", "JSON that is not an object"),
    ("no-tokens", "without a list of token ids in 'tokens'"),
    ("bad-tokens", "without a list of token ids in 'tokens'"),
    ("bad-timings", "timings.draft_n = 'many', not a count"),
    ("binary", "did not answer in HTTP"),
    ("http-500", "answered HTTP 500 to a request: 'out of memory'"),
])
def test_malformed_server_output_is_one_error_naming_the_server(fake_server, mode, match):
    server = fake_server(mode)
    with pytest.raises(llamacpp.LlamaCppServerError, match=match) as err:
        server.complete([1, 2, 3], 4)
    assert str(err.value).startswith(f"llama-server on model.gguf ({server.url})") and "\n" not in str(err.value)


def test_a_server_that_never_answers_times_out_by_the_request_size(fake_server, monkeypatch):
    import time

    assert llamacpp.request_timeout(100, 128) == pytest.approx(60 + 128 + 5)  # not an hour
    monkeypatch.setattr(llamacpp, "REQUEST_BASE_S", 1.0)
    monkeypatch.setattr(llamacpp, "REQUEST_PER_TOKEN_S", 0.25)
    server = fake_server("hang")
    start = time.monotonic()
    with pytest.raises(llamacpp.LlamaCppServerError, match="did not answer a request of 4 new tokens within 2 s"):
        server.complete([1, 2, 3], 4)
    assert time.monotonic() - start < 10


def test_a_server_that_exits_or_never_gets_healthy_fails_fast(fake_server, monkeypatch):
    import time

    start = time.monotonic()
    with pytest.raises(LlamaCppUnavailable, match="exited with code 3 while loading model.gguf:\nerror: failed"):
        fake_server("exit")
    assert time.monotonic() - start < 10  # not the start time limit
    monkeypatch.setattr(llamacpp, "START_BASE_S", 2.0)
    with pytest.raises(LlamaCppUnavailable, match="did not become healthy within 2 s"):
        fake_server("never-healthy")
    assert llamacpp.start_timeout(None) == 2.0
