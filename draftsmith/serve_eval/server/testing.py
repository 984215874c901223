"""Support for tests and the load test: a tiny random Llama checkpoint with a chat-template
tokenizer, and the server running in-process on a free loopback port.

Nothing here downloads anything; the checkpoint is random (quality is not the point, exact
agreement between code paths is).
"""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|developer|>", "<|tool|>"]
WORDS = ("the a an of to in is was it and or but for on with as at by from this that which "
         "hello world say tell me about story cat dog bird fish tree river mountain sun moon star "
         "red green blue yellow one two three four five six seven eight nine ten code python "
         "function return value list dict number add sum count write read run stop go come big "
         "small fast slow happy sad good bad new old first last next day night time year").split()


def build_tiny_tokenizer(extra_words: int = 120) -> Any:
    """A whitespace WordLevel tokenizer (PreTrainedTokenizerFast) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(dict.fromkeys(WORDS + [f"w{i}" for i in range(extra_words)] + list(".,!?")))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                  pre_tokenizers.Punctuation()])
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", additional_special_tokens=SPECIAL_TOKENS[4:])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_checkpoint(out_dir: str | Path, seed: int = 0, num_layers: int = 2,
                          hidden_size: int = 64, max_position: int = 256) -> Path:
    """Save a random fp32 LlamaForCausalLM + tokenizer into out_dir; returns the dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # Larger-than-default weights make the random model's next-token choices decisive
    # (fewer near-ties), so greedy outputs do not hinge on float rounding across code paths.
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def free_loopback_socket() -> socket.socket:
    """A socket bound to 127.0.0.1 on a free port (handed to uvicorn: no bind race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class ServerThread:
    """uvicorn serving `app` on a free loopback port in a background thread.

    `stop()` asks uvicorn to exit, which runs the app's lifespan shutdown (the engine
    loop's graceful drain), and joins the thread."""

    def __init__(self, app: Any, graceful_timeout_s: float = 5.0) -> None:
        self.app = app
        self._sock = free_loopback_socket()
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=graceful_timeout_s)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="uvicorn", daemon=True)

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
