"""min_tokens: no EOS, stop token or stop string before a request's first min_tokens output tokens; the answer is
the target's greedy path with those tokens masked (transformers' generate with min_new_tokens, token for token),
and the rows masked are exactly those of output indices below min_tokens."""
import math

import pytest
import torch

from draftsmith.serve_eval.engine import LLM, SamplingParams
from draftsmith.serve_eval.engine.min_tokens import mask_early_stops
from tiny_models import tiny_model, word_tokenizer

VOCAB, MAX_POS = 256, 160
EOS = VOCAB - 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = tiny_model("llama", vocab_size=VOCAB, max_position_embeddings=MAX_POS, initializer_range=0.1,
                       eos_token_id=EOS, bos_token_id=0, pad_token_id=0)
    path = tmp_path_factory.mktemp("tiny_llama_min_tokens")
    model.save_pretrained(path)
    word_tokenizer(VOCAB).save_pretrained(path)
    return path, model


def hf_generate(model, prompt, max_new, stops, min_new=0):
    """transformers' greedy generate ending at any of `stops`, which MinNewTokensLengthLogitsProcessor masks for
    the first min_new tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=min_new, do_sample=False,
                             eos_token_id=list(stops), pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


PROMPT = [5, 17, 3, 99, 42, 8, 8, 61]


def test_stop_tokens_wait_for_min_tokens_as_in_transformers(model_dir):
    """The greedy path's own early tokens made stop tokens end a plain request at once; with min_tokens they are
    masked until then, and the output is transformers' min_new_tokens output token for token."""
    path, model = model_dir
    free = hf_generate(model, PROMPT, 24, stops=[EOS])
    stops = sorted(set(free[:3]) - {EOS})
    llm = LLM(path, num_gpu_blocks=64, block_size=4)
    (short,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=stops),
                            use_tqdm=False)
    assert len(short.output_token_ids) <= 3 and short.finish_reason == "stop"
    for min_tokens in (6, 24):
        params = SamplingParams(temperature=0, max_tokens=24, min_tokens=min_tokens, stop_token_ids=stops)
        (out,) = llm.generate([PROMPT], params, use_tqdm=False)
        expect = hf_generate(model, PROMPT, 24, stops=stops + [EOS], min_new=min_tokens)
        assert out.output_token_ids == expect
        assert len(out.output_token_ids) >= min_tokens
        assert not set(out.output_token_ids[:min_tokens]) & set(stops + [EOS])
    llm.engine.kv.check_integrity()


def test_stop_strings_are_not_checked_before_min_tokens(model_dir):
    """A stop string that the first token already spells ends a plain request after one token; with min_tokens the
    check starts at min_tokens (vLLM's rule), so the request runs that far."""
    path, model = model_dir
    first = hf_generate(model, PROMPT, 1, stops=[EOS])[0]
    llm = LLM(path, num_gpu_blocks=64, block_size=4)
    stop = llm.tokenizer.decode([first])
    (plain,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True),
                            use_tqdm=False)
    assert len(plain.output_token_ids) == 1 and plain.finish_reason == "stop"
    (held,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True,
                                                    min_tokens=5), use_tqdm=False)
    assert len(held.output_token_ids) >= 5


class _Params:
    def __init__(self, min_tokens, stop_token_ids=(), ignore_eos=False):
        self.min_tokens, self.stop_token_ids, self.ignore_eos = min_tokens, list(stop_token_ids), ignore_eos


class _Seq:
    def __init__(self, outputs, params):
        self.num_output_tokens, self.params = outputs, params


def test_masked_rows_are_those_below_min_tokens_by_depth():
    """Root rows predict output index num_output_tokens; node rows num_output_tokens + depth. Only rows below
    min_tokens lose their stop tokens (EOS unless ignore_eos, stop ids inside the vocabulary); others are untouched."""
    logits = torch.zeros(9, 10)
    depths = torch.tensor([1, 2, 1, 3])
    rows_of = [
        (_Seq(2, _Params(4, stop_token_ids=[3, 50])), 0, depths),   # rows 0..4: output idx 2, 3, 4, 3, 5 -> 0, 1, 3
        (_Seq(5, _Params(5)), 5, None),                               # done: untouched
        (_Seq(0, _Params(1, ignore_eos=True)), 6, None),              # no stop token to mask
        (_Seq(0, _Params(2)), 7, torch.tensor([1])),                  # rows 7, 8: idx 0, 1 -> both
    ]
    mask_early_stops(logits, rows_of, frozenset({9}))
    masked = {(r, c) for r, c in zip(*torch.nonzero(torch.isinf(logits), as_tuple=True)) for r, c in [(int(r), int(c))]}
    assert masked == {(0, 3), (0, 9), (1, 3), (1, 9), (3, 3), (3, 9), (7, 9), (8, 9)}
    assert all(v == -math.inf for v in logits[torch.isinf(logits)].tolist())


@pytest.mark.parametrize("fields,name", [({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
                                         ({"min_tokens": 2.0}, "min_tokens"), ({"min_tokens": True}, "min_tokens")])
def test_bad_min_tokens_is_refused_by_name(fields, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)
