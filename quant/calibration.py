"""Token windows for calibration and perplexity: ShareGPT slices, Python stdlib sources, jsonl, datasets.

Texts are tokenized in order, joined with the EOS token, and cut into contiguous windows of
`seq_len` tokens (no padding, no randomness: the same call gives the same windows). Contiguous
windows follow a few long texts: 32 windows of 512 tokens of the held-out ShareGPT slice span 9
conversations, nearly all one thread. `one_per_text=True` takes each window from the start of
its own text instead (texts shorter than a window are skipped), so N windows span N texts.
Calibration reads the ShareGPT "calibration" slice, Python sources of installed third-party
packages ("code"), or both ("sharegpt+code": half the windows each, interleaved); evaluation reads
the disjoint "heldout" slice or stdlib sources (`runtime.data`), so scored text never overlaps
calibration text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from runtime.data import python_package_texts, python_stdlib_texts, sharegpt_conversations


def conversation_text(tokenizer: Any, turns: list[dict]) -> str:
    """One conversation as text: the tokenizer's chat template when it has one, else 'role: content' lines."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tokenize=False)
    return "\n".join(f"{t['role']}: {t['content']}" for t in turns)


def _record_text(tokenizer: Any, record: dict) -> str:
    if "text" in record:
        return str(record["text"])
    for key in ("messages", "conversations"):
        if key in record:
            turns = [{"role": t.get("role", t.get("from", "user")), "content": t.get("content", t.get("value", ""))}
                     for t in record[key]]
            return conversation_text(tokenizer, turns)
    raise ValueError(f"calibration record has none of the fields 'text', 'messages', 'conversations': "
                     f"{sorted(record)}")


def _jsonl_records(path: Path) -> Iterator[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {path} does not exist")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno} is not valid JSON ({err}); expected one object per line "
                                     "with a 'text' (or 'messages') field") from err


def _texts(tokenizer: Any, source: Any, split: str) -> Iterator[str]:
    if isinstance(source, str) and source == "sharegpt":
        for turns in sharegpt_conversations(split):
            yield conversation_text(tokenizer, turns)
    elif isinstance(source, str) and source == "stdlib":
        yield from python_stdlib_texts()
    elif isinstance(source, str) and source == "code":
        yield from python_package_texts()
    elif isinstance(source, (str, Path)):
        for record in _jsonl_records(Path(source)):
            yield _record_text(tokenizer, record)
    elif hasattr(source, "column_names"):  # a datasets.Dataset
        for record in source:
            yield _record_text(tokenizer, record)
    else:
        raise ValueError(f"source must be 'sharegpt', 'code', 'sharegpt+code', a .jsonl path or a datasets.Dataset, "
                         f"got {source!r}")


def pack_windows(tokenizer: Any, texts: Iterable[str], n_samples: int, seq_len: int,
                 what: str = "text", one_per_text: bool = False) -> torch.Tensor:
    """Tokenize texts in order (EOS between them) into `n_samples` windows of `seq_len`: LongTensor (N, T).

    one_per_text: window i is the first `seq_len` tokens of the i-th text that has that many.
    """
    if n_samples < 1 or seq_len < 2:
        raise ValueError(f"need n_samples >= 1 and seq_len >= 2, got {n_samples} and {seq_len}")
    if one_per_text:
        return _first_windows(tokenizer, texts, n_samples, seq_len, what)
    needed = n_samples * seq_len
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
        if len(ids) >= needed:
            break
    if len(ids) < needed:
        raise ValueError(f"{what} holds only {len(ids)} tokens but {n_samples} samples x {seq_len} tokens = "
                         f"{needed} were requested; lower n_samples or seq_len, or provide more text")
    return torch.tensor(ids[:needed], dtype=torch.long).view(n_samples, seq_len)


def _first_windows(tokenizer: Any, texts: Iterable[str], n_samples: int, seq_len: int, what: str) -> torch.Tensor:
    windows: list[list[int]] = []
    seen = 0
    for text in texts:
        seen += 1
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= seq_len:
            windows.append(ids[:seq_len])
            if len(windows) == n_samples:
                return torch.tensor(windows, dtype=torch.long)  # (N, T)
    raise ValueError(f"{what} holds only {len(windows)} texts of >= {seq_len} tokens (of {seen}) but "
                     f"{n_samples} windows, one per text, were requested; lower n_samples or seq_len")


def calibration_batches(tokenizer: Any, source: Any = "sharegpt", n_samples: int = 128,
                        seq_len: int = 512, one_per_text: bool = False) -> torch.Tensor:
    """Calibration windows (N, T) from the ShareGPT calibration slice, code, a jsonl path or a datasets Dataset.

    source: "sharegpt"; "code" (Python sources of installed third-party packages, never the
    stdlib files that code perplexity scores); "sharegpt+code" (N // 2 code windows interleaved
    with the rest from ShareGPT: for code models, whose GPTQ calibrated on chat alone fits code
    worse); a jsonl path or a datasets Dataset, whose records need a 'text' field, or 'messages' /
    'conversations' turns (rendered with the tokenizer's chat template). `one_per_text`: each
    window from the start of its own text (see the module docstring).
    """
    if isinstance(source, str) and source == "sharegpt+code":
        n_code = n_samples // 2
        chat = calibration_batches(tokenizer, "sharegpt", n_samples - n_code, seq_len, one_per_text)  # (N - N//2, T)
        if n_code == 0:
            return chat
        code = calibration_batches(tokenizer, "code", n_code, seq_len, one_per_text)  # (N//2, T)
        rows = [r for pair in zip(chat, code) for r in pair] + list(chat[n_code:])
        return torch.stack(rows)
    what = f"calibration source {source!r}" if isinstance(source, (str, Path)) else "calibration source"
    return pack_windows(tokenizer, _texts(tokenizer, source, "calibration"), n_samples, seq_len, what=what,
                        one_per_text=one_per_text)


def eval_batches(tokenizer: Any, source: str = "sharegpt", n_samples: int = 32, seq_len: int = 512,
                 one_per_text: bool = False) -> torch.Tensor:
    """Perplexity windows (N, T): "sharegpt" reads the held-out slice, "stdlib" the Python stdlib sources.

    `one_per_text`: each window from the start of its own conversation / file (module docstring).
    """
    if source not in ("sharegpt", "stdlib"):
        raise ValueError(f"eval source must be 'sharegpt' (held-out slice) or 'stdlib', got {source!r}")
    return pack_windows(tokenizer, _texts(tokenizer, source, "heldout"), n_samples, seq_len,
                        what=f"eval source {source!r}", one_per_text=one_per_text)
