"""ddlcore.flight (the recorder's ring, its JSON file) and ddlcore.trace's verdict on made-up records."""

from __future__ import annotations

import json
import os
import stat
from unittest.mock import patch

import numpy as np
import pytest

import ddlcore
from ddlcore import calls, flight, trace
from ddlcore.errors import CommunicatorClosedError, DDLTimeoutError, PeerFailureError

RNG = np.random.default_rng(19)


def _call(
    collective: str = "allreduce", count: int = 13, dtype=np.float32, op="sum", root: int = 0
) -> calls.Call:
    x = RNG.standard_normal(count).astype(dtype)
    if collective == "barrier":
        return calls.prepare("barrier", None, None, None, 0, 4)
    if collective == "broadcast":
        return calls.prepare("broadcast", x, None, None, root, 4)
    return calls.prepare(collective, x, op if collective != "allgather" else None, None, 0, 4)


def _done(call: calls.Call, seq: int) -> object:
    return call.result


def test_ring_keeps_the_last_n_in_order():
    rec = flight.FlightRecorder(1, 4, "job", entries=5)
    run = rec.recording(_done)
    shapes = [
        ("allreduce", 13, np.float32),
        ("broadcast", 1, np.float64),
        ("allgather", 0, np.int32),
        ("barrier", 0, None),
        ("reduce_scatter", 28, np.int8),
    ]
    for seq in range(12):
        coll, count, dtype = shapes[seq % len(shapes)]
        call = _call(coll, count, dtype or np.float32, root=3)
        assert run(call, seq) is call.result
    entries = rec.entries()
    assert [e["seq"] for e in entries] == [7, 8, 9, 10, 11]
    for e in entries:
        coll, count, dtype = shapes[e["seq"] % len(shapes)]
        assert e["collective"] == coll and e["state"] == flight.COMPLETED
        assert e["start"] <= e["end"]
        if coll == "barrier":
            assert (e["count"], e["bytes"], e["dtype"], e["op"]) == (0, 0, None, None)
        else:
            assert e["count"] == count and e["bytes"] == count * np.dtype(dtype).itemsize
            assert e["dtype"] == np.dtype(dtype).name and e["memory"] == "host"
        assert e["root"] == (3 if coll == "broadcast" else None)
        assert e["op"] == ("sum" if coll in ("allreduce", "reduce_scatter") else None)


def test_zero_entries_is_off():
    rec = flight.FlightRecorder(0, 2, "job", entries=0, directory="unused")
    assert not rec.enabled
    assert rec.recording(_done) is _done  # nothing between the communicator and its calls
    assert rec.document("request")["entries"] == []


def test_failure_writes_the_record_and_names_it(tmp_path):
    rec = flight.FlightRecorder(2, 4, "host:1234", entries=8, directory=str(tmp_path / "fr"))
    broken: list[str] = []

    def execute(call: calls.Call, seq: int) -> object:
        if broken:
            raise CommunicatorClosedError(f"rank 2: refused: failed earlier ({broken[0]})")
        if seq == 3:
            broken.append("timeout")
            raise DDLTimeoutError("rank 2: allreduce #3 (13 x float32, sum): rank 0 silent")
        return call.result

    run = rec.recording(execute)
    for seq in range(3):
        run(_call(), seq)
    with pytest.raises(DDLTimeoutError) as err:
        run(_call(), 3)
    path = tmp_path / "fr" / "rank2.json"  # the first communicator of job host:1234 here
    assert rec.path == str(path)
    assert str(path) in str(err.value) and "python -m ddlcore.trace" in str(err.value)
    assert str(err.value).startswith("rank 2: allreduce #3")
    with pytest.raises(CommunicatorClosedError) as refused:
        run(_call(), 4)
    assert str(path) not in str(refused.value)
    doc = flight.load(str(path))
    assert doc["reason"] == "failure" and (doc["rank"], doc["size"]) == (2, 4)
    assert doc["error"]["type"] == "DDLTimeoutError" and "rank 0 silent" in doc["error"]["message"]
    assert [(e["seq"], e["state"]) for e in doc["entries"]] == [
        (0, "completed"),
        (1, "completed"),
        (2, "completed"),
        (3, "failed"),
    ]
    # A refused call is not a collective that ran; closing keeps the failure's record.
    assert [e["seq"] for e in rec.entries()] == [0, 1, 2, 3]
    before = path.read_text()
    rec.closed()
    assert path.read_text() == before


def test_interrupt_gets_a_note_not_a_new_message(tmp_path):
    rec = flight.FlightRecorder(0, 2, "interrupt", entries=4, directory=str(tmp_path))

    def execute(call: calls.Call, seq: int) -> object:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as err:
        rec.recording(execute)(_call(), 0)
    assert flight.load(rec.path)["error"]["type"] == "KeyboardInterrupt"
    if hasattr(err.value, "__notes__"):
        assert rec.path in err.value.__notes__[0]


def test_json_round_trip_and_file_names(tmp_path):
    first = flight.FlightRecorder(3, 4, "round-trip:1", entries=16, directory=str(tmp_path))
    second = flight.FlightRecorder(3, 4, "round-trip:1", entries=16, directory=str(tmp_path))
    assert (first.comm_index, second.comm_index) == (0, 1)
    assert first.path.endswith("rank3.json") and second.path.endswith("rank3.comm1.json")
    run = first.recording(_done)
    for seq, call in enumerate(
        [
            _call("broadcast", 7, np.float64, root=2),
            _call("barrier"),
            _call("allreduce", 97, np.int64, "max"),
        ]
    ):
        run(call, seq)
    doc = first.document("request")
    path = first.write(doc)
    assert flight.load(path) == json.loads(json.dumps(doc))
    text = open(path).read()
    assert text.count("\n") < 40 and "pickle" not in text  # one line per entry, plain JSON


@pytest.mark.parametrize(
    "content,why",
    [
        ("[1, 2]", "not a ddlcore flight record"),
        ("{not json", "not JSON"),
        ('{"format": "ddlcore-flight-record", "version": 99}', "version 99"),
        (
            '{"format": "ddlcore-flight-record", "version": 1, '
            '"rank": 0, "size": 2, "entries": [{"seq": "x"}]}',
            "malformed entry",
        ),
    ],
)
def test_load_rejects_what_is_not_a_record(tmp_path, content, why):
    path = tmp_path / "rank0.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=why):
        flight.load(str(path))


def test_world_of_one_records_its_collectives(tmp_path):
    env = {"DDL_FLIGHT_RECORDER": str(tmp_path), "DDL_FLIGHT_RECORDER_ENTRIES": "3"}
    with patch.dict("os.environ", env):
        comm = ddlcore.init(rank=0, size=1)
    x = RNG.standard_normal(101).astype(np.float32)
    comm.allreduce(x)
    comm.broadcast(x)
    comm.barrier()
    comm.allgather(x[:7])
    record = comm.flight_record()
    assert json.loads(json.dumps(record)) == record
    assert record["reason"] == "request" and record["error"] is None
    assert [e["collective"] for e in record["entries"]] == ["broadcast", "barrier", "allgather"]
    assert all(e["algorithm"] != "?" and e["path"] == "schedule" for e in record["entries"])
    comm.close()
    written = flight.load(str(tmp_path / flight.file_name(0, record["comm"])))
    assert written["reason"] == "close" and len(written["entries"]) == 3


def test_recording_off_through_the_environment():
    with patch.dict("os.environ", {"DDL_FLIGHT_RECORDER_ENTRIES": "0"}):
        comm = ddlcore.init(rank=0, size=1)
    with comm:
        assert comm._execute_recorded == comm._execute
        comm.allreduce(np.ones(5, np.float32))
        assert comm.flight_record()["entries"] == []


# --- trace's verdict on records made up here -------------------------------------------------
def _record(
    rank: int,
    size: int,
    calls_made: list[tuple[str, str]],
    reason: str = "failure",
    error: BaseException | None = None,
    t0: float = 1000.0,
    starts: dict[int, float] | None = None,
) -> dict:
    """A record of ``calls_made`` = [(collective, state)...], seq 0, 1, ..., a millisecond each."""
    entries = []
    for seq, (coll, state) in enumerate(calls_made):
        start = (starts or {}).get(seq, t0 + seq * 1e-3)
        entries.append(
            {
                "seq": seq,
                "collective": coll,
                "count": 0 if coll == "barrier" else 13,
                "bytes": 52,
                "dtype": None if coll == "barrier" else "float32",
                "op": "sum" if coll == "allreduce" else None,
                "root": 0 if coll == "broadcast" else None,
                "memory": "host",
                "algorithm": "direct",
                "path": "boards",
                "start": start,
                "end": None if state == "started" else start + (3.0 if state == "failed" else 1e-4),
                "state": state,
            }
        )
    err = (
        None
        if error is None
        else {
            "type": type(error).__name__,
            "message": str(error),
            "peer": getattr(error, "peer", None),
        }
    )
    return {
        "format": flight.FORMAT,
        "version": flight.VERSION,
        "job": "h:1",
        "comm": 0,
        "rank": rank,
        "size": size,
        "host": "h",
        "pid": 100 + rank,
        "created": t0 - 1,
        "written": t0 + 10,
        "reason": reason,
        "error": err,
        "timeout": 3.0,
        "entries": entries,
    }


def _group(*records: dict) -> trace.Group:
    group = trace.Group("h:1", 0, records[0]["size"])
    for rec in records:
        group.records[rec["rank"]] = rec
        group.paths[rec["rank"]] = f"/fr/rank{rec['rank']}.json"
    return group


OK = "completed"


def test_verdict_rank_that_never_started():
    timeout = DDLTimeoutError("rank 0: allreduce #2: rank 2 silent")
    group = _group(
        _record(0, 4, [("barrier", OK), ("broadcast", OK), ("allreduce", "failed")], error=timeout),
        _record(
            1,
            4,
            [("barrier", OK), ("broadcast", OK), ("allreduce", "failed")],
            error=PeerFailureError("rank 1: rank 0 aborted", 0),
        ),
        _record(2, 4, [("barrier", OK), ("broadcast", OK)], reason="close"),
        _record(
            3,
            4,
            [("barrier", OK), ("broadcast", OK), ("allreduce", "failed")],
            error=PeerFailureError("rank 3: rank 0 aborted", 0),
        ),
    )
    findings = trace.analyze(group)
    assert [(f.kind, f.ranks, f.seq) for f in findings] == [("behind", [2], 2)]
    assert (
        "rank 2 is behind: it never started allreduce #2 (13 x float32, sum), which ranks "
        "0, 1, 3 started" in findings[0].text
    )
    assert "broadcast #1" in findings[0].text and "closed its communicator" in findings[0].text


def test_verdict_rank_far_behind_the_others_records():
    ahead = _record(
        0,
        2,
        [("barrier", OK)] * 40 + [("allreduce", "failed")],
        error=DDLTimeoutError("rank 0: allreduce #40: rank 1 silent"),
    )
    ahead["entries"] = ahead["entries"][-8:]  # its ring kept 8
    group = _group(ahead, _record(1, 2, [("barrier", OK)] * 3, reason="close"))
    findings = trace.analyze(group)
    assert [(f.kind, f.ranks, f.seq) for f in findings] == [("behind", [1], 3)]
    assert "its last collective was #2, the others reached #40" in findings[0].text


def test_verdict_rank_that_started_after_the_others_failed():
    late = {2: 1010.0}  # 10 s after the others, who failed after 3 s
    group = _group(
        *[
            _record(
                r,
                3,
                [("barrier", OK), ("barrier", OK), ("allreduce", "failed")],
                error=DDLTimeoutError(f"rank {r}: timed out"),
            )
            for r in (0, 1)
        ],
        _record(
            2, 3, [("barrier", OK), ("barrier", OK), ("allreduce", OK)], reason="close", starts=late
        ),
    )
    findings = trace.analyze(group)
    assert [(f.kind, f.ranks, f.seq) for f in findings] == [("late", [2], 2)]
    assert "rank 2 is behind: it started allreduce #2" in findings[0].text
    assert "after ranks 0, 1" in findings[0].text


def test_verdict_no_late_rank_after_a_quick_failure():
    # Rank 0 failed at once (its peer rank 3 died); rank 1 came a little later: not "behind".
    dead = PeerFailureError("rank 0: rank 3 died", 3)
    first = _record(0, 4, [("barrier", OK), ("allreduce", "failed")], error=dead)
    first["entries"][-1]["end"] = first["entries"][-1]["start"] + 1e-3
    second = _record(
        1,
        4,
        [("barrier", OK), ("allreduce", "failed")],
        error=dead,
        starts={1: first["entries"][-1]["start"] + 0.1},
    )
    findings = trace.analyze(
        _group(first, second, _record(2, 4, [("barrier", OK), ("allreduce", "failed")], error=dead))
    )
    assert [f.kind for f in findings] == ["failed", "missing"]
    assert findings[0].text.startswith("no rank on record was behind")
    assert findings[1].ranks == [3] and "name it as the peer that failed" in findings[1].text


@pytest.mark.parametrize("size,odd", [(4, 1), (2, 1)])
def test_verdict_mismatch(size, odd):
    records = [
        _record(
            r,
            size,
            [("barrier", OK), ("broadcast" if r == odd else "allreduce", "failed")],
            error=ddlcore.CollectiveMismatchError(f"rank {r}: mismatch"),
        )
        for r in range(size)
    ]
    findings = trace.analyze(_group(*records))
    assert findings[0].kind == "mismatch" and findings[0].seq == 1
    if size > 2:
        assert findings[0].ranks == [odd]
        assert (
            "rank 1 called broadcast (13 x float32, root 0) where ranks 0, 2, 3 called "
            "allreduce (13 x float32, sum)" in findings[0].text
        )
    else:  # two ranks: nobody to outvote
        assert "rank 0 called allreduce" in findings[0].text
        assert "rank 1 called broadcast" in findings[0].text


def test_verdict_missing_rank_and_clean_end():
    group = _group(
        _record(0, 3, [("allreduce", OK)], reason="close"),
        _record(1, 3, [("allreduce", OK)], reason="close"),
    )
    kinds = {f.kind: f for f in trace.analyze(group)}
    assert kinds["completed"].text.startswith("no rank on record was behind")
    assert kinds["missing"].ranks == [2] and "rank 2 left no record" in kinds["missing"].text


def test_report_and_table_print_every_rank():
    group = _group(
        _record(0, 2, [("barrier", OK), ("allreduce", "started")], reason="request"),
        _record(1, 2, [("barrier", OK)], reason="close"),
    )
    text = trace.report(group, with_tables=True, last=1)
    assert "rank 1 is behind: it never started allreduce #1" in text
    assert "/fr/rank0.json" in text and "/fr/rank1.json" in text
    assert "seq  collective" in text and "started" in text


def test_a_sigterm_interrupting_the_write_on_its_thread_writes_the_record(tmp_path):
    """SIGTERM while this thread writes the failure record: the handler ends the process right
    after, so it writes the record itself (it used to skip it: a stray .tmp and no record)."""
    rec = flight.FlightRecorder(3, 4, "job", entries=8, directory=str(tmp_path))
    import threading

    rec._writing, rec._writer = (
        ("failure", DDLTimeoutError("rank 3: timed out")),
        threading.get_ident(),
    )
    rec.terminated(15)
    (path,) = tmp_path.glob("rank3*.json")
    assert flight.load(str(path))["rank"] == 3


def test_sigterm_handler_leaves_the_end_to_a_handler_that_chains_it(tmp_path):
    """A framework that installs its own SIGTERM handler over ours and calls ours from it keeps
    its graceful shutdown: ours writes the record and returns instead of ending the process."""
    import signal

    rec = flight.FlightRecorder(0, 2, "job", entries=8, directory=str(tmp_path))
    flight._live.add(rec)
    called = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: called.append(s))
    try:
        flight._on_sigterm(signal.SIGTERM, None)  # chained: the installed handler is not ours
    finally:
        signal.signal(signal.SIGTERM, previous)
        flight._live.discard(rec)
    assert list(tmp_path.glob("rank0*.json")) and not called


# --- where records go: only this user may write there -----------------------------------------
def test_a_missing_directory_is_made_for_this_user_only(tmp_path):
    folder = tmp_path / "made" / "fr"
    rec = flight.FlightRecorder(0, 2, "private:1", entries=4, directory=str(folder))
    rec.closed()
    path = folder / "rank0.json"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(folder) == ["rank0.json"]  # no temporary file left


@pytest.mark.parametrize("kind", ["group-writable", "symlink", "file"])
def test_a_directory_others_could_write_turns_writing_off(tmp_path, caplog, kind):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    folder = tmp_path / "fr"
    if kind == "group-writable":
        folder.mkdir()
        folder.chmod(0o770)
    elif kind == "symlink":
        folder.symlink_to(real)
    else:
        folder.write_text("")
    with caplog.at_level("WARNING", logger="ddlcore"):
        rec = flight.FlightRecorder(0, 2, "unsafe:1", entries=4, directory=str(folder))
    assert rec.directory == "" and "will not be written" in caplog.text
    with pytest.raises(flight.UnsafeDirectoryError):
        flight.open_directory(str(folder))
    rec.closed()  # nothing to write to: not an error
    assert os.listdir(real) == []


def test_a_directory_replaced_after_the_check_is_checked_again(tmp_path, caplog):
    folder = tmp_path / "fr"
    rec = flight.FlightRecorder(0, 2, "swapped:1", entries=4, directory=str(folder))
    folder.rmdir()
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    folder.symlink_to(real)
    with caplog.at_level("WARNING", logger="ddlcore"):
        rec.closed()
    assert "could not write the flight record" in caplog.text
    assert os.listdir(real) == []


def test_a_link_at_a_temporary_name_is_never_followed(tmp_path, monkeypatch):
    folder = tmp_path / "fr"
    rec = flight.FlightRecorder(0, 2, "link:1", entries=4, directory=str(folder))
    target = tmp_path / "target"
    target.write_text("mine\n")
    monkeypatch.setattr(flight.secrets, "token_hex", lambda n: "0" * 2 * n)
    (folder / f"rank0.json.{'0' * 16}.tmp").symlink_to(target)
    with pytest.raises(FileExistsError):
        rec.write(rec.document("request"))
    assert target.read_text() == "mine\n" and not (folder / "rank0.json").exists()


def test_trace_reads_no_symlink_and_no_fifo(tmp_path, capsys):
    rec = flight.FlightRecorder(0, 2, "links:1", entries=4, directory=str(tmp_path / "fr"))
    rec.closed()
    elsewhere = tmp_path / "elsewhere.json"
    other = flight.FlightRecorder(1, 2, "links:1", entries=4)
    elsewhere.write_text(flight.dumps(other.document("close")))
    (tmp_path / "fr" / "rank1.json").symlink_to(elsewhere)
    os.mkfifo(tmp_path / "fr" / "rank2.json")  # read, it would block trace for good
    assert trace.main([str(tmp_path / "fr")]) == 0
    out, err = capsys.readouterr()
    assert "records from rank 0\n" in out, out
    assert "rank1.json: a symbolic link" in err and "rank2.json: not a regular file" in err, err
