"""benchmarks/serve_load.py's in-process mode: requests submitted to the engine at their arrival
times are each answered once, as generate() answers them alone."""

import json

import torch

import specdec
from runtime.tiny import tiny_model
from specdec.serving.engine import Engine


def test_the_in_process_mode_answers_every_request_as_generate_does(load):
    serve_load = load("serve_load")
    model = tiny_model("llama", seed=3, vocab_size=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 9, 3, 7, 4)]
    limits = [6, 3, 8, 5, 2]
    offsets = serve_load.arrivals(len(prompts), 0.01, "poisson", seed=0)
    engine = Engine(model, "ngram", max_batch=2, max_len=32, num_draft_tokens=3)
    results, start = serve_load.run_engine_mode(engine, prompts, offsets, limits)
    refs = [specdec.generate(model, [torch.tensor(p)], draft="ngram", max_new_tokens=n, num_draft_tokens=3)
            .sequences[0][len(p):].tolist() for p, n in zip(prompts, limits)]
    summary = serve_load.summarize("continuous_in_process", results, start, refs, None)
    assert summary["answered"] == 5 and summary["lost"] == 0 and summary["duplicated"] == 0
    assert summary["matches_single_request"] == 5
    assert all(r.first is not None and r.arrival <= r.first <= r.done for r in results)


def test_a_streamed_error_event_counts_as_an_error_not_an_answer(load):
    """The server ends a failed request's stream with an error event then [DONE]: the load test
    records it as an error (it used to count the partial text as answered)."""
    import http.server
    import threading

    serve_load = load("serve_load")
    events = [{"id": "cmpl-1", "choices": [{"text": "ab"}]}, {"error": {"message": "boom", "type": "server_error"}}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        res = serve_load.Result(0, 0.0)
        serve_load.stream_request(server.server_address[1], [1, 2], 4, res)
    finally:
        server.shutdown()
        server.server_close()
    assert res.error == "stream error: boom" and res.done is None
