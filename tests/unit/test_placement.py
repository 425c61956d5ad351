"""Where init pins the local ranks (ddlcore.job.placement): the CPU list on the wire, the order
blocks are cut in, and when a rank is pinned at all."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest

from ddlcore.job import placement


def _flat(cpu):
    return 0, 0, cpu


def test_cpu_lists_travel_as_ranges():
    for cpus in ([0], [0, 1, 2, 3], [0, 2, 3, 7, 8, 9, 63], list(range(0, 256, 2))):
        text = placement.encode(cpus)
        assert placement.decode(text) == frozenset(cpus)
    assert placement.encode([5, 0, 1, 2, 9]) == "0-2,5,9"
    assert placement.encode([]) == ""


@pytest.mark.parametrize(
    "text", ["", "a", "3-1", "-1", "1-", "1,,2", f"0-{1 << 16}", ",".join(["1"] * 2000)]
)
def test_a_cpu_list_that_encode_did_not_write_reads_as_none(text):
    assert placement.decode(text) is None


def test_blocks_keep_a_cores_threads_and_a_nodes_cores_together():
    # Two nodes of two cores, two threads each, numbered as Linux does: the second thread of
    # every core after the first threads of all of them.
    def position(cpu):
        core = cpu % 4
        return core // 2, 0, core

    assert placement.cpu_order(range(8), position) == [0, 4, 1, 5, 2, 6, 3, 7]
    assert placement.cpu_shares(2, range(8), position) == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert placement.cpu_shares(4, range(8), position) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_cpu_shares_split_evenly_and_round_robin_past_the_cpus():
    assert placement.cpu_shares(2, [3, 1, 2, 0], _flat) == [[0, 1], [2, 3]]
    assert placement.cpu_shares(3, range(8), _flat) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert placement.cpu_shares(1, [5, 4], _flat) == [[4, 5]]
    assert placement.cpu_shares(5, [0, 2], _flat) == [[0], [2], [0], [2], [0]]


def test_sysfs_position_of_a_cpu_sysfs_does_not_list():
    assert placement.sysfs_position(1 << 20) == (0, 0, 1 << 20)


def test_plan():
    four = frozenset(range(4))
    assert placement.plan("auto", 1, [four, four], False) == (
        [2, 3] if placement.cpu_order(four) == [0, 1, 2, 3] else placement.cpu_shares(2, four)[1],
        "local rank 1 of 2",
    )
    cases = {
        ("none", (four, four), False): "DDL_BIND=none",
        ("auto", (four,), False): "no other rank of the job runs on this host",
        ("auto", (four, frozenset({0, 1})), False): "the launcher placed the local ranks",
        ("auto", (four, None), False): "the launcher placed the local ranks",
        ("auto", (None, None), False): "the launcher placed the local ranks",
        ("auto", (frozenset({0}),) * 2, False): "2 local ranks share 1 CPUs",
        ("auto", (four, four), True): "a GPU host",
    }
    for (mode, cpus, gpu), why in cases.items():
        got, said = placement.plan(mode, 0, list(cpus), gpu)
        assert got is None and said.startswith(why), (mode, cpus, gpu, said)
    assert placement.plan("block", 0, [four, four], True)[0] == placement.cpu_shares(2, four)[0]


def _in_a_thread(fn):
    """fn's result, run in a thread of its own: pinning applies to the calling thread, and the
    test process's own threads keep their CPUs."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(30)
    return out[0]


@pytest.fixture(autouse=True)
def _unpinned(monkeypatch):
    """Each test starts as a process nothing pinned (the module's state is per process)."""
    monkeypatch.setattr(placement, "_pinned", None)
    monkeypatch.setattr(placement, "_holders", 0)


def test_records_carry_a_token_the_machine_and_the_launchers_cpus():
    token, machine, cpus = placement.read_record(placement.record())
    assert len(token) == 16 and cpus == frozenset(os.sched_getaffinity(0))
    assert machine == placement.machine_id() and len(machine) in (0, 36)
    assert placement.read_record(placement.record())[0] != token
    assert placement.read_record("0123456789abcdef - 0-1") == ("0123456789abcdef", "", {0, 1})
    for bad in (
        "",
        "0-3",
        "zz - 0-3",
        "0123456789abcdeg - 0",
        "0123456789abcdef",
        "0123456789abcdef machine 0",
        "0123456789abcdef - ",
    ):
        assert placement.read_record(bad)[2] is None, bad


def test_pin_remembers_what_the_launcher_gave():
    mine = frozenset(os.sched_getaffinity(0))
    one = min(mine)

    def pin_twice():
        assert placement.launcher_cpus() == mine
        assert placement.pin([one])
        pinned = frozenset(os.sched_getaffinity(0))
        # A second init in the process sees the launcher's CPUs, not its own pinning ...
        seen = placement.launcher_cpus()
        # ... unless the program moved the thread since.
        os.sched_setaffinity(0, mine)
        return pinned, seen, placement.launcher_cpus()

    assert _in_a_thread(pin_twice) == (frozenset({one}), mine, mine)
    assert frozenset(os.sched_getaffinity(0)) == mine


def test_a_cpu_the_kernel_refuses_leaves_the_thread_as_it_was():
    mine = frozenset(os.sched_getaffinity(0))
    assert _in_a_thread(lambda: (placement.pin([1 << 20]), os.sched_getaffinity(0))) == (
        False,
        mine,
    )
    assert placement._pinned is None


def _claims_in(monkeypatch, folder):
    """Keep the claims in ``folder`` (the host's are shared with whatever else runs); returns
    the claims file's path."""
    monkeypatch.setattr(placement, "claims_dirs", lambda: [str(folder)])
    return folder / placement.CLAIMS_FILE


def test_claims_of_other_live_jobs_keep_a_rank_unpinned(monkeypatch, tmp_path):
    path = _claims_in(monkeypatch, tmp_path / "claims")
    path.parent.mkdir(mode=0o700)
    monkeypatch.setattr(placement, "host_has_gpu", lambda: False)
    mine = frozenset(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two CPUs")
    parent = os.getppid()
    live = f"{parent} {placement._start_time(parent)} other:1 {placement.encode(mine)}\n"
    path.write_text(
        "garbage\n" + live + f"{parent} 1 dead:1 0\n" + "4194304 7 gone:1 0-1\n" + "1 2 3\n"
    )
    both = [mine, mine]
    cpus, why = _in_a_thread(lambda: placement.pin_local_rank("auto", "job:2", 0, both))
    assert cpus is None and why.startswith("another job pinned ranks to CPUs"), why
    # The same job's claims do not count; the file keeps the live claims and this rank's only.
    cpus, why = _in_a_thread(lambda: placement.pin_local_rank("auto", "other:1", 1, both))
    assert cpus == placement.cpu_shares(2, mine)[1], why
    assert path.read_text().splitlines() == [
        live.strip(),
        f"{os.getpid()} {placement._start_time(os.getpid())} other:1 {placement.encode(cpus)}",
    ]

    # Closing unpins the thread (where it still is) and drops the claim; the others stay.
    placement.release()  # the pin above, made in a thread now gone
    assert path.read_text().splitlines() == [live.strip()]

    def pin_and_release():
        got = placement.pin_local_rank("auto", "other:1", 1, both)[0]
        pinned = frozenset(os.sched_getaffinity(0))
        placement.release()
        return got, pinned, frozenset(os.sched_getaffinity(0))

    got, pinned, after = _in_a_thread(pin_and_release)
    assert pinned == frozenset(got) and after == mine
    assert path.read_text().splitlines() == [live.strip()]


def test_auto_pins_nothing_where_the_claims_cannot_be_read(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    _claims_in(monkeypatch, tmp_path / "file" / "claims")  # a file where a folder must be
    monkeypatch.setattr(placement, "host_has_gpu", lambda: False)
    mine = frozenset(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two CPUs")
    cpus, why = _in_a_thread(lambda: placement.pin_local_rank("auto", "j", 0, [mine, mine]))
    assert cpus is None and why.startswith("other jobs' CPUs unknown"), why
    got = _in_a_thread(lambda: placement.pin_local_rank("block", "j", 0, [mine, mine])[0])
    assert got == placement.cpu_shares(2, mine)[0]


def test_a_claims_lock_held_elsewhere_delays_init_only_briefly(monkeypatch, tmp_path):
    import fcntl

    path = _claims_in(monkeypatch, tmp_path / "claims")
    path.parent.mkdir(mode=0o700)
    monkeypatch.setattr(placement, "host_has_gpu", lambda: False)
    monkeypatch.setattr(placement, "_LOCK_WAIT_S", 0.05)
    mine = frozenset(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two CPUs")
    with open(path, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another open file: flock locks are per open file
        cpus, why = _in_a_thread(lambda: placement.pin_local_rank("auto", "j", 0, [mine, mine]))
    assert cpus is None and "stayed locked" in why, why


def _two_cpus():
    mine = frozenset(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two CPUs")
    return mine


def _pin_and_release(mine):
    def run():
        got = placement.pin_local_rank("auto", "j:1", 0, [mine, mine])
        placement.release()
        return got

    return _in_a_thread(run)


def test_the_claims_go_with_the_last_release(monkeypatch, tmp_path):
    folder = tmp_path / "claims"
    _claims_in(monkeypatch, folder)
    monkeypatch.setattr(placement, "host_has_gpu", lambda: False)
    mine = _two_cpus()
    cpus, why = _pin_and_release(mine)
    assert cpus == placement.cpu_shares(2, mine)[0], why
    assert not folder.exists()


@pytest.mark.parametrize("kind", ["open to others", "symlink", "file"])
def test_a_claims_place_that_will_not_do_is_passed_over(monkeypatch, tmp_path, kind):
    first, second = tmp_path / "first", tmp_path / "home" / "second"
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    if kind == "open to others":
        first.mkdir()
        first.chmod(0o777)
    elif kind == "symlink":
        first.symlink_to(ours)
    else:
        first.write_text("")
    monkeypatch.setattr(placement, "claims_dirs", lambda: [str(first), str(second)])
    monkeypatch.setattr(placement, "host_has_gpu", lambda: False)
    mine = _two_cpus()

    def pin_and_look():
        got = placement.pin_local_rank("auto", "j:1", 0, [mine, mine])
        claims = (second / placement.CLAIMS_FILE).read_text()
        placement.release()
        return got, claims

    (cpus, why), claims = _in_a_thread(pin_and_look)
    assert cpus == placement.cpu_shares(2, mine)[0], why
    assert claims.split(" ")[0] == str(os.getpid())
    assert not second.exists() and os.listdir(ours) == []
    assert first.is_symlink() or first.exists()  # left as it was


def test_the_second_place_in_use_is_kept_while_the_first_is_free(monkeypatch, tmp_path):
    """A job that started while the first place was taken keeps its claims in the second; a
    later job must see them there, even once the first is free again."""
    first, second = tmp_path / "first", tmp_path / "second"
    second.mkdir(mode=0o700)
    monkeypatch.setattr(placement, "claims_dirs", lambda: [str(first), str(second)])
    monkeypatch.setattr(placement, "host_has_gpu", lambda: False)
    mine = _two_cpus()
    parent = os.getppid()
    live = f"{parent} {placement._start_time(parent)} other:1 {placement.encode(mine)}\n"
    (second / placement.CLAIMS_FILE).write_text(live)
    cpus, why = _in_a_thread(lambda: placement.pin_local_rank("auto", "j:1", 0, [mine, mine]))
    assert cpus is None and why.startswith("another job pinned ranks"), why
    assert not first.exists()


def test_a_claims_file_removed_while_its_lock_was_awaited_is_left(monkeypatch, tmp_path):
    """The last rank of another job removes the claims file while this one waits for its lock:
    this one then makes its claim in the file at the name, not in the removed one."""
    import fcntl
    import time

    folder = tmp_path / "claims"
    path = _claims_in(monkeypatch, folder)
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(placement, "host_has_gpu", lambda: False)
    monkeypatch.setattr(placement, "_LOCK_WAIT_S", 60.0)
    mine = _two_cpus()
    held = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    out = []

    def pin():
        out.append(placement.pin_local_rank("auto", "j:1", 0, [mine, mine]))

    waiter = threading.Thread(target=pin)
    waiter.start()
    try:

        def opened_by_both():
            links = []
            for fd in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError):
                    links.append(os.readlink(f"/proc/self/fd/{fd}"))
            return links.count(str(path)) >= 2

        deadline = time.monotonic() + 60
        while not opened_by_both() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert opened_by_both(), "the pinning thread never opened the claims file"
        path.unlink()  # as the last rank of the other job does, holding the lock
    finally:
        os.close(held)
        waiter.join(60)
    cpus, why = out[0]
    assert cpus == placement.cpu_shares(2, mine)[0], why
    assert path.read_text().split(" ")[0] == str(os.getpid())
    placement.release()
    assert not folder.exists()


def test_cpu_share_is_the_most_crowded_machines():
    a, b = "0" * 8 + "-0000-0000-0000-" + "0" * 12, "1" * 8 + "-0000-0000-0000-" + "0" * 12
    two = frozenset({0, 1})
    # Two emulated hosts on one machine of 2 CPUs, 4 ranks each: a quarter of a CPU a rank.
    records = [("t" * 16, a, two)] * 8
    assert placement.cpu_share(records, ["h0"] * 4 + ["h1"] * 4) == 0.25
    # Two machines: the crowded one counts; the CPUs of a machine's ranks add up.
    records = [("t", a, two)] * 4 + [("t", b, frozenset({0})), ("t", b, frozenset({1, 2, 3}))]
    assert placement.cpu_share(records, ["h0"] * 4 + ["h1"] * 2) == 0.5
    # Machines unknown: hosts tell them apart; never more than a whole CPU; unknown CPUs: 1.
    records = [("t", "", frozenset(range(8)))] * 2 + [("t", "", frozenset({0}))] * 2
    assert placement.cpu_share(records, ["h0", "h0", "h1", "h1"]) == 0.5
    assert placement.cpu_share(records[:2], ["h0", "h0"]) == 1.0
    assert placement.cpu_share([("t", a, None)] * 4, ["h0"] * 4) == 1.0
