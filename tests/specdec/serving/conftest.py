"""Fixtures of the specdec serve tests: a tiny random Llama checkpoint with a whitespace tokenizer and
a chat template (built offline), greedy decoding alone, and plain HTTP calls."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import runtime
import specdec

WORDS = ["<unk>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>", "def", "return", "the", "a", "of", "x",
         "print", "hello", "world"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")
MODEL = "tiny-llama"
MAX_LEN = 1024
PROMPTS = ["return a of x", "print the world", "def hello x", "hello world", "the x of a", "print hello",
           "def the world", "a x a x"]


def tiny_tokenizer(eos: str) -> PreTrainedTokenizerFast:
    """A 128-word whitespace tokenizer with a chat template (built offline)."""
    words = WORDS + [f"w{i}" for i in range(128 - len(WORDS))]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token=eos,
                                   additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"],
                                   chat_template=CHAT_TEMPLATE)


def greedy(target, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    out = specdec.generate(target, [torch.tensor(ids)], max_new_tokens=max_new_tokens, eos_token_id=eos)
    return out.sequences[0][len(ids):].tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A random tiny Llama checkpoint whose eos is the 4th new token greedy decoding gives PROMPTS[0]."""
    path = tmp_path_factory.mktemp("server") / "ckpt"
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
                      bos_token_id=None, pad_token_id=None, eos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok = tiny_tokenizer("<|eos|>")
    probe = runtime.load_model(path, dtype=torch.float32)
    ids = tok(PROMPTS[0])["input_ids"]
    out = greedy(probe, ids, 8, eos=1)
    eos_id = next(t for i, t in enumerate(out) if i >= 3 and t not in out[:i] and t > 4)
    tiny_tokenizer(tok.convert_ids_to_tokens(eos_id)).save_pretrained(path)
    return path


def post(server, path: str, body: bytes | dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    status, payload = resp.status, json.loads(resp.read())
    conn.close()
    return status, payload


def get(server, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", path)
    resp = conn.getresponse()
    status, text = resp.status, resp.read().decode()
    conn.close()
    return status, text
