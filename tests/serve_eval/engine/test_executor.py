"""ModelExecutor against transformers on tiny random Llama / Mistral / Qwen2 checkpoints (fp32, exact to 1e-4)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.kernels.attention import AttentionMetadata
from draftsmith.serve_eval.engine.model_executor import ModelExecutor
from tiny_models import SHAPE as TINY_SHAPE, Init, tiny_model

VOCAB = 160
BLOCK_SIZE = 4
TOL = 1e-4


# The executor tests' model shape (head_dim 16; 3 layers, so per-layer variants have a middle layer)
SHAPE = dict(TINY_SHAPE, vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=3)
BIASED = Init(bias_std=0.5)  # HF initialises Qwen2's q/k/v biases to zero, which would leave the bias path untested


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """Full-sequence, cache-free logits [S, V] from transformers."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


class PagedRunner:
    """Minimal engine stand-in: per-sequence token lists and block tables over shuffled physical blocks."""

    def __init__(self, executor: ModelExecutor, num_blocks: int = 64, seed: int = 0):
        self.executor = executor
        executor.allocate_kv_cache(num_blocks, BLOCK_SIZE, num_cpu_blocks=8)
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}

    def step(self, work: dict[str, list[int]], **kwargs):
        """Append each sequence's new tokens and run one forward; returns ({seq: logits rows}, output)."""
        ids, positions, q_lens, s_lens, tables = [], [], [], [], []
        for name, new in work.items():
            toks = self.tokens.setdefault(name, [])
            table = self.tables.setdefault(name, [])
            start = len(toks)
            toks.extend(new)
            while len(table) * BLOCK_SIZE < len(toks):
                table.append(self.free.pop())
            ids.extend(new)
            positions.extend(range(start, len(toks)))
            q_lens.append(len(new))
            s_lens.append(len(toks))
            tables.append(table)
        meta = AttentionMetadata.build(q_lens, s_lens, tables, BLOCK_SIZE)
        out = self.executor.forward(torch.tensor(ids), torch.tensor(positions), meta, **kwargs)
        rows, offset = {}, 0
        for name, n in zip(work, q_lens):
            rows[name] = out.logits[offset:offset + n]
            offset += n
        return rows, out


# (sequence -> new tokens) per step: chunked prefill of A over 3 steps, B prefill then decode, C joins late;
# step 4 is pure decode (vectorized path), step 5 a single decode.
SCHEDULE = [
    {"A": 5, "B": 9},
    {"A": 7, "B": 1, "C": 6},
    {"A": 4, "B": 1, "C": 1},
    {"A": 1, "B": 1, "C": 1},
    {"A": 1},
]


def run_schedule_and_compare(model, executor) -> float:
    gen = torch.Generator().manual_seed(1)
    runner = PagedRunner(executor)
    seen: dict[str, list[torch.Tensor]] = {}
    for step in SCHEDULE:
        work = {name: torch.randint(0, VOCAB, (n,), generator=gen).tolist() for name, n in step.items()}
        rows, _ = runner.step(work)
        for name, logits in rows.items():
            seen.setdefault(name, []).append(logits)
    worst = 0.0
    for name, chunks in seen.items():
        ours = torch.cat(chunks)
        worst = max(worst, (ours - hf_logits(model, runner.tokens[name])).abs().max().item())
    return worst


@pytest.mark.parametrize("kind,kv_heads,tied", [
    ("llama", 2, False),  # GQA, untied
    ("llama", 4, True),   # MHA, tied embeddings
    ("qwen2", 2, False),  # attention bias
    ("mistral", 1, False),  # MQA
])
def test_logits_match_transformers_over_mixed_steps(tmp_path, kind, kv_heads, tied):
    """Prefill, chunked prefill (3 chunks), decode and mixed batches give HF's full-sequence logits."""
    model = tiny_model(kind, init=BIASED, shape=SHAPE, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    executor = ModelExecutor(tmp_path)
    assert executor.model.tied == tied
    assert run_schedule_and_compare(model, executor) < TOL


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
])
def test_rope_scaling_matches_transformers(tmp_path, rope_scaling):
    """Linear, llama3 and yarn rope scaling read from the saved config reproduce HF logits."""
    model = tiny_model(shape=SHAPE, rope_scaling=rope_scaling)
    model.save_pretrained(tmp_path)
    assert run_schedule_and_compare(model, ModelExecutor(tmp_path)) < TOL


def test_dynamic_rope_beyond_max_positions():
    """Dynamic NTK scaling: a 24-token prefill past max_position_embeddings=16 matches HF."""
    model = tiny_model(shape=SHAPE, rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=16)
    runner = PagedRunner(ModelExecutor.from_hf_model(model))
    tokens = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    rows, _ = runner.step({"A": tokens})
    assert (rows["A"] - hf_logits(model, tokens)).abs().max().item() < TOL


def test_sharded_checkpoint_loads(tmp_path):
    """A checkpoint split into shards with model.safetensors.index.json loads to the same logits."""
    model = tiny_model(shape=SHAPE)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert run_schedule_and_compare(model, ModelExecutor(tmp_path)) < TOL


def test_aux_hidden_and_final_hidden_match_hf_hidden_states():
    """aux_hidden[i] equals HF output_hidden_states[i] (0 = embeddings, L = final norm); hidden = last_hidden_state."""
    model = tiny_model(shape=SHAPE)
    runner = PagedRunner(ModelExecutor.from_hf_model(model))
    gen = torch.Generator().manual_seed(3)
    work = {"A": torch.randint(0, VOCAB, (7,), generator=gen).tolist(),
            "B": torch.randint(0, VOCAB, (5,), generator=gen).tolist()}
    layers = (0, 1, 2, 3)
    _, out = runner.step(work, aux_hidden_layers=layers)
    offset = 0
    for name, toks in work.items():
        with torch.no_grad():
            ref = model.model(torch.tensor([toks]), output_hidden_states=True)
        for i in layers:
            got = out.aux_hidden[i][offset:offset + len(toks)]
            assert (got - ref.hidden_states[i][0]).abs().max().item() < TOL, i
        assert (out.hidden[offset:offset + len(toks)] - ref.last_hidden_state[0]).abs().max().item() < TOL
        offset += len(toks)


def test_logits_indices_select_rows():
    """logits_indices returns exactly those rows of the full logits."""
    model = tiny_model(shape=SHAPE)
    executor = ModelExecutor.from_hf_model(model)
    runner = PagedRunner(executor)
    toks = list(range(10))
    _, full = runner.step({"A": toks})
    runner2 = PagedRunner(ModelExecutor.from_hf_model(model))
    _, picked = runner2.step({"A": toks}, logits_indices=torch.tensor([9, 3]))
    torch.testing.assert_close(picked.logits, full.logits[[9, 3]])


def _tree_fixture(model):
    """A prefix plus a 6-node draft tree; returns runner, prefix, nodes, parents, per-node logits rows."""
    executor = ModelExecutor.from_hf_model(model)
    runner = PagedRunner(executor)
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
    runner.step({"A": prefix})
    nodes = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
    parents = [-1, 0, 0, 1, 3, 2]
    depth, mask = [], torch.zeros(6, 6, dtype=torch.bool)
    for j, p in enumerate(parents):
        depth.append(0 if p == -1 else depth[p] + 1)
        mask[j] = mask[p] if p != -1 else mask[j]
        mask[j, j] = True
    table = runner.tables["A"]
    while len(table) * BLOCK_SIZE < len(prefix) + 6:
        table.append(runner.free.pop())
    meta = AttentionMetadata.build([6], [len(prefix) + 6], [table], BLOCK_SIZE, tree_mask=mask)
    positions = torch.tensor([len(prefix) + d for d in depth])
    out = executor.forward(torch.tensor(nodes), positions, meta)
    return runner, prefix, nodes, parents, out.logits


def _path(parents, j):
    path = []
    while j != -1:
        path.append(j)
        j = parents[j]
    return path[::-1]


def test_tree_mask_verification_matches_per_path_reference():
    """With a tree mask and depth positions, node j's logits equal HF on prefix + its root-to-node path."""
    model = tiny_model(shape=SHAPE)
    _, prefix, nodes, parents, logits = _tree_fixture(model)
    for j in range(len(nodes)):
        path_tokens = prefix + [nodes[i] for i in _path(parents, j)]
        assert (logits[j] - hf_logits(model, path_tokens)[-1]).abs().max().item() < TOL, j


def test_copy_slots_compacts_an_accepted_path():
    """After moving the accepted path's K/V to consecutive slots, decoding continues exactly as HF would."""
    model = tiny_model(shape=SHAPE)
    runner, prefix, nodes, parents, _ = _tree_fixture(model)
    accepted = _path(parents, 4)  # nodes 0, 1, 3, 4 -> slots must become prefix positions 6..9
    table = runner.tables["A"]
    slot = lambda pos: table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE  # noqa: E731
    runner.executor.copy_slots(torch.tensor([slot(len(prefix) + j) for j in accepted]),
                               torch.tensor([slot(len(prefix) + i) for i in range(len(accepted))]))
    runner.tokens["A"] = prefix + [nodes[j] for j in accepted]
    rows, _ = runner.step({"A": [7]})
    assert (rows["A"][0] - hf_logits(model, runner.tokens["A"])[-1]).abs().max().item() < TOL


def test_copy_blocks_and_swap_round_trip():
    """A sequence whose blocks were copied (CoW) or swapped out and back in to new blocks decodes unchanged."""
    model = tiny_model(shape=SHAPE)
    runner = PagedRunner(ModelExecutor.from_hf_model(model))
    executor = runner.executor
    runner.step({"A": list(range(11))})
    old = list(runner.tables["A"])
    copied = [runner.free.pop() for _ in old]
    executor.copy_blocks(list(zip(old, copied)))
    executor.swap_out(list(zip(copied, range(len(copied)))))
    executor.k_cache[:, copied] = 0  # the device copies are gone; only the CPU pool holds them
    executor.v_cache[:, copied] = 0
    swapped_in = [runner.free.pop() for _ in old]
    executor.swap_in(list(zip(range(len(copied)), swapped_in)))
    runner.tables["A"] = swapped_in
    rows, _ = runner.step({"A": [3]})
    assert (rows["A"][0] - hf_logits(model, list(range(11)) + [3])[-1]).abs().max().item() < TOL


def test_bfloat16_tracks_transformers_bfloat16():
    """bf16 executor logits stay close to HF's bf16 forward (same rounding points, loose tolerance)."""
    model = tiny_model(shape=SHAPE).to(torch.bfloat16)
    runner = PagedRunner(ModelExecutor.from_hf_model(model, dtype="bfloat16"))
    toks = list(range(20, 33))
    rows, out = runner.step({"A": toks})
    assert runner.executor.k_cache.dtype == torch.bfloat16 and out.logits.dtype == torch.float32
    ref = hf_logits(model, toks)
    assert (rows["A"] - ref).abs().max().item() < 0.1
    assert (rows["A"].argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_kv_cache_layout_and_bytes():
    """allocate_kv_cache makes [L, blocks, bs, KVH, D] tensors; kv_bytes_per_block matches their size."""
    executor = ModelExecutor.from_hf_model(tiny_model(shape=SHAPE))
    executor.allocate_kv_cache(5, 8)
    assert executor.k_cache.shape == (3, 5, 8, 2, 16)
    per_block = 2 * executor.k_cache[:, 0].numel() * executor.k_cache.element_size()
    assert executor.kv_bytes_per_block(8) == per_block


def test_bad_inputs(tmp_path):
    """Missing config, unsupported model type, forward before allocation and bad aux layers raise ValueError."""
    with pytest.raises(ValueError, match="config.json"):
        ModelExecutor(tmp_path)
    model = tiny_model(shape=SHAPE)
    model.save_pretrained(tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match="safetensors"):
        ModelExecutor(tmp_path)
    executor = ModelExecutor.from_hf_model(model)
    meta = AttentionMetadata.build([1], [1], [[0]], BLOCK_SIZE)
    with pytest.raises(ValueError, match="allocate_kv_cache"):
        executor.forward(torch.tensor([1]), torch.tensor([0]), meta)
    executor.allocate_kv_cache(4, BLOCK_SIZE)
    with pytest.raises(ValueError, match="aux_hidden_layers"):
        executor.forward(torch.tensor([1]), torch.tensor([0]), meta, aux_hidden_layers=(9,))
    with pytest.raises(ValueError, match="dtype"):
        ModelExecutor.from_hf_model(model, dtype="int8")
    with pytest.raises(ValueError, match="model_type"):
        from transformers import GPT2Config
        ModelExecutor.from_state_dict(GPT2Config(), {})


@pytest.mark.parametrize("native, fast, expected", [(False, True, torch.bfloat16), (False, False, torch.float32),
                                                     (True, True, torch.float32)])
def test_dtype_auto_is_fp32_where_the_native_kernels_run_else_bf16_where_faster(monkeypatch, native, fast, expected):
    from draftsmith.kernels import precision, small_gemm
    from draftsmith.serve_eval.engine.model_executor import dtype_name, resolve_dtype

    monkeypatch.setattr(precision, "_bf16_probe", lambda kind: (fast, 0.5 if fast else 40.0))
    monkeypatch.setattr(small_gemm, "available", lambda: native)
    assert resolve_dtype("auto") is expected and dtype_name("auto") == str(expected).removeprefix("torch.")
    assert resolve_dtype("float32") is torch.float32 and dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="'auto'"):
        resolve_dtype("float8")


def test_a_verify_block_gives_the_decode_steps_logits_bit_for_bit():
    """With the native kernels (fp32, one thread, a step of at most SMALL_GEMM_MAX_ROWS rows: the C layer computes
    a row the same way whatever shares the call), K+1 verify rows beside another sequence's rows give exactly the
    logits of K+1 single-token decode steps: greedy speculation then picks the very tokens plain decoding picks."""
    from draftsmith.kernels import small_gemm
    from draftsmith.kernels.attention import native_paged

    if not (small_gemm.available() and native_paged.available()):
        pytest.skip("the native CPU kernels do not build or run here")
    model = tiny_model(shape=SHAPE)
    prompt, drafts, other = list(range(3, 20)), [5, 9, 11, 2, 7], list(range(40, 52))
    decoding = PagedRunner(ModelExecutor.from_hf_model(model))
    decoding.step({"s": prompt})
    decoded = torch.cat([decoding.step({"s": [token]})[0]["s"] for token in drafts])
    verifying = PagedRunner(ModelExecutor.from_hf_model(model), seed=1)  # other physical blocks
    verifying.step({"o": other[:4], "s": prompt})
    verified = verifying.step({"o": other[4:6], "s": drafts})[0]["s"]  # 7 rows
    assert torch.equal(verified, decoded)


@pytest.mark.parametrize("layers,tied", [(1, True), (2, False)])
def test_greedy_draft_decode_in_one_c_call_equals_the_forward_steps(layers, tied):
    """executor.draft_decode (the draft's K - 1 greedy steps in C: embedding, stack, final norm, head, argmax) gives
    the tokens of step-by-step forwards with argmax, for sequences of different lengths and step counts, and leaves
    the same KV cache behind, bit for bit."""
    model = tiny_model(shape=dict(SHAPE, num_hidden_layers=layers), tie_word_embeddings=tied)
    reference, mine = ModelExecutor.from_hf_model(model), ModelExecutor.from_hf_model(model)
    if mine.model.draft_loop() is None:
        pytest.skip("the native CPU kernels do not build or run here")
    stepping, looping = PagedRunner(reference, seed=2), PagedRunner(mine, seed=2)
    prompts, steps = {"a": [5, 17, 3, 99, 41, 8, 60], "b": list(range(20, 33)), "c": [7]}, {"a": 4, "b": 2, "c": 5}
    rows, _ = stepping.step(prompts)
    looping.step(prompts)
    first = {name: int(r[-1].argmax()) for name, r in rows.items()}
    expected, token = {name: [] for name in prompts}, dict(first)
    for s in range(max(steps.values())):
        rows, _ = stepping.step({name: [token[name]] for name in prompts if steps[name] > s})
        for name, r in rows.items():
            token[name] = int(r[-1].argmax())
            expected[name].append(token[name])
    names = list(prompts)
    got = mine.draft_decode([[first[n]] for n in names], [len(prompts[n]) for n in names],
                            [steps[n] for n in names], [stepping.tables[n] for n in names])   # the forwards' blocks
    assert got.tokens == [expected[n] for n in names] and got.probs == [None] * len(names)
    assert torch.equal(mine.k_cache, reference.k_cache) and torch.equal(mine.v_cache, reference.v_cache)
    with pytest.raises(ValueError, match="outside its table"):
        mine.draft_decode([[first["c"]]], [len(prompts["c"]) + 40], [1], [stepping.tables["c"]])
    # a shorter table beside a longer one: its steps past its own blocks are refused, not written into block 0
    assert len(stepping.tables["c"]) < len(stepping.tables["b"])
    with pytest.raises(ValueError, match="outside its table"):
        mine.draft_decode([[first["b"]], [first["c"]]], [len(prompts["b"]), 1], [1, 4 * len(stepping.tables["b"])],
                           [stepping.tables["b"], stepping.tables["c"]])


@pytest.mark.parametrize("layers", [1, 2])
def test_draft_decode_feeds_a_catch_up_of_several_rows_before_its_first_pick(layers):
    """A catch-up (the tokens the draft cache lacks: the round's accepted drafts and the bonus token) fed as the
    loop's first step, several rows per sequence, gives the tokens of a catch-up forward, its last row's argmax and
    the decode steps after it, and the same KV cache, bit for bit. A sequence that feeds nothing or picks nothing,
    and row features handed to a draft that carries none, are refused."""
    model = tiny_model(shape=dict(SHAPE, num_hidden_layers=layers))
    reference, mine = ModelExecutor.from_hf_model(model), ModelExecutor.from_hf_model(model)
    if mine.model.draft_loop() is None:
        pytest.skip("the native CPU kernels do not build or run here")
    stepping, looping = PagedRunner(reference, seed=3), PagedRunner(mine, seed=3)
    prompts = {"a": [5, 17, 3, 99, 41, 8, 60], "b": list(range(20, 33)), "c": [7, 9]}
    catch_up = {"a": [11, 12, 13], "b": [40], "c": [50, 51, 52, 53, 54]}
    steps = {"a": 3, "b": 4, "c": 1}
    stepping.step(prompts)
    looping.step(prompts)
    for name in prompts:   # the blocks the loop writes, which the replaying forwards then use
        while len(stepping.tables[name]) * BLOCK_SIZE < len(prompts[name]) + len(catch_up[name]) + steps[name]:
            stepping.tables[name].append(stepping.free.pop())
    names = list(prompts)
    got = mine.draft_decode([catch_up[n] for n in names], [len(prompts[n]) for n in names],
                            [steps[n] for n in names], [stepping.tables[n] for n in names])
    rows, _ = stepping.step(catch_up)
    token = {name: int(r[-1].argmax()) for name, r in rows.items()}
    expected = {name: [token[name]] for name in names}
    for s in range(1, max(steps.values())):
        rows, _ = stepping.step({name: [token[name]] for name in names if steps[name] > s})
        for name, r in rows.items():
            token[name] = int(r[-1].argmax())
            expected[name].append(token[name])
    assert got.tokens == [expected[n] for n in names]
    assert torch.equal(mine.k_cache, reference.k_cache) and torch.equal(mine.v_cache, reference.v_cache)
    for bad_fed, bad_steps in (([[1, 2], []], [1, 1]), ([[1, 2], [3]], [1, 0])):
        with pytest.raises(ValueError, match="first tokens per sequence"):
            mine.draft_decode(bad_fed, [len(prompts["a"]), len(prompts["b"])], bad_steps,
                              [stepping.tables["a"], stepping.tables["b"]])
    loop = mine.model.draft_loop()
    with pytest.raises(ValueError, match="takes no first_features"):
        loop([[1, 2]], [len(prompts["a"])], [1], torch.tensor([stepping.tables["a"]]), mine._layer_caches, 0.125,
             first_features=torch.zeros(2, SHAPE["hidden_size"]))


def test_sampled_draft_decode_draws_each_token_from_the_row_it_returns():
    """Sampled at a plain temperature, executor.draft_decode returns per step the row softmax(logits / T) of the
    step-by-step forwards (to fp32 rounding) and the token kernels.sampling.sample draws from exactly that row with
    the request's generator (one uniform per step, the same stream; two requests sharing a generator draw from it
    step by step in batch order, as the Python steps do); a greedy sequence beside them keeps its argmax, and the KV
    cache is the forwards', bit for bit. A top-p request is not served (None: the Python steps)."""
    from draftsmith.kernels.layers.native_draft_loop import LoopSampling
    from spec_helpers import params
    from draftsmith.kernels.sampling import sample

    model = tiny_model(shape=dict(SHAPE, num_hidden_layers=1))
    reference, mine = ModelExecutor.from_hf_model(model), ModelExecutor.from_hf_model(model)
    if mine.model.draft_loop() is None:
        pytest.skip("the native CPU kernels do not build or run here")
    stepping, looping = PagedRunner(reference, seed=2), PagedRunner(mine, seed=2)
    prompts = {"a": [5, 17, 3, 99, 41], "b": list(range(20, 31)), "c": [7, 8], "d": [60, 61, 62]}
    steps = {"a": 5, "b": 3, "c": 4, "d": 2}
    temperatures, seeds = {"a": 0.7, "b": 0.0, "c": 1.3, "d": 1.0}, {"a": 11, "b": None, "c": 12, "d": 12}
    rows, _ = stepping.step(prompts)
    looping.step(prompts)
    names = list(prompts)
    first = {name: int(r[-1].argmax()) for name, r in rows.items()}
    by_seed = {seed: torch.Generator().manual_seed(seed) for seed in set(seeds.values()) - {None}}
    generators = [by_seed.get(seeds[n]) for n in names]   # c and d share one
    plain = LoopSampling.of([params(temperatures[n]) for n in names], VOCAB, generators)
    assert LoopSampling.of([params(0.7, 0, 0.9)], VOCAB, [None]) is None   # top-p: logits_to_probs' filters only
    for name in names:   # the blocks the loop writes, which the replaying forwards then use
        while len(stepping.tables[name]) * BLOCK_SIZE < len(prompts[name]) + steps[name]:
            stepping.tables[name].append(stepping.free.pop())
    got = mine.draft_decode([[first[n]] for n in names], [len(prompts[n]) for n in names],
                            [steps[n] for n in names], [stepping.tables[n] for n in names], plain)
    replays = {seed: torch.Generator().manual_seed(seed) for seed in by_seed}
    replay = {n: replays[seeds[n]] for n in names if seeds[n] is not None}
    token = dict(first)
    for s in range(max(steps.values())):
        rows, _ = stepping.step({name: [token[name]] for name in names if steps[name] > s})
        for j, name in enumerate(names):
            if steps[name] <= s:
                continue
            logits = rows[name][-1]
            if temperatures[name] == 0:
                assert got.probs[j] is None and got.tokens[j][s] == int(logits.argmax())
            else:
                row = got.probs[j][s]
                assert torch.allclose(row, torch.softmax(logits / temperatures[name], -1), rtol=1e-4, atol=1e-7)
                assert got.tokens[j][s] == int(sample(row[None], replay[name])[0])
            token[name] = got.tokens[j][s]
    assert [len(t) for t in got.tokens] == [steps[n] for n in names]
    assert len({tuple(t) for t in got.tokens}) == 4 and len(set(got.tokens[0])) > 1   # draws, not a fixed point
    assert torch.equal(mine.k_cache, reference.k_cache) and torch.equal(mine.v_cache, reference.v_cache)
