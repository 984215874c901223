"""SpecConfig: which draft speculates, how far (K, tree), under which policy; and the proposer registry.

`LLMEngine(config, speculative=SpecConfig(...))` calls `make_strategy(engine)`, which builds the
proposer named by `method` and wraps it in the SpeculativeStrategy (serve_eval.speculative.strategy).

Proposer classes register themselves by method name (`@register_proposer`, proposers/registry.py), so a
proposer module plugs in by existing in draftsmith/serve_eval/speculative/proposers/. A registered class builds
itself with `from_spec_config(config, engine)`; it may define `attach(engine)`, called once when the
engine's KV cache exists (to size its own draft cache), before the first propose.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from draftsmith.drafts.kinds import KIND_NAMES
from draftsmith.serve_eval.speculative.batch_gate import BatchGateConfig
from draftsmith.serve_eval.speculative.metrics import DEFAULT_DOMAIN
from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig
from draftsmith.serve_eval.speculative.proposers.registry import proposer_class, proposer_methods
from draftsmith.serve_eval.speculative.tree import TreeShape, check_node_budget
from draftsmith.serve_eval.speculative.tree_budget import TreeBudget, TreeBudgetConfig
from draftsmith.serve_eval.speculative.tree_dynamic import DynamicTreeBuilder

if TYPE_CHECKING:
    from draftsmith.serve_eval.engine.llm_engine import LLMEngine

DRAFT_METHODS = KIND_NAMES  # methods that load a draft dir: one per draft kind (drafts.kinds)
TREE_MODES = ("none", "static", "dynamic")
TREE_BUDGETS = ("fixed", "cost")
WEIGHT_STORAGES = {"float16": torch.float16, "float32": torch.float32}


@dataclass
class SpecConfig:
    method: str  # ngram | standalone | medusa | eagle | eagle3
    draft_path: str | None = None  # draft dir (all methods but ngram)
    num_speculative_tokens: int = 4  # K: chain length; depth budget of trees
    tree: str = "none"  # none (chains) | static (tree_paths / tree_branching) | dynamic (EAGLE-2)
    tree_paths: list[list[int]] | None = None  # static shape, Medusa "choices" form
    tree_branching: list[int] | None = None  # static shape: children per node at each depth
    tree_top_k: int = 4  # dynamic: candidates per expanded node and frontier width
    tree_depth: int | None = None  # dynamic: draft depth (None = K)
    max_draft_nodes: int = 16  # node budget of one tree (= KV lookahead slots reserved per step)
    # dynamic: "cost" ranks nodes by calibrated acceptance and keeps as many as pay for their verification
    # (serve_eval.speculative.tree_budget, at most max_draft_nodes); "fixed" is EAGLE-2's raw confidence
    # ranking with exactly max_draft_nodes nodes.
    tree_budget: str = "cost"
    tree_budget_config: TreeBudgetConfig | None = None
    draft_dtype: str | None = None  # None = the target's dtype
    # Where the draft's few-row steps run the CPU kernels (fp32, kernels.small_gemm): its weights stored in
    # float16 (half the bytes a draft step reads; arithmetic and activations stay fp32) or float32. Output
    # stays exactly the target's either way; only the proposals move by the weights' rounding. A draft step
    # of more than 24 rows or on several threads runs the fp32 weights (torch's GEMM), so such steps propose
    # from the unrounded draft.
    draft_weight_storage: str = "float16"
    draft_num_blocks: int | None = None  # draft KV pool size (None = sized from the engine)
    ngram_max_n: int = 3
    ngram_min_n: int = 1
    ngram_max_lookback: int | None = None
    policy: SpecPolicyConfig | None = None  # its num_speculative_tokens is replaced by the K above
    # K caps by batch size (serve_eval.speculative.batch_gate): "off" (always speculate, the default here),
    # "measured" (the server's default: speculate where the measured step cost pays), or a config.
    batch_gate: BatchGateConfig | str | None = None
    # method="routed": an eval's recommendations.yaml; each request gets the draft and K recommended
    # for its domain and temperature (serve_eval.speculative.proposers.routed), several drafts in one engine.
    routes: str | None = None
    proposer_kwargs: dict[str, Any] = field(default_factory=dict)  # extra, method-specific
    # Target-fingerprint rule when loading the draft (drafts.io.load_draft): None = error for feature
    # drafts (Medusa/EAGLE) made for another target, warning for standalone. The eval harness and the
    # retrain hook pass False to measure an old draft on an updated target.
    strict_fingerprint: bool | None = None

    def __post_init__(self) -> None:
        if self.method not in proposer_methods():
            raise ValueError(f"speculative method {self.method!r} is not one of {list(proposer_methods())}")
        if isinstance(self.num_speculative_tokens, bool) or not isinstance(self.num_speculative_tokens, int) \
                or self.num_speculative_tokens <= 0:
            raise ValueError(f"num_speculative_tokens (K) must be an int > 0, got {self.num_speculative_tokens!r}")
        if (self.method == "routed") != bool(self.routes):
            raise ValueError("routes: method='routed' needs routes=RECOMMENDATIONS.yaml, and routes needs "
                             f"method='routed' (got method={self.method!r})")
        fallback_bars: dict[str, float] = {}
        if self.method == "routed":
            from draftsmith.serve_eval.eval.recommend import load_recommendations
            from draftsmith.serve_eval.speculative.proposers.routed import recommended_k
            recs = load_recommendations(self.routes)
            self.num_speculative_tokens, fallback_bars = recommended_k(recs), recs.fallback_bars()
        if self.method in DRAFT_METHODS and not self.draft_path:
            raise ValueError(f"speculative method {self.method!r} needs draft_path (a draft dir)")
        if self.tree not in TREE_MODES:
            raise ValueError(f"tree must be one of {TREE_MODES}, got {self.tree!r}")
        if self.max_draft_nodes <= 0:
            raise ValueError(f"max_draft_nodes must be > 0, got {self.max_draft_nodes}")
        if self.tree == "static":
            self.tree_shape()  # validates the shape and its node budget now, not at the first step
        if self.tree == "dynamic":
            if self.tree_budget not in TREE_BUDGETS:
                raise ValueError(f"tree_budget must be one of {TREE_BUDGETS}, got {self.tree_budget!r}")
            if self.tree_top_k <= 0 or self.dynamic_depth <= 0:
                raise ValueError(f"dynamic tree needs tree_top_k > 0 and tree_depth > 0, got "
                                 f"{self.tree_top_k}, {self.dynamic_depth}")
        if self.draft_dtype not in (None, "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"):
            raise ValueError(f"draft_dtype must be float32/bfloat16/float16 or None, got {self.draft_dtype!r}")
        if self.draft_weight_storage not in WEIGHT_STORAGES:
            raise ValueError(f"draft_weight_storage must be one of {list(WEIGHT_STORAGES)}, got "
                             f"{self.draft_weight_storage!r}")
        if self.draft_num_blocks is not None and self.draft_num_blocks <= 0:
            raise ValueError(f"draft_num_blocks must be > 0, got {self.draft_num_blocks}")
        # Routed: each domain falls back below its recommended draft's measured break-even alpha (unseen
        # domains below the default choice's, as the global bar, unless the caller gave a policy), and a
        # bar the caller's policy names for a domain wins.
        default_bar = fallback_bars.pop(DEFAULT_DOMAIN, None)
        policy = self.policy or SpecPolicyConfig(**({} if default_bar is None else
                                                    {"min_alpha": default_bar, "fallback_bar": "fixed"}))
        self.policy = replace(policy, num_speculative_tokens=self.num_speculative_tokens,
                              min_alpha_by_domain={**fallback_bars, **policy.min_alpha_by_domain})
        if not isinstance(self.batch_gate, BatchGateConfig):
            self.batch_gate = BatchGateConfig(mode=self.batch_gate or "off")

    # -- trees ---------------------------------------------------------------------------
    @property
    def uses_tree(self) -> bool:
        return self.tree != "none"

    @property
    def dynamic_depth(self) -> int:
        return self.tree_depth if self.tree_depth is not None else self.num_speculative_tokens

    def tree_shape(self) -> TreeShape | None:
        """Static shape (ValueError naming both counts when it exceeds max_draft_nodes)."""
        if self.tree != "static":
            return None
        if (self.tree_paths is None) == (self.tree_branching is None):
            raise ValueError("tree='static' needs exactly one of tree_paths or tree_branching")
        if self.tree_paths is not None:
            return TreeShape.from_paths(self.tree_paths, self.max_draft_nodes)
        return TreeShape.from_branching(self.tree_branching, self.max_draft_nodes)

    def dynamic_tree_builder(self, budget: TreeBudget | None = None) -> DynamicTreeBuilder | None:
        """A fresh EAGLE-2-style builder per proposal (tree='dynamic'), sized by `budget` when given."""
        if self.tree != "dynamic":
            return None
        return DynamicTreeBuilder(self.tree_top_k, self.dynamic_depth, self.max_draft_nodes, budget)

    def make_tree_budget(self) -> TreeBudget | None:
        """The cost model a proposer's dynamic trees share (tree='dynamic', tree_budget='cost'), else None."""
        if self.tree != "dynamic" or self.tree_budget != "cost":
            return None
        return TreeBudget(self.tree_budget_config or TreeBudgetConfig())

    def check_tree(self, num_nodes: int) -> None:
        check_node_budget(num_nodes, self.max_draft_nodes, "draft tree")

    @property
    def max_lookahead_tokens(self) -> int:
        """KV slots a step may reserve per sequence: the node budget for trees, the largest K for chains."""
        if self.uses_tree:
            return self.max_draft_nodes
        ks = [self.num_speculative_tokens, *self.policy.k_by_domain.values()]
        if self.policy.adaptive_k:
            ks.append(self.policy.k_max)
        return max(ks)

    # -- building ------------------------------------------------------------------------
    def make_proposer(self, engine: "LLMEngine"):
        from draftsmith.kernels.small_gemm import panel_storage

        cls = proposer_class(self.method)
        with panel_storage(WEIGHT_STORAGES[self.draft_weight_storage]):  # the draft's serving form, not the target's
            proposer = cls.from_spec_config(self, engine)
        if self.uses_tree and not proposer.supports_tree:
            raise ValueError(f"speculative method {self.method!r} does not support trees, but tree={self.tree!r}")
        return proposer

    def make_strategy(self, engine: "LLMEngine"):
        from draftsmith.serve_eval.speculative.strategy import SpeculativeStrategy

        return SpeculativeStrategy(self, self.make_proposer(engine), engine)


def expected_target(engine: "LLMEngine"):
    """draftsmith.drafts.io.ExpectedTarget of the engine's target (vocab, hidden size, fingerprint)."""
    from draftsmith.drafts.io import ExpectedTarget

    return ExpectedTarget.from_model_dir(engine.config.model)
