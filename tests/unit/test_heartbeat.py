"""hvd_balance.heartbeat in one process: two ranks' channels, linked."""

import threading
import time

import pytest

from hvd_balance import channel, heartbeat
from support.channels import linked

SECRET = b"h" * 32


def pair(lost_s, on_lost):
    """Ranks 0 and 1, each a started Heartbeat beating every 0.1 s."""
    ends = linked([channel.Channel("heartbeat", SECRET, r, 2, heartbeat.check_beat)
                   for r in (0, 1)])
    beats = [heartbeat.Heartbeat(e, lost_s, on_lost, interval_s=0.1) for e in ends]
    for b in beats:
        b.start()
    return beats


def test_a_silent_peer_is_lost_after_lost_s_naming_it_its_host_and_pid():
    lost = []
    a, b = pair(0.6, lambda rank, beat, s: lost.append((rank, beat, s)))
    time.sleep(0.5)
    assert lost == []  # both beating
    b.state = "frozen"  # its thread ends: no more beats, no word said
    time.sleep(1.5)
    assert len(lost) == 1, lost
    rank, beat, silent_s = lost[0]
    assert rank == 1 and beat["pid"] > 0 and beat["host"] != "?" and 0.6 < silent_s < 1.2
    a.close()


def test_a_peer_that_says_it_ended_is_not_lost():
    lost = []
    a, b = pair(0.4, lambda *args: lost.append(args))
    time.sleep(0.3)
    b.close()
    time.sleep(1.0)
    assert lost == [] and a.heard[1][0]["state"] == "exited"
    a.close()


def test_wait_marks_returns_once_the_peer_reached_the_mark_and_raises_if_it_ended():
    a, b = pair(5.0, lambda *args: None)
    try:
        deadline = time.monotonic() + 5
        while 1 not in a.ever and time.monotonic() < deadline:  # a peer never heard is not
            time.sleep(0.01)                                    # waited for
        threading.Timer(0.3, b.set_mark, args=((1, 2),)).start()
        start = time.monotonic()
        a.wait_marks([1], (1, 2))
        assert 0.25 < time.monotonic() - start < 2.0
        a.wait_marks([1], (1, 1))  # passed already: at once
        flag = threading.Event()
        threading.Timer(0.2, flag.set).start()
        a.wait_marks([1], (1, 3), also=flag.is_set)  # the other way out
        b.close()
        with pytest.raises(heartbeat.PeerExited, match=r"rank\(s\) \[1\] ended"):
            a.wait_marks([1], (1, 3))
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("beat", [
    {"state": "running", "host": "h", "pid": 5},                              # no mark
    {"state": "asleep", "host": "h", "pid": 5, "mark": [0, 0]},                # unknown state
    {"state": "running", "host": "h", "pid": 5, "mark": [0, -1]},              # negative count
    {"state": "running", "host": "h\x1b[2J", "pid": 5, "mark": [0, 0]},        # escape codes
    {"state": "running", "host": "h", "pid": 5, "mark": [0, 0], "x": 1}])      # extra field
def test_malformed_beats_are_refused(beat):
    assert not heartbeat.check_beat(beat, 1)
    assert heartbeat.check_beat({"state": "running", "host": "h", "pid": 5, "mark": [0, 0]}, 1)


def test_a_peer_never_heard_is_not_lost_but_warned_of_once(caplog):
    """UDP blocked between hosts: nothing ever came, so nothing can be said of a freeze."""
    lost = []
    ends = linked([channel.Channel("heartbeat", SECRET, r, 2, heartbeat.check_beat)
                   for r in (0, 1)])  # rank 1 never beats
    a = heartbeat.Heartbeat(ends[0], 0.3, lambda *args: lost.append(args), interval_s=0.1)
    a.start()
    time.sleep(1.0)
    assert lost == []
    assert [r.getMessage() for r in caplog.records].count(
        "hvd_balance: no heartbeat ever came from rank(s) [1] in 0 s (UDP blocked between hosts?): "
        "a rank that freezes there is not seen") == 1
    a.wait_marks([1], (1, 1))  # not waited for: at once
    a.close()
    ends[1].close()
