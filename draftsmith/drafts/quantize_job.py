"""`draftsmith quantize DRAFT_DIR --bits 4|8 [--group-size G] [--quantize-head] [--out DIR]`: a step after distillation.

Writes a quantized copy of a draft dir (drafts.quant: weight-only INT8 per channel or INT4 grouped), with the
source's metadata (target fingerprint, data manifest, metrics) and ``quantization.json``. The default output is
a sibling ``<draft dir>-<label>`` (e.g. ``eagle3-ab12-int4-g64``), so the registry sees it as another draft of
the same target (``draftsmith.drafts.io.latest_drafts_by_kind`` only with ``include_quantized``). Optionally exports it (``--export``) in compressed-tensors'
``pack-quantized`` layout (drafts.quant_export) that vLLM loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftsmith.drafts.io import save_draft
from draftsmith.drafts.quant import (
    QuantConfig,
    QuantRecord,
    is_quantized,
    quantize_draft,
    weight_bytes,
)


def save_quantized(model, out_dir: Path, kind: str, meta, record: QuantRecord) -> Path:
    """Write a quantized draft dir: the usual files (drafts.io) + quantization.json; same metadata as the source."""
    out = save_draft(model, out_dir, kind, meta.target_fingerprint, meta.data_manifest_hash,
                     {**meta.metrics, "quantization": record.config.label})
    record.write(out)
    return out

def quantize_dir(src: str | Path, config: QuantConfig, out: str | Path | None = None) -> tuple[Path, dict]:
    """Quantize one draft dir; returns (output dir, summary fields for the log line)."""
    from draftsmith.drafts.io import load_draft

    src = Path(src)
    if is_quantized(src):
        raise ValueError(f"quantize: {src} is already quantized ({QuantRecord.read(src).config.label}); "
                         f"quantize its unquantized source")
    loaded = load_draft(src)
    dense = weight_bytes(loaded.model, float_itemsize=2)  # bf16: the baseline a quantized draft replaces
    names = quantize_draft(loaded.model, loaded.kind, config)
    out = Path(out) if out else src.with_name(f"{src.name}-{config.label}")
    save_quantized(loaded.model, out, loaded.kind, loaded.meta, QuantRecord(config, names, str(src.resolve())))
    summary = {"kind": loaded.kind, "quantization": config.label, "quantized_linears": len(names),
               "bf16_bytes": dense, "quantized_bytes": weight_bytes(loaded.model, float_itemsize=2), "out": str(out)}
    return out, summary


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="draftsmith quantize", description=__doc__.splitlines()[0])
    p.add_argument("draft_dir", help="a draft dir (distilled, unquantized)")
    p.add_argument("--bits", type=int, default=4, help="8 (per output channel) or 4 (grouped)")
    p.add_argument("--group-size", type=int, default=64, help="int4 group along the input dim: 32, 64, 128, 256")
    p.add_argument("--quantize-head", action="store_true",
                   help="also quantize the draft's OWN lm_head (a head shared with the target never is)")
    p.add_argument("--out", default=None, help="output dir (default: <draft_dir>-<label>)")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="also write a compressed-tensors (vLLM) export of the quantized draft here")
    p.add_argument("--verifier", default=None, help="target path or hub id written into the export's config")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = QuantConfig(args.bits, args.group_size if args.bits == 4 else None, args.quantize_head)
        out, summary = quantize_dir(args.draft_dir, config, args.out)
        if args.export:
            from draftsmith.drafts.quant_export import export_compressed

            summary["export"] = str(export_compressed(out, args.export, verifier=args.verifier))
    except ValueError as err:  # bad input: one line naming the field and the allowed values
        print(f"draftsmith quantize: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
