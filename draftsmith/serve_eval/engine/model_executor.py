"""Our own Llama-family forward over a flattened batch of many sequences (selective batching).

Norms, projections and the MLP run over all T new tokens of the step as one [T, d] matrix; only attention
looks at sequence boundaries, through ``AttentionMetadata`` and the paged KV cache. The executor owns the
KV cache tensors ([L, num_blocks, block_size, KVH, D] for K and for V) and the block-level copies the
cache manager asks for (copy-on-write, swap to/from a CPU pool, compaction of accepted tree slots).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from draftsmith.kernels import small_gemm
from draftsmith.kernels.attention import AttentionMetadata, get_attention_backend, paged_attn_fn, select_backend
from draftsmith.kernels.attention.window import sliding_window_attention
from draftsmith.kernels.layers.causal_lm import CausalLM, causal_lm_from_state_dict
from draftsmith.kernels.layers.checkpoint import load_config, read_state_dict
from draftsmith.kernels.layers.native_draft_loop import LoopSampling, LoopTokens, padded_tables
from draftsmith.kernels.layers.linear import SMALL_GEMM_MAX_ROWS, should_pack
from draftsmith.kernels.precision import AUTO, bf16_is_fast

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> str:
    """resolve_dtype's choice by name ("auto" -> "bfloat16" or "float32"), for configs and printed headers."""
    return str(resolve_dtype(dtype, device)).removeprefix("torch.")


class ForwardOutput(NamedTuple):
    logits: Tensor  # [N, V] float32, rows = logits_indices (all T if None)
    hidden: Tensor  # [T, d] final-norm output (the lm_head input)
    aux_hidden: dict[int, Tensor]  # {i: [T, d]} in HF hidden_states indexing (0 = embeddings)


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> torch.dtype:
    """A dtype or its name. "auto" is float32 on a CPU where the native C kernels run (they serve fp32 only),
    else bfloat16 where the device runs a bf16 matmul faster than fp32, else float32.

    Why the native kernels decide first: a bf16 matmul beats fp32 on an AMX Xeon (the probe), but a bf16 engine
    runs torch's ops, and a batch-1 decode step of the embedded target took 11-20 ms there against 3.6-4.2 in
    fp32 through the C layers."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == AUTO:
        if torch.device(device).type == "cpu" and small_gemm.available():
            return torch.float32
        return torch.bfloat16 if bf16_is_fast(device) else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or {AUTO!r}, got {dtype!r}")
    return _DTYPES[dtype]


class ModelExecutor:
    """Loads a HF checkpoint dir and runs paged forwards. See docs/interfaces.md for the contract."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
                 attn_backend: str = "auto", compile: bool = False):
        config = load_config(model_dir)
        self._setup(config, read_state_dict(model_dir), dtype, device, attn_backend, source=str(model_dir))
        if compile:
            self.enable_compile()

    @classmethod
    def from_state_dict(cls, config, state_dict: dict[str, Tensor], dtype: torch.dtype | str = torch.float32,
                        device: str = "cpu", attn_backend: str = "auto") -> "ModelExecutor":
        """Build from an in-memory HF config + state dict (tests, standalone drafts)."""
        executor = cls.__new__(cls)
        executor._setup(config, state_dict, dtype, device, attn_backend, source="state dict")
        return executor

    @classmethod
    def from_hf_model(cls, model: torch.nn.Module, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
                      attn_backend: str = "auto") -> "ModelExecutor":
        """Build from a loaded transformers LlamaForCausalLM-like model (weights are copied)."""
        return cls.from_state_dict(model.config, model.state_dict(), dtype, device, attn_backend)

    @classmethod
    def from_model(cls, config, model: CausalLM, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
                   attn_backend: str = "auto") -> "ModelExecutor":
        """Run an already built CausalLM (e.g. a quantized standalone draft, drafts.quant); it is put in its
        serving form here, with its weights as they are (no cast)."""
        executor = cls.__new__(cls)
        executor._setup(config, None, dtype, device, attn_backend, source="model", model=model)
        return executor

    def _setup(self, config, state_dict, dtype, device, attn_backend: str, source: str,
               model: CausalLM | None = None) -> None:
        self.config = config
        self.dtype = resolve_dtype(dtype, device)
        self.device = torch.device(device)
        self.model: CausalLM = model if model is not None else causal_lm_from_state_dict(
            config, state_dict, self.dtype, self.device, source)
        self.model.to_serving_(should_pack(self.dtype, self.device))
        decoder = self.model.shape.decoder
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = decoder.num_attention_heads
        self.num_kv_heads: int = decoder.num_key_value_heads
        self.head_dim: int = decoder.head_dim
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.scale: float = self.head_dim ** -0.5
        # Per layer: the attention window (None = full attention), from the family rules (kernels.layers.family).
        self.sliding_windows: list[int | None] = self.model.shape.sliding_windows
        self.attn_backend_name = attn_backend
        self.attn_backend = select_backend(attn_backend, self.device)
        self._attention = get_attention_backend(self.attn_backend)
        self.k_cache: Tensor | None = None  # [L, num_blocks, block_size, KVH, D]
        self.v_cache: Tensor | None = None
        self.cpu_k_cache: Tensor | None = None  # swap space, same layout, on the CPU
        self.cpu_v_cache: Tensor | None = None
        self.block_size: int | None = None
        self._compiled_run = None

    def enable_compile(self) -> None:
        """torch.compile the all-decode forward (one graph for every layer; dynamic batch and context sizes).

        Only pure-decode steps use it (the batch-1 latency path); prefill and mixed steps stay eager. The first
        decode step pays the compile (tens of seconds on a small CPU).
        """
        self.model.repack(False)  # inductor traces plain matmuls; oneDNN-packed weights are opaque to it
        # Measured on the shared 2-CPU dev box (scripts/bench_roofline.py --threads 1 --compile): 15-20% faster
        # than the plain-weight eager path, but ~2x slower than eager with packed bf16 weights. Opt-in only.
        self._compiled_run = torch.compile(self._run, dynamic=True)

    # ------------------------------------------------------------------ KV cache
    def synchronize(self) -> None:
        """Wait for the device's queued kernels (CUDA runs them asynchronously); timers call it around a forward."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of K and V of all layers for one block."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * element

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        """Preallocate the paged cache (and, if asked, a CPU swap pool of the same layout)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        shape = (self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.block_size = block_size
        # Per-layer views made once, not on every layer of every step.
        self._layer_caches = list(zip(self.k_cache.unbind(0), self.v_cache.unbind(0)))
        if num_cpu_blocks:
            self.allocate_cpu_cache(num_cpu_blocks)

    def allocate_cpu_cache(self, num_cpu_blocks: int) -> None:
        if self.k_cache is None:
            raise ValueError("allocate_kv_cache must run before allocate_cpu_cache")
        shape = (self.num_layers, num_cpu_blocks, *self.k_cache.shape[2:])
        pin = self.device.type == "cuda"
        self.cpu_k_cache = torch.zeros(shape, dtype=self.dtype, pin_memory=pin)
        self.cpu_v_cache = torch.zeros(shape, dtype=self.dtype, pin_memory=pin)

    def _require_cache(self) -> None:
        if self.k_cache is None:
            raise ValueError("KV cache not allocated: call allocate_kv_cache(num_blocks, block_size) first")

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write)."""
        self._require_cache()
        if pairs:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*pairs))
            self.k_cache[:, dst] = self.k_cache[:, src]
            self.v_cache[:, dst] = self.v_cache[:, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """pairs: (device block, cpu block). Copies device blocks into the CPU pool."""
        self._swap(pairs, self.k_cache, self.v_cache, self.cpu_k_cache, self.cpu_v_cache)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """pairs: (cpu block, device block). Copies CPU pool blocks back into the device cache."""
        self._swap(pairs, self.cpu_k_cache, self.cpu_v_cache, self.k_cache, self.v_cache)

    def _swap(self, pairs, src_k, src_v, dst_k, dst_v) -> None:
        self._require_cache()
        if self.cpu_k_cache is None:
            raise ValueError("no CPU swap pool: pass num_cpu_blocks to allocate_kv_cache or call allocate_cpu_cache")
        if not pairs:
            return
        src, dst = zip(*pairs)
        src_idx = torch.tensor(src, device=src_k.device)
        dst_idx = torch.tensor(dst, device=dst_k.device)
        # Blocking copies: a non-blocking device->host copy could be read before it lands.
        dst_k[:, dst_idx] = src_k[:, src_idx].to(dst_k.device)
        dst_v[:, dst_idx] = src_v[:, src_idx].to(dst_v.device)

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """Copy single token slots src[i] -> dst[i] in every layer (compacting an accepted tree path).

        src, dst: int64 [n] flat slots (block * block_size + offset). Sources are read before any write,
        so overlapping src/dst is safe.
        """
        self._require_cache()
        src = torch.as_tensor(src, dtype=torch.int64, device=self.device)
        dst = torch.as_tensor(dst, dtype=torch.int64, device=self.device)
        if src.shape != dst.shape:
            raise ValueError(f"copy_slots: src {tuple(src.shape)} and dst {tuple(dst.shape)} differ")
        for cache in (self.k_cache, self.v_cache):
            flat = cache.view(self.num_layers, -1, self.num_kv_heads, self.head_dim)
            flat[:, dst] = flat[:, src]

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                logits_indices: Tensor | None = None, aux_hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """input_ids, positions: int [T]; logits_indices: int [N] rows to project (None = all T).

        aux_hidden_layers index HF ``hidden_states``: 0 = embeddings, i = output of layer i-1, L = final norm.
        """
        self._require_cache()
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be [T]")
        aux_layers = tuple(sorted(set(aux_hidden_layers)))
        bad = [i for i in aux_layers if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"aux_hidden_layers {bad} outside [0, {self.num_layers}]")
        body = self._run
        if meta.is_pure_decode and self._compiled_run is not None and self.attn_backend == "torch":
            body = self._compiled_run
        logits, hidden, aux = body(input_ids, positions, meta, logits_indices, aux_layers)
        return ForwardOutput(logits=logits, hidden=hidden, aux_hidden=aux)

    @property
    def native_rows(self) -> int:
        """Rows up to which a one-thread forward runs the native C layers (fp32 CPU, every layer native, full
        attention, the torch paged backend); 0: none."""
        layers = self.model.native_layers()
        served = (layers and all(layer is not None for layer in layers) and self.attn_backend == "torch"
                  and all(window is None for window in self.sliding_windows))
        return SMALL_GEMM_MAX_ROWS if served else 0

    @torch.no_grad()
    def draft_decode(self, first_tokens: list[list[int]], start_positions: list[int], num_steps: list[int],
                     block_tables: list[list[int]], sampling: LoopSampling | None = None) -> LoopTokens | None:
        """num_steps[j] decode steps of sequence j after feeding first_tokens[j] from start_positions[j] on (one
        token, or a catch-up of several; the first step picks from the last), greedy or as sampling says, its KV
        written through block_tables[j] (slots already allocated), all in one C call
        (kernels.layers.native_draft_loop); None where that path cannot serve this model now (the caller then runs
        forward step by step)."""
        self._require_cache()
        loop = self.model.draft_loop() if self.native_rows else None   # the layers' C path serves this model
        last = max(p + len(fed) + n - 2 for p, fed, n in zip(start_positions, first_tokens, num_steps))
        if loop is None or not loop.accepts(self._layer_caches, last):
            return None
        return loop(first_tokens, start_positions, num_steps, padded_tables(block_tables), self._layer_caches,
                    self.scale, sampling=sampling)

    def _run(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, logits_indices: Tensor | None,
             aux_layers: tuple[int, ...]) -> tuple[Tensor, Tensor, dict[int, Tensor]]:
        """The model proper over the paged cache -> (lm_head rows fp32, hidden, aux) (compilable as one graph)."""
        attn_fns = [paged_attn_fn(self._attention if window is None else partial(sliding_window_attention, window=window),
                                  k, v, meta, self.scale)
                    for (k, v), window in zip(self._layer_caches, self.sliding_windows)]
        # Positions never exceed max_seqlen_k - 1 (new tokens sit inside the context), so no device sync here.
        hidden, aux = self.model.run(input_ids, positions, attn_fns, aux_layers, meta.max_seqlen_k - 1)
        rows = hidden if logits_indices is None else hidden.index_select(0, logits_indices)
        return self.model.compute_logits(rows).float(), hidden, aux

    __call__ = forward

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """lm_head over final-norm hidden rows [N, d] -> fp32 [N, V] (drafts that reuse the target's head)."""
        return self.model.compute_logits(hidden).float()

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads (roofline numerator)."""
        return self.model.weight_bytes()
