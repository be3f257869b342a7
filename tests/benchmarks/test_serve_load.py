"""benchmarks/serve_load.py's in-process mode: requests submitted to the engine at their arrival
times are each answered once, as generate() answers them alone."""

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
