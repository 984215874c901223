"""Distillation-data regeneration: our own engine in process vs an OpenAI-compatible endpoint over loopback.

`draftsmith generate backend=openai endpoint=...` is how a cluster user regenerates through vLLM or SGLang;
here the endpoint is draftsmith's own server on 127.0.0.1 serving the same checkpoint, so the ratio prints
what the HTTP round trips, JSON and the client's bounded concurrency cost against in-process batching.
Repetitions are interleaved (in process, endpoint, endpoint with top-k, then again), each into a fresh
dataset dir, after one untimed warm-up round; medians and the min-max spread are printed. The in-process
time includes building the engine (a job pays it; a cluster's endpoint is already up), the endpoint's
excludes its server's start-up.

    scripts/bench_external_gen.py                                   # tiny random Llama, 48 prompts x 32 tokens
    scripts/bench_external_gen.py --model artifacts/target-cache/<key> --prompts 64 --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.drafts.identity import target_fingerprint  # noqa: E402
from draftsmith.drafts.schemas import DraftDataConfig  # noqa: E402
from draftsmith.serve_eval.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from draftsmith.serve_eval.server.app import ServerConfig, create_app  # noqa: E402
from draftsmith.serve_eval.server.testing import ServerThread, build_tiny_checkpoint  # noqa: E402
from draftsmith.train.distill.dataset.build import generate_dataset  # noqa: E402
from draftsmith.train.distill.gendata import StoredExtras  # noqa: E402
from draftsmith.train.external_gen import EndpointConfig  # noqa: E402

DOMAINS = [("chat", "tell me about"), ("code", "write a function for"), ("math", "count the"),
           ("prose", "once upon a time")]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="target checkpoint dir (default: a tiny random Llama)")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8, help="endpoint requests in flight")
    parser.add_argument("--topk", type=int, default=4, help="top-k log-probs asked in the third mode")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (engine and server)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    return parser.parse_args()


def engine_config(model: Path, max_len: int, threads: int) -> EngineConfig:
    return EngineConfig(model=str(model), max_model_len=max_len, num_threads=threads, kv_cache_memory_gb=0.1)


def one_run(mode: str, model: Path, records: list[dict], data: DraftDataConfig, topk: int,
            args: argparse.Namespace, scratch: Path) -> float:
    """Seconds for one whole regeneration into a fresh dir (the server's start-up is outside the timing)."""
    extras = StoredExtras(topk=topk)
    if mode == "in-process":
        start = time.perf_counter()
        generate_dataset(model, target_fingerprint(model), records, data, extras, scratch)
        return time.perf_counter() - start
    engine = LLMEngine(engine_config(model, data.max_length, args.threads))
    server = ServerThread(create_app(engine, ServerConfig())).start()
    try:
        endpoint = EndpointConfig(server.base_url + "/v1", concurrency=args.concurrency)
        start = time.perf_counter()
        generate_dataset(model, target_fingerprint(model), records, data, extras, scratch, endpoint=endpoint)
        return time.perf_counter() - start
    finally:
        server.stop()


def answer_tokens(out_dir: Path) -> int:
    import datasets

    rows = datasets.load_from_disk(str(out_dir / "dataset"))
    return sum(len(r["input_ids"]) - r["prompt_length"] for r in rows)


def measure(args: argparse.Namespace, model: Path, scratch: Path) -> list[dict]:
    records = [{"domain": d, "prompt": f"{words} item {i}", "reference": "ok"}
               for i, (d, words) in enumerate(DOMAINS * (args.prompts // len(DOMAINS) + 1))][: args.prompts]
    modes = [("in-process", 0), ("endpoint", 0), (f"endpoint top-{args.topk}", args.topk)]
    seconds: dict[str, list[float]] = {name: [] for name, _ in modes}
    tokens: dict[str, int] = {}
    for rep in range(-1, args.repeats):  # rep -1: the warm-up round, not kept
        for name, topk in modes:
            out = scratch / f"{name.replace(' ', '_')}-{rep}"
            data = DraftDataConfig(max_new_tokens=args.max_new_tokens, max_length=args.max_new_tokens + 64,
                                   shard_size=16, temperature=0.0, path=str(out), kv_cache_memory_gb=0.1,
                                   topk_logits=topk)
            took = one_run(name.split()[0], model, records, data, topk, args, scratch / "cache")
            if rep >= 0:
                seconds[name].append(took)
                tokens[name] = answer_tokens(out)
    base = statistics.median(seconds["in-process"])
    return [{"mode": name, "requests": len(records), "answer_tokens": tokens[name],
             "median_s": round(statistics.median(s), 3), "spread_s": [round(min(s), 3), round(max(s), 3)],
             "requests_per_s": round(len(records) / statistics.median(s), 1),
             "answer_tokens_per_s": round(tokens[name] / statistics.median(s), 1),
             "time_vs_in_process": round(statistics.median(s) / base, 2)} for name, s in seconds.items()]


def main() -> None:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = args.model or build_tiny_checkpoint(scratch / "ckpt", max_position=256)
        rows = measure(args, Path(model), scratch)
    print(f"{'mode':<18} {'req/s':>7} {'tok/s':>8} {'median s':>9} {'spread s':>15} {'x in-process time':>18}")
    for r in rows:
        print(f"{r['mode']:<18} {r['requests_per_s']:>7} {r['answer_tokens_per_s']:>8} {r['median_s']:>9} "
              f"{str(r['spread_s']):>15} {r['time_vs_in_process']:>18}")
    print(f"({args.prompts} prompts x <= {args.max_new_tokens} tokens, concurrency {args.concurrency}, "
          f"{args.repeats} interleaved repetitions, {args.threads} torch thread(s))")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
