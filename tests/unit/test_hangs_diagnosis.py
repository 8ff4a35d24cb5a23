"""The hang diagnosis from progress records and stack dumps alone (no processes)."""

from __future__ import annotations

from gpufleet.launch.hangs import diagnose, user_frame

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
    assert set(found.missing) == {1} and "its last collective: #4" in found.missing[1]
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
    found = diagnose(progress, {}, 2, 20.0)
    assert "every rank is in all_gather #3 [[2]] and none is missing" in found.summary[1]
    assert not found.missing
