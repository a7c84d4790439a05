"""Channels of one process linked to each other, as :func:`hvd_balance.channel.open_channel`
links the ranks of a job (a connected Unix datagram socket per pair of ranks)."""

import socket
from typing import Sequence

from hvd_balance import channel


def linked(ends: Sequence[channel.Channel]) -> Sequence[channel.Channel]:
    """``ends`` (one channel per rank, rank order), each now reaching every other."""
    for i, a in enumerate(ends):
        for b in ends[i + 1:]:
            sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            a.add_route(b.rank, sa)
            b.add_route(a.rank, sb)
    return ends
