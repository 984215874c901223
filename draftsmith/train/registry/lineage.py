"""A draft's lineage as W&B artifacts: target -> data -> draft -> eval report.

Each link is one small W&B run of its own job type (``register_target``, ``generate``, ``distill``,
``eval``) that takes its inputs and logs its output as an artifact, so W&B's graph reads the way the
draft was made. The registry entry keeps the four `ArtifactRef`s (``draftsmith drafts show`` prints
the chain).

The hook logs one chain per recovery round (`log_chain`). The pipeline logs a whole run's drafts at
once (`log_pipeline_run`) in at most four W&B runs, whatever the number of drafts: starting a W&B run
costs seconds and the main job has a fixed budget. Its ``distill`` run logs every draft and its
``eval`` run the one report, which uses every draft; `logged_chain` is then told which draft a
chain goes through.

Offline (the default), wandb 0.31 allows ``log_artifact`` (the artifact, its digest and metadata go
into the run's ``.wandb`` file) but refuses ``Run.use_artifact`` ("Cannot use artifact when in
offline mode", for a name, a logged artifact or a draft one alike), ``Artifact.wait()`` and
``link_artifact``; a use record needs the server's artifact id, which an offline artifact does not
have even after ``wandb sync``. So the edges are written explicitly: every artifact's metadata holds
``draftsmith_uses``, the ``name@digest`` keys of its inputs, and the registry keeps the same refs;
`draftsmith.train.registry.wandb_runs` reads them back from the run files. Online, each run also calls
``use_artifact`` on its inputs (W&B then draws the edges itself) and the refs get the server's id and
version after ``wait()``.

Draft dirs are logged as checksummed ``file://`` references (W&B records each file's md5, copies
nothing); a target and a dataset as a small JSON of their identity plus an unchecksummed reference
to their dir (a target's weights are too big to hash again: its fingerprint already does); a report
as its report.json.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from draftsmith.train.logs import WandbSettings, start_run
from draftsmith.train.registry.records import ArtifactRef, RegisteredTarget
from draftsmith.train.registry.wandb_runs import LoggedArtifact, logged_artifacts, wait_until_written

USES_KEY = "draftsmith_uses"


class Lineage(Protocol):
    def log_chain(self, target: RegisteredTarget, data_dir: Path, draft_dir: Path, report_path: Path,
                  parents: Sequence[ArtifactRef] = ()) -> list[ArtifactRef]:
        """Log target, data, draft and report (the draft also uses ``parents``); their refs, in that order."""

    def log_pipeline_run(self, target: RegisteredTarget, data_dir: Path, drafts: Mapping[str, Path],
                         report_path: Path) -> dict[str, list[ArtifactRef]]:
        """Log a pipeline run's drafts (key -> draft dir), all made from one dataset and judged by one report;
        per key, that draft's chain [target, data, draft, report]."""


class NoLineage:
    """W&B disabled (or a test's fakes): nothing logged, no refs."""

    def log_chain(self, target, data_dir, draft_dir, report_path, parents=()) -> list[ArtifactRef]:
        return []

    def log_pipeline_run(self, target, data_dir, drafts, report_path) -> dict[str, list[ArtifactRef]]:
        return {key: [] for key in drafts}


@dataclass(frozen=True)
class _Spec:
    """What one artifact holds: JSON files written here, a dir referenced, and its metadata."""

    name: str
    type: str
    json_files: dict[str, Any] = field(default_factory=dict)
    files: tuple[Path, ...] = ()
    reference: Path | None = None
    checksum: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


def artifact_name(*parts: str) -> str:
    """A W&B artifact name (letters, digits, ``-_.``) from path-ish parts."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(parts)).strip("-.")[:128]


class WandbLineage:
    """Logs lineage chains into W&B runs under ``wandb_dir``; a target or dataset already logged by this
    object is not logged again (a hook's recovery rounds share them)."""

    def __init__(self, settings: WandbSettings, wandb_dir: Path):
        if settings.mode == "disabled":
            raise ValueError("wandb.mode=disabled: use NoLineage")
        self.settings, self.wandb_dir = settings, Path(wandb_dir)
        self._known: dict[tuple[str, str], ArtifactRef] = {}
        self._online_objects: dict[str, Any] = {}   # key -> logged wandb.Artifact (online use_artifact)

    def log_chain(self, target: RegisteredTarget, data_dir: Path, draft_dir: Path, report_path: Path,
                  parents: Sequence[ArtifactRef] = ()) -> list[ArtifactRef]:
        return self._log_chains(target, data_dir, {"draft": (Path(draft_dir), parents)}, report_path)["draft"]

    def log_pipeline_run(self, target: RegisteredTarget, data_dir: Path, drafts: Mapping[str, Path],
                         report_path: Path) -> dict[str, list[ArtifactRef]]:
        return self._log_chains(target, data_dir, {key: (Path(d), ()) for key, d in drafts.items()}, report_path)

    def _log_chains(self, target: RegisteredTarget, data_dir: Path,
                    drafts: Mapping[str, tuple[Path, Sequence[ArtifactRef]]],
                    report_path: Path) -> dict[str, list[ArtifactRef]]:
        """One run each for target, data, all the drafts (each also using its parents) and the report."""
        if not drafts:
            return {}
        data_dir, report_path = Path(data_dir), Path(report_path)
        target_ref = self._once("register_target", _target_spec(target), [])
        data_ref = self._once("generate", _data_spec(target, data_dir), [target_ref])
        draft_refs = self._log("distill", [(_draft_spec(draft_dir), [data_ref, target_ref, *parents])
                                           for draft_dir, parents in drafts.values()])
        [report_ref] = self._log("eval", [(_report_spec(report_path), [*draft_refs, target_ref])])
        return {key: [target_ref, data_ref, draft_ref, report_ref] for key, draft_ref in zip(drafts, draft_refs)}

    def _once(self, job_type: str, spec: _Spec, uses: list[ArtifactRef]) -> ArtifactRef:
        key = (spec.type, spec.name)
        if key not in self._known:
            [self._known[key]] = self._log(job_type, [(spec, uses)])
        return self._known[key]

    def _log(self, job_type: str, items: Sequence[tuple[_Spec, Sequence[ArtifactRef]]]) -> list[ArtifactRef]:
        """Log each spec (with the inputs it uses) as an artifact of one W&B run; their refs, in order."""
        names = [spec.name for spec, _ in items]
        if len(set(names)) < len(names):   # one run cannot tell two same-named artifacts apart
            raise ValueError(f"lineage: artifact names repeat within one {job_type} run: {names}")
        name = f"{job_type}-{names[0]}" + (f"-and-{len(names) - 1}-more" if len(names) > 1 else "")
        run = start_run(self.settings, job_type, self.wandb_dir, name=name[:128], reinit="create_new")
        online = not run.offline
        try:
            if online:   # W&B's edges are per run (every artifact of it reads as made from all its inputs);
                # each artifact's own inputs stay exact in its metadata
                for used in {u.key: u for _, uses in items for u in uses}.values():
                    self._use_online(run, used)
            refs = [self._log_one(run, spec, list(uses), online) for spec, uses in items]
        finally:
            run.finish()
        if not online:
            wait_until_written(refs[0].run_dir)
        return refs

    def _log_one(self, run: Any, spec: _Spec, uses: list[ArtifactRef], online: bool) -> ArtifactRef:
        with tempfile.TemporaryDirectory() as tmp:
            artifact = _build(spec, uses, Path(tmp))
            run.log_artifact(artifact)
        if online:
            artifact.wait()   # the server's id and version exist only after the upload
            self._online_objects[f"{spec.name}@{artifact.digest}"] = artifact
        return ArtifactRef(spec.name, spec.type, artifact.digest, tuple(u.key for u in uses), run.id,
                           None if online else str(Path(run.dir).parent),
                           artifact.id if online else None, artifact.version if online else None)

    def _use_online(self, run: Any, used: ArtifactRef) -> None:
        logged = self._online_objects.get(used.key)
        if logged is not None:
            run.use_artifact(logged)
        elif used.version:
            run.use_artifact(f"{used.name}:{used.version}", type=used.type)
        # else: logged offline before; its edge lives in the metadata (draftsmith_uses) only


def _build(spec: _Spec, uses: list[ArtifactRef], tmp: Path) -> Any:
    import wandb

    artifact = wandb.Artifact(spec.name, type=spec.type, metadata={**spec.metadata, USES_KEY: [u.key for u in uses]})
    for file_name, content in spec.json_files.items():
        path = tmp / file_name
        path.write_text(json.dumps(content, indent=2, sort_keys=True, default=str))
        artifact.add_file(str(path), name=file_name)   # copied into W&B's staging dir here
    for path in spec.files:
        artifact.add_file(str(path), name=path.name)
    if spec.reference is not None:
        artifact.add_reference(spec.reference.resolve().as_uri(), name="files", checksum=spec.checksum)
    return artifact


def _target_spec(target: RegisteredTarget) -> _Spec:
    return _Spec(artifact_name("target", target.fingerprint), "target", json_files={"target.json": asdict(target)},
                 reference=Path(target.path) if target.path and Path(target.path).is_dir() else None,
                 metadata={"fingerprint": target.fingerprint, "path": target.path})


def _draft_spec(draft_dir: Path) -> _Spec:
    return _Spec(artifact_name("draft", draft_dir.name), "draft", reference=draft_dir.resolve(), checksum=True,
                 metadata={"path": str(draft_dir.resolve())})


def report_artifact_name(report_path: Path) -> str:
    """The report artifact's name: its eval dir's (one per eval run), so a registry entry can tell whether
    its lineage ends in this report."""
    return artifact_name("eval", Path(report_path).parent.name)


def _report_spec(report_path: Path) -> _Spec:
    return _Spec(report_artifact_name(report_path), "report", files=(report_path,),
                 metadata={"path": str(report_path.resolve())})


def _data_spec(target: RegisteredTarget, data_dir: Path) -> _Spec:
    manifest = data_dir / "manifest.json"
    return _Spec(artifact_name("data", target.fingerprint[:8], data_dir.name), "dataset",
                 files=(manifest,) if manifest.is_file() else (), reference=data_dir.resolve() if data_dir.is_dir() else None,
                 metadata={"path": str(data_dir.resolve())})


def lineage_for(settings: WandbSettings, wandb_dir: Path) -> Lineage:
    """The lineage logger for a config's ``wandb`` group: nothing when W&B is disabled."""
    return NoLineage() if settings.mode == "disabled" else WandbLineage(settings, wandb_dir)


def logged_chain(wandb_dir: Path, last: ArtifactRef, along: Sequence[ArtifactRef] = ()) -> list[LoggedArtifact]:
    """Read the offline runs below ``wandb_dir`` back and walk the ``draftsmith_uses`` edges from ``last``
    to its target, each step following its first input (the one it was made from) unless ``along`` (a
    registry chain) names the step before: a pipeline run's report uses every draft of the run, and a
    draft's chain goes through that draft. [target, data, draft, report] for a whole chain; shorter when
    a link is missing from the run files."""
    by_key = {f"{a.name}@{a.digest}": a for a in logged_artifacts(wandb_dir)}
    before = {later.key: earlier.key for earlier, later in zip(along, along[1:])}
    chain: list[LoggedArtifact] = []
    key: str | None = last.key
    while key in by_key and len(chain) <= len(by_key):
        artifact = by_key[key]
        chain.append(artifact)
        inputs = artifact.metadata.get(USES_KEY) or [None]
        step = before.get(key)
        key = step if step is not None and step in inputs else inputs[0]
    return chain[::-1]
