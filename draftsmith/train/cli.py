"""``draftsmith <job> [key=value ...]``: dispatch to a job's entry point, imported only when asked for.

Hydra jobs (pipeline, generate, distill, eval, serve) take ``key=value`` overrides; plan, export, hook
and drafts take their own flags (``draftsmith <job> --help``). The process exits with the job's return
code (e.g. the hook's 0 / 3 / 2), 0 when it returns none. Every job is also runnable as
``python -m <module> ...`` (eval and serve: ``python -m draftsmith.train.jobs eval|serve ...``). A job whose module
is not in this checkout yet says so in one line instead of failing with an import traceback.
"""

from __future__ import annotations

import sys

# job name -> ("module:function", one-line description). The function is a Hydra app (train.config.hydra_app).
JOBS: dict[str, tuple[str, str]] = {
    "pipeline": ("draftsmith.train.pipeline.run:main", "main job: corpus -> tokenizer -> target -> generate -> distill -> eval -> report"),
    "generate": ("draftsmith.train.distill.dataset.job:main", "regenerate answers to the distill prompts with the target"),
    "distill": ("draftsmith.train.distill.run:main", "train a draft (draft=standalone|medusa|eagle|eagle3)"),
    "eval": ("draftsmith.train.jobs:eval_main", "measure drafts per domain: alpha, tau, ms/token, speedup ('eval compare A B')"),
    "plan": ("draftsmith.serve_eval.plan.cli:main", "predict speedups and memory from a target config and the hardware"),
    "serve": ("draftsmith.train.jobs:serve_main", "OpenAI-compatible HTTP server with speculative decoding"),
    "quantize": ("draftsmith.drafts.quantize_job:main", "weight-only INT8 / INT4 copy of a distilled draft (drafts.quant)"),
    "export": ("draftsmith.drafts.export:main", "export a draft to vLLM (EAGLE-1, speculators EAGLE-3) / SGLang / Medusa layouts"),
    "hook": ("draftsmith.train.hook.cli:main", "target changed? re-measure, re-distill on regression, promote if better"),
    "drafts": ("draftsmith.train.registry.cli:main", "list / show / promote / retire the drafts filed under each target"),
}


def usage() -> str:
    width = max(map(len, JOBS))
    lines = ["usage: draftsmith <job> [key=value ...] [-m] [--cfg job] [--help]", "", "jobs:"]
    lines += [f"  {name:<{width}}  {description}" for name, (_, description) in JOBS.items()]
    lines += ["", "'draftsmith <job> --help' shows a job's options (Hydra jobs: its config groups over conf/)."]
    return "\n".join(lines)


def load_job(name: str):
    """The job's entry function, or SystemExit with a one-line reason."""
    if name not in JOBS:
        raise SystemExit(f"draftsmith: unknown job {name!r}\n\n{usage()}")
    from draftsmith.train.named import resolve   # jobs import lazily: `draftsmith --help` loads no torch

    try:
        return resolve(JOBS[name][0], f"draftsmith {name}")
    except ValueError as err:
        raise SystemExit(str(err)) from None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    name, rest = argv[0], argv[1:]
    fn = load_job(name)
    sys.argv = [f"draftsmith {name}", *rest]  # Hydra and argparse read their arguments from sys.argv
    code = fn()
    # Job return codes pass through (the hook's 3 = retrained, not promoted); Hydra apps return None.
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
