"""Every check a prompt passes before it reaches the engine: the model name, the text's byte bound (before
the tokenizer spends time on it), token ids inside the vocabulary, the chat template, and prompt + max_tokens
against the context and the whole KV pool. Each refusal is an OpenAI-style 400 (404 for the model) naming
its field."""
from __future__ import annotations

from typing import Any

from draftsmith.serve_eval.server import protocol as P

MAX_PROMPTS_PER_REQUEST = 64


class PromptChecks:
    def __init__(self, tokenizer: Any, model_name: str, max_model_len: int, kv_capacity_tokens: int | None) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        # A request whose prompt + max_tokens cannot fit in the whole KV pool could never run; refuse it
        # up front instead of letting it wait forever.
        self.kv_capacity_tokens = kv_capacity_tokens
        # Text longer than this holds more than max_model_len tokens whatever it says, so it is refused
        # before the tokenizer spends seconds on it.
        self.max_prompt_bytes = max_prompt_bytes(tokenizer, max_model_len)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            # 404, as OpenAI and vLLM answer an unknown model.
            raise P.ApiError(404, f"The model '{model}' does not exist; this server serves "
                             f"'{self.model_name}'", "model", code="model_not_found")

    def _tokenize(self, text: str, param: str) -> list[int]:
        if text == "":
            raise P.ApiError(400, f"{param} must not be empty", param)
        self._check_text_bytes(len(text.encode("utf-8", "surrogatepass")), param)
        return list(self.tokenizer(text)["input_ids"])

    def _check_text_bytes(self, num_bytes: int, param: str) -> None:
        if num_bytes > self.max_prompt_bytes:
            raise P.ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens, "
                             f"and the {param} holds {num_bytes} bytes of text, more than that many tokens "
                             f"can span ({self.max_prompt_bytes} bytes)", param,
                             code="context_length_exceeded")

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise P.ApiError(400, f"{param} must not be empty", param)
        vocab = len(self.tokenizer)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise P.ApiError(400, f"{param} holds token id {bad}, outside the vocabulary [0, {vocab})", param)
        return ids

    def completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self._check_ids(self._tokenize(prompt, "prompt"), "prompt")]
        if not prompt:
            raise P.ApiError(400, "prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [self._check_ids(list(prompt), "prompt")]
        if len(prompt) > MAX_PROMPTS_PER_REQUEST:
            raise P.ApiError(400, f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request", "prompt")
        if isinstance(prompt[0], str):
            return [self._check_ids(self._tokenize(p, "prompt"), "prompt") for p in prompt]
        return [self._check_ids(list(p), "prompt") for p in prompt]

    def chat_prompt(self, messages: list[P.ChatMessage]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise P.ApiError(400, "this model's tokenizer has no chat template; use /v1/completions",
                             "messages")
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        self._check_text_bytes(sum(len(m["content"].encode("utf-8", "surrogatepass"))
                                   for m in conversation), "messages")
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template may raise on odd role orders
            raise P.ApiError(400, f"messages could not be rendered by the chat template: {exc}",
                             "messages") from None
        # The template writes its own special tokens (BOS etc.); do not add them twice.
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._check_ids(ids, "messages")

    def max_tokens(self, num_prompt: int, requested: int | None, prompt_field: str,
                    max_field: str) -> int:
        if num_prompt >= self.max_model_len:
            raise P.ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens, "
                             f"but the {prompt_field} holds {num_prompt} tokens", prompt_field,
                             code="context_length_exceeded")
        room = self.max_model_len - num_prompt
        if requested is None:
            requested = room
        elif requested > room:
            raise P.ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens; "
                             f"{num_prompt} prompt tokens + {max_field}={requested} exceed it", max_field,
                             code="context_length_exceeded")
        if self.kv_capacity_tokens is not None and num_prompt + requested > self.kv_capacity_tokens:
            raise P.ApiError(400, f"{num_prompt} prompt tokens + {max_field}={requested} exceed the KV "
                             f"cache capacity of {self.kv_capacity_tokens} tokens", max_field)
        return requested


def max_prompt_bytes(tokenizer: Any, max_model_len: int) -> int:
    """Bytes of text that can not fit in max_model_len tokens: no token decodes to more bytes than
    the UTF-8 of its vocabulary string (byte-level BPE spells each byte as one character,
    SentencePiece spells a space as a 3-byte marker). The factor 4 covers normalizers that shrink
    text before it is split (NFKC folds some 3-byte characters into one byte)."""
    vocab = tokenizer.get_vocab()
    longest = max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=64)
    return 4 * max_model_len * max(longest, 1) + 1024
