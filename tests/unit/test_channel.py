"""The authenticated datagram channel (hvd_balance.channel) and the notes' schema
(hvd_balance.notice): what passes, what is dropped, and that a drop changes nothing."""

import contextlib
import json
import os
import secrets
import threading
import time

import numpy as np
import pytest

from hvd_balance import channel, notice
from support.channels import linked

SECRET = b"s" * 32
NOTE = {"rank": 1, "fit": 1, "epoch": 0, "batch": 5, "steps": 20, "why": "its loss is nan"}


def pair(name="notice", check=notice.check_note):
    """Ranks 0 and 1 of a 2-rank channel, linked."""
    return linked([channel.Channel(name, SECRET, r, 2, check) for r in (0, 1)])


def test_a_genuine_datagram_arrives_with_its_sender():
    a, b = pair()
    try:
        b.send(NOTE)
        assert a.receive(5.0) == (1, NOTE)
        assert a.dropped == 0
    finally:
        a.close()
        b.close()


def test_replays_older_counters_other_keys_and_other_channels_are_dropped():
    a = channel.Channel("notice", SECRET, 0, 2, notice.check_note)
    b = channel.Channel("notice", SECRET, 1, 2, notice.check_note)
    first, second = b.seal(NOTE), b.seal({**NOTE, "batch": 6})
    assert a.open(second) == (1, {**NOTE, "batch": 6})
    assert a.open(second) is None  # the same datagram again
    assert a.open(first) is None   # an older counter
    earlier_job = channel.Channel("notice", secrets.token_bytes(32), 1, 2, notice.check_note)
    assert a.open(earlier_job.seal(NOTE)) is None
    watchdog = channel.Channel("watchdog", SECRET, 1, 2, lambda body, sender: True)
    assert a.open(watchdog.seal(NOTE)) is None  # signed for the other channel
    assert (a.dropped, a.repeated) == (2, 2)
    assert a.open(b.seal(NOTE)) == (1, NOTE)  # the sender's next note still passes


def signed(payload: bytes) -> bytes:
    import hashlib
    import hmac

    return hmac.new(SECRET, payload, hashlib.sha256).digest() + payload


@pytest.mark.parametrize("data", [
    b"", b"not json", b"\xff" * 40, json.dumps(NOTE).encode(),             # unsigned
    secrets.token_bytes(32) + json.dumps(["notice", 1, 9, NOTE]).encode(),  # a guessed tag
    b"x" * (channel.MAX_DATAGRAM + 1),                                      # oversize
    signed(b"not json"), signed(b'["notice", 1, NaN, {"rank": 1}]'),
    signed(json.dumps(["notice", 0, 1, {**NOTE, "rank": 0}]).encode()),     # "from" this rank
    signed(json.dumps(["notice", 2, 1, {**NOTE, "rank": 2}]).encode()),     # not in the job
    signed(json.dumps(["notice", 1, "1", NOTE]).encode()),                  # a counter not an int
    signed(json.dumps(["notice", 1, 1, {**NOTE, "rank": 0}]).encode()),     # speaks for another
    signed(json.dumps({"notice": 1}).encode()),
])
def test_garbage_and_forgeries_are_dropped(data):
    a = channel.Channel("notice", SECRET, 0, 2, notice.check_note)
    assert a.open(data) is None
    assert a.dropped == 1


@pytest.mark.parametrize("note", [
    {**NOTE, "why": "x" * (channel.MAX_TEXT + 1)},
    {**NOTE, "why": "two\nlines"},
    {**NOTE, "why": "\x1b[31mred"},
    {**NOTE, "epoch": -1},
    {**NOTE, "epoch": True},
    {**NOTE, "epoch": 1.0},
    {**NOTE, "batch": "5"},
    {**NOTE, "steps": 2 ** 40},
    {**NOTE, "extra": 1},
    {"fit": 1},
    {"rank": 1, "gen": 1, "left": {"epoch": 0, "step": 3, "steps": 40}},   # no reason
    {"rank": 1, "gen": 1, "in": [[0, 3], [0, "4"]]},
    {"rank": 1, "gen": 1, "in": [3, 4]},
    {"rank": 1, "gen": 1, "bound": 4},
    {"rank": 1, "gen": 1, "in": [[0, i] for i in range(2000)]},
    {"rank": 1, "gen": 0},
    [1, 2],
])
def test_a_note_outside_the_schema_is_refused(note):
    assert not notice.check_note(note, 1)


def test_both_edges_notes_pass_the_schema():
    assert notice.check_note(NOTE, 1)
    assert notice.check_note({**NOTE, "batch": -1}, 1)  # stopped before its first batch
    torch_notes = [{"rank": 1, "gen": 2, "left": {"epoch": 0, "step": 3, "steps": 40, "why": "x"},
                    "bound": [0, 4]},
                   {"rank": 1, "gen": 2, "bound": None, "in": [[0, 3], [0, 4]]}]
    assert all(notice.check_note(n, 1) for n in torch_notes)


def test_printable_escapes_control_characters_and_bounds_the_length():
    assert channel.printable("a\nb\x1b[0m\u2028") == "a\\nb\\x1b[0m\\u2028"
    assert channel.printable("é ok") == "é ok"
    assert len(channel.printable("y" * 10_000)) == channel.MAX_TEXT


def open_two(between_bind_and_connect=None, opener=notice.open_board):
    """Ranks 0 and 1 opening a notice board (or what ``opener(rank, size, gather)`` opens) in
    threads, gathering through a barrier as a framework's allgather would."""
    gathered, barrier = {}, threading.Barrier(2)

    def gather_as(rank):
        calls = [0]

        def gather(value):
            calls[0] += 1
            gathered[(calls[0], rank)] = value
            barrier.wait(10)
            out = [gathered[(calls[0], r)] for r in range(2)]
            if between_bind_and_connect and calls[0] == 2 and rank == 0:
                between_bind_and_connect(out)
            barrier.wait(10)
            return out
        return gather

    boards = [None, None]

    def open_as(rank):
        boards[rank] = opener(rank, 2, gather_as(rank))

    threads = [threading.Thread(target=open_as, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return boards, gathered


def test_open_channel_links_ranks_of_one_host_by_unix_sockets_nobody_else_reaches():
    import socket

    (a, b), gathered = open_two()
    try:
        assert a.channel.transports == {1: "unix"} and b.channel.transports == {0: "unix"}
        assert a.channel._secret == b.channel._secret and len(a.channel._secret) == 32
        paths = gathered[(2, 0)][1]  # rank 0's sockets for rank 1: receiving, sending
        assert a.channel.routes[1].getsockname() == paths[1]
        assert not os.path.exists(os.path.dirname(paths[0]))
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stranger:
            for path in paths:
                with pytest.raises(OSError):  # the names are gone once both ends are connected
                    stranger.sendto(b"x" * 64, path)
        got = []
        a.listen(got.append)
        b.post({**NOTE, "why": "loss\nis nan\x07"})
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [{**NOTE, "why": "loss\\nis nan\\x07"}]
        b.post({**NOTE, "batch": np.int64(7), "steps": 20.0})  # numpy's and integral numbers
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got[1] == {**NOTE, "batch": 7, "why": NOTE["why"]} and type(got[1]["batch"]) is int
        b.post({**NOTE, "epoch": "zero"})  # a bug: logged, not sent, not raised
        time.sleep(0.3)
        assert len(got) == 2
    finally:
        for board in (a, b):
            board.withdraw()
            board.channel.close()


def heard_by(listener, note, poster):
    """What ``listener``'s board hears (up to 10 s for the first note) once ``poster`` posts
    ``note``: the list its listener fills."""
    got = []
    listener.listen(got.append)
    poster.post(note)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def test_a_peers_last_datagram_is_read_after_it_closed_and_this_rank_sent_to_it():
    """Linux purges a Unix datagram socket's queue when it sends to a closed peer: a peer's
    last words ("exited") live on a socket that never sends."""
    (a, b), _ = open_two(opener=lambda rank, size, gather: channel.open_channel(
        "notice", rank, size, gather, notice.check_note))
    try:
        b.send(NOTE)
        b.close()
        a.send(NOTE)  # refused by the closed peer, and swallowed
        assert a.receive(5) == (1, NOTE)
    finally:
        a.close()


def test_what_a_stranger_sends_before_the_sockets_connect_is_discarded_unread():
    import socket

    def stranger(endpoints):  # each rank's bound sockets, by peer; both still unconnected
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            for bound in endpoints:
                for paths in bound.values():
                    for path in paths:
                        for _ in range(3):
                            s.sendto(b"FORGED" * 10, path)

    (a, b), _ = open_two(stranger)
    try:
        assert a.channel.dropped == b.channel.dropped == 6  # 3 on each of its 2 sockets
        got = heard_by(a, NOTE, b)
        assert got == [NOTE] and a.channel.dropped == 6
    finally:
        for board in (a, b):
            board.withdraw()
            board.channel.close()


def test_a_udp_route_takes_datagrams_from_its_peer_alone(monkeypatch):
    """Peers that share no files (containers, hosts) talk UDP; the kernel drops what comes to a
    rank's socket from any other address or port."""
    import socket

    monkeypatch.setattr(channel, "local_id", lambda: "")
    (a, b), _ = open_two()
    try:
        assert a.channel.transports == {1: "udp"}
        port = a.channel.routes[1].getsockname()
        assert port[0] == "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
            for _ in range(100):
                stranger.sendto(b"x" * 64, port)
        got = heard_by(a, NOTE, b)
        assert got == [NOTE] and a.channel.dropped == 0  # the stranger's never reached it
    finally:
        for board in (a, b):
            board.withdraw()
            board.channel.close()


def test_addresses_toward_skips_loopback_and_shared_addresses():
    own = ["10.9.8.7", "127.0.0.1"]
    # No peer address to route to: every non-loopback address of this host, else any.
    assert channel.addresses_toward(["127.0.0.1", "10.9.8.7"], own) == ["10.9.8.7"]
    assert channel.addresses_toward([], ["127.0.1.1"]) == ["0.0.0.0"]


def test_receive_times_out_under_a_flood_and_a_closed_channel_says_so():
    a, b = pair()
    stop = threading.Event()

    def flood():  # garbage from the one socket that reaches ``a``: its peer's
        while not stop.is_set():
            with contextlib.suppress(OSError):
                b.routes[0].send(b"x" * 64)
            time.sleep(0.001)

    threading.Thread(target=flood, daemon=True).start()
    try:
        start = time.monotonic()
        assert a.receive(0.3) is None
        assert time.monotonic() - start < 2.0 and a.dropped > 10
    finally:
        stop.set()
    a.close()
    b.close()
    with pytest.raises(channel.ChannelClosed):
        a.receive(0.1)
