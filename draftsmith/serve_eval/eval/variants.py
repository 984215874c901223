"""Quantized variants of a draft in one eval run: which draft each is a variant of, and the side-by-side table.

A variant is a quantized draft dir (drafts.quant: quantization.json) evaluated as its own method row,
labelled ``<source label>@<quantization>`` (e.g. ``standalone@int4-g64``). It is matched to the draft it
was quantized from by the source path its quantization.json records. The int kernels take bf16
activations (kernels.quant; any other dtype dequantizes at load), so where bf16 is fast a variant runs its draft
at bf16; where bf16 is slow (an AVX2-only CPU emulates it, ~9x a fp32 matmul) it runs fp32 and dequantizes. The
source draft runs as it is served without a variant (the engine's dtype): its row is the one the recommendations
judge, and moving it to bf16 would take it off the engine's fp32 C paths (on an AMX CPU a 1-layer standalone
draft's round went from 1.4 ms in the fp32 C loop to 7.2 ms at bf16). So the side-by-side compares the two as
each would serve, and says the dtypes.

The comparison, per (domain, temperature, K) and source draft: alpha and tau beside the source's, the
alpha points the variant costs, draft ms per round and its ratio to the source's (the draft step
speed-up), c, the end-to-end speed-up with its interval, and the draft's memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftsmith.serve_eval.eval.report import ResultRow
from draftsmith.serve_eval.eval.sources import DraftSource

VARIANT_DRAFT_DTYPE = "bfloat16"   # what torch's CPU int8/int4 weight kernels multiply with


def variant_draft_dtype(device: str = "cpu") -> str:
    """The dtype a variant runs at here: the int kernels' bf16 where bf16 is fast, else fp32."""
    from draftsmith.kernels.precision import bf16_is_fast

    return VARIANT_DRAFT_DTYPE if bf16_is_fast(device) else "float32"


def variant_label(source_label: str, quantization: str) -> str:
    return f"{source_label}@{quantization}"


def mark_variants(sources: list[DraftSource], device: str = "cpu") -> list[str]:
    """Fill quantization / variant_of / draft_dtype of quantized drafts (their sources keep theirs), in place;
    returns notes (a variant whose source is not in this run is still measured, without a comparison)."""
    from draftsmith.drafts.quant import QuantRecord

    dtype = variant_draft_dtype(device)

    by_path = {s.path.resolve(): s for s in sources if s.path.exists()}
    notes = []
    for source in sources:
        record = QuantRecord.read(source.path) if source.path.is_dir() else None
        if record is None:
            continue
        source.quantization, source.draft_dtype = record.config.label, dtype
        base = by_path.get(Path(record.source).resolve()) if record.source else None
        if base is None:
            notes.append(f"{source.method}: a {record.config.label} draft whose source {record.source} is not in "
                         "this run; measured without a side-by-side row")
            continue
        source.variant_of = base.method
    if any(s.variant_of for s in sources):
        notes.append(f"quantized variants run the draft at {dtype} "
                     + ("(the int kernels' activation dtype)" if dtype == VARIANT_DRAFT_DTYPE else
                        "(bf16 is slow here, so the variants dequantize)")
                     + "; their source drafts at the engine's dtype, as they serve")
    return notes


@dataclass
class VariantComparison:
    """One variant beside its source draft at one (domain, temperature, K)."""

    domain: str
    temperature: float
    K: int
    source: ResultRow
    variant: ResultRow

    @property
    def alpha_cost(self) -> float | None:
        """Alpha points the variant loses against its source (negative: it gained)."""
        a, b = self.source.alpha, self.variant.alpha
        return None if a is None or b is None else a - b

    @property
    def draft_step_speedup(self) -> float | None:
        """Source draft ms per round / the variant's: how much faster the quantized draft proposes."""
        a, b = self.source.draft_ms_per_round, self.variant.draft_ms_per_round
        return None if a is None or not b else a / b

    @property
    def memory_ratio(self) -> float | None:
        a, b = self.source.draft_bytes, self.variant.draft_bytes
        return None if not a or b is None else b / a


def variant_comparisons(rows: list[ResultRow]) -> list[VariantComparison]:
    """Every variant row that has its source's row at the same (domain, temperature, K)."""
    cells = {(r.domain, r.method, r.K, r.temperature): r for r in rows}
    out = []
    for r in rows:
        source = cells.get((r.domain, r.variant_of, r.K, r.temperature)) if r.variant_of else None
        if source is not None:
            out.append(VariantComparison(r.domain, r.temperature, r.K, source, r))
    return sorted(out, key=lambda c: (c.domain, c.temperature, c.source.method, c.K, c.variant.method))
