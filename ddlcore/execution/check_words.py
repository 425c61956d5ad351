"""Another rank's call, named from the check word its message carried (`describe_check`):
the word (`ddlcore.execution._frontend.check_word`) is a hash of a call's kind, dtype, op,
count, root and chunking, so this tries the calls a peer plausibly made, nearest first, and
words the one that matches as `ddlcore.calls.describe_call` does. Only on the way to an error."""

from __future__ import annotations

from ddlcore.calls import COLLECTIVES, NAMED_CODES, NONE_CODE, Call, describe_call
from ddlcore.collectives import HAS_ROOT, Collective
from ddlcore.execution._frontend import check_word
from ddlcore.execution.hostcoll import BoardKind
from ddlcore.kernels.dtypes import BOOL_CODE, DType, numpy_dtype
from ddlcore.ops import Op

_REDUCING = (Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.REDUCE)
# How far from its own count `describe_check` looks for another rank's: 2 x 32 Ki check words,
# ~70 ms at worst on a busy machine, once, on the way to an error (the peers hear of it after).
_COUNT_SEARCH = 1 << 15


def describe_check(
    check: int, call: Call, size: int, chunk_bytes: int = 0, nbytes: int | None = None
) -> str | None:
    """The call another rank made, from the ``check`` word its message carried, where this
    rank made ``call`` on ``size`` ranks with schedules cut in ``chunk_bytes`` (0: the
    boards'): found among every collective, dtype, op and root of ``call``'s count, that count
    times or divided by ``size`` (an allgather's input beside an allreduce's), or the count of
    ``nbytes`` (the message's length) of the dtype; then ``call`` itself with counts up to
    32 Ki elements from its own. As `describe_fingerprint` words it, or None where none
    matches: the counts differ by more, or the buffers are chunked otherwise (device buffers on
    one rank, host buffers on the other)."""
    counts = {call.count, call.count * size, call.count // size}
    codes = sorted(NAMED_CODES | {BOOL_CODE})
    roots = range(min(size, 64))  # a root beyond them: not named
    for name in COLLECTIVES:
        kind = int(BoardKind.of(name))
        if name == Collective.BARRIER:
            candidates = [(NONE_CODE, NONE_CODE, 0, 0)]
        elif name == Collective.ALLTOALLV:  # each rank's own counts: its check word has 0
            candidates = [(code, NONE_CODE, 0, 0) for code in codes]
        else:
            ops = [int(o) for o in Op] if name in _REDUCING else [NONE_CODE]
            by_root = roots if name in HAS_ROOT else [0]
            candidates = [
                (code, op, count, root)
                for code in codes
                for op in ops
                for count in _counts(counts, code, nbytes, size)
                for root in by_root
            ]
            if name in (Collective.ALLREDUCE, Collective.REDUCE_SCATTER):
                candidates += [  # an integer avg's wide sum (`int_avg.marker`)
                    (int(DType.INT64), int(Op.SUM), count, -1 - code)
                    for code in NAMED_CODES
                    if numpy_dtype(DType(code)).kind in "iu"
                    for count in counts
                ]
        for code, op, count, root in candidates:
            if check_word(kind, code, op, count, root, chunk_bytes) == check:
                return describe_call(name, code, op, root, count)
    if call.inp is None:
        return None
    # The same call with another count (a last batch cut short): the nearest counts first.
    kind, code = int(BoardKind.of(call.collective)), call.inp.check_code
    op = int(call.op) if call.op is not None else NONE_CODE
    for distance in range(1, _COUNT_SEARCH):
        for count in (call.count - distance, call.count + distance):
            if count >= 0 and check_word(kind, code, op, count, call.root, chunk_bytes) == check:
                return describe_call(call.collective, code, op, call.root, count)
    return None


def _counts(counts: set[int], code: int, nbytes: int | None, size: int) -> set[int]:
    """``counts``, and those of a whole message of ``nbytes`` of dtype ``code`` (once, and
    as one of ``size`` blocks)."""
    if not nbytes:
        return counts
    itemsize = 1 if code == BOOL_CODE else numpy_dtype(DType(code)).itemsize
    if nbytes % itemsize:
        return counts
    return counts | {nbytes // itemsize, nbytes // itemsize * size}
