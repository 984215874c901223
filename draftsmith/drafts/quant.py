"""Weight-only quantization of a trained draft (any kind), and quantized draft dirs.

Which linears are quantized: every nn.Linear of the draft except its LM heads; a head that is the TARGET's
(EAGLE-1's frozen copy, Medusa's shared head) always stays as the target has it, and a head that is the
draft's own (standalone, EAGLE-3, Medusa per-head) is quantized when ``quantize_head`` is set. Embeddings and
norms stay dense (a lookup and a vector: nothing a GEMV would save).

A quantized draft dir is a normal draft dir (config.json, draftsmith.json) whose model.safetensors holds
``<linear>.qweight`` / ``<linear>.scales`` in place of ``<linear>.weight``, plus ``quantization.json``
(``QuantConfig`` + the quantized module names + the source dir). ``draftsmith.drafts.io.load_draft`` reads it back; the
serving form runs kernels.quant's int kernels.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torch import nn

from draftsmith.drafts.files import write_json
from draftsmith.drafts.kinds import WEIGHTS_FILE, build_from_config
from draftsmith.kernels.quant import INT4_GROUP_SIZES, QuantizedLinear, QuantScheme

QUANT_FILE = "quantization.json"
# heads that are copies of the target's: never quantized (the draft shares what the target serves)
TARGET_HEADS: dict[str, tuple[str, ...]] = {"eagle": (r"lm_head",), "medusa": (r"lm_head",), "block": (r"lm_head",)}
# the draft's own heads: quantized only with quantize_head
OWN_HEADS: dict[str, tuple[str, ...]] = {"standalone": (r"lm_head",), "eagle3": (r"lm_head",),
                                         "medusa": (r"heads\.\d+\.lm_head",)}


@dataclass
class QuantConfig:
    """What `draftsmith quantize` does to a draft (validated: one line naming the field and allowed values)."""

    bits: int = 4
    group_size: int | None = 64  # int4 only (int8 is per channel); must divide every quantized layer's width
    quantize_head: bool = False  # the draft's own LM head (a target-shared head is never quantized)

    def __post_init__(self) -> None:
        if self.bits == 8:
            self.group_size = None
        self.scheme  # validates bits / group_size

    @property
    def scheme(self) -> QuantScheme:
        return QuantScheme(self.bits, self.group_size)

    @property
    def label(self) -> str:
        """e.g. int8, int4-g64, int4-g64-head: names the copy's dir and its eval row, so each config has its own."""
        return ("int8" if self.bits == 8 else f"int4-g{self.group_size}") + ("-head" if self.quantize_head else "")


@dataclass
class QuantRecord:
    """quantization.json: the config, which modules were quantized, and the unquantized source."""

    config: QuantConfig
    modules: list[str] = field(default_factory=list)
    source: str | None = None

    @classmethod
    def read(cls, draft_dir: str | Path) -> "QuantRecord | None":
        path = Path(draft_dir) / QUANT_FILE
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        return cls(QuantConfig(**raw["config"]), list(raw.get("modules", [])), raw.get("source"))

    def write(self, draft_dir: str | Path) -> None:
        write_json(Path(draft_dir) / QUANT_FILE, {"config": asdict(self.config), "modules": self.modules,
                                                  "source": self.source})


def is_quantized(draft: nn.Module | str | Path) -> bool:
    """A module holding QuantizedLinear layers, or a dir with quantization.json."""
    if isinstance(draft, (str, Path)):
        return (Path(draft) / QUANT_FILE).is_file()
    return any(isinstance(m, QuantizedLinear) for m in draft.modules())


def refuse_quantized(draft: nn.Module | str | Path, field_name: str) -> None:
    """Training entry points call this: a quantized draft cannot be trained or warm-started."""
    if is_quantized(draft):
        record = QuantRecord.read(draft) if isinstance(draft, (str, Path)) else None
        hint = f"; its unquantized source is {record.source}" if record and record.source else ""
        raise ValueError(f"{field_name}: {draft if isinstance(draft, (str, Path)) else 'the draft'} is a quantized "
                         f"draft; training takes an unquantized (float32/bfloat16) draft{hint}")


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(re.fullmatch(p, name) for p in patterns)


def _is_target_head(name: str, module: nn.Linear, kind: str) -> bool:
    """A head the draft shares with the target: listed for its kind, or (a kind not listed) a frozen *lm_head."""
    if kind in TARGET_HEADS or kind in OWN_HEADS:
        return _matches(name, TARGET_HEADS.get(kind, ()))
    return name.split(".")[-1] == "lm_head" and not module.weight.requires_grad


def linears_to_quantize(model: nn.Module, kind: str, config: QuantConfig) -> list[str]:
    """Names of the nn.Linear modules quantization replaces (heads per the rule in the module docstring)."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or _is_target_head(name, module, kind):
            continue
        if _matches(name, OWN_HEADS.get(kind, ())) and not config.quantize_head:
            continue
        names.append(name)
    return names


def check_group_size(model: nn.Module, names: list[str], config: QuantConfig) -> None:
    """ValueError naming the first layer whose width the group size does not divide, with the sizes that fit all."""
    if config.bits != 4:
        return
    widths = {name: model.get_submodule(name).in_features for name in names}
    fits = [g for g in INT4_GROUP_SIZES if all(w % g == 0 for w in widths.values())]
    for name, width in widths.items():
        if width % config.group_size:
            raise ValueError(f"quant.group_size: {config.group_size} does not divide the input width {width} of "
                             f"{name}; allowed values for this draft: {fits}")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def quantize_draft(model: nn.Module, kind: str, config: QuantConfig) -> list[str]:
    """Replace the draft's quantizable linears by QuantizedLinear in place; returns their names.

    A tied standalone head that is quantized becomes its own quantized matrix (the embedding stays dense)."""
    names = linears_to_quantize(model, kind, config)
    check_group_size(model, names, config)
    for name in names:
        _replace(model, name, QuantizedLinear.from_linear(model.get_submodule(name), config.scheme, name))
    return names


def quantized_structure(model: nn.Module, record: QuantRecord) -> None:
    """Empty QuantizedLinear modules where the record says (before loading a quantized state dict)."""
    for name in record.modules:
        linear = model.get_submodule(name)
        dtype = linear.weight.dtype
        _replace(model, name, QuantizedLinear(linear.in_features, linear.out_features, record.config.scheme,
                                              bias=linear.bias is not None).to(dtype))


def load_quantized_model(draft_dir: str | Path, kind: str, cfg_dict: dict) -> nn.Module:
    """The module of a quantized draft dir (drafts.io.load_draft calls this when quantization.json exists)."""
    from draftsmith.kernels.layers.checkpoint import read_file

    draft_dir = Path(draft_dir)
    record = QuantRecord.read(draft_dir)
    model = build_from_config(kind, cfg_dict)
    quantized_structure(model, record)
    state = read_file(draft_dir / WEIGHTS_FILE)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied_head = kind == "standalone" and "lm_head" not in record.modules and model.config.tie_word_embeddings
    missing = [k for k in missing if not (tied_head and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{draft_dir / WEIGHTS_FILE}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    return model


def weight_bytes(model: nn.Module, float_itemsize: int | None = None) -> int:
    """Bytes of the draft's parameters and buffers (shared storage counted once): what it holds in memory.
    float_itemsize: count floating tensors at that size instead (2 = the draft's bf16 size)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            size = float_itemsize if float_itemsize and t.is_floating_point() else t.element_size()
            total += t.numel() * size
    return total
