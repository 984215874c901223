"""`draftsmith serve`: build the engine (optionally speculative), the app, and run uvicorn.

Two doors, one body (`serve`):
- Hydra: `draftsmith.train.cli` composes conf/ and calls `serve_from_config(cfg.serve, model_dir)`;
  `ServeConfig` is the schema of the `serve` group (`SCHEMAS` below, for serve_eval.schemas).
  serve_eval must not import train, so the Hydra wiring itself lives in train.cli.
- Standalone: `python -m draftsmith.serve_eval.server.run --model DIR [--port 8000]
  [--spec method=ngram,num_speculative_tokens=4]` (spec keys = serve_eval.speculative.config.SpecConfig fields).

Binds 127.0.0.1 unless told otherwise; the API key comes from `--api-key` or
DRAFTSMITH_API_KEY, and is compared in constant time (app.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn

log = logging.getLogger(__name__)

@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    api_key: str | None = None              # or DRAFTSMITH_API_KEY
    max_model_len: int | None = None
    max_waiting_requests: int = 128
    retry_after_s: int = 1
    shutdown_grace_s: float = 5.0
    max_request_body_bytes: int = 4 * 1024 * 1024   # 413 above it
    # acceptance drift: hold the served draft's per-domain alpha to an eval report's (off when unset)
    drift_reference: str | None = None      # report.json; its rows of the spec method at the spec K, T=0
    drift_log: str | None = None            # JSON lines of drift events (default: beside the report)
    drift_webhook: str | None = None        # POSTed each event
    drift_window_tokens: int = 512
    drift_tolerance: float = 0.10
    drift_min_alpha: float = 0.0
    log_level: str = "info"
    # engine
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_memory_gb: float = 1.0
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int = 256
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    attn_backend: str = "auto"
    device: str = "cpu"
    seed: int = 0
    # speculation: None = off; else "key=value,..." handed to the spec package's SpecConfig
    spec: str | None = None
    # an eval's recommendations.yaml: several drafts, each request served by the one recommended for its
    # domain and temperature (instead of `spec`)
    recommendations: str | None = None
    # speculate at a batch size only where it pays (serve_eval.speculative.batch_gate): measured | off
    batch_gate: str = "measured"


SCHEMAS = {"serve/schema_server": ServeConfig}

_ENGINE_FIELDS = ("dtype", "block_size", "kv_cache_memory_gb", "num_gpu_blocks", "num_cpu_blocks",
                  "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "attn_backend",
                  "device", "seed", "max_model_len")


def parse_spec(spec: str) -> dict[str, Any]:
    """'method=eagle,num_speculative_tokens=4,draft_path=/d' -> SpecConfig keyword arguments
    ({'method': 'eagle', 'num_speculative_tokens': 4, 'draft_path': '/d'})."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"spec: expected key=value pairs separated by commas, got {part!r}")
        out[key.strip()] = _literal(value.strip())
    if not out:
        raise ValueError("spec: empty; e.g. --spec method=ngram,num_speculative_tokens=4")
    return out


def _literal(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(value.lower(), value)


def build_speculative(spec: str | None, batch_gate: str = "measured") -> Any:
    """The SpecConfig for `spec` ("key=value,..." over SpecConfig's fields), or None when off."""
    if not spec:
        return None
    from draftsmith.serve_eval.speculative.config import SpecConfig
    kwargs = parse_spec(spec)
    # A server must never decode slower than without speculation at its batch sizes (batch_gate=off
    # in the spec string turns the measured gate off).
    kwargs.setdefault("batch_gate", batch_gate)
    try:
        return SpecConfig(**kwargs)
    except TypeError as exc:
        raise ValueError(f"spec: {exc}") from None


def build_engine(model_dir: str, cfg: ServeConfig) -> Any:
    from draftsmith.serve_eval.engine.llm_engine import EngineConfig, LLMEngine
    engine_kwargs = {name: getattr(cfg, name) for name in _ENGINE_FIELDS}
    if cfg.spec and cfg.recommendations:
        raise ValueError("serve: set spec or recommendations, not both (recommendations name their drafts)")
    spec = f"method=routed,routes={cfg.recommendations}" if cfg.recommendations else cfg.spec
    return LLMEngine(EngineConfig(model=str(model_dir), **engine_kwargs),
                     speculative=build_speculative(spec, cfg.batch_gate))


def build_app(model_dir: str, cfg: ServeConfig, engine: Any = None) -> Any:
    from draftsmith.serve_eval.server.app import ServerConfig, api_key_from_env, create_app
    engine = engine if engine is not None else build_engine(model_dir, cfg)
    return create_app(engine, ServerConfig(
        model_name=cfg.model_name, api_key=api_key_from_env(cfg.api_key), max_model_len=cfg.max_model_len,
        max_waiting_requests=cfg.max_waiting_requests, retry_after_s=cfg.retry_after_s,
        shutdown_grace_s=cfg.shutdown_grace_s, max_request_body_bytes=cfg.max_request_body_bytes,
        drift=drift_settings(cfg)))


def drift_settings(cfg: ServeConfig) -> Any:
    """DriftSettings from the flat serve flags (speculation must be on: its method and K are read)."""
    if not cfg.drift_reference:
        return None
    if not cfg.spec:
        raise ValueError("drift_reference: acceptance drift needs speculation on (--spec method=...)")
    from draftsmith.serve_eval.server.drift import DriftConfig, DriftSettings
    spec = parse_spec(cfg.spec)
    return DriftSettings(cfg.drift_reference, str(spec["method"]), spec.get("num_speculative_tokens"),
                         0.0, cfg.drift_log, cfg.drift_webhook,
                         DriftConfig(cfg.drift_window_tokens, cfg.drift_tolerance, cfg.drift_min_alpha))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(model_dir: str, cfg: ServeConfig) -> None:
    """Blocking: serve until SIGINT/SIGTERM, then drain (the engine loop and uvicorn together)."""
    from draftsmith.serve_eval.server.app import api_key_from_env
    if not _is_loopback(cfg.host) and not api_key_from_env(cfg.api_key):
        log.warning("serving on %s without an API key: anyone who can reach it can use it", cfg.host)
    app = build_app(model_dir, cfg)
    # uvicorn's own grace outlasts the engine's, so that aborted streams can still send their
    # terminal event and [DONE] before connections are closed.
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                            timeout_graceful_shutdown=int(cfg.shutdown_grace_s) + 5)
    _DrainingServer(config, app.state.engine_loop, cfg.shutdown_grace_s).run()


class _DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT the engine loop starts draining at once (new requests 503, in-flight ones
    get the grace period, then end with finish_reason 'abort'), while uvicorn waits for their
    connections to close; without this, uvicorn waits with the engine still running and then
    cuts the streams mid-body."""

    def __init__(self, config: uvicorn.Config, engine_loop: Any, grace_s: float) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop
        self.grace_s = grace_s

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine_loop.begin_shutdown(self.grace_s)
        super().handle_exit(sig, frame)


def serve_from_config(serve_cfg: Mapping[str, Any] | Any, model_dir: str) -> None:
    """Hydra door: `serve_cfg` is the composed `serve` group (DictConfig or mapping)."""
    if not isinstance(serve_cfg, Mapping):
        from omegaconf import OmegaConf
        serve_cfg = OmegaConf.to_container(serve_cfg, resolve=True)
    known = {f.name for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(serve_cfg) - known - {"name"})
    if unknown:
        raise ValueError(f"serve config: unknown keys {unknown}")
    serve(model_dir, ServeConfig(**{k: v for k, v in serve_cfg.items() if k in known}))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith serve",
                                     description="OpenAI-compatible server over the draftsmith engine")
    parser.add_argument("--model", required=True, help="HF checkpoint dir (Llama family)")
    defaults = ServeConfig()
    for f in dataclasses.fields(ServeConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if f.name in ("num_gpu_blocks", "max_model_len"):
                kind = int
            parser.add_argument(flag, type=kind, default=default)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = vars(_parser().parse_args(argv))
    model_dir = args.pop("model")
    logging.basicConfig(level=args["log_level"].upper())
    serve(model_dir, ServeConfig(**args))


if __name__ == "__main__":
    main()
