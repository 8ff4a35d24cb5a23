"""The hang diagnosis from progress records and stack dumps alone (no processes)."""

from __future__ import annotations

from gpufleet.launch.hangwatch.diagnosis import diagnose, user_frame

STACK = '''Thread 0x00007f1 (most recent call first):
  File "/x/site-packages/gpufleet/launch/progress.py", line 150 in loop
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f2 (most recent call first):
  File "/x/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/home/me/train.py", line 42 in step
  File "/home/me/train.py", line 60 in train
  File "/x/site-packages/gpufleet/launch/worker.py", line 101 in run_call
  File "/x/site-packages/gpufleet/launch/worker.py", line 200 in main
'''


def _collectives(seq: int, op: str, sizes: list) -> dict:
    return {"seq": seq, "collectives": [{"op": op, "seq": seq, "state": "scheduled", "sizes": sizes}]}


def test_the_users_frame_is_the_newest_one_outside_libraries():
    assert user_frame(STACK) == "/home/me/train.py:42 in step"


PY_SPY = """Process 4242: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    step (/home/me/train.py:42)
    <module> (/home/me/train.py:60)
Thread 4250 (idle): "gpufleet-progress"
    loop (/x/site-packages/gpufleet/launch/progress.py:150)
"""


def test_the_users_frame_is_found_in_a_py_spy_dump_too():
    assert user_frame(PY_SPY) == "/home/me/train.py:42 in step"


def test_a_rank_behind_is_missing_from_the_collective_the_others_wait_in():
    progress = {0: _collectives(5, "all_reduce", [[4]]), 1: {"seq": 4}, 2: _collectives(5, "all_reduce", [[4]])}
    found = diagnose(progress, {0: STACK}, 3, 61.0)
    assert found.summary[0] == "no rank made progress for 61 s (no collective completed, no step reported)"
    assert found.summary[1] == "rank 1 missing from all_reduce #5 [[4]], which ranks 0, 2 wait in"
    assert set(found.missing) == {1} and "after collective #4" in found.missing[1]
    assert found.waiting[0].startswith("waiting in all_reduce #5 [[4]] at /home/me/train.py:42")


def test_ranks_at_the_same_count_in_different_collectives_are_mismatched():
    progress = {0: _collectives(2, "all_reduce", [[8]]), 1: _collectives(2, "broadcast", [[3]])}
    found = diagnose(progress, {}, 2, 30.0)
    assert found.summary[1] == "mismatched collectives: rank 0 in all_reduce #2 [[8]]; rank 1 in broadcast #2 [[3]]"
    assert set(found.missing) == {0, 1}


def test_a_rank_that_returned_while_the_others_wait_is_named():
    progress = {0: {"seq": 2}, 1: {"seq": 2}}
    progress[0] = _collectives(2, "all_reduce", [[8]])
    found = diagnose(progress, {0: STACK}, 2, 20.0, finished=frozenset({1}))
    assert "rank 1 returned while rank 0 still waits in all_reduce #2 [[8]]" in found.summary[1]
    assert not any("none is missing" in line for line in found.summary)  # rank 1 did not wait
    assert set(found.missing) == {0} and found.waiting[1].startswith("returned its result")
    assert found.missing[0].startswith("stuck in all_reduce #2 [[8]], which rank 1 passed with a different")


def test_every_rank_in_the_same_collective_says_none_is_missing():
    progress = {0: _collectives(3, "all_gather", [[2]]), 1: _collectives(3, "all_gather", [[2]])}
    found = diagnose(progress, {0: STACK, 1: STACK}, 2, 20.0)
    assert "every rank is in all_gather #3 [[2]] and none is missing" in found.summary[1]
    assert not found.missing and found.clear


OWN = STACK.replace('  File "/x/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper\n', "")


def test_ranks_in_their_own_code_after_a_completed_collective_are_not_said_to_wait_in_it():
    # three all-reduces completed, then every rank sleeps in its own code (a data-loader deadlock)
    progress = {0: _collectives(3, "all_reduce", [[1]]), 1: _collectives(3, "all_reduce", [[1]])}
    found = diagnose(progress, {0: OWN, 1: OWN}, 2, 20.0, activity={0: "idle", 1: "idle"})
    text = "\n".join(found.summary)
    assert "every rank is in all_reduce" not in text and "waiting in" not in text
    assert found.summary[1] == ("no rank waits in a collective: every rank is in its own code after all_reduce #3 [[1]], "
                                "which completed (all idle: a deadlock, e.g. in a data loader or between threads)")  # fmt: skip
    assert found.missing[0] == "in its own code at /home/me/train.py:42 in step, after all_reduce #3 [[1]] (idle)"
    assert not found.clear  # no collective left to wait in: not a fast-path hang


def test_a_rank_busy_in_its_own_code_is_named_busy_and_the_evidence_is_not_clear():
    progress = {0: _collectives(5, "all_reduce", [[4]]), 1: _collectives(4, "all_reduce", [[4]])}
    found = diagnose(progress, {0: STACK, 1: OWN}, 2, 30.0, activity={0: "idle", 1: "busy"})
    assert found.missing[1].endswith("in its own code at /home/me/train.py:42 in step, after all_reduce #4 [[4]] (busy)")
    assert found.busy == {1: "/home/me/train.py:42 in step"} and not found.clear


def test_a_rank_stopped_by_a_signal_is_named_so():
    progress = {0: _collectives(5, "all_reduce", [[4]]), 1: _collectives(4, "all_reduce", [[4]])}
    found = diagnose(progress, {0: STACK}, 2, 30.0, activity={0: "idle", 1: "stopped"})
    assert "after all_reduce #4 [[4]] (stopped: SIGSTOP or SIGTSTP)" in found.missing[1] and found.clear


def test_a_rank_whose_reporter_cannot_run_holds_the_gil_and_its_last_collective_comes_from_the_others():
    # rank 1's record is 40 s old (written before collectives #4 to #6): the others entered #7, so it completed #6
    progress = {0: {"time": 1000.0, "seq": 7, "collectives": [
                    {"op": "all_reduce", "seq": s, "state": "scheduled", "sizes": [[4]]} for s in (5, 6, 7)]},
                1: {"time": 960.0, **_collectives(3, "all_reduce", [[4]])}}  # fmt: skip
    found = diagnose(progress, {0: STACK, 1: OWN}, 2, 30.0, activity={1: "idle"}, now=1000.5)
    assert found.missing[1] == ("missing from all_reduce #7 [[4]]: in its own code at /home/me/train.py:42 in step, "
                                "after all_reduce #6 [[4]] (idle; its progress reporter has not run for 40 s: a call "
                                "that holds the GIL)")  # fmt: skip


THREADS = OWN.replace("Current thread 0x00007f2", """Thread 0x00007f3 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 100 in acquire
  File "/home/me/loader.py", line 12 in fill
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f2""")


def test_a_deadlock_between_threads_shows_each_threads_line():
    progress = {0: _collectives(5, "all_reduce", [[4]]), 1: _collectives(4, "all_reduce", [[4]])}
    found = diagnose(progress, {0: STACK, 1: THREADS}, 2, 30.0, activity={1: "idle"})
    assert found.missing[1].endswith("(idle); its other threads: /home/me/loader.py:12 in fill")
    assert "in its own code at /home/me/train.py:42 in step" in found.missing[1]


def test_a_rank_without_any_record_or_stack_is_named_missing():
    progress = {0: _collectives(2, "barrier", None), 2: _collectives(2, "barrier", None)}
    found = diagnose(progress, {0: STACK, 2: STACK}, 3, 30.0)
    assert found.summary[1] == "rank 1 missing from barrier #2, which ranks 0, 2 wait in"
    assert "no progress record and no stack: it never reached runtime.setup()" in found.missing[1]


def test_a_rank_that_returned_without_entering_the_collective_is_named():
    progress = {0: _collectives(3, "barrier", None), 1: _collectives(2, "all_reduce", [[4]])}
    found = diagnose(progress, {0: STACK}, 2, 30.0, finished=frozenset({1}))
    assert found.summary[1] == "rank 1 returned without entering barrier #3, which rank 0 waits in"
    assert found.waiting[1] == "returned its result (after all_reduce #2 [[4]])" and found.clear


def test_nccl_ranks_waiting_at_their_next_sync_are_inside_the_collective_the_recorder_saw_start():
    rec = {"seq": 4, "backend": "nccl", "collectives": [{"op": "all_reduce", "seq": 4, "state": "started", "sizes": [[4]]}]}
    found = diagnose({0: rec, 1: rec}, {0: OWN, 1: OWN}, 2, 30.0)  # both at loss.item(), their GPUs in the kernel
    assert "every rank is in all_reduce #4 [[4]] and none is missing" in found.summary[1]
