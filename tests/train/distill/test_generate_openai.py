"""`generate backend=openai` against our own server on loopback: the answers equal the in-process engine's
(greedy, ids exact through return_tokens_as_token_ids), the manifest records the endpoint's model id and the
sampling, a server killed mid-run stops the job after its last complete shard and a rerun resumes from there;
an unreachable endpoint stops before any shard; top-k KD data stores the endpoint's top-k (equal to the target's
teacher-forced log-probs), and an endpoint offering none stops the job before any shard."""
from __future__ import annotations

import json
import time

import pytest

from draftsmith.drafts.identity import target_fingerprint
from draftsmith.drafts.schemas import DraftDataConfig
from draftsmith.train.distill.gendata import Manifest, StoredExtras, shard_complete
from draftsmith.train.external_gen import EndpointConfig, EndpointError, OpenAIGenerator
from draftsmith.train.distill.dataset.build import generate_dataset
from server_helpers import make_engine, serve, tiny_checkpoint

NONE = StoredExtras(final_hidden=False, aux_layers=[], topk=0)
RECORDS = [{"domain": d, "prompt": f"{w} the cat sat on the mat {i}", "reference": "ok"}
           for i, (d, w) in enumerate([("chat", "tell"), ("code", "write"), ("math", "count")] * 4)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def data(path=None):
    return DraftDataConfig(max_new_tokens=12, max_length=64, shard_size=4, temperature=0.0, path=path,
                           kv_cache_memory_gb=0.05)


def rows(cache_dir):
    import datasets

    ds = datasets.load_from_disk(str(cache_dir / "dataset")) if (cache_dir / "dataset").is_dir() else None
    if ds is None:
        from draftsmith.train.distill.gendata import shard_paths

        ds = datasets.concatenate_datasets([datasets.Dataset.from_parquet(str(shard_paths(cache_dir, i)[0]))
                                            for i in range(3)])
    return sorted((r["example_id"], list(r["input_ids"])) for r in ds)


def test_external_answers_equal_the_engine_and_resume_after_a_kill(ckpt, tmp_path, monkeypatch):
    fp = target_fingerprint(ckpt)
    local = generate_dataset(ckpt, fp, RECORDS, data(), NONE, tmp_path / "local")
    out = tmp_path / "external"
    original = OpenAIGenerator.answers
    with serve(make_engine(ckpt)) as first:
        calls = []

        def answers_then_die(self, prompts, ids):
            if calls:  # the server goes away between shards
                first.stop()
            calls.append(len(prompts))
            return original(self, prompts, ids)

        monkeypatch.setattr(OpenAIGenerator, "answers", answers_then_die)
        cfg = EndpointConfig(first.base_url + "/v1", concurrency=4, retries=1, backoff_s=0.05, logprobs=1)
        with pytest.raises(EndpointError, match="failed after 2 attempts"):
            generate_dataset(ckpt, fp, RECORDS, data(str(out)), NONE, tmp_path / "x", endpoint=cfg)
    assert shard_complete(out, 0) and not shard_complete(out, 1)
    assert not Manifest.read(out).complete
    monkeypatch.setattr(OpenAIGenerator, "answers", original)
    with serve(make_engine(ckpt)) as second:
        cfg = EndpointConfig(second.base_url + "/v1", concurrency=4, logprobs=1)
        start = time.perf_counter()
        generate_dataset(ckpt, fp, RECORDS, data(str(out)), NONE, tmp_path / "x", endpoint=cfg)
        seconds = time.perf_counter() - start
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["endpoint"]["backend"] == "openai"
    assert manifest["endpoint"]["model_id"] and manifest["endpoint"]["logprobs_offered"] is True
    assert manifest["sampling"]["temperature"] == 0.0
    assert rows(out) == rows(local)
    answered = sum(len(ids) for _, ids in rows(out))
    print(f"external generation over loopback: {8 / seconds:.1f} requests/s, {answered / seconds:.0f} prompt+answer tokens/s "
          f"(8 resumed prompts)")


def test_unreachable_endpoint_stops_before_any_shard(ckpt, tmp_path):
    cfg = EndpointConfig("http://127.0.0.1:9/v1", retries=1, backoff_s=0.01)
    out = tmp_path / "never"
    with pytest.raises(EndpointError, match="127.0.0.1:9"):
        generate_dataset(ckpt, target_fingerprint(ckpt), RECORDS, data(str(out)), NONE, tmp_path, endpoint=cfg)
    assert not (out / "manifest.json").exists()


def test_vocabulary_mismatch_is_one_line(ckpt):
    """Ids the target's tokenizer does not have (another model behind the endpoint) stop the job, naming it."""
    class SmallVocab:  # a target tokenizer of 3 ids
        eos_token_id = None

        def __len__(self):
            return 3

    with serve(make_engine(ckpt)) as srv:
        gen = OpenAIGenerator(EndpointConfig(srv.base_url + "/v1", logprobs=1), SmallVocab(), data())
        with pytest.raises(EndpointError, match="vocabulary mismatch"):
            gen.answers([[5, 6, 7, 8]], [0])


TOPK = 4
SERVER_MAX_LOGPROBS = 20  # serve_eval.server.protocol's cap on top_logprobs


def _stored_topk(cache_dir, example_id):
    from safetensors import safe_open

    from draftsmith.train.distill.gendata import shard_paths

    shard = example_id // data().shard_size
    with safe_open(str(shard_paths(cache_dir, shard)[1]), "pt") as tensors:
        return tensors.get_tensor(f"{example_id}.topk_ids"), tensors.get_tensor(f"{example_id}.topk_logprobs")


def test_endpoint_topk_logprobs_are_stored_as_the_targets(ckpt, tmp_path):
    """Top-k KD data through the endpoint: the stored top-k of every answer row are the endpoint's, and they are
    the target's own distribution (each stored log-prob equals the target's teacher-forced log-softmax at that row
    and id, 1e-3; ranked best first); rows no answer token is predicted from hold the data token at log-prob 0.
    Prints the loopback throughput of this run (noisy: a shared 2-core machine)."""
    import torch

    from draftsmith.train.distill.objectives.teacher import Teacher

    out = tmp_path / "topk"
    with serve(make_engine(ckpt)) as srv:
        start = time.perf_counter()
        generate_dataset(ckpt, target_fingerprint(ckpt), RECORDS, data(str(out)), StoredExtras(topk=TOPK), tmp_path / "x",
                         endpoint=EndpointConfig(srv.base_url + "/v1", concurrency=4))
        seconds = time.perf_counter() - start
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["endpoint"]["topk_source"].startswith("endpoint")
    assert manifest["endpoint"]["logprobs"] == TOPK and manifest["extras"]["topk"] == TOPK
    teacher = Teacher.from_dir(ckpt)
    prompt_lengths = _prompt_lengths(out)
    answered = 0
    for example_id, seq in rows(out):
        ids, logprobs = _stored_topk(out, example_id)
        n, p = len(seq), prompt_lengths[example_id]
        assert tuple(ids.shape) == tuple(logprobs.shape) == (n, TOPK)
        with torch.no_grad():
            reference = torch.log_softmax(teacher(torch.tensor([seq]), torch.ones(1, n, dtype=torch.bool)).logits[0], -1)
        answer_rows = range(p - 1, n - 1)
        answered += len(answer_rows)
        for row in answer_rows:
            assert torch.allclose(logprobs[row], reference[row, ids[row].long()], atol=1e-3), (example_id, row)
            assert bool((logprobs[row][:-1] >= logprobs[row][1:]).all())
        for row in [*range(p - 1), n - 1]:
            assert logprobs[row, 0] == 0.0 and ids[row, 0] == seq[min(row + 1, n - 1)]
    print(f"external generation with top-{TOPK} over loopback: {len(RECORDS) / seconds:.1f} requests/s, "
          f"{answered / seconds:.0f} answer tokens/s ({len(RECORDS)} prompts, concurrency 4, {seconds:.2f} s)")


def _prompt_lengths(cache_dir):
    import datasets

    return {r["example_id"]: r["prompt_length"] for r in datasets.load_from_disk(str(cache_dir / "dataset"))}


def test_endpoint_without_topk_stops_before_any_shard(ckpt, tmp_path, monkeypatch):
    """An endpoint that answers but offers no log-probs (or fewer than k) stops a top-k KD job with one line
    naming it, before a shard is written; the answers-only job against it still runs."""
    original = OpenAIGenerator._request

    def without_logprobs(self, method, path, body=None):
        response = original(self, method, path, body)
        for choice in response.get("choices", []):
            choice["logprobs"] = None
        return response

    monkeypatch.setattr(OpenAIGenerator, "_request", without_logprobs)
    out = tmp_path / "no_topk"
    with serve(make_engine(ckpt)) as srv:
        cfg = EndpointConfig(srv.base_url + "/v1", concurrency=4)
        with pytest.raises(EndpointError, match=f"offers no top-{TOPK} log-probs.*topk_logits={TOPK}") as err:
            generate_dataset(ckpt, target_fingerprint(ckpt), RECORDS, data(str(out)), StoredExtras(topk=TOPK),
                             tmp_path / "x", endpoint=cfg)
        assert "\n" not in str(err.value) and srv.base_url in str(err.value)
        assert not shard_complete(out, 0) and not list(out.glob("shard-*"))
        monkeypatch.setattr(OpenAIGenerator, "_request", original)
        fewer = OpenAIGenerator(cfg, _tokenizer(ckpt), data(), topk=SERVER_MAX_LOGPROBS + 1)
        with pytest.raises(EndpointError):  # the server caps top_logprobs at 20: refused (HTTP 400) or fewer
            fewer.answers([[5, 6, 7, 8]], [0])


def _tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt))

