"""Writing the winner: config.pbtxt, build.json and tuned.toml change together under the repository
lock, journaled so that a write killed between its renames is put back by the next one."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import math
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from builder.errors import BuilderError
from builder.repository import model_folder, tuned_serving
from builder.repository.lock import repository_lock
from builder.spec import tuned as tuned_file
from builder.spec.tuned import TunedServing
from builder.tuning.objective import Objective
from builder.tuning.points import Point, Result, apply, mean_throughput, worst_p99
from builder.tuning.strategies import Search
from common.files import write_atomic

log = logging.getLogger(__name__)


def tuned_entry(model: str, winner: Point, measured: list[Result], objective: Objective,
                search: Search) -> TunedServing:
    p99 = worst_p99(measured)
    return TunedServing(model=model, variant=winner.variant, max_batch_size=winner.max_batch_size,
                        queue_delay_us=winner.queue_delay_us, instances=winner.instances, measured={
                            "objective": str(objective.goal), "search": str(search),
                            "p99_budget_ms": None if objective.p99_budget_us is None else objective.p99_budget_us / 1e3,
                            "min_throughput": objective.min_throughput,
                            "throughput": round(mean_throughput(measured), 2),
                            "p99_ms": round(p99 / 1e3, 3) if math.isfinite(p99) else None,
                            "concurrency": [r.concurrency for r in measured],
                            "tuned_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})


JOURNAL = ".trtbuild.tune-journal.json"  # beside the lock file: not a model folder, never served


def write_winner(repository: Path, point: Point, *, wait: bool = True, tuned: TunedServing | None = None,
                 tuned_toml: Path | None = None) -> Path:
    """Replace the variant's config.pbtxt atomically under the repository lock; record the settings in
    build.json and, given `tuned_toml`, as the model's entry there (so `trtbuild engines` keeps them).
    Returns the config's path.

    No backup is left in the model folder: Triton skips it, but every deploy would copy it, one more per
    tune. Nothing is lost: the config is the builder's own with the serving settings replaced, so the
    previous one is what `trtbuild engines` writes again (build.json keeps `serving_as_built`), and the
    tune report's `changes` hold the exact diff.

    The files change together or not at all. Each is renamed into place on its own, so before the first
    rename a journal in the repository root keeps the previous content of all three; it is removed
    after the last. A write that fails puts the others back at once; one killed between renames leaves
    the journal, and the next winner written to this repository puts them back first
    (`recover_interrupted_write`)."""
    with repository_lock(repository, what=f"tune's winner for {point.variant}", wait=wait):
        recover_interrupted_write(repository)
        target = repository / point.variant / model_folder.CONFIG
        original = target.read_text(encoding="utf-8")
        built = tuned_serving.as_built(target.parent) or tuned_serving.serving_of(original)
        new: dict[Path, bytes] = {target: apply(original, point).encode("utf-8")}
        if tuned is not None:
            new[target.parent / model_folder.RECORD] = _record_after(target.parent, tuned, built)
            if tuned_toml is not None:
                new[tuned_toml.absolute()] = tuned_file.render(tuned_toml, tuned)[1].encode("utf-8")
        previous = {path: path.read_bytes() if path.exists() else None for path in new}
        changed = {path: data for path, data in new.items() if previous[path] != data}
        journal = repository / JOURNAL
        write_atomic(journal, json.dumps({"variant": point.variant, "files": [
            {"path": str(path.absolute()), "previous": None if previous[path] is None
             else base64.b64encode(previous[path] or b"").decode("ascii"),
             "written_sha256": hashlib.sha256(data).hexdigest()} for path, data in changed.items()]}, indent=1))
        try:
            for path, data in changed.items():
                write_atomic(path, data)
        except BaseException:
            if not _restore({path: previous[path] for path in changed}):
                journal.unlink(missing_ok=True)
            raise
        journal.unlink()
    return target


def _record_after(model_dir: Path, tuned: TunedServing, built: tuned_serving.Serving) -> bytes:
    """build.json as `record_tuned` would leave it, computed in a scratch folder so that it can be
    journalled before anything in the repository changes."""
    with tempfile.TemporaryDirectory(prefix="trtbuild-tune-record-") as scratch:
        record = model_dir / model_folder.RECORD
        if record.exists():
            shutil.copyfile(record, Path(scratch) / model_folder.RECORD)
        tuned_serving.record_tuned(Path(scratch), tuned, built)
        written = Path(scratch) / model_folder.RECORD
        return written.read_bytes() if written.exists() else b""


def recover_interrupted_write(repository: Path) -> bool:
    """Called under the repository lock: when a winner's write was killed between its renames (its
    journal is still there), put config.pbtxt, build.json and tuned.toml back as they were before it.
    A file that holds neither its previous content nor the killed write's means another writer (a
    rebuild) has written since; that later state stands and nothing is put back. True when a journal
    was found and dealt with."""
    journal = repository / JOURNAL
    try:
        entries = json.loads(journal.read_text(encoding="utf-8"))["files"]
        files = {Path(e["path"]): (None if e["previous"] is None else base64.b64decode(e["previous"]),
                                   str(e["written_sha256"])) for e in entries}
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BuilderError(f"{journal}: expected the journal of an interrupted tune write ({exc}); check "
                           "config.pbtxt, build.json and tuned.toml, then delete it") from exc
    current = {path: path.read_bytes() if path.exists() else None for path in files}
    later = [path for path, (previous, written) in files.items()
             if current[path] != previous
             and (current[path] is None or hashlib.sha256(current[path] or b"").hexdigest() != written)]
    if later:
        log.warning("tune: %s: a winner's write was interrupted, but %s changed since; leaving the files as "
                    "they are", journal, ", ".join(map(str, later)))
    else:
        log.warning("tune: %s: a winner's write was interrupted; putting %s back as they were", journal,
                    ", ".join(map(str, files)))
        if _restore({path: previous for path, (previous, _) in files.items()}):
            raise BuilderError(f"{journal}: could not put back the files of an interrupted tune write; "
                               "check config.pbtxt, build.json and tuned.toml, then delete it")
    journal.unlink()
    return True


def _restore(previous: dict[Path, bytes | None]) -> list[Path]:
    """Put each file back as it was (absent where it was absent); a file that cannot be put back is
    logged, and the error on its way stays the one raised. Returns those not put back."""
    failed = []
    for path, data in previous.items():
        try:
            if data is None:
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # never written: nothing to undo
                    path.unlink()
            elif not path.exists() or path.read_bytes() != data:
                write_atomic(path, data)
        except OSError as exc:
            failed.append(path)
            log.error("tune: could not restore %s (%s); it may hold the new winner's settings",
                      path, exc.strerror or exc)
    return failed


def planned_changes(repository: Path, point: Point, *, tuned: TunedServing | None,
                    tuned_toml: Path | None) -> list[str]:
    """Unified diffs of what writing the winner changes (shown by --dry-run)."""
    target = repository / point.variant / "config.pbtxt"
    before = target.read_text()
    changes = [tuned_file.diff(target, before, apply(before, point))]
    if tuned is not None and tuned_toml is not None:
        changes.append(tuned_file.diff(tuned_toml, *tuned_file.render(tuned_toml, tuned)))
    return [c for c in changes if c]
