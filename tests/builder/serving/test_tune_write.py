"""Writing tune's winner: config.pbtxt, build.json and tuned.toml change together, and nothing else
appears in the served repository (deploy copies every file of a model folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.repository.lock import LOCK_FILE
from builder.serving.tune import Point, point_of, write_winner
from builder.spec.tuned import TunedServing, as_built, load_tuned
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
