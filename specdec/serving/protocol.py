"""The OpenAI wire format of `specdec serve`: request checks, error bodies, responses and stream chunks.

`parse_completion` / `parse_chat` turn a decoded JSON body into a `GenerationRequest` or raise
`APIError`, whose `body()` is OpenAI's error object `{"error": {"message", "type", "param",
"code"}}` and whose `status` the HTTP reply carries. Parameters the server does not implement
(best_of, logprobs, echo, penalties, ...) are refused by name with a 400 instead of being ignored
silently, and so is a field the server does not know (a typo, another server's extension such as
`stop_token_ids`): 400 `unknown_parameter` naming it. `user` (OpenAI's end-user tag) is taken and
has no effect.

`IncrementalText` turns a growing list of token ids into text deltas for streaming: it decodes only
the ids from the previous step on (the prefix / read offsets of vLLM's incremental detokenizer, so
a streamed answer costs O(T) decoding in all rather than O(T^2)), holds back a trailing partial
UTF-8 character ("\\ufffd"), and ends the text before the first stop string (`stop`), holding
back a tail that may still become one.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from specdec.sampling import MIN_TEMPERATURE, MIN_TOP_P

# parameter -> the values it may take here (its OpenAI default, or an equivalent)
_UNSUPPORTED = {"best_of": (None, 1), "echo": (None, False), "logprobs": (None, False, 0),
                "top_logprobs": (None, 0), "suffix": (None, ""),
                "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
                "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
                "function_call": (None, "none"), "response_format": (None, {"type": "text"})}
# the fields each endpoint takes (besides the _UNSUPPORTED ones at their defaults)
_COMMON = ("model", "temperature", "top_p", "top_k", "seed", "n", "stop", "stream", "stream_options", "user")
_FIELDS = {"completions": ("prompt", "max_tokens") + _COMMON,
           "chat": ("messages", "max_completion_tokens", "max_tokens") + _COMMON}
MAX_SEED = 2 ** 63  # seeds are in [0, MAX_SEED), as SamplingParams takes them
_ROLES = ("system", "user", "assistant")
MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_N = 16  # choices per request: each is one row of the batch


class APIError(Exception):
    """A request the server refuses: HTTP `status` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request: the prompt as ids (chat template already applied) and its settings.

    max_tokens None = as many as the context leaves. chat: answer as chat.completion(.chunk)
    objects; include_usage: a streamed reply ends with a usage chunk (stream_options). n: choices
    sampled for the prompt (each one engine request; with a seed, choice i uses seed + i). stop:
    strings that end a choice's text (left out of it; finish_reason "stop")."""

    model: str
    prompt_ids: tuple[int, ...]
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stream: bool
    include_usage: bool
    chat: bool
    n: int = 1
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise APIError(400, "the prompt is empty after tokenization; send at least one token", "prompt")


def _check_type(body: dict, name: str, types: tuple[type, ...], what: str):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise APIError(400, f"'{name}' must be {what}, got {value!r}", name, "invalid_type")
    return value


def _known(body: dict, endpoint: str) -> None:
    """Refuse the first field that `endpoint` does not take (not one of its _FIELDS nor _UNSUPPORTED)."""
    fields = _FIELDS[endpoint]
    for name in body:
        if name not in fields and name not in _UNSUPPORTED:
            raise APIError(400, f"unknown parameter {name!r}; leave it out (this endpoint takes: "
                           f"{', '.join(fields)})", name, "unknown_parameter")


def _common(body: dict, served_model: str, endpoint: str) -> dict:
    """The settings both endpoints share, checked; raises APIError naming the first bad field."""
    if "model" not in body or body["model"] is None:
        raise APIError(400, f"missing required parameter 'model'; this server serves {served_model!r}",
                       "model", "missing_required_parameter")
    model = _check_type(body, "model", (str,), "a string")
    if model != served_model:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served_model!r} "
                       "(GET /v1/models lists it)", "model", "model_not_found")
    for name, allowed in _UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise APIError(400, f"'{name}' = {body[name]!r} is not supported by specdec serve; leave it out "
                           f"(supported: {', '.join(_FIELDS[endpoint])})", name, "unsupported_parameter")
    _known(body, endpoint)
    temperature = _check_type(body, "temperature", (int, float), "a number between 0 and 2")
    temperature = 1.0 if temperature is None else float(temperature)
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"'temperature' must be between 0 and 2 (0 = greedy), got {temperature}",
                       "temperature", "invalid_value")
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise APIError(400, f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature}: "
                       "a smaller one overflows float32 logits", "temperature", "invalid_value")
    top_p = _check_type(body, "top_p", (int, float), "a number in (0, 1]")
    top_p = 1.0 if top_p is None else float(top_p)
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, f"'top_p' must be in (0, 1], got {top_p}", "top_p", "invalid_value")
    if top_p < MIN_TOP_P:
        raise APIError(400, f"'top_p' must be at least {MIN_TOP_P:.3g} (float32's smallest normal number), got "
                       f"{top_p}", "top_p", "invalid_value")
    top_k = _check_type(body, "top_k", (int,), "an integer >= 0 (0 = off)") or 0
    if top_k < 0:
        raise APIError(400, f"'top_k' must be >= 0 (0 = off), got {top_k}", "top_k", "invalid_value")
    seed = _check_type(body, "seed", (int,), "an integer in [0, 2**63)")
    if seed is not None and not 0 <= seed < MAX_SEED:
        raise APIError(400, f"'seed' must be in [0, 2**63), got {seed}", "seed", "invalid_value")
    stream = _check_type(body, "stream", (bool,), "true or false") or False
    options = _check_type(body, "stream_options", (dict,), "an object like {\"include_usage\": true}") or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError(400, f"'stream_options.include_usage' must be true or false, got {include_usage!r}",
                       "stream_options", "invalid_type")
    n = _check_type(body, "n", (int,), f"an integer in [1, {MAX_N}]")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"'n' must be in [1, {MAX_N}] (choices per request), got {n}", "n", "invalid_value")
    return dict(model=model, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stream=stream,
                include_usage=include_usage, n=n, stop=_stop(body.get("stop")))


def _text(text: str, where: str, param: str) -> str:
    """`text` when it is valid Unicode; APIError 400 naming `where` for a lone surrogate (JSON lets
    "\\ud800" through, but it is no character: the tokenizer and the UTF-8 reply cannot take it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(400, f"'{where}' holds a lone surrogate \\u{ord(text[err.start]):04x} at character "
                       f"{err.start}, which is not text: send each character outside the BMP as a UTF-16 pair "
                       "(\\ud83d\\ude00) or as UTF-8", param, "invalid_value") from err
    return text


def _stop(value) -> tuple[str, ...]:
    """`stop`: None, a string, or a list of up to MAX_STOP non-empty strings."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, f"'stop' must be a string or a list of strings, got {value!r}", "stop", "invalid_type")
    if len(stops) > MAX_STOP or not all(stops):
        raise APIError(400, f"'stop' takes at most {MAX_STOP} non-empty strings, got {stops!r}", "stop",
                       "invalid_value")
    return tuple(dict.fromkeys(_text(s, "stop", "stop") for s in stops))


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None) -> int | None:
    for name in names:
        value = _check_type(body, name, (int,), "a positive integer")
        if value is None:
            continue
        if value < 1:
            raise APIError(400, f"'{name}' must be at least 1, got {value}", name, "invalid_value")
        return value
    return default


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def parse_completion(body: dict, served_model: str, tokenizer, vocab_size: int) -> GenerationRequest:
    """A /v1/completions body: `prompt` is a string, a list of token ids, or a one-element list of
    either (OpenAI's batch form with one prompt). max_tokens defaults to 16, as OpenAI's does."""
    common = _common(body, served_model, "completions")
    if "prompt" not in body or body["prompt"] is None:
        raise APIError(400, "missing required parameter 'prompt' (a string or a list of token ids)", "prompt",
                       "missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' is empty; send some text or token ids", "prompt", "invalid_value")
        ids = list(tokenizer(_text(prompt, "prompt", "prompt"), add_special_tokens=True)["input_ids"])
    elif _is_ids(prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"'prompt' holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                           "prompt", "invalid_value")
        ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, f"'prompt' holds {len(prompt)} prompts; send one prompt per request (requests "
                       "are batched on the server)", "prompt", "invalid_value")
    else:
        raise APIError(400, f"'prompt' must be a string or a non-empty list of token ids, got "
                       f"{type(prompt).__name__}", "prompt", "invalid_type")
    return GenerationRequest(prompt_ids=tuple(ids), max_tokens=_max_tokens(body, ("max_tokens",), 16),
                             chat=False, **common)


def _message_text(message, index: int) -> tuple[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise APIError(400, f"'{where}' must be an object with 'role' and 'content'", "messages", "invalid_type")
    role, content = message.get("role"), message.get("content")
    if role not in _ROLES:
        raise APIError(400, f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}", "messages",
                       "invalid_value")
    if isinstance(content, list):  # content parts: only text parts
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise APIError(400, f"'{where}.content' parts must all be {{\"type\": \"text\", \"text\": ...}}; "
                           "this server takes text only", "messages", "invalid_value")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(400, f"'{where}.content' must be a string, got {type(content).__name__}", "messages",
                       "invalid_type")
    return role, _text(content, f"{where}.content", "messages")


def parse_chat(body: dict, served_model: str, tokenizer) -> GenerationRequest:
    """A /v1/chat/completions body: the messages through the tokenizer's chat template with a
    generation prompt. max_tokens (or max_completion_tokens) defaults to what the context leaves."""
    common = _common(body, served_model, "chat")
    messages = body.get("messages")
    if messages is None:
        raise APIError(400, "missing required parameter 'messages' (a list of {role, content})", "messages",
                       "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", "messages",
                       "invalid_value")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "the served model's tokenizer has no chat template; use /v1/completions",
                       "messages", "chat_template_missing")
    turns = [dict(zip(("role", "content"), _message_text(m, i))) for i, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return GenerationRequest(prompt_ids=tuple(ids), max_tokens=_max_tokens(body, ("max_completion_tokens",
                                                                                   "max_tokens"), None),
                             chat=True, **common)


class IncrementalText:
    """Text deltas of a growing token list (special tokens skipped), cut at the first stop string.

    `text` is the whole text so far, cut before the first stop string (what a reply sent whole
    carries); `sent` is what `add` has returned; `tokens` counts the ids behind `text`: all of them,
    or up to and including the one that completed the stop string (what `usage` counts).
    `stopped` turns true once a stop string appeared; later ids are ignored. Until then a tail of
    the text that begins a stop string is held back, so a stop string split across steps never
    reaches the client."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop, self.ids = tokenizer, stop, []
        self.text = self.sent = ""
        self.tokens, self.stopped = 0, False
        # ids[:read] decode to `done`; ids[prefix:read] are re-decoded with the new ids, so that a
        # token whose text depends on the one before it (a leading space, a multi-byte character)
        # decodes as it does in the whole list
        self.prefix = self.read = 0
        self.done = ""

    def add(self, new_ids: list[int], final: bool) -> str:
        """Append ids; return the text not sent yet (a trailing partial character, or a possible
        start of a stop string, waits unless final)."""
        if self.stopped:
            return ""
        before = len(self.ids)
        self.ids.extend(new_ids)
        text, kept = self._decode_new()
        # a stop string within the text that earlier steps searched would have ended it there
        cut = self._first_stop(text, max(kept - max(map(len, self.stop), default=0), 0))
        if cut is not None:
            text, final, self.stopped = text[:cut], True, True
            self.tokens = self._tokens_to_stop(before)
        else:
            self.tokens = len(self.ids)
        self.text = text
        if not text.startswith(self.sent):  # a re-decode changed text already sent: it cannot be streamed in order
            return ""
        if not final:
            if text.endswith("\ufffd"):
                return ""
            text = text[:len(text) - self._held(text)]
        delta, self.sent = text[len(self.sent):], max(text, self.sent, key=len)
        return delta

    def extend(self, new_ids: list[int]) -> str:
        """Append ids without decoding (a reply sent whole decodes once, at its last `add`); ""."""
        self.ids.extend(new_ids)
        self.tokens = len(self.ids)
        return ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_new(self) -> tuple[str, int]:
        """The text of all ids, decoding only ids[prefix:], and how many of its first characters
        earlier steps' text already held; the offsets advance when the new ids added text that
        does not end in a partial character (its next ids complete it)."""
        seen = self._decode(self.ids[self.prefix:self.read])
        new = self._decode(self.ids[self.prefix:])
        if new.startswith(seen):
            text, kept = self.done + new[len(seen):], len(self.done)
        else:  # a window that does not extend its own text (a tokenizer's clean-up rule): decode all
            text, kept = self._decode(self.ids), 0
        # the window moves on once it has text, whole (SentencePiece drops a leading space of a
        # window's first token: a window of only skipped or empty ids would lose the next one's)
        if len(new) > len(seen) and not text.endswith("\ufffd"):
            self.done, self.prefix, self.read = text, self.read, len(self.ids)
        return text, kept

    def _first_stop(self, text: str, start: int = 0) -> int | None:
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _tokens_to_stop(self, lo: int) -> int:
        """The fewest ids whose text holds a stop string (the first `lo` ids' text held none)."""
        hi = len(self.ids)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._first_stop(self._decode(self.ids[:mid])) is not None else (mid, hi)
        return hi

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        return max((k for s in self.stop for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), default=0)


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(req: GenerationRequest, rid: str, created: int, choices: list[tuple[str, str]],
             completion_tokens: int) -> dict:
    """The whole (not streamed) reply: a text_completion or a chat.completion object with one
    choice per (text, finish_reason)."""
    if req.chat:
        out = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason} for i, (text, reason) in enumerate(choices)]
    else:
        out = [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
               for i, (text, reason) in enumerate(choices)]
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": created,
            "model": req.model, "choices": out, "usage": usage(len(req.prompt_ids), completion_tokens)}


def chunk(req: GenerationRequest, rid: str, created: int, text: str | None, finish_reason: str | None = None,
          role: bool = False, index: int = 0) -> dict:
    """One stream chunk of choice `index`. Chat: `role` opens the choice with the assistant role;
    text None = no content key."""
    if req.chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "choices": [choice]}
    choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model, "choices": [choice]}


def usage_chunk(req: GenerationRequest, rid: str, created: int, completion_tokens: int) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": created,
            "model": req.model, "choices": [], "usage": usage(len(req.prompt_ids), completion_tokens)}


def now() -> int:
    return int(time.time())
