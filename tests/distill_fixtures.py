"""Tiny target + prompt corpus shared by the distillation tests (not a test module itself).

The target is a 4-layer Llama (hidden 64, vocab 96) with a word-level tokenizer "w0".."w95" (w95 = EOS),
briefly trained on a deterministic rule (next word = (3 * word + 7) mod 90, with noise) so its greedy
answers are structured yet not trivially constant. Prompts are short word lists in four domains.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from tiny_models import tiny_model, word_tokenizer

VOCAB = 96
EOS = VOCAB - 1
DOMAINS = ("code", "prose", "math", "chat")


def rule_sequence(rng: random.Random, length: int, offset: int) -> list[int]:
    tokens = [rng.randrange(1, 90)]
    for _ in range(length - 1):
        tokens.append(rng.randrange(1, 90) if rng.random() < 0.1 else (3 * tokens[-1] + offset) % 90 + 1)
    return tokens


def make_target(path: Path, seed: int = 0, train_steps: int = 0) -> Path:
    model = tiny_model("llama", seed, vocab_size=VOCAB, intermediate_size=128, num_hidden_layers=4,
                       eos_token_id=EOS, bos_token_id=0, pad_token_id=0, initializer_range=0.1)
    model.train()
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(train_steps):
        batch = torch.tensor([rule_sequence(rng, 32, 7) for _ in range(16)])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    word_tokenizer(VOCAB, pad_token="w0").save_pretrained(path)
    return path


def make_corpus(path: Path, per_domain: int = 24, seed: int = 1) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for domain in DOMAINS:
            for _ in range(per_domain):
                prompt = " ".join(f"w{t}" for t in rule_sequence(rng, rng.randint(3, 8), 7))
                reference = " ".join(f"w{t}" for t in rule_sequence(rng, 12, 11))  # another rule than the target's
                f.write(json.dumps({"domain": domain, "prompt": prompt, "reference": reference}) + "\n")
    return path


def overrides(tmp: Path, target: Path, corpus: Path, **extra: str) -> list[str]:
    """Hydra overrides for a fast job on the tiny target."""
    base = {
        "artifacts_root": str(tmp / "artifacts"), "target.path": str(target), "data.path": str(corpus),
        "data.eval_per_domain": "2", "data.distill_per_domain": "20", "target.eval_records_per_domain": "2",
        "wandb.mode": "disabled",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


REPO = Path(__file__).resolve().parent.parent
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
TOY = REPO / "tests" / "distill_toy.py"
RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a launched job: no progress bars, one OpenMP thread, no rank variables inherited from a
    launcher around pytest. DeepSpeed JIT-builds its CPU ops (the shared-memory collectives) on first use under
    TORCH_EXTENSIONS_DIR, behind a lock file that a build killed midway leaves behind and every later build then
    waits on forever (a CI run hung on one left in ~/.cache by another checkout): each venv gets its own."""
    env = {**os.environ, "DRAFTSMITH_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1", **extra}
    for name in RANK_VARIABLES:
        env.pop(name, None)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    return env


JOB_ENV = job_env()


def start_job(command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`command` in the background from the repository root, its output appended to `log`, in a session of its
    own so that stop_jobs reaches what it started."""
    with log.open("a") as handle:
        return subprocess.Popen(command, cwd=REPO, env=env or JOB_ENV, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop_jobs(procs: list[subprocess.Popen], grace_s: float = 45.0) -> None:
    """SIGTERM to each job's group, then SIGKILL to those still running after `grace_s`. torchrun passes SIGTERM on
    to its ranks (each in a session of its own, which a signal to the job's group would miss) and SIGKILLs them 30 s
    later (its shutdown timeout), so the grace outlasts that; a rank left running would hold its port, its files and
    any build lock past the test."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_jobs(procs: dict, timeout: float) -> dict:
    """{key: return code} of jobs started together, each given `timeout` in turn; when one runs out, TimeoutExpired
    is raised and every job still running is stopped, not left behind."""
    try:
        return {key: proc.wait(timeout=timeout) for key, proc in procs.items()}
    finally:
        stop_jobs([proc for proc in procs.values() if proc.poll() is None])


def run_job(command: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True) from the repository root, stopping the whole job
    (ranks included) on timeout."""
    proc = subprocess.Popen(command, cwd=REPO, env=env or JOB_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_jobs([proc])
        with contextlib.suppress(subprocess.TimeoutExpired):   # a rank that outlived torchrun holds the pipes
            proc.communicate(timeout=10)
        raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def train_toy(out: Path, *extra: str) -> subprocess.CompletedProcess:
    """distill_toy.py in a fresh process: 9 steps, checkpoints every 4, eval every 3, accumulation 2."""
    args = [sys.executable, str(TOY), "--out", str(out), "--max-steps", "9", "--checkpoint-every", "4",
            "--eval-every", "3", "--accum", "2", *extra]
    return run_job(args, timeout=120)


def toy_records(out: Path) -> list[dict]:
    """Its metrics.jsonl, without the wall-clock figure (everything else must match exactly across runs)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        record.pop("tokens_per_s", None)
    return records


_HANDED_OUT: set[int] = set()   # ports this process has handed out (each rendezvous gets its own)


def free_port() -> int:
    """A free loopback port for one torchrun / accelerate rendezvous, outside the kernel's ephemeral range. A port
    from bind(0) is an ephemeral one, which a distributed job started beside this one (its gloo listeners, its store's
    client sockets) may take before this rendezvous binds it: a CI run failed with EADDRINUSE on such a port."""
    low, high = 32768, 60999
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        pass
    candidates = range(10000, low) if low > 11000 else range(high + 1, 65536)
    rng = random.Random()
    for _ in range(500):
        port = rng.choice(candidates)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {candidates.start}-{candidates.stop - 1}")


def tensor_digest(tensor: torch.Tensor) -> str:
    """Same bytes -> same digest (train.distill.launch.write_rank_report hashes parameters this way)."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
