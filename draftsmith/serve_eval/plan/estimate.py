"""`draftsmith plan`: back-of-the-envelope memory budget and ms/token for each draft strategy.

Follows the seed's method (chapter 18 worked examples): a decode step is bandwidth-bound, so
step time = bytes of weights each GPU reads / that GPU's bandwidth; a speculative round is K draft
steps plus one target verification (costed as one target step) and emits 1 + K*alpha tokens on
average, so ms/token = (target step + draft cost per round) / (1 + K*alpha).  The speed-up formula
itself lives in serve_eval.speculative.metrics; this module only prices the steps.

Units: GB = 1e9 bytes and TB/s = 1e12 bytes/s, as in the seed (140 GB = 2 x 70e9).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftsmith.serve_eval.plan.block import BLOCK_ALPHA, block_row
from draftsmith.serve_eval.speculative.metrics import predicted_speedup

GB = 1e9
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
# Acceptance assumptions from the seed's 70B-on-two-H100s table.
SEED_ALPHA = {"standalone": 0.80, "eagle": 0.72, "medusa": 0.50}


@dataclass
class TargetSpec:
    """The numbers of a Llama-family target that the plan needs."""

    params: float            # parameter count (e.g. 70e9)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int = 0   # MLP width; only used to size an EAGLE layer (0 -> 8/3 * hidden)
    num_heads: int = 0           # query heads; 0 -> hidden_size // head_dim
    dtype_bytes: float = 2       # bf16

    def __post_init__(self) -> None:
        for name in ("params", "num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size", "dtype_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"target.{name} must be > 0, got {getattr(self, name)!r}")

    @classmethod
    def from_hf_config(cls, path: str | Path, params: float | None = None,
                       dtype_bytes: float | None = None) -> "TargetSpec":
        """Read an HF config.json (file or model dir); estimate params from the shapes when not given."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"--config: no config.json at {path}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--config: {path} is not valid JSON ({e})") from e
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in cfg]
        if missing:
            raise ValueError(f"--config: {path} lacks {', '.join(missing)}")
        hidden, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or hidden // n_heads
        spec = cls(
            params=1.0,  # placeholder, replaced below
            num_layers=cfg["num_hidden_layers"],
            num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            vocab_size=cfg["vocab_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_heads=n_heads,
            dtype_bytes=dtype_bytes or DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype")), 2),
        )
        spec.params = params or spec.layer_params() * spec.num_layers + spec.vocab_size * spec.hidden_size * (
            1 if cfg.get("tie_word_embeddings", False) else 2)
        return spec

    def layer_params(self) -> float:
        """Parameters of one decoder layer (attention + gated MLP + two norms)."""
        d = self.hidden_size
        q_dim = (self.num_heads or d // self.head_dim) * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        ffn = self.intermediate_size or int(8 * d / 3)
        return d * q_dim + 2 * d * kv_dim + q_dim * d + 3 * d * ffn + 2 * d

    def kv_bytes_per_token(self, tp: int = 1) -> float:
        """K and V of one token over all layers, on one GPU (KV heads are split over TP ranks)."""
        kv_heads_per_gpu = max(1, self.num_kv_heads // tp)
        return 2 * self.num_layers * kv_heads_per_gpu * self.head_dim * self.dtype_bytes


@dataclass
class Hardware:
    gpu_mem_gb: float = 80.0     # per GPU (H100 SXM)
    bandwidth_tbs: float = 3.35  # per GPU HBM bandwidth
    tp: int = 1
    gpu_util: float = 0.9        # share of memory the server may use (weights + drafts + KV)

    def __post_init__(self) -> None:
        if self.gpu_mem_gb <= 0:
            raise ValueError(f"gpu_mem_gb must be > 0, got {self.gpu_mem_gb}")
        if self.bandwidth_tbs <= 0:
            raise ValueError(f"bandwidth_tbs must be > 0, got {self.bandwidth_tbs}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if not 0 < self.gpu_util <= 1:
            raise ValueError(f"gpu_util must be in (0, 1], got {self.gpu_util}")

    def read_ms(self, bytes_per_gpu: float) -> float:
        """Time to stream `bytes_per_gpu` from HBM once: the bandwidth-bound step time."""
        return bytes_per_gpu / (self.bandwidth_tbs * 1e12) * 1e3


@dataclass
class Workload:
    batch: int = 1
    context_len: int = 2048      # tokens reserved per sequence (prompt + generation)
    block_size: int = 16
    avg_len: int = 256           # mean tokens a sequence actually holds (paged allocation)
    shared_prefix_tokens: int = 0
    shared_prefix_seqs: int = 0  # sequences sharing that prefix (0 -> batch)
    kv_budget_gb: float | None = None  # per GPU; None -> gpu_util * memory - weights

    def __post_init__(self) -> None:
        for name in ("batch", "context_len", "block_size", "avg_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_budget_gb is not None and self.kv_budget_gb <= 0:
            raise ValueError(f"kv_budget_gb must be > 0, got {self.kv_budget_gb}")


@dataclass
class DraftOptions:
    K: int = 5
    standalone_params: float = 0.0      # 0 -> no standalone draft row
    eagle_params: float | None = None   # None -> one target decoder layer + the 2d->d fusion fc
    medusa_heads: int | None = None     # None -> K heads
    medusa_layers: int = 1              # residual blocks per Medusa head
    alpha: dict[str, float] = field(default_factory=lambda: {**SEED_ALPHA, "block": BLOCK_ALPHA})
    # Measured or assumed step costs override the bandwidth model (the seed's tables use rounded ones).
    target_step_ms: float | None = None
    standalone_step_ms: float | None = None
    eagle_step_ms: float | None = None
    medusa_round_ms: float | None = None
    draft_dtype_bytes: float | None = None  # bytes per draft weight (int8 1, int4 0.5); None = the target's
    block_layers: int = 2               # the block-parallel draft (serve_eval.plan.block)
    block_round_ms: float | None = None  # measured cost of its one forward per round (None: bandwidth model)

    def __post_init__(self) -> None:
        if self.K < 1:
            raise ValueError(f"K must be >= 1, got {self.K}")
        for name, a in self.alpha.items():
            if not 0 <= a <= 1:
                raise ValueError(f"alpha[{name}] must be in [0, 1], got {a}")


@dataclass
class StrategyRow:
    strategy: str
    draft_gb_per_gpu: float
    draft_cost_ms: float          # draft time per round (all K proposals)
    tokens_per_call: float        # 1 + K*alpha
    ms_per_token: float
    speedup: float
    free_gb_per_gpu: float        # memory left after weights, this draft and the batch's KV
    fits: bool
    note: str = ""


@dataclass
class KVPlan:
    bytes_per_token: float
    bytes_per_block: float
    blocks_per_seq: int
    bytes_per_seq: float          # block-granular (ceil(context / block_size) blocks)
    bytes_for_batch: float
    kv_budget_gb: float
    num_blocks: int
    token_slots: int
    max_seqs_preallocated: int    # every sequence reserves context_len up front
    blocks_per_avg_seq: int
    max_seqs_paged: int           # on-demand blocks at avg_len
    internal_fragmentation: float # share of a preallocated reservation unused at avg_len
    prefix_blocks: int
    prefix_blocks_without_sharing: int
    prefix_blocks_saved: int
    prefix_gb_saved: float


@dataclass
class PlanResult:
    target_params: float
    tp: int
    weights_gb_total: float
    weights_gb_per_gpu: float
    target_step_ms: float
    kv: KVPlan
    strategies: list[StrategyRow]
    notes: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def _kv_plan(target: TargetSpec, hw: Hardware, work: Workload, weights_gb_per_gpu: float) -> KVPlan:
    per_token = target.kv_bytes_per_token(hw.tp)
    per_block = per_token * work.block_size
    blocks_per_seq = math.ceil(work.context_len / work.block_size)
    budget_gb = work.kv_budget_gb if work.kv_budget_gb is not None else \
        hw.gpu_util * hw.gpu_mem_gb - weights_gb_per_gpu
    num_blocks = max(0, math.floor(budget_gb * GB / per_block))
    blocks_per_avg = math.ceil(work.avg_len / work.block_size)
    prefix_blocks = math.ceil(work.shared_prefix_tokens / work.block_size)
    sharers = work.shared_prefix_seqs or work.batch
    return KVPlan(
        bytes_per_token=per_token,
        bytes_per_block=per_block,
        blocks_per_seq=blocks_per_seq,
        bytes_per_seq=blocks_per_seq * per_block,
        bytes_for_batch=work.batch * blocks_per_seq * per_block,
        kv_budget_gb=budget_gb,
        num_blocks=num_blocks,
        token_slots=num_blocks * work.block_size,
        max_seqs_preallocated=num_blocks // blocks_per_seq,
        blocks_per_avg_seq=blocks_per_avg,
        max_seqs_paged=num_blocks // blocks_per_avg,
        internal_fragmentation=max(0.0, (blocks_per_seq - blocks_per_avg) / blocks_per_seq),
        prefix_blocks=prefix_blocks,
        prefix_blocks_without_sharing=sharers * prefix_blocks,
        prefix_blocks_saved=(sharers - 1) * prefix_blocks if prefix_blocks else 0,
        prefix_gb_saved=((sharers - 1) * prefix_blocks * per_block / GB) if prefix_blocks else 0.0,
    )


def _strategy(name: str, K: int, alpha: float, target_ms: float, draft_ms: float, draft_gb: float,
              free_before_draft_gb: float, note: str = "") -> StrategyRow:
    # The cost ratio per proposed token, c = draft cost per round / (K * target step), feeds the
    # shared predicted-speedup formula; ms/token = target step / predicted speed-up.
    cost_ratio = draft_ms / (K * target_ms)
    speedup = predicted_speedup(k=K, alpha=alpha, cost_ratio=cost_ratio)
    free = free_before_draft_gb - draft_gb
    return StrategyRow(name, draft_gb, draft_ms, 1 + K * alpha, target_ms / speedup, speedup, free, free >= 0, note)


def make_plan(target: TargetSpec, hw: Hardware, work: Workload, drafts: DraftOptions) -> PlanResult:
    """Price the memory budget and every draft strategy for one target on one hardware setup."""
    K, tp, b = drafts.K, hw.tp, target.dtype_bytes
    db = drafts.draft_dtype_bytes or b  # the draft's own weights; a head shared with the target stays at b
    weights_total_gb = target.params * b / GB
    weights_gpu_gb = weights_total_gb / tp
    kv = _kv_plan(target, hw, work, weights_gpu_gb)
    free_gb = hw.gpu_mem_gb - weights_gpu_gb - kv.bytes_for_batch / GB
    notes = []
    if drafts.target_step_ms is None:
        target_ms = hw.read_ms(weights_gpu_gb * GB)
        if tp > 1:
            notes.append(f"target step assumes ideal TP: each of {tp} GPUs streams 1/{tp} of the weights; "
                         "the seed's 2xH100 table keeps the 1-GPU 42 ms (pass --target-step-ms to do the same)")
    else:
        target_ms = drafts.target_step_ms
    lm_head_bytes = target.vocab_size * target.hidden_size * b
    rows = [StrategyRow("no-spec", 0.0, 0.0, 1.0, target_ms, 1.0, free_gb, free_gb >= 0)]
    if drafts.standalone_params > 0:
        gb = drafts.standalone_params * db / GB / tp
        ms = drafts.standalone_step_ms if drafts.standalone_step_ms is not None else hw.read_ms(gb * GB)
        rows.append(_strategy("standalone", K, drafts.alpha["standalone"], target_ms, K * ms, gb, free_gb,
                              "own KV cache not counted"))
    eagle_params = drafts.eagle_params if drafts.eagle_params is not None else \
        target.layer_params() + 2 * target.hidden_size * target.hidden_size
    eagle_gb = eagle_params * db / GB / tp
    # Each EAGLE step also reads the (shared) lm_head to pick its token.
    eagle_ms = drafts.eagle_step_ms if drafts.eagle_step_ms is not None else \
        hw.read_ms(eagle_gb * GB + lm_head_bytes / tp)
    rows.append(_strategy("eagle", K, drafts.alpha["eagle"], target_ms, K * eagle_ms, eagle_gb, free_gb,
                          f"{eagle_params / 1e9:.2f}B params; step reads its layer + lm_head"))
    n_heads = drafts.medusa_heads or K
    d = target.hidden_size
    medusa_gb = n_heads * (target.vocab_size * d + drafts.medusa_layers * (d * d + d)) * db / GB / tp
    # All heads run once per round, in parallel, on the last hidden state: one read of their weights.
    medusa_ms = drafts.medusa_round_ms if drafts.medusa_round_ms is not None else hw.read_ms(medusa_gb * GB)
    rows.append(_strategy("medusa", n_heads, drafts.alpha["medusa"], target_ms, medusa_ms, medusa_gb, free_gb,
                          f"{n_heads} heads, one parallel pass per round"))
    if "block" in drafts.alpha:
        rows.append(block_row(_strategy, target, hw, drafts, target_ms, free_gb, db, lm_head_bytes, GB))
    return PlanResult(target.params, tp, weights_total_gb, weights_gpu_gb, target_ms, kv, rows, notes)
