"""draftsmith.train.distill.dataset (draftsmith generate): answers are the target's own greedy continuations through the engine; stored hidden
states / top-k are one teacher-forced forward of the target; shards resume; the manifest names the target."""
import json
import os

import pytest
import torch

from distill_fixtures import make_corpus, make_target, overrides

os.environ.setdefault("DRAFTSMITH_NO_PROGRESS", "1")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("generate")
    torch.set_num_threads(1)
    return tmp, make_target(tmp / "target"), make_corpus(tmp / "corpus.jsonl", per_domain=8)


def generate(world, **extra):
    from draftsmith.train.config import compose
    from draftsmith.train.distill.dataset.job import run

    tmp, target, corpus = world
    base = {"draft": "eagle3", "draft.mode": "offline", "draft.data.topk_logits": "4", "draft.data.max_new_tokens": "6",
            "draft.data.shard_size": "4", "data.distill_per_domain": "3"}
    merged = {**base, **extra}
    if merged["draft"] == "standalone":
        merged.pop("draft.mode")  # standalone drafts have no online/offline mode
    return run(compose(overrides(tmp, target, corpus, **merged)))


def test_answers_are_target_greedy_and_extras_match_a_forward(world, capsys):
    """Each answer equals HF greedy decoding of the target; hidden/aux/top-k equal a fresh forward (bf16)."""
    from transformers import AutoModelForCausalLM

    from draftsmith.train.distill.gendata import DistillDataset, Manifest
    from draftsmith.train.distill.objectives.teacher import Teacher

    out = generate(world)
    assert "estimated at up to" in capsys.readouterr().out  # size estimate printed before starting
    manifest = Manifest.read(out)
    from draftsmith.drafts.identity import target_fingerprint

    assert manifest.target_fingerprint == target_fingerprint(world[1]) and manifest.complete
    assert manifest.sampling["temperature"] == 0.0 and manifest.extras.aux_layers == [2, 2, 1]
    dataset = DistillDataset(out, manifest.target_fingerprint, manifest.extras)
    assert len(dataset) == 12 == manifest.num_examples
    model = AutoModelForCausalLM.from_pretrained(str(world[1])).eval()
    teacher = Teacher(model)
    for i in range(len(dataset)):
        ex = dataset[i]
        ids, p = ex["input_ids"], ex["prompt_length"]
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids[:p]]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones(1, p, dtype=torch.long))[0, p:].tolist()
        assert ids[p:] == ref[: len(ids) - p]
        fwd = teacher(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool), [2, 2, 1])
        torch.testing.assert_close(ex["hidden"].float(), fwd.hidden[0], atol=0.02, rtol=0.01)
        torch.testing.assert_close(ex["aux_hidden"].float(), fwd.aux_hidden[0], atol=0.02, rtol=0.01)
        top = torch.log_softmax(fwd.logits[0], -1).topk(4)
        torch.testing.assert_close(ex["topk_logprobs"], top.values, atol=1e-4, rtol=1e-4)
        assert (ex["topk_ids"] == top.indices).all()


def test_a_job_reads_its_own_aux_layers_of_those_stored(tmp_path):
    """A dataset holding several kinds' aux layers (the pipeline's union) serves each job its own, in its order;
    a layer it does not hold stops the job naming the layers."""
    from draftsmith.train.distill.gendata import DistillDataset, Manifest, StoredExtras
    from draftsmith.train.distill.objectives.teacher import Teacher
    from transformers import AutoModelForCausalLM

    world = tmp_path, make_target(tmp_path / "target"), make_corpus(tmp_path / "corpus.jsonl", per_domain=8)
    out = generate(world, **{"draft.aux_layers": "[2,0,1]"})   # its own artifacts: a covering dataset is reused
    stored = Manifest.read(out).extras
    assert stored.aux_layers == [2, 0, 1]
    dataset = DistillDataset(out, stored_fp := Manifest.read(out).target_fingerprint, StoredExtras(True, [1, 2]))
    teacher = Teacher(AutoModelForCausalLM.from_pretrained(str(world[1])).eval())
    ex = dataset[0]
    with torch.no_grad():
        fwd = teacher(torch.tensor([ex["input_ids"]]), torch.ones(1, len(ex["input_ids"]), dtype=torch.bool), [1, 2])
    torch.testing.assert_close(ex["aux_hidden"].float(), fwd.aux_hidden[0], atol=0.02, rtol=0.01)
    with pytest.raises(ValueError, match="holds"):
        DistillDataset(out, stored_fp, StoredExtras(True, [1, 3]))


def test_resume_skips_complete_shards(world):
    """A killed run (a shard missing, manifest incomplete) resumes: only the missing shard is regenerated."""
    out = generate(world)
    before = (out / "dataset").exists() and json.loads((out / "manifest.json").read_text())
    shard_rows = sorted(out.glob("shard-*.parquet"))
    kept = {p: p.stat().st_mtime_ns for p in shard_rows[:-1]}
    shard_rows[-1].unlink()
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    again = generate(world)
    assert again == out and shard_rows[-1].is_file()
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert json.loads((out / "manifest.json").read_text()) == before


def test_sampled_answers_do_not_depend_on_sharding(world):
    """Per-prompt seeds: temperature sampling gives the same answers whatever the shard size."""
    from draftsmith.train.distill.gendata import DistillDataset

    runs = [DistillDataset(generate(world, **{"draft": "standalone", "draft.data.temperature": "1.0",
                                              "draft.data.topk_logits": "0", "draft.data.shard_size": size}))
            for size in ("2", "5")]
    assert [r["input_ids"] for r in runs[0]] == [r["input_ids"] for r in runs[1]]


def test_a_disk_that_fills_mid_run_leaves_no_half_written_shard(world, monkeypatch):
    """The third shard's rows hit ENOSPC half-way: the error names the shard and the reason, no file
    of that shard (temporary or final) is left, earlier shards stay, and a rerun with room resumes
    to the same dataset as an uninterrupted run."""
    import errno

    import datasets

    reference = generate(world, **{"draft.data.max_new_tokens": "5"})
    expected = json.loads((reference / "manifest.json").read_text())
    for path in reference.iterdir():   # start over, same key
        if path.is_file():
            path.unlink()
    real_to_parquet = datasets.Dataset.to_parquet
    writes = {"n": 0}

    def filling_disk(self, path, *args, **kwargs):
        writes["n"] += 1
        if writes["n"] == 3:
            with open(path, "wb") as half:
                half.write(b"PAR1 half a shard")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_to_parquet(self, path, *args, **kwargs)

    monkeypatch.setattr(datasets.Dataset, "to_parquet", filling_disk)
    with pytest.raises(OSError) as err:
        generate(world, **{"draft.data.max_new_tokens": "5"})
    assert err.value.errno == errno.ENOSPC
    assert "shard 2" in str(err.value) and "No space left on device" in str(err.value)
    names = sorted(p.name for p in reference.iterdir())
    assert not any("shard-00002" in n for n in names), names
    assert not any(".tmp-" in n for n in names), names
    assert {"shard-00000.parquet", "shard-00001.parquet"} <= set(names)
    monkeypatch.setattr(datasets.Dataset, "to_parquet", real_to_parquet)
    again = generate(world, **{"draft.data.max_new_tokens": "5"})
    assert again == reference and json.loads((again / "manifest.json").read_text()) == expected


def test_prompts_are_answered_whole_and_stored_in_their_training_window(world):
    """A prompt longer than the training window is answered whole (the answer is the target's greedy continuation
    of the full prompt, as serving sees it) and stored as the window's last max_length tokens: the answer and the
    end of its prompt, prompt_length counted inside the window, hidden states of a forward over the full
    sequence (not over the cut one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.train.distill.gendata import DistillDataset, Manifest
    from draftsmith.train.distill.objectives.teacher import Teacher

    out = generate(world, **{"draft.data.max_length": "8"})
    manifest = Manifest.read(out)
    dataset = DistillDataset(out, manifest.target_fingerprint, manifest.extras)
    tokenizer = AutoTokenizer.from_pretrained(str(world[1]))
    prompts = [tokenizer.encode(json.loads(line)["prompt"]) for line in world[2].read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(str(world[1])).eval()
    teacher = Teacher(model)
    cut_examples = 0
    for i in range(len(dataset)):
        ex = dataset[i]
        ids, p = ex["input_ids"], ex["prompt_length"]
        assert len(ids) <= 8 and 1 <= p < len(ids)
        # the records whose prompt ends in the window's prompt part: one of them is this example's, answered whole
        candidates = [q for q in prompts if len(q) >= p and q[-p:] == ids[:p]]
        assert any(_answered_from(model, teacher, q, ids, p, ex) for q in candidates), i
        cut_examples += min(map(len, candidates)) > p   # no record's whole prompt fits the window
    assert cut_examples > 0   # the window did cut prompts


def _answered_from(model, teacher, prompt: list[int], ids: list[int], p: int, example: dict) -> bool:
    """Whether the window ids (prompt part p) holds the target's greedy answer to the whole ``prompt``, with the
    hidden states, aux layers and top-k of a forward over the whole sequence."""
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
        if ids[p:] != ref[: len(ids) - p]:
            return False
        sequence = prompt + ids[p:]
        fwd = teacher(torch.tensor([sequence]), torch.ones(1, len(sequence), dtype=torch.bool), [2, 2, 1])
    window = slice(len(sequence) - len(ids), len(sequence))
    top = torch.log_softmax(fwd.logits[0, window], -1).topk(4)
    return (torch.allclose(example["hidden"].float(), fwd.hidden[0, window], atol=0.02, rtol=0.01)
            and torch.allclose(example["aux_hidden"].float(), fwd.aux_hidden[0, window], atol=0.02, rtol=0.01)
            and torch.allclose(example["topk_logprobs"], top.values, atol=1e-4, rtol=1e-4)
            and bool((example["topk_ids"] == top.indices).all()))


def test_a_window_keeps_the_answer_and_a_prompt_token_and_long_prompts_batch_by_positions():
    """window_bounds: the last max_length positions, or, for an answer longer than the window (an endpoint may
    return more than asked), one prompt token and the answer's head. The teacher batches whole sequences by
    positions (batch_size windows' worth), so a prompt many windows long runs alone, and its head and top-k run on
    the window only."""
    from types import SimpleNamespace

    from draftsmith.train.distill.dataset.passes import teacher_forced_extras, window_bounds
    from draftsmith.train.distill.gendata import StoredExtras

    assert window_bounds(10, 4, 8) == (2, 10)
    assert window_bounds(6, 4, 8) == (0, 6)
    assert window_bounds(20, 3, 8) == (2, 10)
    widths, head_rows = [], []

    class FakeTeacher:
        model = torch.nn.Module()

        def __call__(self, ids, mask, aux_layers, need_logits):
            assert not need_logits
            widths.append(tuple(ids.shape))
            return SimpleNamespace(hidden=ids[..., None].float().expand(-1, -1, 4), aux_hidden=None)

    FakeTeacher.model.register_parameter("w", torch.nn.Parameter(torch.zeros(1)))
    FakeTeacher.model.lm_head = lambda h: head_rows.append(h.shape[0]) or torch.cat([h, -h], -1)
    sequences = [list(range(1, 101)), [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    bounds = [window_bounds(len(s), len(s) - 2, 8) for s in sequences]   # 2-token answers
    out = teacher_forced_extras(FakeTeacher(), sequences, StoredExtras(final_hidden=True, topk=2), 2, [0, 1, 2],
                                bounds=bounds)
    assert widths == [(1, 100), (2, 5)]   # the long prompt alone; the two short ones together
    assert head_rows == [8, 5, 5]
    assert out["0.hidden"][:, 0].tolist() == list(range(93, 101))   # the whole sequence's last 8 positions
