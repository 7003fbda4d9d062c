"""A bundled Triton serving python-backend models written by the test itself (a sequence-batcher counter, a
decoupled streamer): the repository written from (name, model.py text, config.pbtxt text) triples."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from builder.serving.triton_server import Ports, TritonServer, free_ports


@contextmanager
def serving(root: Path, models: Sequence[tuple[str, str, str]]) -> Iterator[TritonServer]:
    """A started server over `root/repository` holding `models`; stopped afterwards."""
    repository = root / "repository"
    for name, model, config in models:
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "1" / "model.py").write_text(model)
        (repository / name / "config.pbtxt").write_text(config)
    server = TritonServer(repository, root / "state", Ports(*free_ports(3)))
    server.start(timeout=180)
    try:
        yield server
    finally:
        server.stop()
