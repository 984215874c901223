"""Hydra doors of serve_eval's jobs: ``draftsmith eval`` and ``draftsmith serve``.

serve_eval may not import train (imports point ``train -> serve_eval``), yet the Hydra config (conf/ and
its schema registry) lives in train. So the job bodies stay in serve_eval and their Hydra wrappers
live here:

    draftsmith eval [key=value ...]          = python -m draftsmith.train.jobs eval [key=value ...]
    draftsmith eval compare A B              (report deltas; no Hydra)
    draftsmith serve [key=value ...]         = python -m draftsmith.train.jobs serve [key=value ...]

``serve`` resolves the target like every train job (``target.path``, else the embedded target, built
and cached by the pipeline's corpus -> tokenizer -> target stages) and calls
``draftsmith.serve_eval.server.run.serve_from_config(cfg.serve, model_dir)``. Without Hydra:
``python -m draftsmith.serve_eval.server.run --model DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from draftsmith.train.config import hydra_app


def eval_job(cfg: DictConfig) -> Path:
    """The eval harness (serve_eval.eval.run.run); returns the report dir."""
    from draftsmith.serve_eval.eval.run import run

    return run(cfg)


def serve_job(cfg: DictConfig) -> None:
    """Blocking: the OpenAI-compatible server over the configured target until SIGINT/SIGTERM."""
    from draftsmith.serve_eval.server.run import serve_from_config
    from draftsmith.train.artifacts import artifacts_from_config
    from draftsmith.train.distill.dataset.job import ensure_target

    model_dir, fingerprint, _ = ensure_target(cfg, artifacts_from_config(cfg))
    print(f"draftsmith serve: target {model_dir} (fingerprint {fingerprint}) on http://{cfg.serve.host}:{cfg.serve.port}",
          flush=True)
    serve_from_config(cfg.serve, str(model_dir))


def eval_main(argv: list[str] | None = None) -> int | None:
    """``compare A B`` goes to serve_eval.eval.compare (its exit status); anything else is the Hydra job."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["compare"]:
        from draftsmith.serve_eval.eval.compare import main as compare_main

        return compare_main(args[1:])
    if argv is not None:
        sys.argv = [sys.argv[0], *args]
    return hydra_app(eval_job)()


def serve_main(argv: list[str] | None = None) -> None:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    hydra_app(serve_job)()


JOBS: dict[str, Any] = {"eval": eval_main, "serve": serve_main}


def main() -> int | None:
    if len(sys.argv) < 2 or sys.argv[1] not in JOBS:
        raise SystemExit(f"usage: python -m draftsmith.train.jobs {{{'|'.join(JOBS)}}} [key=value ...]")
    name = sys.argv.pop(1)
    sys.argv[0] = f"draftsmith {name}"
    return JOBS[name]()


if __name__ == "__main__":
    raise SystemExit(main())
