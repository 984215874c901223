"""EAGLE-1 / EAGLE-3 proposers: chains equal a dense-cache reference unroll, draft-cache rollback equals a
fresh proposer, dynamic trees follow the draft along each path within the node budget, foreign drafts fail."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from draftsmith.drafts.common import DenseKVCache
from draftsmith.drafts.eagle import EagleDraft
from draftsmith.drafts.eagle3 import Eagle3Draft, build_reduced_vocab
from draftsmith.drafts.identity import target_fingerprint
from draftsmith.drafts.io import save_draft
from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head
from draftsmith.kernels.sampling import logits_to_probs, sample
from draftsmith.serve_eval.engine.model_executor import ModelExecutor
from draftsmith.serve_eval.speculative.config import SpecConfig
from draftsmith.serve_eval.speculative.proposers.base import FeatureBatch, TargetFeatures
from draftsmith.serve_eval.speculative.proposers.eagle import EagleProposer
from draftsmith.serve_eval.speculative.proposers.eagle3 import Eagle3Proposer
from draftsmith.serve_eval.speculative.tree_dynamic import DynamicTreeBuilder
from spec_helpers import Seq, params
from tiny_models import save_tiny_model
from draftsmith.serve_eval.speculative.verify import VerifyResult

VOCAB, HIDDEN = 96, 32


TARGET = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4)


@pytest.fixture(scope="module")
def target_dir(family_checkpoint):
    return family_checkpoint("llama", **TARGET)


def make_draft(kind, target_dir, seed=1, **opts):
    """A draft with large random weights (so argmaxes are far from ties), embed/head copied from the target."""
    torch.manual_seed(seed)
    if kind == "eagle":
        draft = EagleDraft.from_target_config(target_dir, **opts)
    else:
        draft = Eagle3Draft.from_target_config(target_dir, draft_vocab_size=64, **opts)
        counts = torch.rand(VOCAB)
        draft.set_vocab_map(*build_reduced_vocab(counts, 64))
    for name, p in draft.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.3)
    embed, head = load_target_embed_and_head(target_dir)
    draft.init_from_target(embed * 10, head * 10) if kind == "eagle" else draft.init_from_target(embed * 10)
    return draft.eval()


PROPOSERS = {"eagle": EagleProposer, "eagle3": Eagle3Proposer}




def feature_table(kind, n, seed):
    """'True' target features per position: hidden [n, d] and aux [n, 3d]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HIDDEN, generator=g), torch.randn(n, 3 * HIDDEN, generator=g)


def feats(hidden, aux, start, end):
    return TargetFeatures(start, hidden[start:end], aux[start:end])


def reference_chain(draft, kind, tokens, hidden, aux, k, prm, generator):
    """Dense-cache unroll straight from the draft module: (tokens, probs rows)."""
    root = len(tokens) - 1
    attn = DenseKVCache(1).attn_fns()[0]
    logits_of = draft.compute_logits if kind == "eagle" else (lambda h: draft.to_target_logits(draft.compute_logits(h)))
    x = hidden[:root] if kind == "eagle" else draft.fuse(aux[:root])
    f = draft(torch.tensor(tokens[1:root + 1]), x, torch.arange(root), attn)[-1:]
    out, rows = [], []
    for step in range(k):
        probs = logits_to_probs(logits_of(f).float(), prm.temperature, prm.top_k, prm.top_p)
        tok = int(probs.argmax()) if prm.temperature == 0 else int(sample(probs, [generator])[0])
        out.append(tok)
        rows.append(probs[0])
        f = draft(torch.tensor([tok]), f, torch.tensor([root + step]), attn)
    return out, torch.stack(rows)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@torch.inference_mode()
def test_chain_matches_dense_reference(kind, target_dir):
    """A batch of three sequences (different lengths, K, greedy / sampled with top-k/top-p) proposes exactly the
    tokens and draft rows of an independent dense-cache unroll of the draft module, seeded identically."""
    draft = make_draft(kind, target_dir)
    proposer = PROPOSERS[kind].from_draft(draft, num_blocks=32, block_size=4)
    cases = [(11, 3, params()), (6, 5, params(0.8, 20, 0.9)), (17, 1, params(1.0))]
    seqs, refs = [], []
    for i, (length, k, prm) in enumerate(cases):
        hidden, aux = feature_table(kind, length, seed=i)
        tokens = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(10 + i)).tolist()
        proposer.add_features(f"r{i}", feats(hidden, aux, 0, length - 1))
        seqs.append(Seq(f"r{i}", tokens, prm, torch.Generator().manual_seed(100 + i)))
        refs.append(reference_chain(draft, kind, tokens, hidden, aux, k, prm, torch.Generator().manual_seed(100 + i)))
    proposals = proposer.propose(seqs, [k for _, k, _ in cases])
    for (length, k, prm), proposal, (ref_tokens, ref_rows) in zip(cases, proposals, refs):
        assert proposal.tokens.tolist() == ref_tokens
        if prm.temperature == 0:
            assert proposal.draft_probs is None  # point masses
        else:
            torch.testing.assert_close(proposal.draft_probs, ref_rows, atol=1e-5, rtol=1e-4)
        proposal.validate(VOCAB)
    proposer.check_integrity()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("kind,opts", [("eagle", {}), ("eagle3", {}), ("eagle3", {"norm_before_residual": True})])
@torch.inference_mode()
def test_a_batchs_chains_run_in_one_c_call_with_the_reference_tokens(kind, opts, temperature, target_dir, monkeypatch):
    """Every request greedy, or sampled at a plain temperature with its own generator: the ingest of the fed
    features and every chain's steps run in the draft's C loop (EAGLE-1: fc, the layer, the head; EAGLE-3: the two
    input norms, the mid layer, the final norm, the head over the reduced vocabulary and d2t; then the argmax or the
    draw), once per propose, all K picks in it, and the chains are still the dense-cache unroll's tokens
    (sampled: drawn with the same generators, from rows equal to the unroll's within fp32 rounding, scattered into
    the target vocabulary), for sequences of different lengths and K."""
    from draftsmith.kernels.layers.native_draft_loop import NativeDraftLoop

    draft = make_draft(kind, target_dir, **opts)
    proposer = PROPOSERS[kind].from_draft(draft, num_blocks=32, block_size=4)
    if proposer.draft.draft_loop() is None:
        pytest.skip("the native CPU kernels do not serve this draft here")
    calls = []
    loop_call = NativeDraftLoop.__call__
    monkeypatch.setattr(NativeDraftLoop, "__call__", lambda self, *a, **k: calls.append(a[2]) or loop_call(self, *a, **k))
    cases = [(11, 3), (6, 5), (17, 1), (9, 4)]
    seqs, refs = [], []
    for i, (length, k) in enumerate(cases):
        hidden, aux = feature_table(kind, length, seed=i)
        tokens = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(20 + i)).tolist()
        proposer.add_features(f"g{i}", feats(hidden, aux, 0, length - 1))
        seqs.append(Seq(f"g{i}", tokens, params(temperature), torch.Generator().manual_seed(50 + i)))
        refs.append(reference_chain(draft, kind, tokens, hidden, aux, k, params(temperature),
                                    torch.Generator().manual_seed(50 + i)))
    proposals = proposer.propose(seqs, [k for _, k in cases])
    assert [p.tokens.tolist() for p in proposals] == [tokens for tokens, _ in refs]
    assert calls == [[k for _, k in cases]]
    for proposal, (_, rows) in zip(proposals, refs):
        if temperature == 0:
            assert proposal.draft_probs is None
        else:
            # rtol: the C loop sums in another order than torch (one value 1.3e-4 off on an AVX2-only CPU)
            torch.testing.assert_close(proposal.draft_probs, rows, atol=1e-6, rtol=2e-4)
            proposal.validate(VOCAB)
    if temperature > 0:
        assert len({tuple(p.tokens.tolist()) for p in proposals if p.num_tokens > 2}) > 1
    proposer.check_integrity()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@torch.inference_mode()
def test_rollback_equals_fresh_proposer(kind, temperature, target_dir):
    """After random accept/reject rounds (speculative entries dropped, accepted positions re-fed as true
    features), the next proposal equals that of a fresh proposer fed the whole accepted history at once, and the
    draft pool holds exactly the committed entries; reset returns every block."""
    draft = make_draft(kind, target_dir)
    hidden, aux = feature_table(kind, 200, seed=5)
    rng = random.Random(0)
    prm = params(temperature)
    proposer = PROPOSERS[kind].from_draft(draft, num_blocks=64, block_size=4)
    tokens = [rng.randrange(VOCAB) for _ in range(7)]
    proposer.add_features("a", feats(hidden, aux, 0, 4))  # a prefill in two chunks
    proposer.add_features("a", feats(hidden, aux, 4, 6))
    for _ in range(8):
        k = rng.randint(1, 4)
        proposal = proposer.propose([Seq("a", tokens, prm, torch.Generator().manual_seed(1))], [k])[0]
        n_acc = rng.randint(0, proposal.num_tokens)
        emitted = proposal.tokens[:n_acc].tolist() + [rng.randrange(VOCAB)]
        root = len(tokens) - 1
        proposer.on_accepted("a", VerifyResult(emitted, n_acc, list(range(n_acc))))
        committed, backed = proposer.num_cached_entries("a")
        assert committed == backed == root  # only true (feature, token) pairs remain
        proposer.check_integrity()
        tokens += emitted
        proposer.add_features("a", feats(hidden, aux, root, root + n_acc + 1))
    fresh = PROPOSERS[kind].from_draft(draft, num_blocks=64, block_size=4)
    fresh.add_features("a", feats(hidden, aux, 0, len(tokens) - 1))
    got = proposer.propose([Seq("a", tokens, prm, torch.Generator().manual_seed(7))], [4])[0]
    want = fresh.propose([Seq("a", tokens, prm, torch.Generator().manual_seed(7))], [4])[0]
    assert got.tokens.tolist() == want.tokens.tolist()
    if temperature > 0:
        torch.testing.assert_close(got.draft_probs, want.draft_probs, atol=1e-5, rtol=1e-4)
    proposer.reset("a")
    proposer.check_integrity()
    assert proposer.cache.manager.pool.num_free_blocks == 64


def reference_tree(draft, kind, tokens, hidden, aux, top_k, depth, max_nodes):
    """EAGLE-2 built straight from the draft: each node's continuation comes from a dense unroll along
    exactly its own path (no other branch in its context), ranked by the same DynamicTreeBuilder."""
    root = len(tokens) - 1

    def logits_after(path):
        attn = DenseKVCache(1).attn_fns()[0]
        x = hidden[:root] if kind == "eagle" else draft.fuse(aux[:root])
        f = draft(torch.tensor(tokens[1:]), x, torch.arange(root), attn)[-1:]
        for step, tok in enumerate(path):
            f = draft(torch.tensor([tok]), f, torch.tensor([root + step]), attn)
        logits = draft.compute_logits(f) if kind == "eagle" else draft.to_target_logits(draft.compute_logits(f))
        return torch.softmax(logits[0].float(), -1).topk(top_k)

    builder = DynamicTreeBuilder(top_k, depth, max_nodes)
    paths = {}  # builder id -> token path
    top = logits_after([])
    frontier = builder.add_root_candidates(top.indices, top.values)
    paths.update({i: [int(t)] for i, t in enumerate(top.indices)})
    while frontier:
        tops = [logits_after(paths[n]) for n in frontier]
        first = builder.num_candidates
        for j, (n, t) in enumerate(zip(frontier, tops)):
            for c, tok in enumerate(t.indices.tolist()):
                paths[first + j * top_k + c] = paths[n] + [tok]
        frontier = builder.add_children(frontier, torch.stack([t.indices for t in tops]),
                                        torch.stack([t.values for t in tops]))
    return builder.build()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@torch.inference_mode()
def test_dynamic_tree_equals_reference_within_budget(kind, target_dir):
    """EAGLE-2 trees of a batch equal (tokens and parents) a reference that unrolls the draft densely along each
    node's own path - so the tree mask hides other branches inside the batched paged draft forward; the tree
    holds max_nodes point-mass nodes (draft_probs None) of depth <= the configured depth."""
    draft = make_draft(kind, target_dir)
    top_k, depth, max_nodes = 3, 4, 12
    proposer = PROPOSERS[kind].from_draft(draft, num_blocks=64, block_size=4, tree=(top_k, depth, max_nodes))
    seqs = []
    for i, length in enumerate([3, 9]):
        hidden, aux = feature_table(kind, length, seed=20 + i)
        tokens = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(i)).tolist()
        proposer.add_features(f"t{i}", feats(hidden, aux, 0, length - 1))
        seqs.append((Seq(f"t{i}", tokens, params()), hidden, aux))
    proposals = proposer.propose([s for s, _, _ in seqs], [depth, depth])
    for (seq, hidden, aux), proposal in zip(seqs, proposals):
        tree = proposal.tree
        assert tree is not None and proposal.draft_probs is None and tree.draft_probs is None
        assert tree.num_nodes == max_nodes and tree.max_depth <= depth
        assert torch.equal(proposal.tokens, tree.tokens)
        ref = reference_tree(draft, kind, seq.token_ids, hidden, aux, top_k, depth, max_nodes)
        assert tree.tokens.tolist() == ref.tokens.tolist() and tree.parents.tolist() == ref.parents.tolist()
    proposer.on_accepted("t0", VerifyResult([1], 0, []))
    assert proposer.num_cached_entries("t0")[1] == len(seqs[0][0].token_ids) - 1  # tree entries dropped
    proposer.check_integrity()


@torch.inference_mode()
def test_features_must_be_consecutive(target_dir):
    """A gap in fed positions is a ValueError naming both positions; a first feed may start past 0
    (prefix-cache hit) and the proposer then drafts from there."""
    proposer = EagleProposer.from_draft(make_draft("eagle", target_dir), num_blocks=16, block_size=4)
    hidden, aux = feature_table("eagle", 20, seed=3)
    proposer.add_features("x", feats(hidden, aux, 4, 8))
    with pytest.raises(ValueError, match="start_pos is 9 but the proposer expects the next position 8"):
        proposer.add_features("x", feats(hidden, aux, 9, 10))
    tokens = list(range(9))
    assert proposer.propose([Seq("x", tokens, params())], [2])[0].num_tokens == 2
    assert proposer.propose([Seq("y", tokens, params())], [2])[0].num_tokens == 0  # nothing fed: no draft


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@torch.inference_mode()
def test_a_feature_batch_feeds_as_per_request_calls(kind, target_dir):
    """One FeatureBatch (the strategy's call: a prefill of one request, a later chunk of another, a request with
    no rows this step) leaves the proposer drafting exactly what per-request add_features calls leave it. A batch
    of the wrong width or a gap in a request's positions is one ValueError naming the field or the request."""
    draft = make_draft(kind, target_dir)
    per_request, batched = (PROPOSERS[kind].from_draft(draft, num_blocks=32, block_size=4) for _ in range(2))
    tables = [feature_table(kind, n, seed=i) for i, n in enumerate((9, 12, 7))]
    spans = [(0, 8), (0, 5), (0, 6)]
    for i, (hidden, aux) in enumerate(tables):
        per_request.add_features(f"s{i}", feats(hidden, aux, *spans[i]))
    batched.add_feature_batch(FeatureBatch(["s0", "s1", "s2"], [0, 0, 0], [8, 5, 6],
                                           torch.cat([t[0][a:b] for t, (a, b) in zip(tables, spans)]),
                                           torch.cat([t[1][a:b] for t, (a, b) in zip(tables, spans)])))
    hidden, aux = tables[1]  # s1's next chunk alone: s0 and s2 keep no rows this step
    per_request.add_features("s1", feats(hidden, aux, 5, 11))
    batched.add_feature_batch(FeatureBatch(["s0", "s1", "s2"], [8, 5, 6], [0, 6, 0], hidden[5:11], aux[5:11]))
    token_lists = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(30 + i)).tolist()
                   for i, n in enumerate((9, 12, 7))]
    seqs = [Seq(f"s{i}", tokens, params()) for i, tokens in enumerate(token_lists)]
    expected = [p.tokens.tolist() for p in per_request.propose(seqs, [3, 3, 3])]
    assert [p.tokens.tolist() for p in batched.propose(seqs, [3, 3, 3])] == expected
    assert all(len(tokens) == 3 for tokens in expected)
    # in a step of one long chunk and one decode row, the chunk's request keeps a view and the row is copied, so a
    # request that keeps decoding does not hold the chunk alive
    storage = lambda rows: rows.untyped_storage().data_ptr()
    chunk = FeatureBatch(["s3", "s0"], [0, 8], [20, 1], torch.randn(21, HIDDEN), torch.randn(21, 3 * HIDDEN))
    batched.add_feature_batch(chunk)
    fed = chunk.hidden if kind == "eagle" else chunk.aux
    assert storage(batched._states["s3"].pending[-1]) == storage(fed)
    assert storage(batched._states["s0"].pending[-1]) != storage(fed)
    width = HIDDEN if kind == "eagle" else 3 * HIDDEN
    with pytest.raises(ValueError, match="FeatureBatch: 2 request ids, 2 start positions and 1 counts"):
        batched.add_feature_batch(FeatureBatch(["s0", "s2"], [9, 6], [1], hidden[:1], aux[:1]))
    with pytest.raises(ValueError, match=rf"FeatureBatch\.{'hidden' if kind == 'eagle' else 'aux'} must be \[n, {width}\]"):
        batched.add_feature_batch(FeatureBatch(["s0"], [8], [1], torch.zeros(1, HIDDEN + 1), torch.zeros(1, 3 * HIDDEN + 1)))
    with pytest.raises(ValueError, match="request s2: TargetFeatures.start_pos is 9 but the proposer expects the next position 6"):
        batched.add_feature_batch(FeatureBatch(["s2"], [9], [1], hidden[:1], aux[:1]))


def spec(kind, draft_dir, **kw):
    return SpecConfig(method=kind, draft_path=str(draft_dir), num_speculative_tokens=3, draft_num_blocks=16, **kw)


def test_constructor_checks_target(target_dir, tmp_path):
    """Built like the registry builds it: a draft for the same target loads; one saved for another target's
    fingerprint, or built for another vocabulary / hidden size, fails naming both sides' values."""
    executor = ModelExecutor(target_dir)
    good = save_draft(make_draft("eagle3", target_dir), tmp_path / "good", target_fingerprint=target_fingerprint(target_dir))
    proposer = Eagle3Proposer(spec("eagle3", good, tree="dynamic"), executor, "cpu", torch.float32, target_dir)
    assert proposer.aux_layers == (2, 2, 1) and proposer.tree == (4, 3, 16)
    foreign = save_draft(make_draft("eagle3", target_dir), tmp_path / "foreign", target_fingerprint="0123456789abcdef")
    with pytest.raises(ValueError, match=f"fingerprint 0123456789abcdef.*{target_fingerprint(target_dir)}"):
        Eagle3Proposer(spec("eagle3", foreign), executor, "cpu", torch.float32, target_dir)
    other = save_tiny_model(tmp_path / "other", **{**TARGET, "vocab_size": 128, "hidden_size": 48})
    wrong = save_draft(EagleDraft.from_target_config(other), tmp_path / "wrong")
    with pytest.raises(ValueError, match="vocab_size=128, but the target has vocab_size=96"):
        EagleProposer(spec("eagle", wrong), executor, "cpu", torch.float32)
    with pytest.raises(ValueError, match="needs eagle"):
        EagleProposer(spec("eagle", good), executor, "cpu", torch.float32)
    with pytest.raises(ValueError, match="tree='dynamic'"):
        Eagle3Proposer(spec("eagle3", good, tree="static", tree_branching=[2]), executor, "cpu", torch.float32)
