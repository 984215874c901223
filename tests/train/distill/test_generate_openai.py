"""`generate backend=openai` against our own server on loopback: the answers equal the in-process engine's
(greedy, ids exact through return_tokens_as_token_ids), the manifest records the endpoint's model id and the
sampling, a server killed mid-run stops the job after its last complete shard and a rerun resumes from there;
an unreachable endpoint stops before any shard."""
from __future__ import annotations

import json
import time

import pytest

from drafts.identity import target_fingerprint
from drafts.schemas import DraftDataConfig
from train.distill.gendata import Manifest, StoredExtras, shard_complete
from train.external_gen import EndpointConfig, EndpointError, OpenAIGenerator
from train.distill.dataset.build import generate_dataset
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
        from train.distill.gendata import shard_paths

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
