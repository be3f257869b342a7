"""distill.data.code_prompts: HumanEval-shaped function stubs from Python sources, and the prompt mix."""

import ast

import pytest

from distill.data import code_prompts
from distill.data.code_prompts import cached_function_stubs, function_stubs, interleave, prompt_id, stub

SOURCE = '''
import os


def closest_pair(numbers: list[float], threshold: float = 0.5) -> bool:
    """Return True when two of `numbers` lie closer than `threshold`.

    >>> closest_pair([1.0, 2.0], 0.5)
    False
    """
    ordered = sorted(numbers)
    return any(b - a < threshold for a, b in zip(ordered, ordered[1:]))


def _private(x):
    """A private helper is not a prompt, however long its docstring is, really."""
    y = x
    return y


@staticmethod
def decorated(x):
    """A decorated function is left out: its decorator changes what the body means."""
    y = x
    return y


def short_doc(x):
    """Too short."""
    y = x
    return y


class Thing:
    def method(self):
        """Methods are left out: a prompt without its class would not make sense to answer."""
        y = 1
        return y
'''


def test_a_stub_is_the_signature_and_docstring_without_the_body():
    node = ast.parse(SOURCE).body[1]
    text = stub(node)
    assert text.startswith("def closest_pair(numbers: list[float], threshold: float=0.5) -> bool:\n")
    assert '>>> closest_pair([1.0, 2.0], 0.5)' in text and "sorted" not in text
    assert len(node.body) == 3  # the source tree keeps its body
    compile(text, "<stub>", "exec")  # a stub is valid Python


def test_function_stubs_keep_public_documented_module_level_functions(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text(SOURCE)
    (tmp_path / "broken.py").write_text("def f(:\n")  # unparsable sources are skipped
    stubs = function_stubs([src, tmp_path / "broken.py"], min_doc_chars=40)
    assert len(stubs) == 1 and stubs[0].startswith("def closest_pair(")
    assert function_stubs([src, src], min_doc_chars=40) == stubs  # duplicates dropped


def test_cached_stubs_are_parsed_once_and_read_back_in_order(tmp_path, monkeypatch):
    src = tmp_path / "mod.py"
    src.write_text(SOURCE)
    monkeypatch.setattr(code_prompts, "function_stubs", lambda: function_stubs([src], min_doc_chars=40))
    first = cached_function_stubs(tmp_path / "stubs.json")
    assert first and first[0].startswith("def closest_pair(")

    def unparsed():
        raise AssertionError("the cache should have been read instead of parsing the sources again")

    monkeypatch.setattr(code_prompts, "function_stubs", unparsed)
    assert cached_function_stubs(tmp_path / "stubs.json") == first


def test_prompt_ids_are_stable_and_far_above_sharegpt_indices():
    assert prompt_id("def f(): pass") == prompt_id("def f(): pass") != prompt_id("def g(): pass")
    assert prompt_id("def f(): pass") > 10**9


def test_interleave_keeps_the_share_in_every_prefix_then_appends_the_rest():
    a, b = [f"a{i}" for i in range(8)], [f"b{i}" for i in range(10)]
    out = interleave(a, b, 2 / 3)
    assert out[:6] == ["a0", "a1", "b0", "a2", "a3", "b1"]
    assert sorted(out) == sorted(a + b) and out[-6:] == b[4:]
    assert interleave(a, b, 0.0) == b + a and interleave(a, b, 1.0) == a + b
    with pytest.raises(ValueError, match="share"):
        interleave(a, b, 1.5)
