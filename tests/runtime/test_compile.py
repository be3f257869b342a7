"""runtime.compile_decode: the compiled short forwards equal the eager model's (float32)."""

import pytest
import torch

import specdec
from runtime import KVCache, compile_decode
from runtime import compile as rc
from runtime.compile import MAX_STATIC_TOKENS, CompileNotices, Regions, module_kind, static_tokens
from runtime.tiny import tiny_model
from specdec.capture import StateCapture


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _counting(fn, calls: list):
    def wrapped(*args):
        calls.append(args[0].shape)
        return fn(*args)
    return wrapped


def _prompts(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g) for n in lengths]


def test_static_tokens_pads_to_few_shapes():
    assert [static_tokens(n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 32)] == [1, 8, 8, 8, 8, 8, 16, 32, 32]
    # a draft's 2-token catch-up feed (selected logits) gets its own program
    assert [static_tokens(n, selected=True) for n in (1, 2, 3, 9)] == [1, 2, 8, 16]
    assert [static_tokens(n, row_cost=True) for n in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 8, 16]


def test_compile_decode_rejects_what_it_cannot_compile():
    with pytest.raises(TypeError, match="runtime Transformer"):
        compile_decode(torch.nn.Linear(4, 4))


def test_the_model_owns_its_compiled_step():
    """runtime.compile_decode(model) is model.compile_decode(); compiled_step = None runs eagerly again."""
    model = tiny_model("llama", seed=2)
    assert model.compiled_step is None and not model.compiled
    assert compile_decode(model) is model and model.compiled
    assert model.compile_decode(cpp_wrapper=False) is model and callable(model.compiled_step)
    calls = []
    model.compiled_step = _counting(model.compiled_step, calls)
    model.compiled_step = None
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]), torch.arange(2)[None], model.new_cache(1, 8))
    assert not model.compiled and calls == []


def test_compile_decode_without_a_cpu_compiler_says_what_to_install(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "no-such-compiler-xyz"))
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler.*install g\\+\\+"):
        compile_decode(tiny_model("llama", seed=0))


@pytest.mark.parametrize("family,extra", [("qwen2", {}), ("mistral", {"sliding_window": 8})])
def test_compiled_steps_equal_eager_steps(family, extra):
    eager = tiny_model(family, seed=3, **extra)
    compiled = compile_decode(tiny_model(family, seed=3, **extra))
    ids = torch.randint(0, 128, (2, 26), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(26)[None].expand(2, -1)
    caches = [m.new_cache(2, 40) for m in (eager, compiled)]
    assert caches[1].max_seq_len == 40 + MAX_STATIC_TOKENS  # room for the padded tokens
    calls = []
    compiled.compiled_step = _counting(compiled.compiled_step, calls)
    with torch.inference_mode():
        outs = []
        for m, cache in zip((eager, compiled), caches):
            steps = [m(ids[:, :10], pos[:, :10], cache).logits]  # prefill, padded to 16
            steps += [m(ids[:, t:t + 1], pos[:, t:t + 1], cache).logits for t in range(10, 14)]  # T = 1
            steps.append(m(ids[:, 14:17], pos[:, 14:17], cache).logits)  # T = 3, padded to 8
            last = torch.tensor([[6], [2]])  # selected logits (a draft's catch-up feed): compiled too
            steps.append(m(ids[:, 17:24], pos[:, 17:24], cache, logits_idx=last).logits)  # T = 7, padded to 8
            last2 = torch.tensor([[1], [1]])  # a 2-token catch-up feed: its own 2-token program
            steps.append(m(ids[:, 24:26], pos[:, 24:26], cache, logits_idx=last2).logits)
            outs.append(torch.cat(steps, 1))
    assert _rel(outs[1], outs[0]) <= 1e-5
    assert len(calls) == 8  # every forward took the compiled program (a 10-token prefill: T <= 32)
    assert calls[-1] == (2, 2)  # the 2-token feed was not padded to 8
    assert torch.equal(caches[0].lengths, caches[1].lengths)
    n = int(caches[0].lengths[0])
    assert _rel(caches[1].k[:, :, :, :n], caches[0].k[:, :, :, :n]) <= 1e-5


def test_a_two_token_prompt_with_selected_logits_stays_padded_to_eight():
    """Only a feed after the prompt (a draft's catch-up) gets the 2-token program: a target's
    2-token prompt must not compile a program (and a weight copy) of its own."""
    model = compile_decode(tiny_model("llama", seed=5))
    calls = []
    model.compiled_step = _counting(model.compiled_step, calls)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.inference_mode():
        cache = model.new_cache(1, 16)
        model(ids[:, :2], torch.arange(2)[None], cache, logits_idx=torch.tensor([[1]]))
        model(ids[:, 2:], torch.arange(2, 4)[None], cache, logits_idx=torch.tensor([[1]]))
    assert [c[1] for c in calls] == [8, 2]


def test_no_room_for_padding_runs_the_exact_shape():
    eager = tiny_model("llama", seed=4)
    compiled = compile_decode(tiny_model("llama", seed=4))
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(8)[None]
    outs = []
    with torch.inference_mode():
        for m in (eager, compiled):
            cfg = m.config  # 8 slots: 5 filled + 3 new leaves no room for the padding to 8
            cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, 8, cfg.head_dim)
            m(ids[:, :5], pos[:, :5], cache)
            outs.append(m(ids[:, 5:], pos[:, 5:], cache).logits)
    assert _rel(outs[1], outs[0]) <= 1e-5


def test_compiled_generate_equals_eager_plain_and_speculative():
    eager = tiny_model("llama", seed=5)
    target = compile_decode(tiny_model("llama", seed=5))
    draft = compile_decode(tiny_model("llama", seed=6))
    rows = _prompts([7, 12])  # ragged rows: the non-uniform write path
    want = specdec.generate(eager, rows, max_new_tokens=20).sequences
    plain = specdec.generate(target, rows, max_new_tokens=20).sequences
    spec = specdec.generate(target, rows, draft=draft, num_draft_tokens=3, max_new_tokens=20).sequences
    for w, p, s in zip(want, plain, spec):
        assert torch.equal(p, w) and torch.equal(s, w)


def test_auto_draft_length_on_a_compiled_target_stays_in_one_program():
    target = compile_decode(tiny_model("llama", seed=5))
    calls = []
    target.compiled_step = _counting(target.compiled_step, calls)
    same = tiny_model("llama", seed=5)  # draft = target: every draft is accepted, auto grows k
    rows = _prompts([9])
    want = specdec.generate(same, rows, max_new_tokens=40).sequences
    out = specdec.generate(target, rows, draft=same, num_draft_tokens="auto", max_new_tokens=40)
    assert torch.equal(out.sequences[0], want[0])
    assert len(out.stats.per_position_acceptance) == 7  # reached k = 7 and never went past it
    # the 9-token prefill ran eagerly: no 16-token program. The k chosen from measured costs depends on
    # timing, so the last step may have room for one token only: the one-token decode program
    assert {shape[1] for shape in calls[:-1]} == {8} and calls[-1][1] in (1, 8)


def test_max_autotune_quantized_model_equals_eager():
    import quant

    cfg = quant.Int4WeightOnly(group_size=32, include_lm_head=True)
    eager, compiled = (quant.quantize_(tiny_model("qwen2", seed=3).to(torch.bfloat16), cfg, progress=False)
                       for _ in range(2))
    compile_decode(compiled, max_autotune=True)  # the packed INT4 matmul gets Inductor's own kernel as a choice
    rows = _prompts([9])
    want = specdec.generate(eager, rows, max_new_tokens=12).sequences[0]
    assert torch.equal(specdec.generate(compiled, rows, max_new_tokens=12).sequences[0], want)


def _tree_block(parent: list[int]) -> torch.Tensor:
    """(N, N) bool: node i sees node j when j is i or one of its ancestors."""
    n = len(parent)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parent[j]
    return anc


@pytest.mark.parametrize("family,extra,compiled_tree", [("qwen2", {}, True),
                                                        ("mistral", {"sliding_window": 12}, False)])
def test_block_mask_steps_run_compiled_and_equal_eager_steps(family, extra, compiled_tree):
    """A tree step (block_mask over the new tokens) runs compiled, a tree of up to 8 tokens padded to
    8 (a suffix match's tree changes size every step), with the eager model's logits, hidden states
    and cache; one that the sliding window cuts (a 9-token row + 6 tree tokens over a 12-token
    window) runs eagerly."""
    from specdec.rows import prefill

    parent = [-1, 0, 0, 1, 1, 2]
    depth = torch.tensor([0, 1, 1, 2, 2, 2])
    block = _tree_block(parent).expand(2, 6, 6)  # (B, N, N)
    rows = _prompts([5, 9], seed=2)  # ragged rows: the tree sits at different slots per row
    tree_ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    eager = tiny_model(family, seed=3, **extra)
    compiled = compile_decode(tiny_model(family, seed=3, **extra))
    calls = []
    compiled.compiled_step = _counting(compiled.compiled_step, calls)
    outs = []
    with torch.inference_mode():
        for m in (eager, compiled):
            cache = m.new_cache(2, 24)
            prefill(m, rows, cache)
            pos = cache.lengths[:, None] + depth[None]  # (B, N)
            logits, hidden, _ = m(tree_ids, pos, cache, block_mask=block, return_hidden=True)
            outs.append((logits, hidden, cache))
    (le, he, ce), (lc, hc, cc) = outs
    assert _rel(lc, le) <= 1e-5 and _rel(hc, he) <= 1e-5
    assert torch.equal(ce.lengths, cc.lengths) and ce.lengths.tolist() == [11, 15]
    for b, n in enumerate(ce.lengths.tolist()):
        assert _rel(cc.k[:, b, :, :n], ce.k[:, b, :, :n]) <= 1e-5
    assert ((2, 8) in calls) == compiled_tree  # padded like a causal block of 6 tokens
    with pytest.raises(ValueError, match="either mask"):
        eager(tree_ids, pos, ce, mask=torch.ones(2, 6, 21, dtype=torch.bool), block_mask=block)


def test_tree_programs_above_eight_tokens_run_at_their_own_size():
    """A 12-node tree (Medusa's, EAGLE's) runs compiled at its own size, equal to the eager step."""
    from specdec.rows import prefill

    parent = [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7]
    block = _tree_block(parent)[None]  # (1, 12, 12)
    depth = torch.tensor([0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4])
    tree_ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    eager = tiny_model("qwen2", seed=4)
    compiled = compile_decode(tiny_model("qwen2", seed=4))
    calls = []
    compiled.compiled_step = _counting(compiled.compiled_step, calls)
    outs = []
    with torch.inference_mode():
        for m in (eager, compiled):
            cache = m.new_cache(1, 40)
            prefill(m, _prompts([7], seed=4), cache)
            pos = cache.lengths[:, None] + depth[None]  # (1, N)
            outs.append(m(tree_ids, pos, cache, block_mask=block).logits)
    assert _rel(outs[1], outs[0]) <= 1e-5
    assert calls[-1] == (1, 12)  # the tree at its own size (the 7-token prefill took the 8-token program)


def test_a_tree_step_takes_an_expanded_or_a_contiguous_block_mask():
    """One tree shape, its mask expanded over the batch (stride 0) and then contiguous: one program
    serves both (a program asserts its inputs' strides) with the same logits."""
    from specdec.rows import prefill

    parent = [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7]
    depth = torch.tensor([0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4])
    tree_ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    compiled = compile_decode(tiny_model("qwen2", seed=4))
    outs = []
    with torch.inference_mode():
        for block in (_tree_block(parent).expand(2, 12, 12), _tree_block(parent).repeat(2, 1, 1)):
            cache = compiled.new_cache(2, 40)
            prefill(compiled, _prompts([7, 5], seed=4), cache)
            pos = cache.lengths[:, None] + depth[None]  # (2, N)
            outs.append(compiled(tree_ids, pos, cache, block_mask=block).logits)
    assert torch.equal(outs[0], outs[1])


def test_compiled_steps_return_the_eager_hidden_states():
    """return_hidden takes the compiled program too (self-distillation data, Medusa's prefill)."""
    eager = tiny_model("llama", seed=7)
    compiled = compile_decode(tiny_model("llama", seed=7))
    calls = []
    compiled.compiled_step = _counting(compiled.compiled_step, calls)
    rows = _prompts([6, 4])
    cap_eager, cap_compiled = StateCapture(hidden=True), StateCapture(hidden=True)
    want = specdec.generate(eager, rows, max_new_tokens=6, observer=cap_eager)
    got = specdec.generate(compiled, rows, max_new_tokens=6, observer=cap_compiled)
    for a, b, ha, hb in zip(want.sequences, got.sequences, cap_eager.hidden_states, cap_compiled.hidden_states):
        assert torch.equal(a, b) and _rel(hb, ha) <= 1e-5
    assert {shape[1] for shape in calls} == {1, 8}  # the 6-token prefill padded to 8, then 1-token steps


def test_a_slow_first_program_says_it_is_compiling_and_a_fast_one_is_quiet(capsys):
    import time

    notices = CompileNotices(after_s=0.05)
    assert notices.run(("a", 8), "the 8-token step", lambda: time.sleep(0.3) or 7) == 7
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("compiling the 8-token step (once per shape") and err[1].startswith(
        "compiled the 8-token step in ")
    assert notices.run(("a", 8), "the 8-token step", lambda: time.sleep(0.3) or 8) == 8  # built: no line
    assert notices.run(("b", 1), "the 1-token step", lambda: 9) == 9  # quick (a cached program): no line
    assert capsys.readouterr().err == ""


def _step_programs(model, steps: list[int]) -> tuple[torch.Tensor, int]:
    """Logits of a 5-token prompt and then `steps` tokens at a time, and the programs built."""
    ids = torch.randint(0, 128, (1, 5 + sum(steps)), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(1, 40)
    out, t = [], 0
    with torch.inference_mode():
        for n in [5, *steps]:
            out.append(model(ids[:, t:t + n], torch.arange(t, t + n)[None], cache).logits)
            t += n
    programs = model.compiled_step.regions.programs if model.compiled else 0
    return torch.cat(out, 1), programs


def test_the_layers_of_one_kind_share_one_program_per_shape():
    """Every decoder layer runs the same compiled program (one per shape, plus one each for the embedding
    and the head), so a new shape builds one layer, not the whole model; a layer of another kind gets a
    program of its own."""
    eager = tiny_model("llama", seed=2, num_hidden_layers=3)
    want, _ = _step_programs(eager, [1, 1, 3])
    got, programs = _step_programs(compile_decode(tiny_model("llama", seed=2, num_hidden_layers=3)), [1, 1, 3])
    assert _rel(got, want) <= 1e-5 and programs == 6  # (embedding, layer, head) x the 8-token and 1-token shapes
    kinds = {module_kind(layer) for layer in eager.layers}
    assert len(kinds) == 1

    mixed = tiny_model("llama", seed=2, num_hidden_layers=3)
    w2 = mixed.layers[1].mlp.w2
    biased = torch.nn.Linear(w2.in_features, w2.out_features, bias=True)  # another kind of layer
    with torch.no_grad():
        biased.weight.copy_(w2.weight)
        biased.bias.zero_()
    mixed.layers[1].mlp.w2 = biased
    got, programs = _step_programs(compile_decode(mixed), [1, 1, 3])
    assert _rel(got, want) <= 1e-5 and programs == 8  # embedding, two layer kinds and the head, two shapes


class _Scaled(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self._scale = scale  # private: not part of module_kind, but the compiled program bakes it in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight * self._scale


def _scaled(module: _Scaled, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def test_a_module_the_programs_guards_reject_gets_its_own_program():
    """Two modules of one kind that differ in something the program specializes on: the guards,
    checked on each owner's first call, send the second to a program of its own."""
    regions = Regions(cpp_wrapper=False)
    a, b = _Scaled(2.0), _Scaled(3.0)
    assert module_kind(a) == module_kind(b)
    x = torch.arange(4.0)
    with torch.inference_mode():
        assert torch.equal(regions.run(_scaled, 0, (a,), x), x * 2)
        assert torch.equal(regions.run(_scaled, 1, (b,), x), x * 3)
        assert torch.equal(regions.run(_scaled, 0, (a,), x), x * 2)
    assert regions.programs == 2


class _Branching(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.weight
        return y + 1 if y.sum().item() > 0 else y - 1  # data-dependent: Dynamo breaks the graph here


def _branching(module: _Branching, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def test_a_region_with_a_graph_break_still_runs_compiled_with_its_guards():
    regions = Regions(cpp_wrapper=False)
    module, x = _Branching(), torch.arange(4.0)
    with torch.inference_mode():
        assert torch.equal(regions.run(_branching, 0, (module,), x), x + 1)
        assert torch.equal(regions.run(_branching, 0, (module,), -x - 1), -x - 2)
    assert regions.programs == 1


def _cached_steps(model, direct: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Logits of a prompt and three 1- / 3-token steps, the cache after them, and the direct call sites."""
    model.compiled_step.regions.direct = direct
    model.compiled_step.regions._calls.clear()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(1, 40)
    out, t = [], 0
    with torch.inference_mode():
        for n in (5, 1, 3, 1, 1):
            out.append(model(ids[:, t:t + n], torch.arange(t, t + n)[None], cache).logits)
            t += n
    return torch.cat(out, 1), torch.cat([cache.k, cache.v]), model.compiled_step.regions.direct_calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_later_calls_run_each_program_graph_directly_with_the_same_bits(dtype):
    """After its first call, a call site (step shape, layer) hands the program's Inductor graph its flat
    inputs itself: every layer and the head, bit for bit what the program gives, caches included."""
    model = compile_decode(tiny_model("llama", seed=3, dtype=dtype, num_hidden_layers=3))
    want, want_cache, none = _cached_steps(model, direct=False)
    got, got_cache, sites = _cached_steps(model, direct=True)
    assert none == 0 and sites == 2 * (1 + 3 + 1)  # (the embedding, 3 layers, the head) x the 4- and 1-token steps
    assert torch.equal(got, want) and torch.equal(got_cache, want_cache)


def test_a_direct_call_that_differs_from_its_program_is_not_kept(monkeypatch):
    """The first call of a site checks the direct call against the program; if they differ the site
    keeps the program, and the call's result and the cache are the program's."""
    model = compile_decode(tiny_model("llama", seed=3, num_hidden_layers=2))
    want, want_cache, _ = _cached_steps(model, direct=False)
    run = rc._Direct.__call__
    monkeypatch.setattr(rc._Direct, "__call__", lambda self, *values: _off_by_one(run(self, *values)))
    got, got_cache, sites = _cached_steps(model, direct=True)
    assert sites == 0 and torch.equal(got, want) and torch.equal(got_cache, want_cache)


def _off_by_one(out):
    return tuple(t + 1 for t in out) if isinstance(out, tuple) else out + 1


def test_direct_calls_read_parameters_per_call_and_stay_off_with_grad():
    """A parameter reassigned after the first call is what the next direct call reads, as the program
    would; calls with grad enabled keep the program (its autograd wrappers)."""
    regions = Regions(cpp_wrapper=False)
    module, x = _Scaled(2.0), torch.arange(4.0)
    with torch.inference_mode():
        assert torch.equal(regions.run(_scaled, 0, (module,), x), x * 2)
    assert regions.direct_calls == 1
    module.weight = torch.nn.Parameter(torch.full((4,), 3.0))
    with torch.inference_mode():
        assert torch.equal(regions.run(_scaled, 0, (module,), x), x * 6)
    regions.step = "with grad"
    assert torch.equal(regions.run(_scaled, 0, (module,), x), x * 6)
    assert regions.direct_calls == 1
