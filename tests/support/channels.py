"""Channels of one process linked to each other, as :func:`hvd_balance.channel.open_channel`
links the ranks of a job (two connected Unix datagram sockets per pair of ranks, one each way)."""

import socket
from typing import Sequence

from hvd_balance import channel


def linked(ends: Sequence[channel.Channel]) -> Sequence[channel.Channel]:
    """``ends`` (one channel per rank, rank order), each now reaching every other."""
    for i, a in enumerate(ends):
        for b in ends[i + 1:]:
            a_out, b_in = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            b_out, a_in = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            a.add_route(b.rank, a_out, incoming=a_in)
            b.add_route(a.rank, b_out, incoming=b_in)
    return ends
