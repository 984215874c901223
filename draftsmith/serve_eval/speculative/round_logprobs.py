"""Which verify rows a speculative step's emitted tokens came from, for their logprobs (engine.logprobs).

A sequence's rows in the step's logits are [root, node 0, node 1, ...]. Its emitted tokens are the accepted
drafts plus the correction / bonus token: token 0 is drawn from the root's row, token j from the row of the
accepted node j - 1 (its own parent on the accepted path). Plain rows (no draft) are one row, one token.
"""
from __future__ import annotations


def round_rows(producing: list[int], drafts: dict, results: dict) -> dict[int, list[int]]:
    """producing: scheduled-seq indices in logits-row order; drafts / results by seq index (SpecDraft,
    VerifyResult) -> per producing seq, the logits rows of its emitted tokens, in emission order."""
    rows: dict[int, list[int]] = {}
    row = 0
    for i in producing:
        draft, res = drafts.get(i), results.get(i)
        if draft is None or res is None:
            rows[i] = [row]
        else:
            nodes = res.accepted_node_ids if draft.is_tree else range(res.num_accepted_drafts)
            rows[i] = [row] + [row + 1 + node for node in nodes]
        row += 1 + (draft.num_nodes if draft is not None else 0)
    return rows
