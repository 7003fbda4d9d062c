"""Writing tune's winner: config.pbtxt, build.json and tuned.toml change together, and nothing else
appears in the served repository (deploy copies every file of a model folder)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from builder.repository.lock import LOCK_FILE
from builder.repository.tuned_serving import as_built
from builder.spec.tuned import TunedServing, load_tuned
from builder.tuning.journal import JOURNAL, recover_interrupted_write, write_winner
from builder.tuning.points import Point, apply, point_of
from tests.helpers.files import snapshot


def files(repository: Path) -> set[Path]:
    return {path.relative_to(repository) for path in repository.rglob("*")}


def test_each_tune_replaces_the_config_and_leaves_no_backup_in_the_repository(repo_copy: Path,
                                                                                tmp_path: Path) -> None:
    folder = repo_copy / "mlp_fp32"
    built = point_of("mlp_fp32", (folder / "config.pbtxt").read_text())
    before = files(repo_copy) | {Path(LOCK_FILE)}  # the lock file may appear: it is not served
    toml = tmp_path / "tuned.toml"
    for point in (Point("mlp_fp32", 4, 500, 2), Point("mlp_fp32", 1, None, 1)):
        entry = TunedServing("mlp", point.variant, point.max_batch_size, point.queue_delay_us, point.instances)
        assert write_winner(repo_copy, point, tuned=entry, tuned_toml=toml) == folder / "config.pbtxt"
        assert point_of("mlp_fp32", (folder / "config.pbtxt").read_text()) == point
        assert files(repo_copy) <= before
    # What the previous configs came from is still known: the builder's settings and the last winner.
    recorded = as_built(folder)
    assert recorded is not None
    assert (recorded.max_batch_size, recorded.queue_delay_us, recorded.instances) == (
        built.max_batch_size, built.queue_delay_us, built.instances)
    assert load_tuned(toml)["mlp_fp32"].max_batch_size == 1


def test_a_winner_that_cannot_be_recorded_leaves_the_repository_as_it_was(repo_copy: Path,
                                                                        tmp_path: Path) -> None:
    before = snapshot(repo_copy)
    point = Point("mlp_fp32", 4, 500, 2)
    entry = TunedServing("mlp", point.variant, 4, 500, 2)
    (tmp_path / "file").write_text("")
    unwritable = tmp_path / "file" / "tuned.toml"  # written last, after config.pbtxt and build.json
    with pytest.raises(OSError):
        write_winner(repo_copy, point, tuned=entry, tuned_toml=unwritable)
    assert snapshot(repo_copy) == before


# A child that writes a winner and is killed (os._exit: no except, no finally) right after the
# `kill_after`-th rename of the three files: what a crash, SIGKILL or the OOM killer leaves behind.
CRASH = """
import os, sys
from pathlib import Path
import common.files
from builder.tuning.journal import write_winner
from builder.tuning.points import Point
from builder.spec.tuned import TunedServing

repository, toml, kill_after = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
renames = []
real = common.files._write

def dying(path, fill):
    real(path, fill)
    if path in (repository / "mlp_fp32" / "config.pbtxt", repository / "mlp_fp32" / "build.json", toml):
        renames.append(path)
    if len(renames) == kill_after:
        os._exit(9)

common.files._write = dying
point = Point("mlp_fp32", 4, 500, 2)
write_winner(repository, point, tuned=TunedServing("mlp", point.variant, 4, 500, 2), tuned_toml=toml)
"""


def crash_writing(repository: Path, toml: Path, kill_after: int) -> None:
    done = subprocess.run([sys.executable, "-c", CRASH, str(repository), str(toml), str(kill_after)],
                          cwd=Path(__file__).resolve().parents[3], timeout=120, check=False)
    assert done.returncode == 9, "the child was to die mid-write"


@pytest.mark.parametrize("kill_after", [1, 2])  # after config.pbtxt (and build.json); tuned.toml not yet
def test_a_write_killed_between_renames_is_put_back_by_the_next_writer(repo_copy: Path, tmp_path: Path,
                                                                       kill_after: int) -> None:
    folder = repo_copy / "mlp_fp32"
    builder_config = (folder / "config.pbtxt").read_text()
    built = point_of("mlp_fp32", builder_config)
    toml = tmp_path / "tuned.toml"
    before, names = snapshot(repo_copy), files(repo_copy) | {Path(LOCK_FILE)}
    crash_writing(repo_copy, toml, kill_after)
    # The next writer, under the same lock, first finds the files as they were before the killed write
    # (tuned.toml absent, as it was), then writes its own winner over the builder's config.
    assert recover_interrupted_write(repo_copy) is True
    assert snapshot(repo_copy) == before
    assert not toml.exists()
    crash_writing(repo_copy, toml, kill_after)
    point = Point("mlp_fp32", 1, None, 1)
    write_winner(repo_copy, point, tuned=TunedServing("mlp", point.variant, 1, None, 1), tuned_toml=toml)
    recorded = as_built(folder)
    assert recorded is not None  # the builder's settings, not the killed write's winner taken for them
    assert (recorded.max_batch_size, recorded.queue_delay_us, recorded.instances) == (
        built.max_batch_size, built.queue_delay_us, built.instances)
    assert point_of("mlp_fp32", (folder / "config.pbtxt").read_text()) == point
    assert load_tuned(toml)["mlp_fp32"].max_batch_size == 1
    assert files(repo_copy) <= names  # no journal left behind


def test_an_interrupted_write_is_not_undone_over_a_later_rebuild(repo_copy: Path, tmp_path: Path) -> None:
    folder = repo_copy / "mlp_fp32"
    toml = tmp_path / "tuned.toml"
    crash_writing(repo_copy, toml, 1)
    # A rebuild after the crash wrote the folder again: its files are newer than both versions the
    # journal knows, and putting the old ones back would undo it.
    (folder / "config.pbtxt").write_text(apply((folder / "config.pbtxt").read_text(), Point("mlp_fp32", 2, 100, 1)))
    after_rebuild = snapshot(repo_copy)
    assert recover_interrupted_write(repo_copy) is True
    assert snapshot(repo_copy) == {k: v for k, v in after_rebuild.items() if k != JOURNAL}
    assert recover_interrupted_write(repo_copy) is False  # the journal is gone
