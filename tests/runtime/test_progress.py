"""runtime.progress: long waits keep saying what they do."""

import time

from runtime.progress import progress, still


def test_a_wait_without_a_bar_says_it_is_still_going():
    lines: list[str] = []
    with still("loading the baseline", lines.append, every=0.05):
        time.sleep(0.28)
    assert len(lines) >= 3 and all(line.startswith("  still loading the baseline (") for line in lines)
    count = len(lines)
    time.sleep(0.12)
    assert len(lines) == count  # quiet once the block is done


def test_a_bar_in_a_log_redraws_at_most_every_ten_seconds(capsys):
    bar = progress(range(3), desc="eval")
    assert bar.mininterval == 10.0 and list(bar) == [0, 1, 2]  # stderr is captured here: not a terminal
