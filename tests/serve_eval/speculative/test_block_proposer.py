"""The block proposer computes what the block draft was trained to compute.

Every served block forward (paged draft KV, features injected incrementally across chunked prefill and
verification rounds, several sequences in one flattened batch) must give the same logits as the training
forward ``BlockDraft.anchor_forward`` at the same root over the target's own hidden states. A mismatch here
would show up as served acceptance below the training run's held-out accuracy (the prose T=0 gap of issue 13
was checked against this: it is not the proposer's)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.drafts.io import load_draft
from draftsmith.kernels.layers import native_stack
from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.speculative.config import SpecConfig
from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig
from spec_helpers import VOCAB, feature_draft, make_llama, run_engine

# small cache blocks and prefill chunks: a prompt spans many draft blocks and arrives in several feature feeds
ENGINE = dict(block_size=4, max_model_len=256, prefill_chunk_size=16, max_num_batched_tokens=64, num_gpu_blocks=400,
              enable_prefix_caching=False)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("block_parity")
    target = make_llama(root / "target", layers=4, seed=1, max_pos=256)
    init = lambda d: d.init_from_target(*load_target_embed_and_head(target))  # noqa: E731
    draft = feature_draft("block", target, root / "block", seed=2, init=init,
                          block_opts={"block_size": 5, "num_layers": 2})
    return target, draft


class Counted:
    """A draft's native stack or native context injection, counting its calls."""

    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, 0

    def accepts(self, *args) -> bool:
        return self.stack.accepts(*args)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.stack(*args, **kwargs)


def served_blocks(engine: LLMEngine, prompts, max_tokens: int) -> tuple[dict, list]:
    """Run the engine; record every served block as (request id, root position, logits [k, V])."""
    proposer = engine.strategy.proposer
    seen: list[tuple[str, int, torch.Tensor]] = []
    inner_forward = proposer._block_forward

    def recording(seqs, states, k):
        logits = inner_forward(seqs, states, k)
        seen.extend((s.request_id, len(s.token_ids) - 1, row) for s, row in zip(seqs, logits))
        return logits

    proposer._block_forward = recording  # instance attribute: propose calls self._block_forward
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts]
    outputs = run_engine(engine, prompts, params)
    return outputs, seen


@pytest.mark.parametrize("num_seqs", [1, 3])
@pytest.mark.parametrize("native", [True, False], ids=["c-stack", "torch-layers"])
def test_served_block_logits_equal_the_training_forward(world, num_seqs, native):
    """Both serving paths: every draft layer in one C call and the context rows injected in another (the default
    where the native kernels build), and the torch layers and injection (the path of drafts the C layers do not
    serve)."""
    target, draft_dir = world
    engine = LLMEngine(EngineConfig(str(target), **ENGINE),
                       speculative=SpecConfig("block", draft_path=str(draft_dir), num_speculative_tokens=4,
                                              policy=SpecPolicyConfig(fallback=False),  # every round speculates
                                              draft_weight_storage="float32"))  # the training forward's weights
    module = engine.strategy.proposer.draft
    if native:
        if native_stack._library() is None:
            pytest.skip("the native CPU kernels do not build here")
        assert module.native_stack is not None and module.native_context is not None
        module.native_stack, module.native_context = Counted(module.native_stack), Counted(module.native_context)
    else:
        module.native_stack = module.native_context = None
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB - 1, (n,), generator=gen).tolist() for n in (70, 53, 97)[:num_seqs]]
    outputs, seen = served_blocks(engine, prompts, max_tokens=40)
    assert len(seen) >= 10 * num_seqs
    hf = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    draft = load_draft(draft_dir).model.eval()
    by_request = {rid: [(root, row) for r, root, row in seen if r == rid] for rid in {r for r, _, _ in seen}}
    checked = 0
    for rid, blocks in by_request.items():
        out = outputs[rid]
        ids = torch.tensor([list(out.prompt_token_ids) + list(out.output_token_ids)])
        with torch.no_grad():
            hidden = hf(ids, output_hidden_states=True).hidden_states
            aux = torch.cat([hidden[i] for i in draft.config.aux_layers], dim=-1)
            roots = torch.tensor([[root for root, _ in blocks]])
            reference = draft.anchor_forward(ids, aux, roots)[0]  # [N, K_max, V]
        for (root, row), ref in zip(blocks, reference):
            torch.testing.assert_close(row, ref[:row.shape[0]], atol=2e-4, rtol=2e-4,
                                       msg=lambda m: f"request {rid} root {root}: {m}")
            checked += 1
    assert checked == len(seen)
    if native:   # every block forward ran its layers in the one C call, and the context went in through C
        assert module.native_stack.calls == engine.strategy.proposer.num_forwards > 0
        assert module.native_context.calls > 0
