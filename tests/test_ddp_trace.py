"""ddp.trace: per-rank Chrome-trace files that are valid JSON after every flush (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddp.trace import COMM, COMPUTE, Tracer, rank_path, tracer_for


def test_rank_paths() -> None:
    assert rank_path("out/run.json", 3) == Path("out/run.rank3.json")
    assert rank_path("run", 0) == Path("run.rank0.json")


def test_events_are_appended_and_the_file_stays_valid(tmp_path: Path) -> None:
    tracer = Tracer(tmp_path / "t.json", rank=2)
    assert json.loads((tmp_path / "t.json").read_text()) == []
    tracer.span("backward", COMPUTE, 10.0, 25.5)
    tracer.flush()
    tracer.span("all_reduce bucket 0", COMM, 12.0, 40.0, bytes=64)
    tracer.span("finalize", COMPUTE, 30.0, 29.0)  # clock jitter: never a negative duration
    tracer.flush()
    events = json.loads((tmp_path / "t.json").read_text())
    assert events == [
        {"name": "backward", "ph": "X", "ts": 10.0, "dur": 15.5, "pid": 2, "tid": 0},
        {"name": "all_reduce bucket 0", "ph": "X", "ts": 12.0, "dur": 28.0, "pid": 2, "tid": 1, "args": {"bytes": 64}},
        {"name": "finalize", "ph": "X", "ts": 30.0, "dur": 0.0, "pid": 2, "tid": 0},
    ]
    tracer.close()


def test_environment_variable_and_second_tracers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COMMLIB_DDP_TRACE", raising=False)
    assert tracer_for(None, 0) is None
    monkeypatch.setenv("COMMLIB_DDP_TRACE", str(tmp_path / "env.json"))
    first, second = tracer_for(None, 1), tracer_for(None, 1)
    assert first.path == tmp_path / "env.rank1.json" and second.path == tmp_path / "env.rank1.2.json"
    assert tracer_for(tmp_path / "arg.json", 1).path == tmp_path / "arg.rank1.json"  # the argument wins
    with pytest.raises(TypeError, match=r"trace must be a file path \(str or os.PathLike\) or None, got int"):
        tracer_for(3, 0)  # type: ignore[arg-type]
