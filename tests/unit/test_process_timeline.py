"""bench/process_timeline.py lines every request up on its submission and takes the median offset of each step of
the chain, keyed by the process's role, the function, entry or exit, and its occurrence within the request."""

from __future__ import annotations

from bench.process_timeline import read_events, timeline


def write(directory, pid, lines):
    (directory / f"t{pid}.txt").write_text("".join(f"{t} {phase} {name}\n" for t, phase, name in lines))


def test_requests_are_lined_up_on_their_submission_and_keyed_by_occurrence(tmp_path):
    caller, scheduler = [], []
    for k, (t0, hop) in enumerate([(1_000_000, 100_000), (5_000_000, 300_000), (9_000_000, 200_000)]):
        caller += [(t0, "B", "Engine._submit"), (t0 + 50_000, "E", "Engine._submit")]
        # the scheduler schedules twice per request: each occurrence is its own row
        scheduler += [
            (t0 + hop, "B", "Scheduler.schedule"),
            (t0 + hop + 10_000, "E", "Scheduler.schedule"),
            (t0 + hop + 20_000, "B", "Scheduler.schedule"),
            (t0 + hop + 40_000, "E", "Scheduler.schedule"),
        ]
        caller += [(t0 + 900_000, "E", "Engine._next_outputs")]
    write(tmp_path, 11, caller)
    write(tmp_path, 22, scheduler)
    rows = timeline(read_events(tmp_path), skip=0)
    got = [(round(offset), role, phase, name, n) for offset, role, phase, name, n in rows]
    assert got == [
        (0, "caller", "B", "Engine._submit", 3),
        (50, "caller", "E", "Engine._submit", 3),
        (200, "scheduler", "B", "Scheduler.schedule", 3),  # the median of 100, 300, 200 us
        (210, "scheduler", "E", "Scheduler.schedule", 3),
        (220, "scheduler", "B", "Scheduler.schedule", 3),
        (240, "scheduler", "E", "Scheduler.schedule", 3),
        (900, "caller", "E", "Engine._next_outputs", 3),
    ]
    assert [row[0] for row in timeline(read_events(tmp_path), skip=2)][:1] == [0.0]  # the first two skipped
