"""``python -m ddlcore.trace DIR``: merge the ranks' flight records (``ddlcore.flight``) and say
which rank was behind, and in which collective.

The records of one communicator are lined up by sequence number (every rank numbers its
collectives in call order). The verdict names, in this order: the first collective the ranks
called differently (a mismatch: rank 1 called broadcast where the others called allreduce), the
ranks that never started the collective the others were in (rank 2 never started allreduce #57
that ranks 0, 1, 3 started), the ranks that started it only after another rank had already
failed in it (rank 2 was late), and the ranks that left no record. ``--table`` adds each rank's
last collectives as a table. Files are JSON; nothing is unpickled.

Only records the invoking user or the directory's owner wrote are read, and symlinks are not
followed: in a directory others can write, anyone could put a record of their making in a rank's
place. What is skipped is listed, with the reason, on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddlcore import flight
from ddlcore.collectives import HAS_ROOT, Collective

Record = dict[str, Any]
Entry = dict[str, Any]


@dataclass
class Finding:
    """One conclusion: its ``kind`` ("mismatch", "behind", "late", "missing", "failed",
    "completed"), the ranks it is about, the collective's sequence number, and the sentence."""

    kind: str
    ranks: list[int]
    seq: int | None
    text: str


@dataclass
class Group:
    """The records of one communicator (same job and communicator index), by rank."""

    job: str
    comm: int
    size: int
    records: dict[int, Record] = field(default_factory=dict)
    paths: dict[int, str] = field(default_factory=dict)

    @property
    def written(self) -> float:
        return max(float(r.get("written") or 0) for r in self.records.values())


# --- reading ---------------------------------------------------------------------------------
def load(paths: Iterable[str]) -> tuple[list[Group], list[str]]:
    """Read the flight records in ``paths`` (directories: every ``*.json`` in them), grouped by
    communicator, newest first; also the problems met (files that are not records)."""
    groups: dict[tuple[str, int], Group] = {}
    problems: list[str] = []
    for path, owners in _files(paths, problems):
        try:
            doc = flight.load(path, owners)
        except (OSError, ValueError) as exc:
            problems.append(str(exc))
            continue
        key = (str(doc.get("job")), int(doc.get("comm") or 0))
        group = groups.setdefault(key, Group(key[0], key[1], doc["size"]))
        group.size = max(group.size, doc["size"])
        rank = doc["rank"]
        old = group.records.get(rank)
        if old is None or float(doc.get("written") or 0) >= float(old.get("written") or 0):
            group.records[rank], group.paths[rank] = doc, path
    return sorted(groups.values(), key=lambda g: g.written, reverse=True), problems


def _files(paths: Iterable[str], problems: list[str]) -> list[tuple[str, frozenset[int]]]:
    """The record files in ``paths``, each with the users whose files are read there: the
    invoking user and the owner of the directory it lies in."""
    out = []
    for path in paths:
        try:
            owners = frozenset({os.geteuid(), _owner(path)})
            if os.path.isdir(path):
                names = sorted(n for n in os.listdir(path) if n.endswith(".json"))
                out += [(os.path.join(path, n), owners) for n in names]
            else:
                out.append((path, owners))
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror or exc}")
    return out


def _owner(path: str) -> int:
    """Who owns the directory ``path``, or the one the file ``path`` lies in."""
    st = os.stat(path)
    return st.st_uid if stat.S_ISDIR(st.st_mode) else os.stat(os.path.dirname(path) or ".").st_uid


# --- describing ------------------------------------------------------------------------------
def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _shape(e: Entry) -> str:
    """What a call was, apart from its sequence number: "allreduce (1000 x float32, sum)"."""
    if e["collective"] == Collective.BARRIER:
        return "barrier"
    desc = f"{e.get('count')} x {e.get('dtype')}"
    if e.get("op"):
        desc += f", {e['op']}"
    if e["collective"] in HAS_ROOT:
        desc += f", root {e.get('root')}"
    return f"{e['collective']} ({desc})"


def describe(e: Entry) -> str:
    """An entry as the errors name a collective: "allreduce #57 (1000 x float32, sum)"."""
    name, _, rest = _shape(e).partition(" ")
    return f"{name} #{e['seq']}" + (f" {rest}" if rest else "")


def _signature(e: Entry) -> tuple[Any, ...]:
    return (
        e["collective"],
        e.get("count"),
        e.get("dtype"),
        e.get("op"),
        e.get("root") if e["collective"] in HAS_ROOT else None,
    )


def _clock(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _error_line(rec: Record, limit: int = 200) -> str:
    err = rec.get("error")
    if not err:
        return ""
    first = str(err.get("message", "")).splitlines()[0] if err.get("message") else ""
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{err.get('type')}: {first}"


def _error_type(rec: Record) -> str:
    return str((rec.get("error") or {}).get("type", "an error"))


def _ending(rec: Record) -> str:
    """How a rank's record ends: closed, failed (with the error) or taken on request."""
    reason = rec.get("reason")
    if reason == "close":
        return f"it closed its communicator at {_clock(rec.get('written'))}"
    if reason == "failure":
        return f"then it failed: {_error_line(rec)}"
    if str(reason).startswith("SIG"):
        return f"it was stopped by {reason} at {_clock(rec.get('written'))}"
    return f"its record was taken at {_clock(rec.get('written'))} ({reason})"


def _point_to_point(rec: Record) -> str:
    """What a rank's record says of its point-to-point messages ("" for nothing telling): those
    in flight when it was written, else the last one if it failed. A rank behind in the
    collectives is often waiting in a recv."""
    history = [p for p in rec.get("p2p") or [] if isinstance(p, dict)]
    shown = [p for p in history if p.get("state") == "started"]
    if not shown and history and history[-1].get("state") == "failed":
        shown = history[-1:]
    if not shown:
        return ""
    written = float(rec.get("written") or 0)
    words = []
    for p in shown[-3:]:
        peer = "any rank" if p.get("peer") is None else f"rank {p.get('peer')}"
        way = "from" if p.get("op") == "recv" else "to"
        posted = float(p.get("posted") or 0)
        if p.get("state") == "started":
            how = f"in flight for {_seconds(written - posted)}"
        else:
            how = f"failed ({p.get('error')}) after {_seconds(float(p['end']) - posted)}"
        words.append(
            f"{p.get('op')} of {p.get('bytes')} bytes {way} {peer} tag {p.get('tag')} {how}"
        )
    return "; point-to-point: " + ", ".join(words)


# --- analysis --------------------------------------------------------------------------------
def _by_seq(group: Group) -> dict[int, dict[int, Entry]]:
    """Entries by rank, then by sequence number."""
    return {rank: {e["seq"]: e for e in rec["entries"]} for rank, rec in group.records.items()}


def _majority(calls: dict[int, Entry]) -> tuple[tuple[Any, ...], list[int]]:
    """The signature most ranks called (ties: the one of the lowest rank) and its ranks."""
    by_sig: dict[tuple[Any, ...], list[int]] = {}
    for rank in sorted(calls):
        by_sig.setdefault(_signature(calls[rank]), []).append(rank)
    sig = max(by_sig, key=lambda s: (len(by_sig[s]), -by_sig[s][0]))
    return sig, by_sig[sig]


def _mismatch(seqs: dict[int, dict[int, Entry]]) -> Finding | None:
    every = sorted({s for entries in seqs.values() for s in entries})
    for seq in every:
        calls = {r: entries[seq] for r, entries in seqs.items() if seq in entries}
        if len(calls) < 2 or len({_signature(e) for e in calls.values()}) == 1:
            continue
        sig, agree = _majority(calls)
        others = {r: e for r, e in calls.items() if r not in agree}
        shown = _shape(calls[agree[0]])
        if len(agree) > max(len(v) for v in _groups(others).values()):
            parts = [
                f"{_ranks(rs)} called {_shape(calls[rs[0]])}" for rs in _groups(others).values()
            ]
            text = (
                f"collective #{seq}: " + "; ".join(parts) + f" where {_ranks(agree)} called {shown}"
            )
        else:  # no majority to blame: list each
            parts = [
                f"{_ranks(rs)} called {_shape(calls[rs[0]])}" for rs in _groups(calls).values()
            ]
            text = f"collective #{seq}: the ranks called different collectives: " + "; ".join(parts)
        return Finding("mismatch", sorted(others), seq, text)
    return None


def _groups(calls: dict[int, Entry]) -> dict[tuple[Any, ...], list[int]]:
    out: dict[tuple[Any, ...], list[int]] = {}
    for rank in sorted(calls):
        out.setdefault(_signature(calls[rank]), []).append(rank)
    return out


def analyze(group: Group) -> list[Finding]:
    """What the records of one communicator say, most telling first (see the module doc)."""
    findings: list[Finding] = []
    seqs = _by_seq(group)
    missing = [r for r in range(group.size) if r not in group.records]
    mismatch = _mismatch(seqs)
    if mismatch is not None:
        findings.append(mismatch)
    last = {r: max(entries) for r, entries in seqs.items() if entries}
    if last:
        front = max(last.values())
        started = sorted(r for r, entries in seqs.items() if front in entries)
        # Behind: never started a collective the others started.
        for rank in sorted(seqs):
            mine = last.get(rank)
            if mine is not None and mine >= front:
                continue
            nxt = front if mine is None else mine + 1
            calls = {r: e[nxt] for r, e in seqs.items() if nxt in e}
            rec = group.records[rank]
            if not calls:  # the others' records no longer reach back that far
                findings.append(
                    Finding(
                        "behind",
                        [rank],
                        nxt,
                        f"rank {rank} is behind: its last collective was #{mine}, the others "
                        f"reached #{front} (their records start later than #{nxt}); "
                        f"{_ending(rec)}{_point_to_point(rec)}",
                    )
                )
                continue
            sig, _ = _majority(calls)
            theirs = next(e for e in calls.values() if _signature(e) == sig)
            if mine is None:
                before = "it recorded no collective"
            else:
                e = seqs[rank][mine]
                at = _clock(e.get("end") or e["start"])
                before = f"its last collective was {describe(e)} ({e['state']} at {at})"
            findings.append(
                Finding(
                    "behind",
                    [rank],
                    nxt,
                    f"rank {rank} is behind: it never started {describe(theirs)}, which "
                    f"{_ranks(calls)} started; {before}, and {_ending(rec)}{_point_to_point(rec)}",
                )
            )
        # Late: started the front collective only after another rank had given up waiting in
        # it (a failure after at least half its DDL_TIMEOUT: a quick one, like a peer that
        # died, says nothing about who came late).
        failed_ends = [
            (e["end"], r)
            for r in started
            for e in [seqs[r][front]]
            if e["state"] == flight.FAILED and e.get("end") is not None
        ]
        if failed_ends:
            first_end, first = min(failed_ends)
            waited = first_end - seqs[first][front]["start"]
            late = [r for r in started if seqs[r][front]["start"] > first_end]
            early = [r for r in started if r not in late]
            if late and early and waited >= float(group.records[first].get("timeout") or 0) / 2:
                t0 = min(seqs[r][front]["start"] for r in early)
                for rank in late:
                    e = seqs[rank][front]
                    findings.append(
                        Finding(
                            "late",
                            [rank],
                            front,
                            f"rank {rank} is behind: it started {describe(e)} "
                            f"{_seconds(e['start'] - t0)} after {_ranks(early)}, when rank {first} "
                            f"had already failed in it ({_error_type(group.records[first])} at "
                            f"{_clock(first_end)})",
                        )
                    )
        if not any(f.kind in ("behind", "late", "mismatch") for f in findings):
            findings.append(_front_state(group, seqs, front, started, not missing))
    if missing:
        blamed = sorted(
            {
                r
                for r, rec in group.records.items()
                if (rec.get("error") or {}).get("peer") in missing
            }
        )
        text = (
            f"{_ranks(missing)} left no record: killed (SIGKILL), crashed, or still "
            "running (a rank writes its record when its communicator fails or is closed, "
            "and on SIGTERM)"
        )
        if blamed:
            text += f"; the errors of {_ranks(blamed)} name it as the peer that failed"
        findings.append(Finding("missing", missing, None, text))
    return findings


def _front_state(
    group: Group, seqs: dict[int, dict[int, Entry]], front: int, started: list[int], complete: bool
) -> Finding:
    """Nobody on record behind: how the last collective ended (completed, or where it failed
    first); ``complete``: every rank left a record."""
    nobody = "no rank was behind" if complete else "no rank on record was behind"
    entries = [seqs[r][front] for r in started]
    e0 = entries[0]
    spread = max(e["start"] for e in entries) - min(e["start"] for e in entries)
    failed = sorted(
        (e["end"] or e["start"], r)
        for r, e in zip(started, entries, strict=True)
        if e["state"] == flight.FAILED
    )
    if not failed and all(e["state"] == flight.COMPLETED for e in entries):
        return Finding(
            "completed",
            started,
            front,
            f"{nobody}: {_ranks(started)} completed {describe(e0)}, the last collective recorded",
        )
    if not failed:
        running = [r for r, e in zip(started, entries, strict=True) if e["state"] == flight.STARTED]
        return Finding(
            "failed",
            running,
            front,
            f"{_ranks(started)} started {describe(e0)} within {_seconds(spread)}; "
            f"{_ranks(running)} had not finished it when the record was taken",
        )
    first_t, first = failed[0]
    return Finding(
        "failed",
        [first],
        front,
        f"{nobody}: {_ranks(started)} started {describe(e0)} within "
        f"{_seconds(spread)}; it failed first on rank {first} at {_clock(first_t)}: "
        f"{_error_line(group.records[first])}",
    )


# --- output ----------------------------------------------------------------------------------
_COLUMNS = (
    "seq",
    "collective",
    "count",
    "dtype",
    "op/root",
    "bytes",
    "algorithm",
    "path",
    "start",
    "took",
    "state",
)


def table(rec: Record, last: int = 0) -> str:
    """One rank's entries as a plain table (the ``last`` of them; 0: all)."""
    entries = rec["entries"][-last:] if last else rec["entries"]
    rows = [_COLUMNS]
    for e in entries:
        end = e.get("end")
        took = _seconds(end - e["start"]) if end is not None else "-"
        extra = e.get("op") or (f"root {e.get('root')}" if e["collective"] in HAS_ROOT else "")
        rows.append(
            (
                str(e["seq"]),
                e["collective"],
                str(e.get("count", "")),
                e.get("dtype") or "-",
                extra or "-",
                str(e.get("bytes", "")),
                str(e.get("algorithm", "?")),
                str(e.get("path", "?")),
                _clock(e["start"]),
                took,
                e["state"],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def report(
    group: Group, with_tables: bool = False, last: int = 20, ranks: Sequence[int] | None = None
) -> str:
    """The verdict on one communicator, each rank's status, and optionally its table."""
    present = sorted(group.records)
    lines = [
        f"job {group.job}, communicator {group.comm}: {group.size} ranks, records from "
        f"{_ranks(present) if present else 'no rank'}"
    ]
    created = [float(r.get("created") or 0) for r in group.records.values()]
    timeout = max(float(r.get("timeout") or 0) for r in group.records.values())
    if timeout and max(created) - min(created) > timeout:
        lines.append(
            f"  warning: these records were made {_seconds(max(created) - min(created))}"
            " apart, longer than DDL_TIMEOUT: some may be from an earlier job; give "
            "each job a directory of its own"
        )
    lines.append("verdict:")
    lines += [f"  {f.text}" for f in analyze(group)]
    lines.append("ranks:")
    for rank in present:
        rec = group.records[rank]
        entries = rec["entries"]
        head = f"  rank {rank} ({rec.get('host')}, pid {rec.get('pid')}): "
        if entries:
            e = entries[-1]
            took = f" after {_seconds(e['end'] - e['start'])}" if e.get("end") else ""
            head += f"last {describe(e)} {e['state']}{took}"
        else:
            head += "no collective recorded"
        head += f"; record written on {rec.get('reason')}"
        if rec.get("error"):
            head += f": {_error_line(rec)}"
        lines.append(head + _point_to_point(rec))
        lines.append(f"    {group.paths[rank]}")
    if with_tables:
        for rank in present:
            if ranks and rank not in ranks:
                continue
            rec = group.records[rank]
            shown = min(last, len(rec["entries"])) if last else len(rec["entries"])
            lines.append(
                f"\nrank {rank}: its last {shown} collectives (of {len(rec['entries'])} kept)"
            )
            lines.append(table(rec, last))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddlcore.trace",
        description="Merge the ranks' ddlcore flight records (DDL_FLIGHT_RECORDER=DIR) and say "
        "which rank was behind, in which collective.",
    )
    parser.add_argument(
        "paths", nargs="+", metavar="DIR", help="directory of the records (or record files)"
    )
    parser.add_argument("--table", action="store_true", help="also each rank's collectives")
    parser.add_argument(
        "--last", type=int, default=20, help="rows per rank in --table (0: all; default 20)"
    )
    parser.add_argument(
        "--rank", type=int, action="append", help="only this rank's table (repeatable)"
    )
    args = parser.parse_args(argv)
    groups, problems = load(args.paths)
    for problem in problems:
        print(f"skipped {problem}", file=sys.stderr)
    for path in args.paths:
        with contextlib.suppress(OSError):
            if _owner(path) != os.geteuid():
                print(
                    f"note: {path} is uid {_owner(path)}'s: its records are their word",
                    file=sys.stderr,
                )
    if not groups:
        print(f"no ddlcore flight records in {', '.join(args.paths)}", file=sys.stderr)
        return 1
    if len(groups) > 1:
        print(f"{len(groups)} communicators' records, the newest first\n")
    text = "\n\n".join(report(g, args.table, args.last, args.rank) for g in groups)
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # piped into head: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
