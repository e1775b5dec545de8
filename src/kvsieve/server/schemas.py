"""Request bodies of the OpenAI-compatible endpoints, and the OpenAI error shape.

Bodies are parsed from the raw JSON in strict mode (no "5" for 5, no 1.0 for an integer):
a wrong type is a 400 naming the field, never a silent coercion. Fields the server does
not implement are refused when set to anything but their neutral value, so a client is
never answered as if they had been honoured.
"""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      model_validator)


class BadRequest(ValueError):
    """A client error: HTTP status, message (what is wrong and how to fix it), the field."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code


def error_body(message: str, param: Optional[str] = None, type: str = "invalid_request_error",
               code: Optional[str] = None) -> Dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


Number = Union[StrictInt, StrictFloat]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


NO_TOOLS = "this server does not call tools (no tools, functions or tool results); send the conversation as text"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[StrictStr, List[Dict[str, Any]], None] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[Any] = None  # refused: dropping them would change the conversation
    function_call: Optional[Any] = None

    @model_validator(mode="after")
    def _content(self):
        if self.role in ("tool", "function"):
            raise ValueError(f"a {self.role!r} message holds a tool result: {NO_TOOLS}")
        if self.tool_calls or self.function_call:
            raise ValueError(f"an assistant message with {'tool_calls' if self.tool_calls else 'function_call'}: "
                             f"{NO_TOOLS}")
        if self.content is None and self.role != "assistant":  # (an assistant turn may be empty)
            raise ValueError(f"a {self.role} message needs content: a string or a list of text parts")
        for i, part in enumerate(self.content if isinstance(self.content, list) else ()):
            kind = part.get("type")
            if kind == "refusal" and self.role == "assistant":  # (OpenAI's assistant turns may hold one: its text)
                if not isinstance(part.get("refusal"), str):
                    raise ValueError(f"content part {i} is a refusal part, so its \"refusal\" must be a string")
                continue
            if kind != "text":
                raise ValueError(f"content parts must be {{\"type\": \"text\", \"text\": \"...\"}}; part {i} has type "
                                 f"{kind!r}" + (": this server's model reads text only" if kind in
                                                ("image_url", "input_audio", "file", "image") else ""))
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} is a text part, so its \"text\" must be a string, got "
                                 + ("none" if "text" not in part else json.dumps(part["text"], default=str)[:40]))
        return self

    def text(self) -> str:
        """The message's text; a list of parts joined by newlines, as vLLM joins them."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p["text"] if p["type"] == "text" else p["refusal"] for p in self.content)


class _Common(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="ignore")  # e.g. `user`, `metadata`: accepted, no effect

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, List[StrictStr], None] = None
    n: Optional[StrictInt] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    # extensions (as in vLLM): top_k, ignore_eos, stop_token_ids; kvsieve: the sparse method of this request
    top_k: Optional[StrictInt] = None
    ignore_eos: Optional[StrictBool] = False
    stop_token_ids: Optional[List[StrictInt]] = None
    kvsieve: Optional[Dict[str, Any]] = None
    frequency_penalty: Optional[Number] = None
    presence_penalty: Optional[Number] = None
    logit_bias: Optional[Dict[str, Number]] = None
    # vLLM's extensions that change the answer and are not implemented here: refused when
    # set to anything but their neutral value (see VLLM_NEUTRAL)
    min_tokens: Optional[Any] = None
    repetition_penalty: Optional[Any] = None
    min_p: Optional[Any] = None
    include_stop_str_in_output: Optional[Any] = None
    use_beam_search: Optional[Any] = None
    prompt_logprobs: Optional[Any] = None
    truncate_prompt_tokens: Optional[Any] = None
    allowed_token_ids: Optional[Any] = None
    bad_words: Optional[Any] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_choice: Optional[Any] = None
    guided_grammar: Optional[Any] = None
    structured_outputs: Optional[Any] = None


class ChatCompletionRequest(_Common):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Any] = None
    functions: Optional[List[Any]] = None  # (OpenAI's older name for tools)
    function_call: Optional[Any] = None
    response_format: Optional[Dict[str, Any]] = None
    modalities: Optional[List[Any]] = None
    audio: Optional[Any] = None
    web_search_options: Optional[Any] = None
    # vLLM's chat extensions (see VLLM_NEUTRAL)
    add_generation_prompt: Optional[Any] = None
    continue_final_message: Optional[Any] = None
    chat_template: Optional[Any] = None
    chat_template_kwargs: Optional[Any] = None

    def refused(self) -> List[tuple]:
        """Fields that would change what the answer is (a call, audio, a search, a format):
        refused, not ignored. (user, metadata, store, service_tier, ... are ignored.)"""
        return _refused(self) + [
            ("tools", bool(self.tools)),
            ("tool_choice", self.tool_choice not in (None, "none", "auto")),
            ("functions", bool(self.functions)),
            ("function_call", self.function_call not in (None, "none", "auto")),
            ("response_format", self.response_format not in (None, {"type": "text"})),
            ("modalities", self.modalities not in (None, ["text"])),
            ("audio", self.audio is not None),
            ("web_search_options", self.web_search_options is not None),
        ]


class CompletionRequest(_Common):
    prompt: Union[StrictStr, List[StrictStr], List[StrictInt], List[List[StrictInt]]]
    max_completion_tokens: Optional[StrictInt] = None  # chat's name of max_tokens, taken here too
    echo: Optional[StrictBool] = False
    suffix: Optional[StrictStr] = None
    best_of: Optional[StrictInt] = None
    logprobs: Optional[StrictInt] = None
    response_format: Optional[Any] = None  # (a vLLM extension on this endpoint)

    def refused(self) -> List[tuple]:
        return _refused(self) + [
            ("suffix", bool(self.suffix)),
            # best_of > n ranks extra samples by log-probability
            ("best_of", self.best_of not in (None, self.n or 1),
             f"best_of must equal n ({self.n or 1}) or be left out: this server does not rank extra samples"),
            ("response_format", self.response_format not in (None, {"type": "text"})),
        ]


# vLLM's extensions that change the answer, with their neutral values (None, or one of these):
# a request setting one otherwise is refused, so a client written for vLLM is never answered
# as if it had been honoured
VLLM_NEUTRAL = {
    "min_tokens": (0,), "repetition_penalty": (1,), "min_p": (0,), "include_stop_str_in_output": (False,),
    "use_beam_search": (False,), "prompt_logprobs": (), "truncate_prompt_tokens": (), "allowed_token_ids": (),
    "bad_words": ([],), "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (), "add_generation_prompt": (True,), "continue_final_message": (False,),
    "chat_template": (), "chat_template_kwargs": ({},),
}


def _is_neutral(value, neutral: tuple) -> bool:
    # bool is an int: True must not pass for 1 (nor False for 0) unless the neutral value is a bool
    return value is None or any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def _refused(r: _Common) -> List[tuple]:
    return [(name, not _is_neutral(getattr(r, name), neutral),
             f"{name} (a vLLM extension) is not supported by this server; leave it out or give its neutral value "
             + (" or ".join(json.dumps(n) for n in neutral) if neutral else "null"))
            for name, neutral in VLLM_NEUTRAL.items() if name in type(r).model_fields]


# what each field must be, for wrong-type messages
EXPECTED = {
    "model": "a string (the served model name, see GET /v1/models)",
    "max_tokens": "an integer >= 1 (0 with echo: score the prompt only)", "max_completion_tokens": "an integer >= 1",
    "temperature": "a number in [0, 2]", "top_p": "a number in [0, 1]", "top_k": "an integer >= 0 (0 or -1 = off)",
    "seed": "an integer", "stop": "a string or a list of up to 16 strings", "n": "an integer in [1, 128]",
    "stream": "true or false", "stream_options": 'an object like {"include_usage": true}',
    "stream_options.include_usage": "true or false", "ignore_eos": "true or false",
    "stop_token_ids": "a list of token ids (integers)",
    "kvsieve": 'an object like {"method": "tactic", "threshold": 0.9}',
    "messages": 'a non-empty list of {"role": "user", "content": "..."} objects',
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "frequency_penalty": "a number in [-2, 2]", "presence_penalty": "a number in [-2, 2]",
    "logit_bias": 'an object mapping token ids to numbers in [-100, 100], e.g. {"50256": -100}', "echo": "true or false", "suffix": "a string",
    "best_of": "an integer (only n is served)",
    "top_logprobs": "an integer in [0, 20]",
    "logprobs": "true or false (chat), an integer in [0, 20] (completions)",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def _param(loc) -> Optional[str]:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(str(p))
        elif "[" in p or "(" in p or p in _TYPE_TAGS or p.startswith("function-") or p.startswith("literal"):
            continue
        else:
            parts.append(p)
    return ".".join(parts) or None


def _unpaired_surrogate(obj, where: str = "") -> Optional[str]:
    """The path of the first string (or key) in a JSON value that is not valid Unicode: JSON
    may escape a lone surrogate ("\\ud800"), which no tokenizer can encode; None if none."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        if isinstance(key, str) and _unpaired_surrogate(key) is not None:
            key = key.encode("utf-8", "backslashreplace").decode("utf-8")  # (printable in the error's JSON)
            return f"{where}.{key}" if where else key
        path = f"{where}.{key}" if where else str(key)
        found = _unpaired_surrogate(value, path)
        if found is not None:
            return found
    return None


def parse(model: type, raw: bytes):
    """The body as `model`, or BadRequest naming the first bad field and what it must be."""
    if not raw.strip():
        raise BadRequest("the request body is empty; send a JSON object (Content-Type: application/json)")
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON ({e}); send a JSON object") from None
    except (RecursionError, ValueError) as e:  # nesting past Python's stack, an integer past 4300 digits
        raise BadRequest(f"the request body cannot be read ({type(e).__name__}: {str(e)[:80]}); send a plain "
                         "JSON object") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(obj).__name__}")
    bad = _unpaired_surrogate(obj)
    if bad is not None:
        raise BadRequest(f"{bad or 'the body'} holds a lone UTF-16 surrogate escape (\\ud800-\\udfff not in a pair), "
                         "which is not text; send valid Unicode", bad or None)
    try:
        return model.model_validate(obj, strict=True)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _param(err["loc"])
        if err["type"] == "value_error":  # a validator's own sentence
            raise BadRequest(f"{param}: {err['msg'].removeprefix('Value error, ')}", param) from None
        if err["type"] == "missing":
            raise BadRequest(f"{param} is required; give {EXPECTED.get(param, 'a value')}", param) from None
        got = json.dumps(err.get("input"), default=str)
        if len(got) > 80:
            got = got[:77] + "..."
        generic = param.split(".")[0] if param else None
        nested = re.fullmatch(r"messages\.(\d+)\.content(\..*)?", param or "")
        if nested:  # (a union's members each failed: pydantic names the last one's type)
            param = f"messages.{nested.group(1)}.content"
            msg = f'{param} must be a string or a list of text parts ({{"type": "text", "text": "..."}}), got {got}'
        elif (param or "").startswith("logit_bias."):
            msg = f"{param} must be a number in [-100, 100] (the bias of token {param.split('.', 1)[1]}), got {got}"
        elif param in EXPECTED:
            no_echo = param == "max_tokens" and "echo" not in model.model_fields  # (chat)
            msg = f"{param} must be {EXPECTED['max_completion_tokens' if no_echo else param]}, got {got}"
        elif generic in ("messages",):
            msg = f"{param}: {err['msg']} (got {got}); messages must be {EXPECTED['messages']}"
        else:
            msg = f"{param}: {err['msg']} (got {got})"
        raise BadRequest(msg, param) from None
